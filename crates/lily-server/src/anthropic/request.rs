//! `POST /v1/messages` request: Anthropic content blocks turned into the messages the chat template
//! reads (`role`, `content`, `reasoning_content`, `tool_calls`; tool results as `tool` turns),
//! tools into the OpenAI shape the template and the tool-call parser share, and the sampling fields.

use lily_core::constrain::OutputSpec;
use lily_core::sampling::SamplingParams;
use serde_json::{json, Map, Value};

use crate::openai::error::ApiError;
use crate::request::fields::{kind, read, Fields};
use crate::request::params;
use crate::structured::ToolChoice;

pub struct MessagesRequest {
    /// Messages as the template reads them.
    pub messages: Vec<Value>,
    /// Tools in the OpenAI shape (`{"type": "function", "function": {name, description,
    /// parameters}}`); None when absent or `tool_choice` is `none`.
    pub tools: Option<Vec<Value>>,
    /// What the answer must be, enforced by constrained decoding: the call `tool_choice` forces
    /// (`any`, `tool`), or JSON under `output_config.format`'s schema.
    pub output: Option<OutputSpec>,
    /// `chat_template_kwargs` for the template: `enable_thinking` from `thinking`.
    pub kwargs: Map<String, Value>,
    /// `thinking.budget_tokens`: reasoning is closed after that many tokens.
    pub thinking_budget: Option<usize>,
    pub sampling: SamplingParams,
    /// None only for count_tokens, where it is not required.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
}

impl MessagesRequest {
    /// `counting`: a `/count_tokens` body (no `max_tokens`, nothing about generation needed).
    pub fn parse(
        body: &Map<String, Value>,
        vocab: usize,
        counting: bool,
    ) -> Result<Self, ApiError> {
        let f = Fields::new(body);
        let list = match f.array("messages")? {
            None => {
                return Err(ApiError::invalid_param(
                    "messages",
                    "'messages' is required",
                ))
            }
            Some(l) if l.is_empty() => {
                return Err(ApiError::invalid_param(
                    "messages",
                    "'messages' must not be empty",
                ))
            }
            Some(l) => l,
        };
        let mut messages = Vec::new();
        if let Some(system) = system(&f)? {
            messages.push(json!({"role": "system", "content": system}));
        }
        for (i, m) in list.iter().enumerate() {
            message(i, m, &mut messages)?;
        }

        let (thinking, thinking_budget) = thinking(&f)?;
        let mut kwargs = Map::new();
        if let Some(on) = thinking {
            kwargs.insert("enable_thinking".into(), json!(on));
        }
        let (tools, tool_choice, parallel) = tools(&f)?;
        let forced = tool_choice.spec(tools.as_deref(), parallel);
        let format = output_format(&f)?;
        if forced.is_some() && format.is_some() {
            return Err(ApiError::invalid_param(
                "output_config.format",
                "a JSON output format cannot be combined with a 'tool_choice' that forces a tool call",
            ));
        }

        let max_tokens = params::at_least("max_tokens", f.i64("max_tokens")?, 1)?;
        if max_tokens.is_none() && !counting {
            return Err(ApiError::invalid_param(
                "max_tokens",
                "'max_tokens' is required",
            ));
        }
        // Anthropic's temperature range is 0..1.
        f.f64_in("temperature", 0.0, 1.0)?;
        f.i64_in("top_k", 0, u32::MAX as i64)?;
        f.object("metadata")?;
        let sampling = params::sampling(
            &read(body)?,
            SamplingParams::model_defaults(thinking.unwrap_or(true)),
            vocab,
        )?;
        Ok(MessagesRequest {
            messages,
            tools,
            output: forced.or(format),
            kwargs,
            thinking_budget,
            sampling,
            max_tokens,
            stop: stop_sequences(&f)?,
            stream: f.bool("stream")?.unwrap_or(false),
        })
    }
}

