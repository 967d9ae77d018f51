//! Pieces of OpenAI response bodies shared by both endpoints.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use lily_core::engine::{FinishReason, Outcome, Usage};
use lily_core::text::Tokenizer;
use serde_json::{json, Value};

use super::error::ApiError;

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A unique id such as `chatcmpl-3f2a…`.
pub fn new_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{prefix}-{:016x}{:04x}",
        nanos.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        n & 0xffff
    )
}

pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// The OpenAI `finish_reason` of a finished job, or the error its request should get.
pub fn finish(outcome: &Outcome, tool_calls: usize) -> Result<(&'static str, Usage), ApiError> {
    match outcome {
        Outcome::Done {
            reason: FinishReason::Stop,
            usage,
        } if tool_calls > 0 => Ok(("tool_calls", *usage)),
        Outcome::Done {
            reason: FinishReason::Stop,
            usage,
        } => Ok(("stop", *usage)),
        Outcome::Done {
            reason: FinishReason::Length,
            usage,
        } => Ok(("length", *usage)),
        Outcome::Done {
            reason: FinishReason::Cancelled,
            ..
        } => Err(ApiError::unavailable(
            "the request was cancelled: the server is shutting down",
        )),
        Outcome::Failed { message, .. } => {
            Err(ApiError::internal(format!("generation failed: {message}")))
        }
    }
}

/// A token's text as logprobs report it (a fragment of a UTF-8 character as U+FFFD, as OpenAI
/// does) and its exact bytes.
pub fn token_text(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_bytes(id).unwrap_or_default().to_vec();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// One entry of a chat `logprobs.content` list.
pub fn chat_logprob(tokenizer: &Tokenizer, token: u32, logprob: f32, top: &[(u32, f32)]) -> Value {
    let entry = |id: u32, lp: f32| {
        let (text, bytes) = token_text(tokenizer, id);
        json!({"token": text, "logprob": lp, "bytes": bytes})
    };
    let mut e = entry(token, logprob);
    e["top_logprobs"] = Value::Array(top.iter().map(|&(id, lp)| entry(id, lp)).collect());
    e
}

/// The legacy completions `logprobs` object, built token by token.
#[derive(Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    pub text_offset: Vec<usize>,
    offset: usize,
}

impl CompletionLogprobs {
    pub fn push(
        &mut self,
        tokenizer: &Tokenizer,
        token: u32,
        logprob: Option<f32>,
        top: Option<&[(u32, f32)]>,
    ) {
        let (text, _) = token_text(tokenizer, token);
        self.text_offset.push(self.offset);
        self.offset += text.chars().count();
        self.tokens.push(text);
        self.token_logprobs.push(logprob);
        self.top_logprobs.push(top.map(|top| {
            top.iter()
                .map(|&(id, lp)| (token_text(tokenizer, id).0, json!(lp)))
                .collect()
        }));
    }

    /// The entries pushed since the last `take`, as JSON.
    pub fn take(&mut self) -> Value {
        let v = json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        });
        self.tokens.clear();
        self.token_logprobs.clear();
        self.top_logprobs.clear();
        self.text_offset.clear();
        v
    }
}
