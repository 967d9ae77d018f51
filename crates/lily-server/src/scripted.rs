//! TEST-ONLY backend: answers with scripted text instead of running a model, so the end-to-end
//! tests can drive the reasoning and tool-call paths (which a random-weight model never produces)
//! through the full HTTP stack. Selected with `--model scripted:PATH`, where PATH is a JSON file:
//!
//! ```json
//! {"tokenizer": "/path/to/qwen3.6-tokenizer",
//!  "delay_ms": 0, "load_delay_ms": 0,
//!  "replies": [{"when": "weather", "text": "Checking.</think>\n\n<tool_call>…</tool_call>"}],
//!  "default": "Hello!"}
//! ```
//!
//! Measuring the serving loop: `"cheap": true` hands the scripted tokens over without building
//! logits (log-probability 0, no alternatives, the sampler is not consulted), so a token costs the
//! backend next to nothing; `"spin_us": N` then busy-waits N µs per token, a precise stand-in for
//! a device step (`delay_ms` sleeps, which is coarser). `"default_context": N` makes the backend
//! answer N as its default context (as a GPU backend answers the model's maximum), so `serve`
//! without `--ctx-size` can be tested with long prompts.
//!
//! A reply may instead be `{"when": "…", "fail": "message"}` (decode returns that error) or
//! `{"when": "…", "panic": "message"}` (decode panics), to test that the server answers 500 and
//! keeps serving.
//!
//! The reply whose `when` occurs last in the prompt text wins (so a trigger word in the newest user
//! message beats one in the history); `default` otherwise. The reply is tokenized with the real
//! tokenizer and followed by `<|im_end|>`. Logits put the scripted token far above the rest, so any
//! sampler picks it and log-probabilities are well defined.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use lily_core::backend::{Backend, Flow, SeqId, SnapshotId, StepOut};
use lily_core::config::ModelConfig;
use lily_core::logprob::token_logprob;
use lily_core::sampling::Sampler;
use lily_core::text::{ids, Tokenizer};
use serde_json::Value;

/// How far the scripted token's logit stands above every other (probability ≈ 1 − V·e^-30).
const SCRIPTED_LOGIT: f32 = 30.0;

pub struct ScriptedBackend {
    config: ModelConfig,
    tokenizer: Tokenizer,
    replies: Vec<(String, Reply)>,
    default: Vec<u32>,
    delay: Duration,
    cheap: bool,
    spin: Duration,
    /// `default_context` of the script, if it set one.
    default_context: Option<usize>,
    seqs: HashMap<SeqId, ScriptedSeq>,
    next_seq: u64,
    /// Prefix reuse: a snapshot is the sequence it was taken from and its tokens then.
    snapshots: HashMap<u64, (SeqId, Vec<u32>)>,
}

#[derive(Clone)]
enum Reply {
    Tokens(Vec<u32>),
    Fail(String),
    Panic(String),
}

struct ScriptedSeq {
    max_ctx: usize,
    tokens: Vec<u32>,
    /// The reply chosen at the first decode, and how much of it was produced.
    reply: Option<Vec<u32>>,
    at: usize,
}

/// What the server needs from a scripted model file besides the backend.
pub struct ScriptedModel {
    pub backend: ScriptedBackend,
    pub tokenizer_dir: PathBuf,
}

impl ScriptedModel {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read scripted model {}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        let tokenizer_dir = match json.get("tokenizer").and_then(Value::as_str) {
            Some(dir) => PathBuf::from(dir),
            None => bail!(
                "{}: field \"tokenizer\" (a directory) is required",
                path.display()
            ),
        };
        // Lets tests watch `/health` while a model is loading.
        if let Some(ms) = json.get("load_delay_ms").and_then(Value::as_u64) {
            std::thread::sleep(Duration::from_millis(ms));
        }
        let config = ModelConfig::from_dir(&tokenizer_dir)?;
        let tokenizer = Tokenizer::from_dir(&tokenizer_dir)?;
        let encode_reply = |text: &str| -> Result<Vec<u32>> {
            let mut tokens = tokenizer.encode(text)?;
            tokens.push(ids::IM_END);
            Ok(tokens)
        };
        let mut replies = Vec::new();
        for (i, reply) in json
            .get("replies")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .enumerate()
        {
            let field = |name: &str| reply.get(name).and_then(Value::as_str);
            let answer = match (field("text"), field("fail"), field("panic")) {
                (Some(text), None, None) => Reply::Tokens(encode_reply(text)?),
                (None, Some(message), None) => Reply::Fail(message.to_string()),
                (None, None, Some(message)) => Reply::Panic(message.to_string()),
                _ => bail!(
                    "{}: replies[{i}] needs exactly one of \"text\", \"fail\", \"panic\"",
                    path.display()
                ),
            };
            match field("when") {
                Some(when) if !when.is_empty() => replies.push((when.to_string(), answer)),
                _ => bail!(
                    "{}: replies[{i}] needs a non-empty string \"when\"",
                    path.display()
                ),
            }
        }
        let default = encode_reply(
            json.get("default")
                .and_then(Value::as_str)
                .unwrap_or("Hello!"),
        )?;
        let delay =
            Duration::from_millis(json.get("delay_ms").and_then(Value::as_u64).unwrap_or(0));
        let cheap = json.get("cheap").and_then(Value::as_bool).unwrap_or(false);
        let spin = Duration::from_micros(json.get("spin_us").and_then(Value::as_u64).unwrap_or(0));
        let default_context = json
            .get("default_context")
            .and_then(Value::as_u64)
            .map(|n| (n as usize).clamp(1, config.max_position));
        let backend = ScriptedBackend {
            default_context,
            config,
            tokenizer,
            replies,
            default,
            delay,
            cheap,
            spin,
            seqs: HashMap::new(),
            next_seq: 0,
            snapshots: HashMap::new(),
        };
        Ok(ScriptedModel {
            backend,
            tokenizer_dir,
        })
    }
}

