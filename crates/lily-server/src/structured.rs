//! What a request asks of the shape of its output beyond sampling — a forced tool call
//! (`tool_choice`) or a JSON answer (`response_format`) — and the constraint that enforces it
//! (lily-core `constrain`: a grammar over the tokens, applied once the reasoning block closes).

use std::sync::Arc;

use lily_core::constrain::{Grammars, OutputSpec, Reasoning, TokenConstraint};
use lily_core::parse::prompt_opens_reasoning;
use serde_json::Value;

use crate::openai::error::ApiError;
use crate::request::fields::{kind, Fields};
use crate::state::Model;

/// Which tool calls the answer must make. Both APIs map onto this: OpenAI `"auto"` / `"none"` /
/// `"required"` / `{"type": "function", …}`, Anthropic `auto` / `none` / `any` / `tool`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides.
    Auto,
    /// No tools are offered.
    None,
    /// At least one call, to any of the tools.
    Required,
    /// A call to this tool.
    Named(String),
}

impl ToolChoice {
    /// The output a forcing choice requires, for `tools` (OpenAI shape); `parallel` lets
    /// `Required` make more than one call.
    pub fn spec(&self, tools: Option<&[Value]>, parallel: bool) -> Option<OutputSpec> {
        let tools = tools?.to_vec();
        match self {
            ToolChoice::Auto | ToolChoice::None => None,
            ToolChoice::Required => Some(OutputSpec::ToolCalls {
                tools,
                only: None,
                parallel,
            }),
            ToolChoice::Named(name) => Some(OutputSpec::ToolCalls {
                tools,
                only: Some(name.clone()),
                parallel: false,
            }),
        }
    }

    /// Checks the choice against the tools offered (`param` names the field in errors).
    pub fn check(&self, tools: &[Value], param: &str) -> Result<(), ApiError> {
        match self {
            ToolChoice::Required if tools.is_empty() => Err(ApiError::invalid_param(
                param,
                format!("'{param}' forces a tool call, so 'tools' must offer at least one"),
            )),
            ToolChoice::Named(name)
                if !tools.iter().any(|t| {
                    t.get("function")
                        .unwrap_or(t)
                        .get("name")
                        .and_then(Value::as_str)
                        == Some(name.as_str())
                }) =>
            {
                Err(ApiError::invalid_param(
                    param,
                    format!(
                        "'{param}' names the tool {name:?}: it must be one of the request's tools"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// OpenAI `tool_choice`: "auto", "none", "required", or `{"type": "function", "function":
/// {"name": …}}` (the Responses API's flat `{"type": "function", "name": …}` too).
pub fn openai_tool_choice(f: &Fields) -> Result<ToolChoice, ApiError> {
    match f.get("tool_choice") {
        None => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid_param(
                "tool_choice",
                format!("'tool_choice' is {other:?}; expected \"auto\", \"none\", \"required\" or a named function"),
            )),
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|fun| fun.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str);
            match (o.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) if !name.is_empty() => {
                    Ok(ToolChoice::Named(name.to_owned()))
                }
                _ => Err(ApiError::invalid_param(
                    "tool_choice",
                    "a named 'tool_choice' must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                )),
            }
        }
        Some(other) => Err(ApiError::invalid_param(
            "tool_choice",
            format!(
                "'tool_choice' must be a string or an object, got {}",
                kind(other)
            ),
        )),
    }
}

/// OpenAI `response_format`: "text" (nothing to enforce), "json_object", or "json_schema" with
/// `json_schema.schema` (enforced whether or not `strict` is set).
pub fn openai_response_format(f: &Fields) -> Result<Option<OutputSpec>, ApiError> {
    let Some(format) = f.object("response_format")? else {
        return Ok(None);
    };
    let rf = Fields::nested(format, "response_format".into());
    match rf.str("type")? {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputSpec::JsonObject)),
        Some("json_schema") => {
            let Some(js) = rf.object("json_schema")? else {
                return Err(ApiError::invalid_param(
                    "response_format.json_schema",
                    "'response_format.json_schema' is required when the type is \"json_schema\"",
                ));
            };
            let jf = Fields::nested(js, "response_format.json_schema".into());
            jf.str("name")?;
            jf.bool("strict")?;
            match jf.get("schema") {
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(OutputSpec::JsonSchema(schema.clone())))
                }
                Some(other) => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    format!(
                        "'response_format.json_schema.schema' must be a JSON schema object, got {}",
                        kind(other)
                    ),
                )),
                None => Err(ApiError::invalid_param(
                    "response_format.json_schema.schema",
                    "'response_format.json_schema.schema' is required",
                )),
            }
        }
        Some(other) => Err(ApiError::invalid_param(
            "response_format.type",
            format!("unknown response_format type {other:?}; expected \"text\", \"json_object\" or \"json_schema\""),
        )),
        None => Err(ApiError::invalid_param(
            "response_format.type",
            "'response_format.type' is required",
        )),
    }
}

