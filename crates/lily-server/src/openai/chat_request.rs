//! `POST /v1/chat/completions` request: messages checked and normalised for the chat template,
//! tools, thinking switches, and the shared generation fields.

use lily_core::constrain::OutputSpec;
use lily_core::sampling::SamplingParams;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::fields::{kind, Fields};
use super::params;
use crate::structured::{openai_response_format, openai_tool_choice, ToolChoice};

pub struct ChatRequest {
    /// Messages as the template reads them (`role`, `content`, `reasoning_content`, `tool_calls`).
    pub messages: Vec<Value>,
    /// Tools offered to the model; None when absent or `tool_choice` is "none".
    pub tools: Option<Vec<Value>>,
    /// What the answer must be, enforced by constrained decoding: the call `tool_choice` forces,
    /// or the JSON `response_format` asks for.
    pub output: Option<OutputSpec>,
    /// `chat_template_kwargs`, passed to the template.
    pub kwargs: Map<String, Value>,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub top_logprobs: usize,
}

impl ChatRequest {
    pub fn parse(body: &Map<String, Value>, vocab: usize) -> Result<Self, ApiError> {
        let f = Fields::new(body);
        let messages = match f.array("messages")? {
            None => {
                return Err(ApiError::invalid_param(
                    "messages",
                    "'messages' is required",
                ))
            }
            Some(list) if list.is_empty() => {
                return Err(ApiError::invalid_param(
                    "messages",
                    "'messages' must not be empty",
                ))
            }
            Some(list) => list
                .iter()
                .enumerate()
                .map(|(i, m)| message(i, m))
                .collect::<Result<Vec<_>, _>>()?,
        };

        let kwargs = f
            .object("chat_template_kwargs")?
            .cloned()
            .unwrap_or_default();
        let kw = Fields::nested(&kwargs, "chat_template_kwargs".into());
        let thinking = kw.bool("enable_thinking")?.unwrap_or(true);
        kw.bool("preserve_thinking")?;

        let choice = openai_tool_choice(&f)?;
        let tools = tools(&f, &choice)?;
        let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
        let forced = choice.spec(tools.as_deref(), parallel);
        params::single_choice(&f)?;
        let format = openai_response_format(&f)?;
        if forced.is_some() && format.is_some() {
            return Err(ApiError::invalid_param(
                "response_format",
                "a JSON 'response_format' cannot be combined with a 'tool_choice' that forces a tool call",
            ));
        }
        let output = forced.or(format);
        let (stream, include_usage) = params::streaming(&f)?;
        let logprobs = f.bool("logprobs")?.unwrap_or(false);
        let top_logprobs = f.i64_in("top_logprobs", 0, 20)?.unwrap_or(0) as usize;
        if top_logprobs > 0 && !logprobs {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "'top_logprobs' requires 'logprobs' to be true",
            ));
        }
        Ok(ChatRequest {
            messages,
            tools,
            output,
            kwargs,
            sampling: params::sampling(&f, SamplingParams::model_defaults(thinking), vocab)?,
            max_tokens: params::max_tokens(&f, &["max_completion_tokens", "max_tokens"], 1)?,
            stop: params::stops(&f)?,
            stream,
            include_usage,
            logprobs,
            top_logprobs,
        })
    }
}

