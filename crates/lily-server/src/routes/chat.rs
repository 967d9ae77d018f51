//! `POST /v1/chat/completions`, streaming (SSE chunks) and not.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use lily_core::parse::{prompt_opens_reasoning, Event as Piece};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::prompt::chat_prompt;
use crate::generate::{submit, GenEvent, GenRequest};
use crate::openai::chat_request::ChatRequest;
use crate::openai::error::ApiError;
use crate::openai::response::{chat_logprob, finish, new_id, unix_now, usage};
use crate::output::Output;
use crate::request::fields::parse_object;
use crate::request::params::fit;
use crate::state::{AppState, Model};
use crate::structured;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(|r| ApiError::unreadable_body(&r, super::MAX_BODY_BYTES))?;
    let model = state.model()?;
    // Parsing, rendering and tokenizing a long conversation take a while: off the workers.
    let (req, prompt) = {
        let model = model.clone();
        super::off_the_workers(move || {
            let req = ChatRequest::parse(&parse_object(&body)?, model.vocab)?;
            let prompt = chat_prompt(&model, &req.messages, req.tools.as_deref(), &req.kwargs)?;
            Ok((req, prompt))
        })
        .await?
    };
    let max_tokens = fit(
        prompt.tokens.len(),
        req.max_tokens,
        model.ctx_size,
        "max_tokens",
    )?;
    let reasoning = structured::reasoning(&prompt.text, None);
    let constraint = structured::constraint(&model, req.output.as_ref(), reasoning)?;
    let output = Output::chat(
        &model.tokenizer,
        req.stop.clone(),
        prompt_opens_reasoning(&prompt.text),
        req.tools.clone(),
    );
    let gen = GenRequest {
        prompt: prompt.tokens,
        sampling: req.sampling.clone(),
        max_tokens,
        top_logprobs: if req.logprobs { req.top_logprobs } else { 0 },
        prompt_logprobs: false,
        save_prefix_at: prompt.save_prefix_at,
        constraint,
        output,
        arrived,
    };
    let rx = submit(&model, state.metrics.clone(), gen)?;
    let chunker = Chunker {
        id: new_id("chatcmpl"),
        created: unix_now(),
        model_id: state.model_id.clone(),
        model,
        include_usage: req.include_usage,
        logprobs: req.logprobs,
    };
    if req.stream {
        Ok(Sse::new(chunker.stream(rx)).into_response())
    } else {
        Ok(Json(chunker.collect(rx).await?).into_response())
    }
}

struct Chunker {
    id: String,
    created: u64,
    model_id: String,
    model: Arc<Model>,
    include_usage: bool,
    logprobs: bool,
}

/// Per-stream state: the call being held, logprobs waiting for the next chunk.
struct StreamState {
    rx: UnboundedReceiver<GenEvent>,
    pending_logprobs: Vec<Value>,
    /// Deltas of the call being generated, sent once it is complete.
    held_call: Vec<Value>,
    /// Complete calls sent (the next one's index).
    calls_sent: usize,
    done: bool,
}

