//! What every handler shares: the model once loaded (or why not yet), settings, metrics.

use std::sync::{Arc, OnceLock, RwLock};

use lily_core::chat::ChatTemplate;
use lily_core::constrain::Grammars;
use lily_core::engine::Engine;
use lily_core::text::Tokenizer;

use crate::metrics::{Gauges, Metrics};
use crate::openai::error::ApiError;
use lily_core::engine::{PrefixStats, SchedulerStats};

/// A loaded model: the engine (which owns the backend) and the text side.
pub struct Model {
    pub engine: Engine,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// Tokens a sequence may hold: prompt + generated.
    pub ctx_size: usize,
    /// Logit rows (ids a request may name in `logit_bias`).
    pub vocab: usize,
    pub max_queue: usize,
    /// Grammar compilation for constrained requests, built by the first one (see `structured`).
    pub grammars: OnceLock<Result<Arc<Grammars>, String>>,
    /// Bytes of prompt text that cannot fit the context whatever they say: `ctx_size` times the
    /// longest token's bytes. Longer prompts are refused before the template or the tokenizer
    /// sees them (tokenizing tens of megabytes takes seconds and gigabytes).
    pub max_prompt_bytes: usize,
}

impl Model {
    pub fn engine_capacity(&self) -> usize {
        self.max_queue
    }
}

pub enum Phase {
    /// What is being loaded now.
    Loading(&'static str),
    Ready(Arc<Model>),
    ShuttingDown,
}

pub struct AppState {
    /// The id `/v1/models` lists and responses carry.
    pub model_id: String,
    pub api_key: Option<String>,
    pub phase: RwLock<Phase>,
    pub metrics: Arc<Metrics>,
    pub created: u64,
    /// Time a request's body may take to arrive once its headers are in.
    pub body_timeout: std::time::Duration,
}

impl AppState {
    pub fn set_phase(&self, phase: Phase) {
        *self.phase.write().unwrap_or_else(|p| p.into_inner()) = phase;
    }

    /// The model, or the error a request gets while there is none.
    pub fn model(&self) -> Result<Arc<Model>, ApiError> {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Ready(model) => Ok(model.clone()),
            Phase::Loading(_) => Err(ApiError::loading()),
            Phase::ShuttingDown => Err(ApiError::unavailable("the server is shutting down")),
        }
    }

    pub fn gauges(&self) -> Gauges {
        match &*self.phase.read().unwrap_or_else(|p| p.into_inner()) {
            Phase::Ready(model) => Gauges {
                ready: true,
                prefix: model.engine.prefix_stats(),
                scheduler: model.engine.scheduler_stats(),
            },
            _ => Gauges {
                ready: false,
                prefix: PrefixStats::default(),
                scheduler: SchedulerStats::default(),
            },
        }
    }
}