/// The model's grammar compiler, built by the first constrained request (about a second: the
/// runtime is told this thread blocks, so other requests keep being served meanwhile).
fn grammars(model: &Model) -> Result<Arc<Grammars>, ApiError> {
    let built = match model.grammars.get() {
        Some(built) => built,
        None => tokio::task::block_in_place(|| model.grammars.get_or_init(|| build(model))),
    };
    built
        .clone()
        .map_err(|e| ApiError::internal(format!("constrained decoding is unavailable: {e}")))
}

fn build(model: &Model) -> Result<Arc<Grammars>, String> {
    let started = std::time::Instant::now();
    let built = Grammars::new(&model.tokenizer, model.vocab)
        .map(Arc::new)
        .map_err(|e| format!("{e:#}"));
    tracing::info!(
        "constrained decoding ready: token trie built in {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    built
}

/// Where a constraint starts for this prompt: after the reasoning block it opens (with an
/// optional budget of reasoning tokens), or at once.
pub fn reasoning(prompt_text: &str, budget: Option<usize>) -> Reasoning {
    if prompt_opens_reasoning(prompt_text) {
        Reasoning::Open { budget }
    } else {
        Reasoning::Closed
    }
}

/// The constraint enforcing `spec`, compiled now so that a schema that cannot be used is a 400
/// before anything is queued; `reasoning` says whether the grammar waits for `</think>` (and
/// a reasoning budget alone is a constraint too).
pub fn constraint(
    model: &Model,
    spec: Option<&OutputSpec>,
    reasoning: Reasoning,
) -> Result<Option<Box<dyn TokenConstraint>>, ApiError> {
    let Some(spec) = spec else {
        return Ok(match reasoning {
            Reasoning::Open {
                budget: Some(budget),
            } => Some(grammars(model)?.reasoning_budget(budget)),
            _ => None,
        });
    };
    let grammar = grammars(model)?.compile(spec).map_err(|e| {
        let param = match spec {
            OutputSpec::ToolCalls { .. } => "tools",
            _ => "response_format.json_schema.schema",
        };
        ApiError::invalid_param(param, format!("'{param}' cannot be enforced: {e}"))
    })?;
    Ok(Some(grammar.constraint(reasoning)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields(v: &Value) -> Fields<'_> {
        Fields::new(v.as_object().unwrap())
    }

    #[test]
    fn openai_tool_choices() {
        for (v, want) in [
            (json!({}), ToolChoice::Auto),
            (json!({"tool_choice": "none"}), ToolChoice::None),
            (json!({"tool_choice": "required"}), ToolChoice::Required),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                ToolChoice::Named("f".into()),
            ),
            (
                json!({"tool_choice": {"type": "function", "name": "g"}}),
                ToolChoice::Named("g".into()),
            ),
        ] {
            assert_eq!(openai_tool_choice(&fields(&v)).unwrap(), want, "{v}");
        }
        for v in [
            json!({"tool_choice": "always"}),
            json!({"tool_choice": {"type": "function"}}),
            json!({"tool_choice": 3}),
        ] {
            let err = openai_tool_choice(&fields(&v)).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("tool_choice"), "{v}");
        }
    }

    #[test]
    fn a_named_tool_must_be_offered() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        assert!(ToolChoice::Named("f".into())
            .check(&tools, "tool_choice")
            .is_ok());
        assert!(ToolChoice::Named("g".into())
            .check(&tools, "tool_choice")
            .is_err());
        assert!(ToolChoice::Required.check(&[], "tool_choice").is_err());
    }

    #[test]
    fn response_formats() {
        let rf = |v: Value| openai_response_format(&fields(&json!({"response_format": v})));
        assert_eq!(rf(json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            rf(json!({"type": "json_object"})).unwrap(),
            Some(OutputSpec::JsonObject)
        );
        let schema = json!({"type": "object"});
        assert_eq!(
            rf(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}))
                .unwrap(),
            Some(OutputSpec::JsonSchema(schema))
        );
        for (v, param) in [
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x"}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": "x"}}),
                "response_format.json_schema.schema",
            ),
            (json!({"type": "yaml"}), "response_format.type"),
        ] {
            assert_eq!(
                rf(v.clone()).unwrap_err().param.as_deref(),
                Some(param),
                "{v}"
            );
        }
    }
}
