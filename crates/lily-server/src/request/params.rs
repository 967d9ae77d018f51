//! Request fields both wire formats share (`/v1/chat/completions`, `/v1/completions` and the
//! Anthropic `/v1/messages`): sampling, stop strings, token limits, streaming options.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use lily_core::sampling::SamplingParams;
use std::collections::BTreeMap;

use lily_core::text::{Bounded, MAX_PIECE_BYTES};
use serde::Deserialize;

use crate::openai::error::ApiError;
use crate::request::fields::{within, Int, Num, Obj};

/// At most this many stop strings (OpenAI allows 4; a few more costs nothing).
const MAX_STOPS: usize = 16;

/// The sampling fields, as both APIs spell them (the Anthropic parser reads them too).
#[derive(Deserialize, Default)]
pub struct SamplingFields {
    temperature: Option<Num>,
    top_p: Option<Num>,
    top_k: Option<Int>,
    min_p: Option<Num>,
    presence_penalty: Option<Num>,
    frequency_penalty: Option<Num>,
    repetition_penalty: Option<Num>,
    /// Token id (as a string key) → bias.
    logit_bias: Option<BTreeMap<String, Num>>,
    seed: Option<Int>,
}

/// Sampling fields over `defaults` (the model card's, MODEL.md §4). `vocab` bounds logit_bias ids.
pub fn sampling(
    f: &SamplingFields,
    defaults: SamplingParams,
    vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let mut p = defaults;
    if let Some(v) = within("temperature", f.temperature.map(|n| n.0), 0.0, 2.0)? {
        p.temperature = v as f32;
    }
    if let Some(v) = f.top_p {
        p.top_p = v.0 as f32;
    }
    // vLLM spells "off" as -1, the sampler as 0.
    if let Some(v) = within("top_k", f.top_k.map(|n| n.0), -1, u32::MAX as i64)? {
        p.top_k = v.max(0) as u32;
    }
    for (field, value) in [
        (&mut p.min_p, f.min_p),
        (&mut p.presence_penalty, f.presence_penalty),
        (&mut p.frequency_penalty, f.frequency_penalty),
        (&mut p.repetition_penalty, f.repetition_penalty),
    ] {
        if let Some(v) = value {
            *field = v.0 as f32;
        }
    }
    for (key, bias) in f.logit_bias.iter().flatten() {
        let id: u32 = key.parse().map_err(|_| {
            ApiError::invalid_param(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {key:?}"),
            )
        })?;
        p.logit_bias.push((id, bias.0 as f32));
    }
    p.seed = match f.seed {
        Some(seed) => seed.0 as u64,
        None => fresh_seed(),
    };
    p.validate(vocab).map_err(|message| {
        let param = message.split_whitespace().next().unwrap_or("").to_string();
        ApiError::invalid(Some(param), message)
    })?;
    Ok(p)
}

/// A different seed for every request that names none.
fn fresh_seed() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos
        ^ COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// `stop`: a string or an array of strings.
#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of strings")]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// The generation fields `/v1/chat/completions` and `/v1/completions` share, besides sampling.
#[derive(Deserialize)]
pub struct GenerationFields {
    stop: Option<Stop>,
    n: Option<Int>,
    best_of: Option<Int>,
    stream: Option<bool>,
    stream_options: Option<Obj<StreamOptions>>,
}