const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn message(i: usize, m: &Value) -> Result<Value, ApiError> {
    let path = format!("messages[{i}]");
    let Value::Object(obj) = m else {
        return Err(ApiError::invalid_param(
            &path,
            format!("'{path}' must be an object, got {}", kind(m)),
        ));
    };
    let f = Fields::nested(obj, path.clone());
    let role = match f.str("role")? {
        Some(r) if ROLES.contains(&r) => r,
        Some(r) => {
            return Err(ApiError::invalid_param(
                &f.param("role"),
                format!(
                    "'{}' is {r:?}; expected one of {}",
                    f.param("role"),
                    ROLES.join(", ")
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
    let content = content(&f)?;
    let mut out = Map::new();
    // The template knows `system`; `developer` is the newer name for the same turn.
    out.insert(
        "role".into(),
        json!(if role == "developer" { "system" } else { role }),
    );
    match role {
        "assistant" => {
            let tool_calls = assistant_tool_calls(&f)?;
            if content.is_none() && tool_calls.is_none() {
                return Err(ApiError::invalid_param(
                    &f.param("content"),
                    format!(
                        "'{}' is required unless 'tool_calls' is given",
                        f.param("content")
                    ),
                ));
            }
            out.insert("content".into(), json!(content.unwrap_or_default()));
            if let Some(reasoning) = f.str("reasoning_content")? {
                out.insert("reasoning_content".into(), json!(reasoning));
            }
            if let Some(calls) = tool_calls {
                out.insert("tool_calls".into(), Value::Array(calls));
            }
        }
        _ => match content {
            Some(text) => {
                out.insert("content".into(), json!(text));
            }
            None => {
                return Err(ApiError::invalid_param(
                    &f.param("content"),
                    format!("'{}' is required", f.param("content")),
                ))
            }
        },
    }
    Ok(Value::Object(out))
}

/// `content`: a string or a list of text parts (joined); other part types are refused.
fn content(f: &Fields) -> Result<Option<String>, ApiError> {
    let param = f.param("content");
    match f.get("content") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind_of = part.get("type").and_then(Value::as_str);
                match (kind_of, part.get("text").and_then(Value::as_str)) {
                    (Some("text") | None, Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(ApiError::invalid_param(
                            &format!("{param}[{j}]"),
                            format!("content part type {other:?} is not supported: this model reads text only"),
                        ))
                    }
                    _ => return Err(ApiError::invalid_param(&format!("{param}[{j}]"), "a text content part needs a string 'text'")),
                }
            }
            Ok(Some(text))
        }
        Some(other) => Err(ApiError::invalid_param(
            &param,
            format!(
                "'{param}' must be a string or an array of content parts, got {}",
                kind(other)
            ),
        )),
    }
}

/// An assistant turn's earlier tool calls, with `arguments` parsed into the object the template
/// iterates over.
fn assistant_tool_calls(f: &Fields) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(calls) = f.array("tool_calls")? else {
        return Ok(None);
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, call) in calls.iter().enumerate() {
        let param = format!("{}[{j}]", f.param("tool_calls"));
        let function = call.get("function").and_then(Value::as_object);
        let name = function
            .and_then(|fun| fun.get("name"))
            .and_then(Value::as_str);
        let (Some(function), Some(name)) = (function, name) else {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}' needs a 'function' with a string 'name'"),
            ));
        };
        let arguments = match function.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.function.arguments"),
                        "tool call arguments must be a JSON object (as a string)",
                    ))
                }
            },
            Some(v @ Value::Object(_)) => v.clone(),
            Some(other) => {
                return Err(ApiError::invalid_param(
                    &format!("{param}.function.arguments"),
                    format!(
                        "tool call arguments must be a JSON string, got {}",
                        kind(other)
                    ),
                ))
            }
        };
        let mut c = Map::new();
        if let Some(id) = call.get("id") {
            c.insert("id".into(), id.clone());
        }
        c.insert("type".into(), json!("function"));
        c.insert(
            "function".into(),
            json!({"name": name, "arguments": arguments}),
        );
        out.push(Value::Object(c));
    }
    Ok(Some(out))
}

/// `tools`, checked against `tool_choice`; None when there are none or the choice is "none".
fn tools(f: &Fields, choice: &ToolChoice) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(list) = f.array("tools")? else {
        choice.check(&[], "tool_choice")?;
        return Ok(None);
    };
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}.type' must be \"function\""),
            ));
        }
        let name = tool.pointer("/function/name").and_then(Value::as_str);
        if name.is_none_or(str::is_empty) {
            return Err(ApiError::invalid_param(
                &format!("{param}.function.name"),
                format!("'{param}.function.name' must be a non-empty string"),
            ));
        }
    }
    choice.check(list, "tool_choice")?;
    if *choice == ToolChoice::None || list.is_empty() {
        return Ok(None);
    }
    Ok(Some(list.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<ChatRequest, ApiError> {
        ChatRequest::parse(v.as_object().unwrap(), 1000)
    }

    #[test]
    fn developer_becomes_system_and_text_parts_are_joined() {
        let r = parse(json!({"messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
        ], "unknown_field": 1})).unwrap();
        assert_eq!(
            r.messages[0],
            json!({"role": "system", "content": "Be brief."})
        );
        assert_eq!(
            r.messages[1],
            json!({"role": "user", "content": "Hi there"})
        );
    }

    #[test]
    fn bad_messages_are_400s_naming_the_field() {
        for (body, param) in [
            (json!({}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages[0].role",
            ),
            (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (
                json!({"messages": [{"role": "user"}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": 5}]}),
                "messages[0].content",
            ),
            (json!({"messages": ["hi"]}), "messages[0]"),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
                "messages[0].content[0]",
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
    fn assistant_tool_call_arguments_are_parsed_for_the_template() {
        let r = parse(json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
        ]}))
        .unwrap();
        assert_eq!(
            r.messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({"city": "Paris"})
        );
    }

    #[test]
    fn unsupported_modes_are_refused_clearly() {
        let base = json!([{"role": "user", "content": "x"}]);
        for (extra, param) in [
            (json!({"n": 2}), "n"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"top_logprobs": 3}), "top_logprobs"),
        ] {
            let mut body = extra.clone();
            body["messages"] = base.clone();
            let err = parse(body)
                .err()
                .unwrap_or_else(|| panic!("{extra} was accepted"));
            assert_eq!(
                err.param.as_deref(),
                Some(param),
                "{extra}: {}",
                err.message
            );
        }
        let mut ok =
            json!({"response_format": {"type": "json_object"}, "tool_choice": "none", "n": 1});
        ok["messages"] = base;
        assert!(parse(ok).is_ok());
    }

    #[test]
    fn thinking_switch_picks_the_matching_defaults() {
        let r = parse(json!({"messages": [{"role": "user", "content": "x"}],
                             "chat_template_kwargs": {"enable_thinking": false}}))
        .unwrap();
        assert_eq!(
            r.sampling.temperature,
            SamplingParams::model_defaults(false).temperature
        );
    }
}
