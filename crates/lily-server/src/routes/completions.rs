//! `POST /v1/completions`: raw prompt in, text out, no chat template; `echo` + `logprobs` scores
//! the prompt tokens (teacher forcing) for evaluation harnesses.

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
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::generate::{submit, GenEvent, GenRequest};
use crate::openai::completion_request::{CompletionRequest, Prompt};
use crate::openai::error::ApiError;
use crate::openai::response::{finish, new_id, unix_now, usage, CompletionLogprobs};
use crate::output::Output;
use crate::request::fields::parse_object;
use crate::request::params::{bounded_prompt, check_prompt_bytes, fit};
use crate::state::{AppState, Model};
use lily_core::parse::Event as Piece;

pub async fn handle(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body.map_err(|r| ApiError::unreadable_body(&r, super::MAX_BODY_BYTES))?;
    let model = state.model()?;
    // Parsing and tokenizing a long prompt take a while: off the workers.
    let (req, prompt, prompt_text) = {
        let model = model.clone();
        super::off_the_workers(move || {
            let req = CompletionRequest::parse(&parse_object(&body)?, model.vocab)?;
            if let Prompt::Text(text) = &req.prompt {
                check_prompt_bytes(text.len(), model.max_prompt_bytes, model.ctx_size, "prompt")?;
            }
            let (prompt, prompt_text) = match &req.prompt {
                Prompt::Text(text) => {
                    let ids = model
                        .tokenizer
                        .encode_within(text, model.ctx_size.saturating_sub(1))
                        .map_err(|e| ApiError::internal(format!("{e:#}")))?;
                    let ids = bounded_prompt(ids, model.ctx_size, "prompt")?;
                    (ids, text.clone())
                }
                // The text is only for `echo`: decoding a long prompt costs milliseconds.
                Prompt::Tokens(ids) if req.echo => {
                    (ids.clone(), model.tokenizer.decode(ids, false))
                }
                Prompt::Tokens(ids) => (ids.clone(), String::new()),
            };
            Ok((req, prompt, prompt_text))
        })
        .await?
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid_param(
            "prompt",
            "the prompt encodes to no tokens",
        ));
    }
    let max_tokens = fit(
        prompt.len(),
        Some(req.max_tokens),
        model.ctx_size,
        "max_tokens",
    )?;
    let output = Output::raw(&model.tokenizer, req.stop.clone());
    let gen = GenRequest {
        prompt,
        sampling: req.sampling.clone(),
        max_tokens,
        top_logprobs: req.logprobs.unwrap_or(0),
        prompt_logprobs: req.echo && req.logprobs.is_some(),
        save_prefix_at: None,
        constraint: None,
        output,
        arrived,
    };
    let rx = submit(&model, state.metrics.clone(), gen)?;
    let c = Completer {
        id: new_id("cmpl"),
        created: unix_now(),
        model_id: state.model_id.clone(),
        model,
        include_usage: req.include_usage,
        logprobs: req.logprobs.is_some(),
        echo: req.echo.then_some(prompt_text),
    };
    if req.stream {
        Ok(Sse::new(c.stream(rx)).into_response())
    } else {
        Ok(Json(c.collect(rx).await?).into_response())
    }
}

struct Completer {
    id: String,
    created: u64,
    model_id: String,
    model: Arc<Model>,
    include_usage: bool,
    logprobs: bool,
    /// The prompt text, when it is to be echoed before the completion.
    echo: Option<String>,
}

fn text_of(pieces: Vec<Piece>) -> String {
    pieces
        .into_iter()
        .map(|p| match p {
            Piece::Content(t) | Piece::Reasoning(t) => t,
            Piece::ToolCallStart { .. }
            | Piece::ToolCallArguments { .. }
            | Piece::ToolCallEnd(_) => String::new(),
        })
        .collect()
}