impl ScriptedBackend {
    fn seq(&mut self, seq: SeqId) -> Result<&mut ScriptedSeq> {
        self.seqs
            .get_mut(&seq)
            .with_context(|| format!("unknown sequence {seq:?}"))
    }

    fn choose_reply(&self, prompt: &[u32]) -> Reply {
        let text = self.tokenizer.decode(prompt, false);
        self.replies
            .iter()
            .filter_map(|(when, reply)| text.rfind(when.as_str()).map(|at| (at, reply)))
            .max_by_key(|(at, _)| *at)
            .map(|(_, reply)| reply.clone())
            .unwrap_or_else(|| Reply::Tokens(self.default.clone()))
    }

    fn pending_logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        let vocab = self.config.vocab;
        let s = self
            .seqs
            .get(&seq)
            .with_context(|| format!("unknown sequence {seq:?}"))?;
        let next = match &s.reply {
            Some(reply) => reply.get(s.at).copied().unwrap_or(ids::IM_END),
            // Before any decode the "model" predicts the prompt continuing with itself: a fixed,
            // cheap stand-in so `echo` log-probabilities have something to score against.
            None => s.tokens.last().copied().unwrap_or(0),
        };
        let mut logits = vec![0.0f32; vocab];
        if let Some(l) = logits.get_mut(next as usize) {
            *l = SCRIPTED_LOGIT;
        }
        Ok(logits)
    }
}

impl Backend for ScriptedBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn describe(&self) -> String {
        "scripted (test-only)".into()
    }

    fn default_context(&self) -> usize {
        self.default_context
            .unwrap_or_else(|| self.config.max_position.min(32_768))
    }

    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        self.next_seq += 1;
        let id = SeqId(self.next_seq);
        self.seqs.insert(
            id,
            ScriptedSeq {
                max_ctx,
                tokens: Vec::new(),
                reply: None,
                at: 0,
            },
        );
        Ok(id)
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
        self.snapshots.retain(|_, (s, _)| *s != seq);
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        self.seqs
            .get(&seq)
            .map(|s| s.tokens.len())
            .with_context(|| format!("unknown sequence {seq:?}"))
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let s = self.seq(seq)?;
        if s.tokens.len() + tokens.len() > s.max_ctx {
            bail!("sequence {seq:?} holds at most {} tokens", s.max_ctx);
        }
        s.tokens.extend_from_slice(tokens);
        Ok(())
    }

    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        self.pending_logits(seq)
    }

    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        let prompt = self.seq(seq)?.tokens.clone();
        if self.seq(seq)?.reply.is_none() {
            match self.choose_reply(&prompt) {
                Reply::Tokens(tokens) => self.seq(seq)?.reply = Some(tokens),
                Reply::Fail(message) => bail!("scripted failure: {message}"),
                Reply::Panic(message) => panic!("scripted panic: {message}"),
            }
        }
        for i in 0..n {
            let (token, logprob, top) = if self.cheap {
                let s = self.seq(seq)?;
                let reply = s.reply.as_deref().unwrap_or_default();
                (
                    reply.get(s.at).copied().unwrap_or(ids::IM_END),
                    0.0,
                    Vec::new(),
                )
            } else {
                let logits = self.pending_logits(seq)?;
                let token = sampler.sample(&logits);
                let (logprob, top) = token_logprob(&logits, token, top_logprobs);
                (token, logprob, top)
            };
            if !self.delay.is_zero() {
                std::thread::sleep(self.delay);
            }
            if !self.spin.is_zero() {
                let until = std::time::Instant::now() + self.spin;
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            let flow = on_token(&StepOut {
                token,
                logprob,
                top,
            });
            if flow == Flow::Stop || self.config.eos_ids.contains(&token) || i + 1 == n {
                break;
            }
            sampler.accept(token);
            let s = self.seq(seq)?;
            s.tokens.push(token);
            s.at += 1;
        }
        Ok(())
    }

    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId> {
        let tokens = self.seq(seq)?.tokens.clone();
        self.next_seq += 1;
        self.snapshots.insert(self.next_seq, (seq, tokens));
        Ok(SnapshotId(self.next_seq))
    }

    /// The state is the tokens (the reply is chosen from them at the next decode), so a rewind
    /// and a fork are the same; the contract's dropping of longer snapshots is kept anyway.
    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()> {
        let (from, tokens) = self
            .snapshots
            .get(&snap.0)
            .cloned()
            .with_context(|| format!("unknown snapshot {}", snap.0))?;
        if !self.seqs.contains_key(&from) {
            bail!("snapshot {} outlived its sequence", snap.0);
        }
        let s = self.seq(seq)?;
        if tokens.len() > s.max_ctx {
            bail!(
                "snapshot of {} tokens does not fit sequence {seq:?}",
                tokens.len()
            );
        }
        let len = tokens.len();
        s.tokens = tokens;
        s.reply = None;
        s.at = 0;
        if from == seq {
            self.snapshots
                .retain(|_, (sq, t)| *sq != seq || t.len() <= len);
        }
        Ok(())
    }

    fn drop_snapshot(&mut self, snap: SnapshotId) {
        self.snapshots.remove(&snap.0);
    }

    fn seq_bytes(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.tokens.len() * 4)
    }

    fn snapshot_bytes(&self, snap: SnapshotId) -> usize {
        self.snapshots.get(&snap.0).map_or(0, |(_, t)| t.len() * 4)
    }
}