impl GenerationFields {
    /// The stop strings, at most [`MAX_STOPS`], none empty.
    pub fn stops(&self) -> Result<Vec<String>, ApiError> {
        let list = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        if list.len() > MAX_STOPS {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "at most {MAX_STOPS} stop strings are supported, got {}",
                    list.len()
                ),
            ));
        }
        if list.iter().any(String::is_empty) {
            return Err(ApiError::invalid_param(
                "stop",
                "stop strings must not be empty",
            ));
        }
        Ok(list)
    }

    /// `n` (and `best_of`): only one choice per request.
    pub fn single_choice(&self) -> Result<(), ApiError> {
        for (name, value) in [("n", self.n), ("best_of", self.best_of)] {
            if let Some(Int(n)) = value {
                if n != 1 {
                    return Err(ApiError::invalid_param(
                        name,
                        format!("only {name}=1 is supported, got {n}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// `stream` and `stream_options.include_usage`.
    pub fn streaming(&self) -> (bool, bool) {
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.0.include_usage)
            .unwrap_or(false);
        (self.stream.unwrap_or(false), include_usage)
    }
}

/// A token count given as `name`, refused below `min`.
pub fn at_least(name: &str, value: Option<i64>, min: i64) -> Result<Option<usize>, ApiError> {
    match value {
        Some(n) if n < min => Err(ApiError::invalid_param(
            name,
            format!("'{name}' must be at least {min}, got {n}"),
        )),
        Some(n) => Ok(Some(n as usize)),
        None => Ok(None),
    }
}

/// How many tokens may be generated: the request's limit if it fits beside the prompt in the
/// context, else a 400 that says by how much it does not.
/// Refuses prompt text longer than `limit` bytes (`Model::max_prompt_bytes`): it cannot fit the
/// context, and finding that out by tokenizing it costs seconds and gigabytes.
pub fn check_prompt_bytes(
    bytes: usize,
    limit: usize,
    ctx_size: usize,
    param: &str,
) -> Result<(), ApiError> {
    if bytes > limit {
        return Err(ApiError::invalid_param(
            param,
            format!("the prompt holds {bytes} bytes of text, more than the {limit} bytes a {ctx_size}-token context can hold"),
        )
        .with_code("context_length_exceeded"));
    }
    Ok(())
}

/// The prompt's tokens, or why there are none: more than fit the context beside one token of
/// output (counted only that far), or a stretch of text too long to encode in pieces.
pub fn bounded_prompt(
    encoded: Bounded,
    ctx_size: usize,
    param: &str,
) -> Result<Vec<u32>, ApiError> {
    match encoded {
        Bounded::Ids(ids) => Ok(ids),
        Bounded::TooManyTokens => Err(ApiError::invalid_param(
            param,
            format!("the prompt is longer than the {ctx_size}-token context can hold with any output (at least {ctx_size} tokens)"),
        )
        .with_code("context_length_exceeded")),
        Bounded::Unbroken(bytes) => Err(ApiError::invalid_param(
            param,
            format!("the prompt has {bytes} bytes of text without a space, digit, punctuation or line break; at most {MAX_PIECE_BYTES} are accepted"),
        )),
    }
}

pub fn fit(
    prompt_tokens: usize,
    requested: Option<usize>,
    ctx_size: usize,
    param: &str,
) -> Result<usize, ApiError> {
    if prompt_tokens >= ctx_size {
        return Err(ApiError::invalid(
            Some("messages".to_string()),
            format!("the prompt is {prompt_tokens} tokens long, but the context holds {ctx_size} tokens (prompt plus output)"),
        )
        .with_code("context_length_exceeded"));
    }
    let room = ctx_size - prompt_tokens;
    match requested {
        Some(n) if n > room => Err(ApiError::invalid_param(
            param,
            format!("{param} = {n} cannot fit: the prompt uses {prompt_tokens} of the {ctx_size}-token context, leaving {room}"),
        )
        .with_code("context_length_exceeded")),
        Some(n) => Ok(n),
        None => Ok(room),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::fields::read;
    use serde_json::{json, Value};

    fn sampling_of(v: &Value) -> Result<SamplingParams, ApiError> {
        let f: SamplingFields = read(v.as_object().unwrap())?;
        sampling(&f, SamplingParams::model_defaults(true), 100)
    }

    fn stops(v: &Value) -> Result<Vec<String>, ApiError> {
        read::<GenerationFields>(v.as_object().unwrap())?.stops()
    }

    #[test]
    fn request_values_override_the_defaults_and_a_seed_is_kept() {
        let v = json!({"temperature": 0.0, "top_k": -1, "seed": 7, "logit_bias": {"5": -100}});
        let p = sampling_of(&v).unwrap();
        assert_eq!((p.temperature, p.top_k, p.seed), (0.0, 0, 7));
        assert_eq!(p.logit_bias, vec![(5, -100.0)]);
        assert_eq!(p.top_p, SamplingParams::model_defaults(true).top_p);
    }

    #[test]
    fn out_of_range_sampling_names_the_field() {
        for (body, param) in [
            (json!({"temperature": 3}), "temperature"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"presence_penalty": -5}), "presence_penalty"),
            (json!({"logit_bias": {"1000": 1}}), "logit_bias"),
        ] {
            let err = sampling_of(&body).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        assert_eq!(stops(&json!({"stop": "x"})).unwrap(), vec!["x"]);
        assert_eq!(stops(&json!({"stop": ["a", "b"]})).unwrap(), vec!["a", "b"]);
        assert_eq!(stops(&json!({"stop": null})).unwrap(), Vec::<String>::new());
        let err = stops(&json!({"stop": [1]})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("stop"));
        assert_eq!(
            err.message,
            "'stop' must be a string or an array of strings"
        );
        assert!(stops(&json!({"stop": [""]})).is_err());
    }

    #[test]
    fn max_tokens_must_fit_beside_the_prompt() {
        assert_eq!(fit(10, Some(5), 100, "max_tokens").unwrap(), 5);
        assert_eq!(fit(10, None, 100, "max_tokens").unwrap(), 90);
        assert!(fit(10, Some(91), 100, "max_tokens").is_err());
        assert_eq!(
            fit(100, None, 100, "max_tokens").unwrap_err().code,
            Some("context_length_exceeded")
        );
    }
}