/// `system`: a string or a list of text blocks.
fn system(f: &Fields) -> Result<Option<String>, ApiError> {
    match f.get("system") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(blocks)) => {
            let mut text = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                let param = format!("system[{j}]");
                match block_type(b, &param)? {
                    "text" => text.push(text_of(b, &param)?),
                    other => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("system blocks must be text blocks, got {other:?}"),
                        ))
                    }
                }
            }
            Ok(Some(text.join("\n\n")))
        }
        Some(other) => Err(ApiError::invalid_param(
            "system",
            format!(
                "'system' must be a string or an array of text blocks, got {}",
                kind(other)
            ),
        )),
    }
}

fn block_type<'a>(b: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    if !b.is_object() {
        return Err(ApiError::invalid_param(
            param,
            format!("'{param}' must be a content block object, got {}", kind(b)),
        ));
    }
    b.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid_param(
            &format!("{param}.type"),
            format!("'{param}.type' is required"),
        )
    })
}

fn text_of(b: &Value, param: &str) -> Result<String, ApiError> {
    b.get("text")
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| {
            ApiError::invalid_param(
                &format!("{param}.text"),
                format!("'{param}.text' must be a string"),
            )
        })
}

fn unsupported(param: &str, kind_of: &str) -> ApiError {
    ApiError::invalid_param(
        param,
        format!("content block type {kind_of:?} is not supported here: this model reads text only"),
    )
}

/// One Anthropic message, appended as one or more template messages.
fn message(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let path = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(ApiError::invalid_param(
            &path,
            format!("'{path}' must be an object, got {}", kind(m)),
        ));
    };
    let f = Fields::nested(obj, path.clone());
    let role = match f.str("role")? {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => {
            return Err(ApiError::invalid_param(
                &f.param("role"),
                format!(
                    "'{}' is {r:?}; expected \"user\" or \"assistant\" (the system prompt goes in 'system')",
                    f.param("role")
                ),
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                &f.param("role"),
                format!("'{}' is required", f.param("role")),
            ))
        }
    };
    let param = f.param("content");
    let blocks: Vec<Value> = match f.get("content") {
        Some(Value::String(s)) => vec![json!({"type": "text", "text": s})],
        Some(Value::Array(b)) => b.clone(),
        Some(other) => {
            return Err(ApiError::invalid_param(
                &param,
                format!(
                    "'{param}' must be a string or an array of content blocks, got {}",
                    kind(other)
                ),
            ))
        }
        None => {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}' is required"),
            ))
        }
    };
    if role == "assistant" {
        out.push(assistant(&param, &blocks)?);
    } else {
        user(&param, &blocks, out)?;
    }
    Ok(())
}

/// A user turn: text blocks become user messages, each `tool_result` a `tool` message (the
/// template renders consecutive ones inside one user turn as `<tool_response>`s).
fn user(param: &str, blocks: &[Value], out: &mut Vec<Value>) -> Result<(), ApiError> {
    let mut text: Option<String> = None;
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}[{j}]");
        match block_type(b, &bp)? {
            "text" => text
                .get_or_insert_with(String::new)
                .push_str(&text_of(b, &bp)?),
            "tool_result" => {
                if let Some(t) = text.take() {
                    out.push(json!({"role": "user", "content": t}));
                }
                out.push(json!({"role": "tool", "content": tool_result(b, &bp)?}));
            }
            other => return Err(unsupported(&bp, other)),
        }
    }
    if let Some(t) = text {
        out.push(json!({"role": "user", "content": t}));
    }
    Ok(())
}

/// A `tool_result`'s content as text. `is_error` results are marked, so the model can tell a
/// failed call from a result.
fn tool_result(b: &Value, param: &str) -> Result<String, ApiError> {
    let mut text = match b.get("content") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut t = Vec::new();
            for (k, p) in parts.iter().enumerate() {
                let pp = format!("{param}.content[{k}]");
                match block_type(p, &pp)? {
                    "text" => t.push(text_of(p, &pp)?),
                    other => return Err(unsupported(&pp, other)),
                }
            }
            t.join("\n")
        }
        Some(other) => {
            return Err(ApiError::invalid_param(
                &format!("{param}.content"),
                format!(
                    "'{param}.content' must be a string or an array of text blocks, got {}",
                    kind(other)
                ),
            ))
        }
    };
    match b.get("is_error") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => text = format!("Error: {text}"),
        Some(other) => {
            return Err(ApiError::invalid_param(
                &format!("{param}.is_error"),
                format!("'{param}.is_error' must be a boolean, got {}", kind(other)),
            ))
        }
    }
    Ok(text)
}

