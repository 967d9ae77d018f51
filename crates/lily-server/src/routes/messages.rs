//! `POST /v1/messages` (Anthropic Messages API, streaming and not) and
//! `POST /v1/messages/count_tokens`. Requests run through the same template, engine and output
//! parsers as `/v1/chat/completions`; only the wire format differs.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::stream::{self, Stream, StreamExt};
use lily_core::parse::prompt_opens_reasoning;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::prompt::chat_prompt;
use crate::anthropic::blocks::{stop_reason, usage, BlockOp, Blocks, Content};
use crate::anthropic::error::AnthropicError;
use crate::anthropic::request::MessagesRequest;
use crate::generate::{submit, GenEvent, GenRequest};
use crate::openai::error::ApiError;
use crate::openai::response::new_id;
use crate::output::Output;
use crate::request::fields::parse_object;
use crate::request::params::fit;
use crate::state::AppState;
use crate::structured;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, AnthropicError> {
    let arrived = Instant::now();
    let model = state.model()?;
    // Parsing, rendering and tokenizing a long conversation take a while: off the workers.
    let (req, prompt) = {
        let model = model.clone();
        super::off_the_workers(move || {
            let req = MessagesRequest::parse(&parse_object(&body)?, model.vocab, false)?;
            let prompt = chat_prompt(&model, &req.messages, req.tools.as_deref(), &req.kwargs)?;
            Ok((req, prompt))
        })
        .await?
    };
    // Agents ask for a fixed, large max_tokens (Claude Code: 32,000) whatever the context left:
    // the answer gets the room there is and ends with `max_tokens` when it runs out. Only a
    // prompt that does not fit at all is refused.
    let room = fit(prompt.tokens.len(), None, model.ctx_size, "max_tokens")?;
    let max_tokens = req.max_tokens.map_or(room, |n| n.min(room));
    let reasoning = structured::reasoning(&prompt.text, req.thinking_budget);
    let constraint = structured::constraint(&model, req.output.as_ref(), reasoning)?;
    let output = Output::chat(
        &model.tokenizer,
        req.stop.clone(),
        prompt_opens_reasoning(&prompt.text),
        req.tools.clone(),
    );
    let prompt_tokens = prompt.tokens.len();
    let gen = GenRequest {
        prompt: prompt.tokens,
        sampling: req.sampling.clone(),
        max_tokens,
        top_logprobs: 0,
        prompt_logprobs: false,
        save_prefix_at: prompt.save_prefix_at,
        constraint,
        output,
        arrived,
    };
    let rx = submit(&model, state.metrics.clone(), gen)?;
    let writer = Writer {
        id: new_id("msg").replacen('-', "_", 1),
        model_id: state.model_id.clone(),
        prompt_tokens,
    };
    if req.stream {
        // Pings while the prompt is prefilled keep proxies from closing an idle stream.
        let ping = Event::default().event("ping").data(r#"{"type": "ping"}"#);
        let keep_alive = KeepAlive::new()
            .interval(Duration::from_secs(10))
            .event(ping);
        Ok(Sse::new(writer.stream(rx))
            .keep_alive(keep_alive)
            .into_response())
    } else {
        Ok(Json(writer.collect(rx).await?).into_response())
    }
}

pub async fn count_tokens(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<Value>, AnthropicError> {
    let model = state.model()?;
    let tokens = super::off_the_workers(move || {
        let req = MessagesRequest::parse(&parse_object(&body)?, model.vocab, true)?;
        let prompt = chat_prompt(&model, &req.messages, req.tools.as_deref(), &req.kwargs)?;
        Ok(prompt.tokens.len())
    })
    .await?;
    Ok(Json(json!({"input_tokens": tokens})))
}

struct Writer {
    id: String,
    model_id: String,
    prompt_tokens: usize,
}

struct StreamState {
    rx: UnboundedReceiver<GenEvent>,
    blocks: Blocks,
    done: bool,
}

fn event(name: &str, body: &Value) -> Event {
    Event::default().event(name).data(body.to_string())
}

fn op_event(op: BlockOp) -> Event {
    match op {
        BlockOp::Start { index, block } => event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": block}),
        ),
        BlockOp::Delta { index, delta } => event(
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ),
        BlockOp::Stop { index } => event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ),
    }
}

