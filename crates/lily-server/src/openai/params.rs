//! Request fields shared by `/v1/chat/completions` and `/v1/completions`: sampling, stop strings,
//! token limits, streaming options.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use lily_core::sampling::SamplingParams;
use lily_core::text::{Bounded, MAX_PIECE_BYTES};
use serde_json::Value;

use super::error::ApiError;
use super::fields::{kind, Fields};

/// At most this many stop strings (OpenAI allows 4; a few more costs nothing).
const MAX_STOPS: usize = 16;

/// Sampling fields over `defaults` (the model card's, MODEL.md §4). `vocab` bounds logit_bias ids.
pub fn sampling(
    f: &Fields,
    defaults: SamplingParams,
    vocab: usize,
) -> Result<SamplingParams, ApiError> {
    let mut p = defaults;
    if let Some(v) = f.f64_in("temperature", 0.0, 2.0)? {
        p.temperature = v as f32;
    }
    if let Some(v) = f.f64("top_p")? {
        p.top_p = v as f32;
    }
    // vLLM spells "off" as -1, the sampler as 0.
    if let Some(v) = f.i64_in("top_k", -1, u32::MAX as i64)? {
        p.top_k = v.max(0) as u32;
    }
    if let Some(v) = f.f64("min_p")? {
        p.min_p = v as f32;
    }
    if let Some(v) = f.f64("presence_penalty")? {
        p.presence_penalty = v as f32;
    }
    if let Some(v) = f.f64("frequency_penalty")? {
        p.frequency_penalty = v as f32;
    }
    if let Some(v) = f.f64("repetition_penalty")? {
        p.repetition_penalty = v as f32;
    }
    if let Some(bias) = f.object("logit_bias")? {
        for (key, value) in bias {
            let id: u32 = key.parse().map_err(|_| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {key:?}"),
                )
            })?;
            let b = value.as_f64().ok_or_else(|| {
                ApiError::invalid_param(
                    "logit_bias",
                    format!("logit_bias[{key}] must be a number, got {}", kind(value)),
                )
            })?;
            p.logit_bias.push((id, b as f32));
        }
    }
    p.seed = match f.i64("seed")? {
        Some(seed) => seed as u64,
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
pub fn stops(f: &Fields) -> Result<Vec<String>, ApiError> {
    let list: Vec<String> = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::invalid_param(
                        "stop",
                        format!("'stop' entries must be strings, got {}", kind(v)),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "'stop' must be a string or an array of strings, got {}",
                    kind(other)
                ),
            ))
        }
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

/// The first of `names` that is set (`max_completion_tokens` before the deprecated `max_tokens`),
/// as a count of at least `min`.
pub fn max_tokens(f: &Fields, names: &[&str], min: i64) -> Result<Option<usize>, ApiError> {
    for name in names {
        if let Some(n) = f.i64(name)? {
            if n < min {
                return Err(ApiError::invalid_param(
                    name,
                    format!("'{name}' must be at least {min}, got {n}"),
                ));
            }
            return Ok(Some(n as usize));
        }
    }
    Ok(None)
}

/// `n` (and `best_of`): only one choice per request.
pub fn single_choice(f: &Fields) -> Result<(), ApiError> {
    for name in ["n", "best_of"] {
        if let Some(n) = f.i64(name)? {
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
pub fn streaming(f: &Fields) -> Result<(bool, bool), ApiError> {
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(opts) => Fields::nested(opts, "stream_options".into())
            .bool("include_usage")?
            .unwrap_or(false),
        None => false,
    };
    Ok((stream, include_usage))
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
    use serde_json::json;

    fn fields(v: &Value) -> Fields<'_> {
        Fields::new(v.as_object().unwrap())
    }

    #[test]
    fn request_values_override_the_defaults_and_a_seed_is_kept() {
        let v = json!({"temperature": 0.0, "top_k": -1, "seed": 7, "logit_bias": {"5": -100}});
        let p = sampling(&fields(&v), SamplingParams::model_defaults(true), 100).unwrap();
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
            let err =
                sampling(&fields(&body), SamplingParams::model_defaults(true), 100).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }

    #[test]
    fn stop_accepts_a_string_or_a_list() {
        assert_eq!(stops(&fields(&json!({"stop": "x"}))).unwrap(), vec!["x"]);
        assert_eq!(
            stops(&fields(&json!({"stop": ["a", "b"]}))).unwrap(),
            vec!["a", "b"]
        );
        assert!(stops(&fields(&json!({"stop": [1]}))).is_err());
        assert!(stops(&fields(&json!({"stop": [""]}))).is_err());
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
