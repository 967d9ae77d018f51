//! The generation loop (ARCHITECTURE.md §2, §6): a bounded FIFO queue of jobs and one worker thread
//! that owns the backend and schedules the jobs on it — up to `max_batch` at once, each prefilled
//! in chunks then decoded, the decoding ones one batched step for all (worker.rs) — reporting every
//! step to the job's sink. The engine knows nothing about HTTP: a caller (the server, a CLI) turns its
//! request into a [`Job`] and receives results through its own [`JobSink`].
//!
//! Cancellation is the sink's to signal: `JobSink::is_cancelled` is polled between prefill chunks
//! and `JobSink::token` returning `Flow::Stop` ends decode at once (within one token).
//!
//! Prefix reuse (ARCHITECTURE.md §7): a finished job's sequence is kept with snapshots at the end
//! of its conversation (a save point the job names), of its prompt, of its generated turn and
//! every N tokens of a long prefill; later jobs whose prompts start with those tokens resume from
//! the deepest one, within a byte budget (`prefix.rs`).

mod job;
mod prefix;
mod queue;
mod slot;
mod worker;

pub use job::{FinishReason, Job, JobSink, Outcome, Phases, PromptLogprob, SeqSource, Usage};
pub use prefix::PrefixStats;
pub use queue::{Queue, QueueFull};
pub use worker::{Engine, EngineOptions, SchedulerStats};

#[cfg(test)]
mod tests;