impl Chunker {
    fn chunk(
        &self,
        delta: Value,
        logprobs: Option<Vec<Value>>,
        finish_reason: Option<&str>,
    ) -> Event {
        let mut body = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model_id,
            "choices": [{
                "index": 0,
                "delta": delta,
                "logprobs": logprobs.map(|c| json!({"content": c})),
                "finish_reason": finish_reason,
            }],
        });
        if self.include_usage {
            body["usage"] = Value::Null;
        }
        data(&body)
    }

    /// OpenAI's shape: the first delta of a call carries its id and name, the following ones
    /// pieces of the arguments string. A call's deltas are held until the call is complete: one
    /// that breaks off (cut by `max_tokens`, a stop string, junk) comes back as content instead,
    /// and a delta already sent would leave the client a call the non-streamed answer does not
    /// have. Indices count the calls sent, as the non-streamed list does.
    fn piece_deltas(&self, st: &mut StreamState, pieces: Vec<Piece>) -> Vec<Value> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Content(text) => {
                    st.held_call.clear();
                    out.push(json!({"content": text}));
                }
                Piece::Reasoning(text) => {
                    st.held_call.clear();
                    out.push(json!({"reasoning_content": text}));
                }
                Piece::ToolCallStart { name, .. } => {
                    st.held_call = vec![json!({"id": tool_call_id(), "type": "function",
                                               "function": {"name": name, "arguments": ""}})];
                }
                Piece::ToolCallArguments { fragment, .. } => {
                    st.held_call
                        .push(json!({"function": {"arguments": fragment}}));
                }
                Piece::ToolCallEnd(_) => {
                    let index = st.calls_sent;
                    st.calls_sent += 1;
                    for mut call in st.held_call.drain(..) {
                        call["index"] = json!(index);
                        out.push(json!({ "tool_calls": [call] }));
                    }
                }
            }
        }
        out
    }

    fn on_event(&self, st: &mut StreamState, event: GenEvent) -> Vec<Event> {
        let mut events = Vec::new();
        let (pieces, done) = match event {
            GenEvent::PromptLogprobs(_) => (Vec::new(), None),
            GenEvent::Token {
                events: pieces,
                step,
            } => {
                if self.logprobs {
                    st.pending_logprobs.push(chat_logprob(
                        &self.model.tokenizer,
                        step.token,
                        step.logprob,
                        &step.top,
                    ));
                }
                (pieces, None)
            }
            GenEvent::Done {
                events: pieces,
                outcome,
                tool_calls,
                ..
            } => (pieces, Some((outcome, tool_calls))),
        };
        for delta in self.piece_deltas(st, pieces) {
            let lp = (self.logprobs && !st.pending_logprobs.is_empty())
                .then(|| std::mem::take(&mut st.pending_logprobs));
            events.push(self.chunk(delta, lp, None));
        }
        if let Some((outcome, tool_calls)) = done {
            st.done = true;
            match finish(&outcome, tool_calls) {
                Ok((reason, u)) => {
                    let lp = (self.logprobs && !st.pending_logprobs.is_empty())
                        .then(|| std::mem::take(&mut st.pending_logprobs));
                    events.push(self.chunk(json!({}), lp, Some(reason)));
                    if self.include_usage {
                        events.push(data(&json!({
                            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                            "model": self.model_id, "choices": [], "usage": usage(&u),
                        })));
                    }
                }
                Err(err) => events.push(data(&err.body())),
            }
            events.push(Event::default().data("[DONE]"));
        }
        events
    }

    fn stream(
        self,
        rx: UnboundedReceiver<GenEvent>,
    ) -> impl Stream<Item = Result<Event, Infallible>> {
        let first = self.chunk(json!({"role": "assistant", "content": ""}), None, None);
        let st = StreamState {
            rx,
            pending_logprobs: Vec::new(),
            held_call: Vec::new(),
            calls_sent: 0,
            done: false,
        };
        let rest = stream::unfold((self, st), |(this, mut st)| async move {
            if st.done {
                return None;
            }
            let events = match st.rx.recv().await {
                Some(event) => this.on_event(&mut st, event),
                // The engine dropped the job without finishing it: say so rather than hang.
                None => {
                    st.done = true;
                    vec![
                        data(&ApiError::internal("the engine stopped").body()),
                        Event::default().data("[DONE]"),
                    ]
                }
            };
            Some((stream::iter(events.into_iter().map(Ok)), (this, st)))
        })
        .flatten();
        stream::once(async move { Ok(first) }).chain(rest)
    }

    async fn collect(self, mut rx: UnboundedReceiver<GenEvent>) -> Result<Value, ApiError> {
        let mut message = Message::default();
        let mut logprobs = Vec::new();
        loop {
            match rx.recv().await {
                Some(GenEvent::PromptLogprobs(_)) => {}
                Some(GenEvent::Token { events, step }) => {
                    if self.logprobs {
                        logprobs.push(chat_logprob(
                            &self.model.tokenizer,
                            step.token,
                            step.logprob,
                            &step.top,
                        ));
                    }
                    message.add(events);
                }
                Some(GenEvent::Done {
                    events,
                    outcome,
                    tool_calls,
                    ..
                }) => {
                    message.add(events);
                    let (reason, u) = finish(&outcome, tool_calls)?;
                    return Ok(json!({
                        "id": self.id,
                        "object": "chat.completion",
                        "created": self.created,
                        "model": self.model_id,
                        "choices": [{
                            "index": 0,
                            "message": message.into_json(),
                            "logprobs": if self.logprobs { json!({"content": logprobs}) } else { Value::Null },
                            "finish_reason": reason,
                        }],
                        "usage": usage(&u),
                    }));
                }
                None => {
                    return Err(ApiError::internal(
                        "the engine stopped before finishing the request",
                    ))
                }
            }
        }
    }
}

/// The assistant message of a non-streaming answer, gathered from the events.
#[derive(Default)]
struct Message {
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
}

impl Message {
    fn add(&mut self, events: Vec<Piece>) {
        for event in events {
            match event {
                Piece::Content(t) => self.content.push_str(&t),
                Piece::Reasoning(t) => self.reasoning.push_str(&t),
                // One entry per complete call; a call that broke off came back as content.
                Piece::ToolCallEnd(call) => self.tool_calls.push(json!({
                    "id": tool_call_id(), "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments_json()},
                })),
                Piece::ToolCallStart { .. } | Piece::ToolCallArguments { .. } => {}
            }
        }
    }

    fn into_json(self) -> Value {
        let mut message = json!({"role": "assistant", "content": self.content});
        // OpenAI sends `content: null` when the answer is only tool calls.
        if self.content.is_empty() && !self.tool_calls.is_empty() {
            message["content"] = Value::Null;
        }
        if !self.reasoning.is_empty() {
            message["reasoning_content"] = json!(self.reasoning);
        }
        if !self.tool_calls.is_empty() {
            message["tool_calls"] = Value::Array(self.tool_calls);
        }
        message
    }
}

fn data(body: &Value) -> Event {
    Event::default().data(body.to_string())
}

/// OpenAI's tool-call ids read `call_…` (an underscore, where completion ids have `chatcmpl-`).
fn tool_call_id() -> String {
    new_id("call").replacen('-', "_", 1)
}