/// An assistant turn: text, thinking (→ `reasoning_content`) and `tool_use` blocks (→ `tool_calls`
/// with the input object as the template's arguments).
fn assistant(param: &str, blocks: &[Value]) -> Result<Value, ApiError> {
    let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let bp = format!("{param}[{j}]");
        match block_type(b, &bp)? {
            "text" => text.push_str(&text_of(b, &bp)?),
            "thinking" => match b.get("thinking").and_then(Value::as_str) {
                Some(t) => thinking.push_str(t),
                None => {
                    return Err(ApiError::invalid_param(
                        &format!("{bp}.thinking"),
                        format!("'{bp}.thinking' must be a string"),
                    ))
                }
            },
            // Encrypted reasoning of another model: nothing this one can read.
            "redacted_thinking" => {}
            "tool_use" => {
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|n| !n.is_empty());
                let Some(name) = name else {
                    return Err(ApiError::invalid_param(
                        &format!("{bp}.name"),
                        format!("'{bp}.name' must be a non-empty string"),
                    ));
                };
                let input = match b.get("input") {
                    None | Some(Value::Null) => json!({}),
                    Some(v @ Value::Object(_)) => v.clone(),
                    Some(other) => {
                        return Err(ApiError::invalid_param(
                            &format!("{bp}.input"),
                            format!("'{bp}.input' must be an object, got {}", kind(other)),
                        ))
                    }
                };
                let mut call = Map::new();
                if let Some(id) = b.get("id") {
                    call.insert("id".into(), id.clone());
                }
                call.insert("type".into(), json!("function"));
                call.insert("function".into(), json!({"name": name, "arguments": input}));
                calls.push(Value::Object(call));
            }
            other => return Err(unsupported(&bp, other)),
        }
    }
    let mut m = json!({"role": "assistant", "content": text});
    if !thinking.is_empty() {
        m["reasoning_content"] = json!(thinking);
    }
    if !calls.is_empty() {
        m["tool_calls"] = Value::Array(calls);
    }
    Ok(m)
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}`, `{"type": "adaptive"}` or
/// `{"type": "disabled"}` → the template's `enable_thinking` (absent → the model's default, on)
/// and the reasoning budget.
fn thinking(f: &Fields) -> Result<(Option<bool>, Option<usize>), ApiError> {
    let Some(t) = f.object("thinking")? else {
        return Ok((None, None));
    };
    let tf = Fields::nested(t, "thinking".into());
    match tf.str("type")? {
        Some("enabled") => {
            let budget = tf.i64_in("budget_tokens", 1, i64::from(u32::MAX))?;
            Ok((Some(true), budget.map(|b| b as usize)))
        }
        Some("adaptive") => Ok((Some(true), None)),
        Some("disabled") => Ok((Some(false), None)),
        Some(other) => Err(ApiError::invalid_param(
            "thinking.type",
            format!(
                "'thinking.type' is {other:?}; expected \"enabled\", \"adaptive\" or \"disabled\""
            ),
        )),
        None => Err(ApiError::invalid_param(
            "thinking.type",
            "'thinking.type' is required",
        )),
    }
}

/// `tools` (custom tools: `name`, `description`, `input_schema`), `tool_choice`, and whether
/// several calls may be made.
fn tools(f: &Fields) -> Result<(Option<Vec<Value>>, ToolChoice, bool), ApiError> {
    let mut parallel = true;
    let choice = match f.object("tool_choice")? {
        None => ToolChoice::Auto,
        Some(c) => {
            let cf = Fields::nested(c, "tool_choice".into());
            parallel = !cf.bool("disable_parallel_tool_use")?.unwrap_or(false);
            match cf.str("type")? {
                Some("auto") => ToolChoice::Auto,
                Some("any") => ToolChoice::Required,
                Some("none") => ToolChoice::None,
                Some("tool") => match cf.str("name")? {
                    Some(n) => ToolChoice::Named(n.to_owned()),
                    None => {
                        return Err(ApiError::invalid_param(
                            "tool_choice.name",
                            "'tool_choice.name' is required when 'tool_choice.type' is \"tool\"",
                        ))
                    }
                },
                Some(other) => {
                    return Err(ApiError::invalid_param(
                        "tool_choice.type",
                        format!("'tool_choice.type' is {other:?}; expected \"auto\", \"any\", \"tool\" or \"none\""),
                    ))
                }
                None => {
                    return Err(ApiError::invalid_param(
                        "tool_choice.type",
                        "'tool_choice.type' is required",
                    ))
                }
            }
        }
    };
    let list = f.array("tools")?.map(Vec::as_slice).unwrap_or_default();
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let Value::Object(obj) = tool else {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}' must be an object, got {}", kind(tool)),
            ));
        };
        let tf = Fields::nested(obj, param.clone());
        match tf.str("type")? {
            None | Some("custom") => {}
            Some(other) => {
                return Err(ApiError::invalid_param(
                    &tf.param("type"),
                    format!("tool type {other:?} is not supported: only custom tools (name, description, input_schema) are"),
                ))
            }
        }
        let name = tf.str("name")?.filter(|n| !n.is_empty()).ok_or_else(|| {
            ApiError::invalid_param(
                &tf.param("name"),
                format!("'{}' must be a non-empty string", tf.param("name")),
            )
        })?;
        let schema = tf.object("input_schema")?.ok_or_else(|| {
            ApiError::invalid_param(
                &tf.param("input_schema"),
                format!("'{}' is required", tf.param("input_schema")),
            )
        })?;
        let mut function = Map::new();
        function.insert("name".into(), json!(name));
        if let Some(d) = tf.str("description")? {
            function.insert("description".into(), json!(d));
        }
        function.insert("parameters".into(), Value::Object(schema.clone()));
        out.push(json!({"type": "function", "function": function}));
    }
    if let ToolChoice::Named(name) = &choice {
        if !out.iter().any(|t| t["function"]["name"] == name.as_str()) {
            return Err(ApiError::invalid_param(
                "tool_choice.name",
                format!("'tool_choice.name' is {name:?}, which is not one of the request's tools"),
            ));
        }
    }
    if matches!(choice, ToolChoice::Required) && out.is_empty() {
        return Err(ApiError::invalid_param(
            "tool_choice",
            "'tool_choice' \"any\" needs at least one tool in 'tools'",
        ));
    }
    let tools = (choice != ToolChoice::None && !out.is_empty()).then_some(out);
    Ok((tools, choice, parallel))
}

/// `output_config.format` (or the older `output_format`): `{"type": "json_schema", "schema": …}`.
fn output_format(f: &Fields) -> Result<Option<OutputSpec>, ApiError> {
    let (format, param) = match f.object("output_config")? {
        Some(c) => (
            Fields::nested(c, "output_config".into()).object("format")?,
            "output_config.format",
        ),
        None => (f.object("output_format")?, "output_format"),
    };
    let Some(format) = format else {
        return Ok(None);
    };
    let ff = Fields::nested(format, param.into());
    match ff.str("type")? {
        Some("json_schema") => match ff.get("schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Ok(Some(OutputSpec::JsonSchema(schema.clone())))
            }
            _ => Err(ApiError::invalid_param(
                &ff.param("schema"),
                format!("'{}' must be a JSON schema object", ff.param("schema")),
            )),
        },
        _ => Err(ApiError::invalid_param(
            &ff.param("type"),
            format!("'{}' must be \"json_schema\"", ff.param("type")),
        )),
    }
}

/// `stop_sequences`: an array of non-empty strings.
fn stop_sequences(f: &Fields) -> Result<Vec<String>, ApiError> {
    let Some(list) = f.array("stop_sequences")? else {
        return Ok(Vec::new());
    };
    list.iter()
        .enumerate()
        .map(|(i, v)| match v.as_str() {
            Some(s) if !s.is_empty() => Ok(s.to_owned()),
            _ => Err(ApiError::invalid_param(
                &format!("stop_sequences[{i}]"),
                format!("'stop_sequences[{i}]' must be a non-empty string"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<MessagesRequest, ApiError> {
        MessagesRequest::parse(v.as_object().unwrap(), 1000, false)
    }

    #[test]
    fn blocks_become_template_messages() {
        let r = parse(json!({
            "max_tokens": 10,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "timeout", "is_error": true},
                    {"type": "text", "text": "And tomorrow?"}]}
            ]}))
        .unwrap();
        assert_eq!(
            r.messages,
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Paris?"}),
                json!({"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
                       "tool_calls": [{"id": "toolu_1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}),
                json!({"role": "tool", "content": "sunny"}),
                json!({"role": "tool", "content": "Error: timeout"}),
                json!({"role": "user", "content": "And tomorrow?"}),
            ]
        );
        assert_eq!(r.output, None);
        assert!(r.kwargs.is_empty());
    }

    #[test]
    fn tools_and_choice_take_the_openai_shape() {
        let tool = json!({"name": "f", "description": "d", "input_schema": {"type": "object"}});
        let r = parse(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                             "tools": [tool], "tool_choice": {"type": "tool", "name": "f"}}),
        )
        .unwrap();
        assert!(
            matches!(&r.output, Some(OutputSpec::ToolCalls { only: Some(n), parallel: false, .. }) if n == "f")
        );
        assert_eq!(
            r.tools.unwrap()[0],
            json!({"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}})
        );
        let r = parse(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                             "tools": [tool], "tool_choice": {"type": "none"}}),
        )
        .unwrap();
        assert!(r.tools.is_none());
    }

    #[test]
    fn thinking_sets_enable_thinking_and_its_defaults() {
        let r = parse(
            json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                             "thinking": {"type": "disabled"}}),
        )
        .unwrap();
        assert_eq!(r.kwargs["enable_thinking"], json!(false));
        assert_eq!(
            r.sampling.temperature,
            SamplingParams::model_defaults(false).temperature
        );
        let r = parse(json!({"max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                             "thinking": {"type": "enabled", "budget_tokens": 2048}, "temperature": 0.5}))
        .unwrap();
        assert_eq!(r.kwargs["enable_thinking"], json!(true));
        assert_eq!(r.sampling.temperature, 0.5);
    }

    #[test]
    fn bad_requests_name_the_field() {
        let user = json!([{"role": "user", "content": "x"}]);
        for (body, param) in [
            (json!({"messages": user}), "max_tokens"),
            (json!({"max_tokens": 0, "messages": user}), "max_tokens"),
            (json!({"max_tokens": 5}), "messages"),
            (json!({"max_tokens": 5, "messages": []}), "messages"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": 3}]}),
                "messages[0].content",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "temperature": 1.5}),
                "temperature",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "stop_sequences": [""]}),
                "stop_sequences[0]",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "thinking": {"type": "sometimes"}}),
                "thinking.type",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"name": "f"}]}),
                "tools[0].input_schema",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tool_choice": {"type": "any"}}),
                "tool_choice",
            ),
            (
                json!({"max_tokens": 5, "messages": user, "tools": [{"name": "f", "input_schema": {}}],
                    "tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice.name",
            ),
        ] {
            let err = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} was accepted"));
            assert_eq!(err.status.as_u16(), 400);
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
        }
    }

    #[test]
    fn count_tokens_needs_no_max_tokens() {
        let body = json!({"messages": [{"role": "user", "content": "x"}]});
        assert!(MessagesRequest::parse(body.as_object().unwrap(), 1000, true).is_ok());
    }
}
