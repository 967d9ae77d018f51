//! One unit of work for the engine and the ways it reports back.

use std::time::Duration;

use crate::backend::{Flow, StepOut};
use crate::constrain::{MaskStats, TokenConstraint};
use crate::sampling::SamplingParams;

/// A fully prepared request: tokens in, limits and sampling decided. Validation happens before a
/// job is built; the engine trusts these values.
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Upper bound on generated tokens (the caller has already checked it fits the context).
    pub max_tokens: usize,
    /// Alternatives to report with each generated token (0 = none).
    pub top_logprobs: usize,
    /// Also score the prompt itself (`echo` + `logprobs` in `/v1/completions`): the log-probability
    /// of every prompt token given the ones before it.
    pub prompt_logprobs: bool,
    /// A prompt position worth saving the state at for later jobs to resume from (the end of
    /// the conversation before the generation prompt); `None` saves nothing.
    pub save_prefix_at: Option<usize>,
    /// Restricts the tokens generated (forced tool calls, JSON schemas); `None`: free.
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub sink: Box<dyn JobSink>,
}

/// Where a job's results go. Called on the engine thread; implementations must not block for long.
pub trait JobSink: Send {
    /// True once nobody wants the result any more (client gone). Checked before the job starts,
    /// between prefill chunks and before each generated token is handed over.
    fn is_cancelled(&self) -> bool;

    /// The log-probabilities of the prompt tokens, before any generated token (only when the job
    /// asked for `prompt_logprobs`).
    fn prompt_logprobs(&mut self, _scores: Vec<PromptLogprob>) {}

    /// One generated token (never an end-of-sequence token). `Flow::Stop` ends the job now, with
    /// `FinishReason::Stop` (a stop string matched) — or `Cancelled` if `is_cancelled()` is true.
    fn token(&mut self, step: &StepOut) -> Flow;

    /// The job is over; always called exactly once, last.
    fn finished(&mut self, outcome: Outcome);
}

/// The log-probability of prompt token `token` at its position; `None` for the first token,
/// which has nothing before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    pub token: u32,
    pub logprob: Option<f32>,
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model emitted an end-of-sequence token, or the sink stopped on a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sink was cancelled (client disconnected) or the engine shut down.
    Cancelled,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    /// Prompt tokens whose state came from a reused prefix instead of being prefilled.
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub queue_time: Duration,
    pub prefill_time: Duration,
    /// From the start of the job (after queueing) to the first generated token.
    pub time_to_first_token: Option<Duration>,
    pub decode_time: Duration,
    /// Part of `decode_time` the engine thread spent handing tokens to the sink (`JobSink::token`
    /// and the checks around it): host time during which a device backend waits.
    pub sink_time: Duration,
    /// Part of `decode_time` spent computing the constraint's token masks (host time, during
    /// which a device backend waits).
    pub constraint: MaskStats,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Done {
        reason: FinishReason,
        usage: Usage,
    },
    /// The backend failed; the message is for logs and a 500 answer.
    Failed {
        message: String,
        usage: Usage,
    },
}
