//! Turning `--model` into a running engine: the backend for the chosen device plus the model's
//! tokenizer and chat template. Runs on a background thread while `/health` answers "loading".

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use lily_core::backend::Backend;
use lily_core::chat::ChatTemplate;
use lily_core::engine::{Engine, EngineOptions};
use lily_core::text::Tokenizer;

pub use crate::device::Device;
use crate::device::{open_backend, BackendArgs};
use crate::state::Model;

/// Prefix of the test-only scripted model (see `scripted.rs`).
const SCRIPTED: &str = "scripted:";

pub struct LoadOptions {
    pub model: String,
    pub device: Device,
    pub ctx_size: Option<usize>,
    pub max_queue: usize,
    /// `--max-batch`; `None`: the backend's default.
    pub max_batch: Option<usize>,
    pub prefix_cache_bytes: usize,
    pub snapshot_every: usize,
    pub quantize: bool,
    pub backend: BackendArgs,
}

/// The id clients see: the model directory's name.
pub fn model_id(model: &str) -> String {
    if let Some(path) = model.strip_prefix(SCRIPTED) {
        return format!(
            "scripted-{}",
            Path::new(path)
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("model")
        );
    }
    let path = Path::new(model.trim_end_matches('/'));
    path.file_name()
        .and_then(|s| s.to_str())
        .unwrap_or(model)
        .to_string()
}

/// Loads the model; `stage` hears what is being done (shown by `/health` while loading).
pub fn load(opts: &LoadOptions, stage: &dyn Fn(&'static str)) -> Result<Model> {
    let (backend, text_dir): (Box<dyn Backend>, PathBuf) = match opts.model.strip_prefix(SCRIPTED) {
        Some(path) => {
            stage("loading the scripted test model");
            scripted(Path::new(path))?
        }
        None => {
            let dir = PathBuf::from(&opts.model);
            if !dir.is_dir() {
                bail!("--model {}: not a directory", dir.display());
            }
            stage("loading weights");
            let backend = open_backend(&dir, opts.device, opts.quantize, &opts.backend)
                .with_context(|| format!("loading {}", dir.display()))?;
            (backend, dir)
        }
    };
    stage("loading the tokenizer and chat template");
    let tokenizer = Tokenizer::from_dir(&text_dir)?;
    let template = ChatTemplate::from_dir(&text_dir)?;
    let config = backend.config().clone();
    if tokenizer.vocab_size() > config.vocab {
        bail!(
            "the tokenizer in {} has {} ids but the model's vocabulary has only {} rows: they do not belong together",
            text_dir.display(),
            tokenizer.vocab_size(),
            config.vocab
        );
    }
    let ctx_size = match opts.ctx_size {
        Some(0) => bail!("--ctx-size must be at least 1"),
        Some(n) if n > config.max_position => {
            bail!(
                "--ctx-size {n} exceeds the model's max_position_embeddings ({})",
                config.max_position
            )
        }
        Some(n) => n,
        None => backend.default_context(),
    };
    // 128 bytes for Qwen3.6's (a run of spaces); every token covers at most this much text.
    let longest_token = (0..tokenizer.vocab_size() as u32)
        .filter_map(|id| tokenizer.token_bytes(id))
        .map(<[u8]>::len)
        .max()
        .unwrap_or(1)
        .max(1);
    tracing::info!("backend: {}", backend.describe());
    stage("starting the engine");
    let engine = Engine::start(
        backend,
        EngineOptions {
            max_queue: opts.max_queue,
            ctx_size,
            prefix_cache_bytes: opts.prefix_cache_bytes,
            snapshot_every: opts.snapshot_every,
            max_batch: opts.max_batch,
        },
    )?;
    tracing::info!(
        "decoding up to {} conversations at once",
        engine.max_batch()
    );
    Ok(Model {
        engine,
        tokenizer,
        template,
        ctx_size,
        vocab: config.vocab,
        max_queue: opts.max_queue,
        grammars: Default::default(),
        max_prompt_bytes: ctx_size.saturating_mul(longest_token),
    })
}

/// The test-only scripted backend and the directory of its tokenizer.
#[cfg(feature = "scripted")]
fn scripted(path: &Path) -> Result<(Box<dyn Backend>, PathBuf)> {
    let scripted = crate::scripted::ScriptedModel::load(path)?;
    Ok((Box::new(scripted.backend), scripted.tokenizer_dir))
}

#[cfg(not(feature = "scripted"))]
fn scripted(path: &Path) -> Result<(Box<dyn Backend>, PathBuf)> {
    bail!(
        "--model {SCRIPTED}{}: this lily-engine has no scripted test backend (it is built only \
         with the cargo feature `scripted`, as scripts/test.sh does)",
        path.display()
    )
}

#[cfg(all(test, not(feature = "scripted")))]
mod tests {
    use super::*;

    /// The shipped binary (default features) has no scripted backend: the test-only model is
    /// refused with the reason, not looked for.
    #[test]
    fn scripted_models_need_the_test_feature() {
        let opts = LoadOptions {
            model: "scripted:/nonexistent/script.json".into(),
            device: Device::Cpu,
            ctx_size: None,
            max_queue: 1,
            max_batch: None,
            prefix_cache_bytes: 0,
            snapshot_every: 0,
            quantize: true,
            backend: BackendArgs::default(),
        };
        let err = format!("{:#}", load(&opts, &|_| {}).err().unwrap());
        assert!(err.contains("cargo feature `scripted`"), "{err}");
    }
}
