//! `POST /v1/chat/completions` request: messages checked and normalised for the chat template,
//! tools, thinking switches, and the shared generation fields.

use lily_core::constrain::OutputSpec;
use lily_core::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::request::fields::{read, read_at, within, Fields, Int, Obj};
use crate::request::params::{self, GenerationFields, SamplingFields};
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

/// The body as serde reads it; the fields the shared readers take (sampling, stop, stream) and the
/// ones `structured.rs` reads (`tool_choice`, `response_format`) are read from the same object.
#[derive(Deserialize)]
struct ChatBody {
    messages: Option<Vec<Obj<MessageBody>>>,
    chat_template_kwargs: Option<Map<String, Value>>,
    tools: Option<Vec<Obj<ToolBody>>>,
    parallel_tool_calls: Option<bool>,
    logprobs: Option<bool>,
    top_logprobs: Option<Int>,
    max_completion_tokens: Option<Int>,
    max_tokens: Option<Int>,
}

/// The switches of `chat_template_kwargs` we read; the whole object goes to the template.
#[derive(Deserialize)]
struct TemplateSwitches {
    enable_thinking: Option<bool>,
    #[allow(dead_code)] // read only to check its type
    preserve_thinking: Option<bool>,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

#[derive(Deserialize)]
struct MessageBody {
    role: Option<Role>,
    content: Option<Content>,
    reasoning_content: Option<String>,
    tool_calls: Option<Vec<Obj<ToolCallBody>>>,
}

/// `content`: a string or a list of content parts (each read on its own, so that its errors keep
/// their path).
#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or an array of content parts")]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: Option<String>,
    text: Option<String>,
}

#[derive(Deserialize)]
struct ToolCallBody {
    id: Option<Value>,
    function: Option<Obj<FunctionCallBody>>,
}

#[derive(Deserialize)]
struct FunctionCallBody {
    name: Option<String>,
    arguments: Option<Arguments>,
}

/// Tool call arguments: the JSON string OpenAI sends, or the object it stands for.
#[derive(Deserialize)]
#[serde(untagged, expecting = "a JSON object or a string holding one")]
enum Arguments {
    Text(String),
    Object(Map<String, Value>),
}

#[derive(Deserialize)]
struct ToolBody {
    #[serde(rename = "type")]
    kind: Option<String>,
    function: Option<Obj<ToolFunctionBody>>,
}

#[derive(Deserialize)]
struct ToolFunctionBody {
    name: Option<String>,
}

impl ChatRequest {
    pub fn parse(body: &Map<String, Value>, vocab: usize) -> Result<Self, ApiError> {
        let b: ChatBody = read(body)?;
        let generation: GenerationFields = read(body)?;
        let sampling_fields: SamplingFields = read(body)?;
        let messages = match b.messages {
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
                .into_iter()
                .enumerate()
                .map(|(i, m)| message(i, m.0))
                .collect::<Result<Vec<_>, _>>()?,
        };

        let kwargs = b.chat_template_kwargs.unwrap_or_default();
        let switches: TemplateSwitches = read_at(&kwargs, "chat_template_kwargs")?;
        let thinking = switches.enable_thinking.unwrap_or(true);

        let f = Fields::new(body);
        let choice = openai_tool_choice(&f)?;
        let tools = tools(body, b.tools.as_deref(), &choice)?;
        let parallel = b.parallel_tool_calls.unwrap_or(true);
        let forced = choice.spec(tools.as_deref(), parallel);
        generation.single_choice()?;
        let format = openai_response_format(&f)?;
        if forced.is_some() && format.is_some() {
            return Err(ApiError::invalid_param(
                "response_format",
                "a JSON 'response_format' cannot be combined with a 'tool_choice' that forces a tool call",
            ));
        }
        let output = forced.or(format);
        let (stream, include_usage) = generation.streaming();
        let logprobs = b.logprobs.unwrap_or(false);
        let top_logprobs =
            within("top_logprobs", b.top_logprobs.map(|n| n.0), 0, 20)?.unwrap_or(0) as usize;
        if top_logprobs > 0 && !logprobs {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "'top_logprobs' requires 'logprobs' to be true",
            ));
        }
        // `max_completion_tokens` before the deprecated `max_tokens`.
        let max_tokens = match b.max_completion_tokens {
            Some(n) => params::at_least("max_completion_tokens", Some(n.0), 1)?,
            None => params::at_least("max_tokens", b.max_tokens.map(|n| n.0), 1)?,
        };
        Ok(ChatRequest {
            messages,
            tools,
            output,
            kwargs,
            sampling: params::sampling(
                &sampling_fields,
                SamplingParams::model_defaults(thinking),
                vocab,
            )?,
            max_tokens,
            stop: generation.stops()?,
            stream,
            include_usage,
            logprobs,
            top_logprobs,
        })
    }
}