fn error_event(err: AnthropicError) -> Event {
    event("error", &err.body())
}

impl Writer {
    fn message(&self, content: Value, stop: Option<(&str, Option<String>)>, usage: Value) -> Value {
        let (stop_reason, stop_sequence) = match stop {
            Some((r, s)) => (json!(r), json!(s)),
            None => (Value::Null, Value::Null),
        };
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        })
    }

    fn on_event(&self, st: &mut StreamState, ev: GenEvent) -> Vec<Event> {
        let mut ops = Vec::new();
        match ev {
            GenEvent::PromptLogprobs(_) => {}
            GenEvent::Token { events, .. } => {
                for piece in events {
                    st.blocks.push(piece, &mut ops);
                }
            }
            GenEvent::Done {
                events,
                outcome,
                tool_calls,
                stop_sequence,
            } => {
                st.done = true;
                for piece in events {
                    st.blocks.push(piece, &mut ops);
                }
                st.blocks.close(&mut ops);
                let mut out: Vec<Event> = ops.into_iter().map(op_event).collect();
                match stop_reason(&outcome, tool_calls, stop_sequence.as_deref()) {
                    Ok((reason, u)) => {
                        out.push(event(
                            "message_delta",
                            &json!({"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                                    "usage": usage(&u)}),
                        ));
                        out.push(event("message_stop", &json!({"type": "message_stop"})));
                    }
                    Err(e) => out.push(error_event(e.into())),
                }
                return out;
            }
        }
        ops.into_iter().map(op_event).collect()
    }

    fn stream(
        self,
        rx: UnboundedReceiver<GenEvent>,
    ) -> impl Stream<Item = Result<Event, Infallible>> {
        // The cached part of the prompt is known only at the end; message_delta corrects it.
        let start_usage = json!({"input_tokens": self.prompt_tokens, "output_tokens": 0,
                                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0});
        let first = vec![
            event(
                "message_start",
                &json!({"type": "message_start", "message": self.message(json!([]), None, start_usage)}),
            ),
            event("ping", &json!({"type": "ping"})),
        ];
        let st = StreamState {
            rx,
            blocks: Blocks::default(),
            done: false,
        };
        let rest = stream::unfold((self, st), |(this, mut st)| async move {
            if st.done {
                return None;
            }
            let events = match st.rx.recv().await {
                Some(ev) => this.on_event(&mut st, ev),
                None => {
                    st.done = true;
                    vec![error_event(ApiError::internal("the engine stopped").into())]
                }
            };
            Some((stream::iter(events.into_iter().map(Ok)), (this, st)))
        })
        .flatten();
        stream::iter(first.into_iter().map(Ok)).chain(rest)
    }

    async fn collect(self, mut rx: UnboundedReceiver<GenEvent>) -> Result<Value, ApiError> {
        let mut blocks = Blocks::default();
        let mut content = Content::default();
        let mut ops = Vec::new();
        loop {
            match rx.recv().await {
                Some(GenEvent::PromptLogprobs(_)) => {}
                Some(GenEvent::Token { events, .. }) => {
                    for piece in events {
                        blocks.push(piece, &mut ops);
                    }
                }
                Some(GenEvent::Done {
                    events,
                    outcome,
                    tool_calls,
                    stop_sequence,
                }) => {
                    for piece in events {
                        blocks.push(piece, &mut ops);
                    }
                    blocks.close(&mut ops);
                    for op in ops.drain(..) {
                        content.apply(op);
                    }
                    let (reason, u) = stop_reason(&outcome, tool_calls, stop_sequence.as_deref())?;
                    return Ok(self.message(
                        content.into_json(),
                        Some((reason, stop_sequence)),
                        usage(&u),
                    ));
                }
                None => {
                    return Err(ApiError::internal(
                        "the engine stopped before finishing the request",
                    ))
                }
            }
            for op in ops.drain(..) {
                content.apply(op);
            }
        }
    }
}
