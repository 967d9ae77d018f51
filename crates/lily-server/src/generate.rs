//! The bridge between an HTTP handler and the engine thread: a `JobSink` that turns tokens into
//! visible pieces (detokenise, stop strings, reasoning / tool split) and sends them over a channel.
//! Dropping the receiver — the client went away — is the cancellation signal: the next token's
//! send fails and decoding stops there.

use std::sync::Arc;
use std::time::Instant;

use lily_core::backend::{Flow, StepOut};
use lily_core::constrain::TokenConstraint;
use lily_core::engine::{self, Job, JobSink, Outcome, PromptLogprob};
use lily_core::parse::Event;
use lily_core::sampling::SamplingParams;
use lily_core::stop::FinishReason;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::metrics::Metrics;
use crate::openai::error::ApiError;
use crate::output::Output;
use crate::state::Model;

pub enum GenEvent {
    PromptLogprobs(Vec<PromptLogprob>),
    /// One generated token and the visible output it completed (possibly none).
    Token {
        events: Vec<Event>,
        step: StepOut,
    },
    /// Last event: held-back output, how the job ended, how many tool calls were completed, and
    /// the stop string that ended it (if one did).
    Done {
        events: Vec<Event>,
        /// Boxed: an outcome (its usage and timings) is large, and sent once per request.
        outcome: Box<Outcome>,
        tool_calls: usize,
        stop_sequence: Option<String>,
    },
}

/// A prepared generation request.
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub top_logprobs: usize,
    pub prompt_logprobs: bool,
    /// See `Job::save_prefix_at`.
    pub save_prefix_at: Option<usize>,
    /// See `Job::constraint`.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub output: Output,
    /// When the handler started (see `Job::arrived`).
    pub arrived: Instant,
}

/// Queues `req` on the engine; the receiver yields its events. A full queue is a 429.
pub fn submit(
    model: &Model,
    metrics: Arc<Metrics>,
    req: GenRequest,
) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    let (tx, rx) = unbounded_channel();
    let sink = ChannelSink {
        tx,
        output: req.output,
        metrics,
        tool_calls: 0,
    };
    let job = Job {
        prompt: req.prompt,
        sampling: req.sampling,
        max_tokens: req.max_tokens,
        top_logprobs: req.top_logprobs,
        prompt_logprobs: req.prompt_logprobs,
        save_prefix_at: req.save_prefix_at,
        constraint: req.constraint,
        arrived: Some(req.arrived),
        sink: Box::new(sink),
    };
    match model.engine.submit(job) {
        Ok(()) => Ok(rx),
        Err(_) => Err(ApiError::queue_full(model.engine_capacity())),
    }
}

struct ChannelSink {
    tx: UnboundedSender<GenEvent>,
    output: Output,
    metrics: Arc<Metrics>,
    tool_calls: usize,
}

impl ChannelSink {
    fn count_calls(&mut self, events: &[Event]) {
        self.tool_calls += events
            .iter()
            .filter(|e| matches!(e, Event::ToolCallEnd(_)))
            .count();
    }
}

impl JobSink for ChannelSink {
    fn is_cancelled(&self) -> bool {
        self.tx.is_closed()
    }

    fn prompt_logprobs(&mut self, scores: Vec<PromptLogprob>) {
        let _ = self.tx.send(GenEvent::PromptLogprobs(scores));
    }

    fn token(&mut self, step: &StepOut) -> Flow {
        let mut events = Vec::new();
        let stop_matched = self.output.step(step.token, &mut events);
        self.count_calls(&events);
        let sent = self.tx.send(GenEvent::Token {
            events,
            step: step.clone(),
        });
        if sent.is_err() || stop_matched {
            return Flow::Stop;
        }
        Flow::Continue
    }

    fn finished(&mut self, outcome: Outcome) {
        self.metrics.record_outcome(&outcome);
        let reason = match &outcome {
            Outcome::Done {
                reason: engine::FinishReason::Length,
                ..
            } => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        let mut events = Vec::new();
        self.output.finish(reason, &mut events);
        self.count_calls(&events);
        let tool_calls = self.tool_calls;
        let _ = self.tx.send(GenEvent::Done {
            events,
            outcome: Box::new(outcome),
            tool_calls,
            stop_sequence: self.output.stop_matched(),
        });
    }
}