/// One message as the template reads it.
fn message(i: usize, m: MessageBody) -> Result<Value, ApiError> {
    let path = format!("messages[{i}]");
    let Some(role) = m.role else {
        return Err(ApiError::invalid_param(
            &format!("{path}.role"),
            format!("'{path}.role' is required"),
        ));
    };
    let content = match m.content {
        None => None,
        Some(c) => Some(content(&path, c)?),
    };
    let mut out = Map::new();
    // The template knows `system`; `developer` is the newer name for the same turn.
    let name = match role {
        Role::System | Role::Developer => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    out.insert("role".into(), json!(name));
    if role == Role::Assistant {
        let tool_calls = match m.tool_calls {
            None => None,
            Some(calls) => Some(assistant_tool_calls(&path, calls)?),
        };
        if content.is_none() && tool_calls.is_none() {
            return Err(ApiError::invalid_param(
                &format!("{path}.content"),
                format!("'{path}.content' is required unless 'tool_calls' is given"),
            ));
        }
        out.insert("content".into(), json!(content.unwrap_or_default()));
        if let Some(reasoning) = m.reasoning_content {
            out.insert("reasoning_content".into(), json!(reasoning));
        }
        if let Some(calls) = tool_calls {
            out.insert("tool_calls".into(), Value::Array(calls));
        }
    } else {
        let Some(text) = content else {
            return Err(ApiError::invalid_param(
                &format!("{path}.content"),
                format!("'{path}.content' is required"),
            ));
        };
        out.insert("content".into(), json!(text));
    }
    Ok(Value::Object(out))
}

/// `content`'s text: the string, or the text parts joined; other part types are refused.
fn content(path: &str, c: Content) -> Result<String, ApiError> {
    let parts = match c {
        Content::Text(s) => return Ok(s),
        Content::Parts(parts) => parts,
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{path}.content[{j}]");
        let Obj(p): Obj<ContentPart> = read_at(part, &param)?;
        match (p.kind.as_deref(), p.text) {
            (Some("text") | None, Some(t)) => text.push_str(&t),
            (Some(other), _) if other != "text" => {
                return Err(ApiError::invalid_param(
                    &param,
                    format!(
                        "content part type {other:?} is not supported: this model reads text only"
                    ),
                ))
            }
            _ => {
                return Err(ApiError::invalid_param(
                    &param,
                    "a text content part needs a string 'text'",
                ))
            }
        }
    }
    Ok(text)
}

/// An assistant turn's earlier tool calls, with `arguments` parsed into the object the template
/// iterates over.
fn assistant_tool_calls(path: &str, calls: Vec<Obj<ToolCallBody>>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::with_capacity(calls.len());
    for (j, Obj(call)) in calls.into_iter().enumerate() {
        let param = format!("{path}.tool_calls[{j}]");
        let Some(Obj(FunctionCallBody {
            name: Some(name),
            arguments,
        })) = call.function
        else {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}' needs a 'function' with a string 'name'"),
            ));
        };
        let arguments = match arguments {
            None => json!({}),
            Some(Arguments::Object(o)) => Value::Object(o),
            Some(Arguments::Text(s)) => match serde_json::from_str::<Value>(&s) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return Err(ApiError::invalid_param(
                        &format!("{param}.function.arguments"),
                        "tool call arguments must be a JSON object (as a string)",
                    ))
                }
            },
        };
        let mut c = Map::new();
        if let Some(id) = call.id {
            c.insert("id".into(), id);
        }
        c.insert("type".into(), json!("function"));
        c.insert(
            "function".into(),
            json!({"name": name, "arguments": arguments}),
        );
        out.push(Value::Object(c));
    }
    Ok(out)
}

