//! One unit of work for the engine and the ways it reports back.

use std::time::{Duration, Instant};

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
    /// When the request arrived, before it was parsed, tokenized and templated (`None`: not
    /// known); the engine's timing line reports the preparation time from it.
    pub arrived: Option<Instant>,
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
    /// Where the time before the first token went, phase by phase.
    pub phases: Phases,
}

/// The phases of a job before (and just after) its first token, timed on the engine thread:
/// what the one-line `timing` log of every job reports (engine worker.rs `log_timing`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Phases {
    /// From the request's arrival (`Job::arrived`) to its queueing: parsing, tokenizing, the chat
    /// template, validation. `None` when the caller did not say when the request arrived.
    pub prepare: Option<Duration>,
    /// Getting the job's sequence: a new one (device allocation), a kept one rewound, or a fork
    /// (the kept KV prefix copied).
    pub acquire: Duration,
    /// How the sequence was got.
    pub sequence: SeqSource,
    /// Backend prefill calls, and their time (snapshots not included).
    pub chunks: usize,
    pub chunk_time: Duration,
    /// The slowest prefill call.
    pub max_chunk: Duration,
    /// Snapshots taken during prefill (prefix reuse save points, the prompt's end included) and
    /// their time, evictions they caused included: on the first token's path.
    pub snapshots: usize,
    pub snapshot_time: Duration,
    /// From the end of prefill to the first generated token reaching the sink: sampler set-up and
    /// the first pick (no forward step: the prompt's last logits are sampled).
    pub first_pick: Duration,
    /// From the job leaving the queue to its first generated token (`time_to_first_token`
    /// counts from after the sequence was acquired).
    pub engine_ttft: Option<Duration>,
    /// Saving the generated turn and handing the sequence back to the prefix cache (evictions
    /// and frees): after the last token, before the job's end is reported.
    pub release: Duration,
}

/// Where a job's sequence came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SeqSource {
    /// A new sequence from the backend.
    #[default]
    New,
    /// A kept sequence rewound to a snapshot in place.
    Rewound,
    /// A new sequence with a kept sequence's KV prefix copied in.
    Forked,
}

impl SeqSource {
    pub fn as_str(self) -> &'static str {
        match self {
            SeqSource::New => "new",
            SeqSource::Rewound => "rewound",
            SeqSource::Forked => "forked",
        }
    }
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
