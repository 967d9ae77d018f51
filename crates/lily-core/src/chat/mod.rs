//! The chat template: the model's own Jinja template (`chat_template.jinja`, or the
//! `chat_template` field of `tokenizer_config.json`) rendered with minijinja so the prompt is
//! byte-identical to HF transformers' `apply_chat_template` with Jinja2 (tests/chat_goldens.rs).
//!
//! What needed care to match Jinja2 as transformers configures it:
//! - `trim_blocks` + `lstrip_blocks`, no autoescape;
//! - `tojson` is Python's `json.dumps(ensure_ascii=False)` (no HTML escaping, `", "`/`": "`
//!   separators, Python float repr, insertion key order) — see `pyjson`;
//! - `trim` is Python's `str.strip()` (which also strips U+001C..U+001F, unlike Rust's `trim`);
//! - Python string methods (`startswith`, `split`, `rstrip('\n')`, …) via minijinja-contrib pycompat;
//! - `raise_exception(msg)` fails the render with exactly `msg`;
//! - the message preparation transformers does before rendering: keys whose value is null are
//!   dropped, `reasoning`/`thinking` alias `reasoning_content`; and what the OpenAI API needs on
//!   top: tool-call `arguments` sent as a JSON string are parsed into an object.

mod pyjson;

use std::path::Path;

use anyhow::{anyhow, Context, Result};
use minijinja::value::Value as JValue;
use minijinja::{AutoEscape, Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};

pub use pyjson::{dumps as python_json_dumps, float_repr as python_float_repr};

const TEMPLATE_NAME: &str = "chat_template";
/// Marks errors raised by the template itself, so their message can be passed on verbatim.
const RAISED: &str = "raise_exception: ";

/// Why a conversation could not be rendered. Both are the client's fault (HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ChatError {
    /// The request's messages/tools are not shaped as the API requires.
    #[error("{0}")]
    Invalid(String),
    /// The template refused the conversation (`raise_exception`) or failed while rendering it.
    #[error("{0}")]
    Template(String),
}

/// Per-request rendering options.
#[derive(Clone, Debug, Default)]
pub struct ChatOptions {
    /// Append the assistant header (`<|im_start|>assistant\n<think>\n`) for the model to continue.
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs` of the request (`enable_thinking`, `preserve_thinking`, …), passed
    /// to the template as top-level variables.
    pub kwargs: Map<String, Value>,
}

impl ChatOptions {
    pub fn generation() -> Self {
        ChatOptions {
            add_generation_prompt: true,
            kwargs: Map::new(),
        }
    }

    /// Thinking is on unless `enable_thinking` is literally `false` (the template's own test).
    pub fn thinking_enabled(&self) -> bool {
        self.kwargs.get("enable_thinking") != Some(&Value::Bool(false))
    }
}

/// A compiled chat template. Build once per model; `render` is `&self` and thread-safe.
pub struct ChatTemplate {
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

impl ChatTemplate {
    /// Reads `DIR/chat_template.jinja`, or else the `chat_template` string of
    /// `DIR/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            let source = std::fs::read_to_string(&jinja)
                .with_context(|| format!("cannot read chat template {}", jinja.display()))?;
            return Self::new(source).with_context(|| format!("in {}", jinja.display()));
        }
        let config = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&config).with_context(|| {
            format!(
                "no chat_template.jinja in {} and cannot read {}",
                dir.display(),
                config.display()
            )
        })?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", config.display()))?;
        let source = json
            .get("chat_template")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("{}: no string field `chat_template`", config.display()))?;
        Self::new(source.to_owned())
            .with_context(|| format!("in {} field chat_template", config.display()))
    }

    /// Compiles a template source; syntax errors name the line.
    pub fn new(source: String) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_filter("trim", py_trim);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| anyhow!("chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate { env })
    }

    /// Renders OpenAI-style `messages` (and `tools`, the request's `tools` array as given) into
    /// the prompt text.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        opts: &ChatOptions,
    ) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::Invalid(
                "messages must contain at least one message".into(),
            ));
        }
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| prepare_message(i, m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ctx = opts.kwargs.clone();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::Null, |t| Value::Array(t.to_vec())),
        );
        ctx.insert("documents".into(), Value::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(opts.add_generation_prompt),
        );
        let tmpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Template(format!("chat template: {e}")))?;
        tmpl.render(JValue::from_serialize(&ctx))
            .map_err(template_error)
    }
}