/// `tools`, checked against `tool_choice`; None when there are none or the choice is "none". The
/// tools go to the template as the client sent them (`body["tools"]`).
fn tools(
    body: &Map<String, Value>,
    read: Option<&[Obj<ToolBody>]>,
    choice: &ToolChoice,
) -> Result<Option<Vec<Value>>, ApiError> {
    let (Some(checked), Some(Value::Array(list))) = (read, body.get("tools")) else {
        choice.check(&[], "tool_choice")?;
        return Ok(None);
    };
    for (i, Obj(tool)) in checked.iter().enumerate() {
        let param = format!("tools[{i}]");
        if tool.kind.as_deref() != Some("function") {
            return Err(ApiError::invalid_param(
                &param,
                format!("'{param}.type' must be \"function\""),
            ));
        }
        let name = tool.function.as_ref().and_then(|f| f.0.name.as_deref());
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
    fn wrong_types_are_400s_with_the_path_and_the_expected_kind() {
        let user = json!({"role": "user", "content": "x"});
        for (body, param, message) in [
            (
                json!({"messages": [user, user, {"role": 5, "content": "x"}]}),
                "messages[2].role",
                "'messages[2].role' must be a string, got a number",
            ),
            (
                json!({"messages": [user, {"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}),
                "messages[1].content[0].text",
                "'messages[1].content[0].text' must be a string, got an array",
            ),
            (
                json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]}),
                "messages[1].tool_calls[0].function.arguments",
                "'messages[1].tool_calls[0].function.arguments' must be a JSON object or a string holding one",
            ),
            (
                json!({"messages": [user], "chat_template_kwargs": {"enable_thinking": "no"}}),
                "chat_template_kwargs.enable_thinking",
                "'chat_template_kwargs.enable_thinking' must be a boolean, got a string",
            ),
            (
                json!({"messages": [user], "stream_options": {"include_usage": 1}}),
                "stream_options.include_usage",
                "'stream_options.include_usage' must be a boolean, got a number",
            ),
            (
                json!({"messages": [user], "seed": 1.5}),
                "seed",
                "'seed' must be an integer, got a number",
            ),
            (
                json!({"messages": [user], "temperature": "hot"}),
                "temperature",
                "'temperature' must be a number, got a string",
            ),
            (
                json!({"messages": [user], "logit_bias": {"5": "up"}}),
                "logit_bias.5",
                "'logit_bias.5' must be a number, got a string",
            ),
            (
                json!({"messages": [{"role": "user", "content": ["hi"]}]}),
                "messages[0].content[0]",
                "'messages[0].content[0]' must be an object, got a string",
            ),
            (
                json!({"messages": "hello"}),
                "messages",
                "'messages' must be an array, got a string",
            ),
            (
                json!({"messages": [user], "tools": [{"type": "function", "function": []}]}),
                "tools[0].function",
                "'tools[0].function' must be an object, got an array",
            ),
        ] {
            let err = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} was accepted"));
            assert_eq!(err.status.as_u16(), 400);
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {}", err.message);
            assert_eq!(err.message, message, "{body}");
        }
    }

    #[test]
    fn an_unknown_role_or_an_array_for_an_object_is_refused() {
        let err = parse(json!({"messages": [{"role": "wizard", "content": "x"}]}))
            .err()
            .expect("role wizard was accepted");
        assert_eq!(err.param.as_deref(), Some("messages[0].role"));
        assert_eq!(
            err.message,
            "'messages[0].role' is \"wizard\"; expected one of system, developer, user, assistant, tool"
        );
        // serde's derive would read an array as the fields in order.
        for body in [
            json!({"messages": [["user", "hi"]]}),
            json!({"messages": [{"role": "assistant", "tool_calls": [[null, ["f", "{}"]]]}]}),
        ] {
            let err = parse(body.clone())
                .err()
                .unwrap_or_else(|| panic!("{body} was accepted"));
            assert!(
                err.message.ends_with("must be an object, got an array"),
                "{body}: {}",
                err.message
            );
        }
    }

    #[test]
    fn a_mistyped_value_is_named_by_kind_not_echoed() {
        let long = "y".repeat(100_000);
        let err = parse(json!({"messages": [{"role": "user", "content": "x"}], "top_p": long}))
            .err()
            .expect("a string top_p was accepted");
        assert_eq!(err.message, "'top_p' must be a number, got a string");
    }

    #[test]
    fn null_counts_as_absent_and_unknown_fields_are_ignored() {
        let r = parse(json!({"messages": [{"role": "user", "content": "x", "name": "ann", "extra": {"a": 1}}],
                             "temperature": null, "stop": null, "tools": null, "max_tokens": null,
                             "stream_options": {"include_usage": null, "other": true}, "something_new": [1]}))
        .unwrap();
        assert_eq!(r.messages[0], json!({"role": "user", "content": "x"}));
        assert_eq!(
            r.sampling.temperature,
            SamplingParams::model_defaults(true).temperature
        );
        assert!(r.stop.is_empty() && r.tools.is_none() && r.max_tokens.is_none());
        assert!(!r.include_usage);
    }

    #[test]
    fn max_completion_tokens_comes_before_max_tokens() {
        let r = parse(json!({"messages": [{"role": "user", "content": "x"}],
                             "max_completion_tokens": 7, "max_tokens": 9}))
        .unwrap();
        assert_eq!(r.max_tokens, Some(7));
        let err = parse(json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2.5}))
            .err()
            .expect("max_tokens 2.5 was accepted");
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
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
