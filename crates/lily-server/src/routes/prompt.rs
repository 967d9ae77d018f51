//! The chat prompt both chat APIs build: the template rendered with the generation prompt, its
//! tokens, and where the conversation ends (the state worth saving for the next turn).

use lily_core::chat::{ChatError, ChatOptions};
use serde_json::{Map, Value};

use crate::openai::error::ApiError;
use crate::state::Model;

pub struct ChatPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
    /// See `Job::save_prefix_at`.
    pub save_prefix_at: Option<usize>,
}

/// Renders and tokenizes `messages` (template form) with `tools` and `kwargs`; a template error
/// is a 400 about `messages`.
pub fn chat_prompt(
    model: &Model,
    messages: &[Value],
    tools: Option<&[Value]>,
    kwargs: &Map<String, Value>,
) -> Result<ChatPrompt, ApiError> {
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
    let tokens = model
        .tokenizer
        .encode(&text)
        .map_err(|e| ApiError::internal(format!("{e:#}")))?;
    let save_prefix_at = conversation_end(model, messages, tools, kwargs, &text, &tokens);
    Ok(ChatPrompt {
        text,
        tokens,
        save_prefix_at,
    })
}

/// Where the conversation ends and the generation prompt (`<|im_start|>assistant\n<think>\n`)
/// begins, in tokens: the next turn's prompt starts with everything before it, so that is the
/// state worth keeping for reuse. None if the split is not clean.
fn conversation_end(
    model: &Model,
    messages: &[Value],
    tools: Option<&[Value]>,
    kwargs: &Map<String, Value>,
    prompt_text: &str,
    prompt: &[u32],
) -> Option<usize> {
    let opts = ChatOptions {
        add_generation_prompt: false,
        kwargs: kwargs.clone(),
    };
    let conversation = model.template.render(messages, tools, &opts).ok()?;
    let suffix = prompt_text.strip_prefix(conversation.as_str())?;
    let suffix_ids = model.tokenizer.encode(suffix).ok()?;
    (!suffix_ids.is_empty() && prompt.ends_with(&suffix_ids))
        .then(|| prompt.len() - suffix_ids.len())
}
