//! The chat prompt both chat APIs build: the template rendered with the generation prompt, its
//! tokens, and where the conversation ends (the state worth saving for the next turn). Each is
//! made once per request, and a prompt that cannot fit the context is refused as early as it can
//! be told: by its text's bytes before rendering, by its tokens as soon as they pass the context.

use lily_core::chat::{ChatError, ChatOptions};
use serde_json::{json, Map, Value};

use crate::openai::error::ApiError;
use crate::request::params::{bounded_prompt, check_prompt_bytes};
use crate::state::Model;

pub struct ChatPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
    /// See `Job::save_prefix_at`.
    pub save_prefix_at: Option<usize>,
}

/// Renders and tokenizes `messages` (template form) with `tools` and `kwargs`; a template error,
/// a prompt over the context or one that renders to nothing is a 400 about `messages`. Slow for
/// long conversations: callers run it off the async workers (`off_the_workers`).
pub fn chat_prompt(
    model: &Model,
    messages: &[Value],
    tools: Option<&[Value]>,
    kwargs: &Map<String, Value>,
) -> Result<ChatPrompt, ApiError> {
    check_prompt_bytes(
        rendered_text_bytes(messages),
        model.max_prompt_bytes,
        model.ctx_size,
        "messages",
    )?;
    let opts = ChatOptions {
        add_generation_prompt: true,
        kwargs: kwargs.clone(),
    };
    let text = model
        .template
        .render(messages, tools, &opts)
        .map_err(|e| match e {
            ChatError::Invalid(m) | ChatError::Template(m) => {
                ApiError::invalid_param("messages", m)
            }
        })?;
    // Tokens beyond ctx_size - 1 leave no room for output: the count stops there.
    let tokens = model
        .tokenizer
        .encode_within(&text, model.ctx_size.saturating_sub(1))
        .map_err(|e| ApiError::internal(format!("{e:#}")))?;
    let tokens = bounded_prompt(tokens, model.ctx_size, "messages")?;
    if tokens.is_empty() {
        // A template that renders these messages to nothing: there is nothing to continue.
        return Err(ApiError::invalid_param(
            "messages",
            "the chat template renders these messages to no tokens",
        ));
    }
    let save_prefix_at = conversation_end(model, kwargs, &text, &tokens);
    Ok(ChatPrompt {
        text,
        tokens,
        save_prefix_at,
    })
}

/// Bytes of message text the prompt certainly contains: the content of every message but the
/// assistant's (the template may drop an earlier turn's thinking from those), as a string or as
/// text parts. A lower bound, so refusing on it never refuses a prompt that would fit.
fn rendered_text_bytes(messages: &[Value]) -> usize {
    messages
        .iter()
        .filter(|m| m.get("role").and_then(Value::as_str) != Some("assistant"))
        .map(|m| match m.get("content") {
            Some(Value::String(s)) => s.len(),
            Some(Value::Array(parts)) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .map(str::len)
                .sum(),
            _ => 0,
        })
        .sum()
}

/// Where the conversation ends and the generation prompt (`<|im_start|>assistant\n<think>\n`)
/// begins, in tokens: the next turn's prompt starts with everything before it, so that is the
/// state worth keeping for reuse. The generation prompt depends on the template options, not on
/// the conversation: it is read off a one-message conversation rendered both ways, rather than
/// by rendering this (perhaps long) conversation a second time. None if the split is not clean.
fn conversation_end(
    model: &Model,
    kwargs: &Map<String, Value>,
    prompt_text: &str,
    prompt: &[u32],
) -> Option<usize> {
    let probe = [json!({"role": "user", "content": "."})];
    let render = |add_generation_prompt| {
        let opts = ChatOptions {
            add_generation_prompt,
            kwargs: kwargs.clone(),
        };
        model.template.render(&probe, None, &opts).ok()
    };
    let (with, without) = (render(true)?, render(false)?);
    let suffix = with.strip_prefix(without.as_str())?;
    if !prompt_text.ends_with(suffix) {
        return None;
    }
    let suffix_ids = model.tokenizer.encode(suffix).ok()?;
    (!suffix_ids.is_empty() && prompt.ends_with(&suffix_ids))
        .then(|| prompt.len() - suffix_ids.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_bytes_count_what_the_template_always_renders() {
        let messages = vec![
            json!({"role": "system", "content": "abc"}),
            json!({"role": "user", "content": [{"type": "text", "text": "de"}, {"type": "text", "text": "é"}]}),
            json!({"role": "assistant", "content": "<think>long</think>x"}),
            json!({"role": "tool", "content": "12345"}),
        ];
        assert_eq!(rendered_text_bytes(&messages), 3 + 2 + 2 + 5);
    }
}
