//! `POST /v1/completions` request: a raw prompt (text or token ids), no chat template. `echo` with
//! `logprobs` scores the prompt itself, as lm-evaluation-harness does for log-likelihoods.

use lily_core::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::request::fields::{kind, read, within, Int};
use crate::request::params::{self, GenerationFields, SamplingFields};

/// OpenAI's default `max_tokens` for completions.
const DEFAULT_MAX_TOKENS: usize = 16;

pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub struct CompletionRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub echo: bool,
    /// `logprobs`: None = off, Some(k) = each token's log-probability plus k alternatives.
    pub logprobs: Option<usize>,
}

/// The body as serde reads it; sampling and the shared generation fields are read from the same
/// object by their own structs. `prompt` takes several shapes and is checked by [`prompt`].
#[derive(Deserialize)]
struct CompletionBody {
    prompt: Option<Value>,
    suffix: Option<Value>,
    echo: Option<bool>,
    logprobs: Option<Int>,
    max_tokens: Option<Int>,
}

impl CompletionRequest {
    pub fn parse(body: &Map<String, Value>, vocab: usize) -> Result<Self, ApiError> {
        let b: CompletionBody = read(body)?;
        let generation: GenerationFields = read(body)?;
        let sampling_fields: SamplingFields = read(body)?;
        let prompt = prompt(b.prompt.as_ref(), vocab)?;
        generation.single_choice()?;
        if b.suffix.is_some() {
            return Err(ApiError::invalid_param(
                "suffix",
                "'suffix' (fill-in-the-middle) is not supported",
            ));
        }
        let echo = b.echo.unwrap_or(false);
        let logprobs = within("logprobs", b.logprobs.map(|n| n.0), 0, 20)?.map(|k| k as usize);
        // max_tokens = 0 only makes sense for scoring an echoed prompt.
        let min = if echo { 0 } else { 1 };
        let max_tokens = params::at_least("max_tokens", b.max_tokens.map(|n| n.0), min)?
            .unwrap_or(DEFAULT_MAX_TOKENS);
        let (stream, include_usage) = generation.streaming();
        Ok(CompletionRequest {
            prompt,
            sampling: params::sampling(
                &sampling_fields,
                SamplingParams::model_defaults(true),
                vocab,
            )?,
            max_tokens,
            stop: generation.stops()?,
            stream,
            include_usage,
            echo,
            logprobs,
        })
    }
}

/// A string, a list of token ids, or a one-element list of either.
fn prompt(v: Option<&Value>, vocab: usize) -> Result<Prompt, ApiError> {
    let bad = |msg: String| ApiError::invalid_param("prompt", msg);
    let p = match v {
        None => return Err(bad("'prompt' is required".into())),
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(bad("'prompt' must not be empty".into()))
        }
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            Prompt::Tokens(token_ids(items, vocab)?)
        }
        Some(Value::Array(items)) if items.len() == 1 => return prompt(items.first(), vocab),
        Some(Value::Array(_)) => {
            return Err(bad(
                "only one prompt per request is supported (batches of prompts are not)".into(),
            ))
        }
        Some(other) => {
            return Err(bad(format!(
                "'prompt' must be a string or an array of token ids, got {}",
                kind(other)
            )))
        }
    };
    match &p {
        Prompt::Text(s) if s.is_empty() => Err(bad("'prompt' must not be empty".into())),
        _ => Ok(p),
    }
}

fn token_ids(items: &[Value], vocab: usize) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_u64() {
            Some(id) if (id as usize) < vocab => Ok(id as u32),
            _ => Err(ApiError::invalid_param(
                "prompt",
                format!("prompt token {v} is not a token id (0..{vocab})"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<CompletionRequest, ApiError> {
        CompletionRequest::parse(v.as_object().unwrap(), 1000)
    }

    #[test]
    fn prompt_forms() {
        assert!(matches!(
            parse(json!({"prompt": "hi"})).unwrap().prompt,
            Prompt::Text(_)
        ));
        assert!(matches!(
            parse(json!({"prompt": ["hi"]})).unwrap().prompt,
            Prompt::Text(_)
        ));
        assert!(
            matches!(parse(json!({"prompt": [1, 2]})).unwrap().prompt, Prompt::Tokens(ref t) if t == &[1, 2])
        );
        assert!(
            matches!(parse(json!({"prompt": [[3]]})).unwrap().prompt, Prompt::Tokens(ref t) if t == &[3])
        );
        for bad in [
            json!({}),
            json!({"prompt": ""}),
            json!({"prompt": ["a", "b"]}),
            json!({"prompt": [5000]}),
            json!({"prompt": 3}),
        ] {
            assert_eq!(
                parse(bad.clone()).err().map(|e| e.param),
                Some(Some("prompt".into())),
                "{bad}"
            );
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        for (body, param) in [
            (json!({"prompt": "x", "echo": 1}), "echo"),
            (json!({"prompt": "x", "logprobs": true}), "logprobs"),
            (json!({"prompt": "x", "max_tokens": "ten"}), "max_tokens"),
            (
                json!({"prompt": "x", "stream_options": {"include_usage": "yes"}}),
                "stream_options.include_usage",
            ),
            (json!({"prompt": "x", "stop": {"a": 1}}), "stop"),
            (json!({"prompt": "x", "n": 2}), "n"),
            (json!({"prompt": "x", "best_of": 1.5}), "best_of"),
            (json!({"prompt": "x", "logprobs": 21}), "logprobs"),
        ] {
            let err = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} was accepted"));
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }

    #[test]
    fn echo_allows_scoring_without_generating() {
        let r =
            parse(json!({"prompt": "x", "echo": true, "logprobs": 1, "max_tokens": 0})).unwrap();
        assert_eq!((r.max_tokens, r.logprobs), (0, Some(1)));
        assert!(parse(json!({"prompt": "x", "max_tokens": 0})).is_err());
        assert_eq!(
            parse(json!({"prompt": "x"})).unwrap().max_tokens,
            DEFAULT_MAX_TOKENS
        );
    }
}