/// One message as transformers hands it to the template (see the module comment).
fn prepare_message(i: usize, message: &Value) -> Result<Value, ChatError> {
    let Value::Object(fields) = message else {
        return Err(ChatError::Invalid(format!(
            "messages[{i}] must be an object"
        )));
    };
    let mut m: Map<String, Value> = fields
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| m.get(*k).cloned());
    if let Some(r) = reasoning {
        m.entry("thinking").or_insert_with(|| r.clone());
        m.insert("reasoning_content".into(), r);
    }
    if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
        for (j, call) in calls.iter_mut().enumerate() {
            let fields = match call {
                Value::Object(c) => c,
                _ => {
                    return Err(ChatError::Invalid(format!(
                        "messages[{i}].tool_calls[{j}] must be an object"
                    )))
                }
            };
            let (path, fields) = match fields.get_mut("function") {
                Some(Value::Object(f)) => ("function.arguments", f),
                Some(_) => {
                    return Err(ChatError::Invalid(format!(
                        "messages[{i}].tool_calls[{j}].function must be an object"
                    )))
                }
                None => ("arguments", fields),
            };
            if let Some(Value::String(s)) = fields.get("arguments") {
                // Some clients send "" for a call without arguments.
                let s = if s.trim().is_empty() { "{}" } else { s };
                let parsed: Value = serde_json::from_str(s).map_err(|e| {
                    ChatError::Invalid(format!(
                        "messages[{i}].tool_calls[{j}].{path} is not valid JSON: {e}"
                    ))
                })?;
                if !parsed.is_object() {
                    return Err(ChatError::Invalid(format!(
                        "messages[{i}].tool_calls[{j}].{path} must be a JSON object"
                    )));
                }
                fields.insert("arguments".into(), parsed);
            }
        }
    }
    Ok(Value::Object(m))
}

fn template_error(err: JError) -> ChatError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(je) = e.downcast_ref::<JError>() {
            if let Some(msg) = je.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return ChatError::Template(msg.to_owned());
            }
        }
        source = e.source();
    }
    ChatError::Template(format!("chat template failed: {err:#}"))
}

fn raise_exception(message: String) -> Result<JValue, JError> {
    Err(JError::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

fn tojson(value: JValue) -> Result<JValue, JError> {
    let json = serde_json::to_value(&value)
        .map_err(|e| JError::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(JValue::from_safe_string(pyjson::dumps(&json)))
}

/// Python's `str.isspace()`: Rust's White_Space plus the four information separators.
fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Jinja2's `trim` filter is Python's `str.strip(chars)`.
fn py_trim(value: String, chars: Option<String>) -> String {
    match chars {
        Some(chars) => value.trim_matches(|c| chars.contains(c)).to_owned(),
        None => value.trim_matches(py_is_space).to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tiny(src: &str) -> ChatTemplate {
        ChatTemplate::new(src.to_owned()).unwrap()
    }

    #[test]
    fn tool_call_arguments_string_is_parsed_into_an_object() {
        let t = tiny("{% for k, v in messages[0].tool_calls[0].function.arguments|items %}{{ k }}={{ v|tojson }};{% endfor %}");
        let msgs = [
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"b\": 1.0, \"a\": [true]}"}}]}),
        ];
        assert_eq!(
            t.render(&msgs, None, &ChatOptions::default()).unwrap(),
            "b=1.0;a=[true];"
        );
    }

    #[test]
    fn invalid_arguments_json_names_the_field() {
        let t = tiny("x");
        let msgs = [
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}),
        ];
        let err = t.render(&msgs, None, &ChatOptions::default()).unwrap_err();
        assert!(
            matches!(&err, ChatError::Invalid(m) if m.starts_with("messages[0].tool_calls[0].function.arguments is not valid JSON")),
            "{err}"
        );
        let msgs = [
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}),
        ];
        assert!(t.render(&msgs, None, &ChatOptions::default()).is_err());
        let msgs = [
            json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": " "}}]}),
        ];
        assert!(t.render(&msgs, None, &ChatOptions::default()).is_ok());
    }

    #[test]
    fn raise_exception_message_passes_through_macros() {
        let t = tiny("{% macro m() %}{{ raise_exception('Bad thing.') }}{% endmacro %}{{ m() }}");
        let err = t
            .render(&[json!({"role": "user"})], None, &ChatOptions::default())
            .unwrap_err();
        assert_eq!(err, ChatError::Template("Bad thing.".into()));
    }

    #[test]
    fn null_fields_are_dropped_and_reasoning_is_aliased() {
        let t = tiny("{{ messages[0].content is defined }}|{{ messages[0].reasoning_content }}");
        let msgs = [json!({"role": "assistant", "content": null, "reasoning": "why"})];
        // Booleans print as Python does.
        assert_eq!(
            t.render(&msgs, None, &ChatOptions::default()).unwrap(),
            "False|why"
        );
    }

    #[test]
    fn trim_strips_python_whitespace() {
        assert_eq!(py_trim("\u{1f}\u{3000} a b\u{85}\n".into(), None), "a b");
        assert_eq!(py_trim("xxaxx".into(), Some("x".into())), "a");
        // U+200B is not whitespace for Python either.
        assert_eq!(py_trim("\u{200b}a".into(), None), "\u{200b}a");
    }

    #[test]
    fn empty_messages_are_refused() {
        let t = tiny("x");
        assert!(matches!(
            t.render(&[], None, &ChatOptions::default()),
            Err(ChatError::Invalid(_))
        ));
    }

    #[test]
    fn syntax_error_is_reported_at_load() {
        let err = ChatTemplate::new("{% if %}".into()).unwrap_err();
        assert!(format!("{err:#}").contains("does not compile"), "{err:#}");
    }
}