impl Completer {
    fn body(&self, text: &str, logprobs: Value, finish_reason: Option<&str>) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_id,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
        })
    }

    fn score_prompt(
        &self,
        lp: &mut CompletionLogprobs,
        scores: &[lily_core::engine::PromptLogprob],
    ) {
        for s in scores {
            let top = s.logprob.map(|_| s.top.as_slice());
            lp.push(&self.model.tokenizer, s.token, s.logprob, top);
        }
    }

    async fn collect(self, mut rx: UnboundedReceiver<GenEvent>) -> Result<Value, ApiError> {
        let mut text = self.echo.clone().unwrap_or_default();
        let mut lp = CompletionLogprobs::default();
        loop {
            match rx.recv().await {
                Some(GenEvent::PromptLogprobs(scores)) => self.score_prompt(&mut lp, &scores),
                Some(GenEvent::Token {
                    events: pieces,
                    step,
                }) => {
                    if self.logprobs {
                        lp.push(
                            &self.model.tokenizer,
                            step.token,
                            Some(step.logprob),
                            Some(&step.top),
                        );
                    }
                    text.push_str(&text_of(pieces));
                }
                Some(GenEvent::Done {
                    events: pieces,
                    outcome,
                    tool_calls,
                    ..
                }) => {
                    text.push_str(&text_of(pieces));
                    let (reason, u) = finish(&outcome, tool_calls)?;
                    let logprobs = if self.logprobs {
                        lp.take()
                    } else {
                        Value::Null
                    };
                    let mut body = self.body(&text, logprobs, Some(reason));
                    body["usage"] = usage(&u);
                    return Ok(body);
                }
                None => {
                    return Err(ApiError::internal(
                        "the engine stopped before finishing the request",
                    ))
                }
            }
        }
    }

    fn chunk(&self, text: &str, logprobs: Value, finish_reason: Option<&str>) -> Event {
        let mut body = self.body(text, logprobs, finish_reason);
        if self.include_usage {
            body["usage"] = Value::Null;
        }
        Event::default().data(body.to_string())
    }

    fn on_event(&self, lp: &mut CompletionLogprobs, event: GenEvent) -> (Vec<Event>, bool) {
        let mut events = Vec::new();
        let logprobs = |lp: &mut CompletionLogprobs| {
            if self.logprobs {
                lp.take()
            } else {
                Value::Null
            }
        };
        match event {
            GenEvent::PromptLogprobs(scores) => {
                self.score_prompt(lp, &scores);
                events.push(self.chunk(self.echo.as_deref().unwrap_or(""), logprobs(lp), None));
                (events, false)
            }
            GenEvent::Token {
                events: pieces,
                step,
            } => {
                if self.logprobs {
                    lp.push(
                        &self.model.tokenizer,
                        step.token,
                        Some(step.logprob),
                        Some(&step.top),
                    );
                }
                let text = text_of(pieces);
                if !text.is_empty() || self.logprobs {
                    events.push(self.chunk(&text, logprobs(lp), None));
                }
                (events, false)
            }
            GenEvent::Done {
                events: pieces,
                outcome,
                tool_calls,
                ..
            } => {
                match finish(&outcome, tool_calls) {
                    Ok((reason, u)) => {
                        events.push(self.chunk(&text_of(pieces), logprobs(lp), Some(reason)));
                        if self.include_usage {
                            events.push(Event::default().data(
                                json!({"id": self.id, "object": "text_completion", "created": self.created,
                                       "model": self.model_id, "choices": [], "usage": usage(&u)})
                                .to_string(),
                            ));
                        }
                    }
                    Err(err) => events.push(Event::default().data(err.body().to_string())),
                }
                events.push(Event::default().data("[DONE]"));
                (events, true)
            }
        }
    }

    fn stream(
        self,
        rx: UnboundedReceiver<GenEvent>,
    ) -> impl Stream<Item = Result<Event, Infallible>> {
        // The echoed prompt goes first, unless prompt scores are coming to go with it.
        let first: Vec<Event> = match &self.echo {
            Some(text) if !self.logprobs => vec![self.chunk(text, Value::Null, None)],
            _ => Vec::new(),
        };
        let init = (self, rx, CompletionLogprobs::default(), false);
        let rest = stream::unfold(init, |(this, mut rx, mut lp, done)| async move {
            if done {
                return None;
            }
            let (events, done) = match rx.recv().await {
                Some(event) => this.on_event(&mut lp, event),
                None => (
                    vec![
                        Event::default()
                            .data(ApiError::internal("the engine stopped").body().to_string()),
                        Event::default().data("[DONE]"),
                    ],
                    true,
                ),
            };
            Some((
                stream::iter(events.into_iter().map(Ok)),
                (this, rx, lp, done),
            ))
        })
        .flatten();
        stream::iter(first.into_iter().map(Ok)).chain(rest)
    }
}
