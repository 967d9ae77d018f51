//! Grammar text (llguidance's Lark dialect) for what a request asks of its output. Forced tool
//! calls follow the model's XML-like format exactly as `parse::tool_call` reads it (MODEL.md §4):
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! A parameter whose schema allows strings is raw text up to the first `</parameter>` (the
//! parser keeps strings verbatim); enums of strings are their literals; every other value is
//! JSON under the parameter's own schema (`%json`), which is what the parser parses. Parameters
//! come in the schema's order, the required ones always, the others optionally, so the call's
//! arguments validate against the tool's `parameters`. JSON answers are one `%json` value.

use serde_json::{json, Map, Value};

/// The shape a request requires of its answer (after any reasoning).
#[derive(Clone, Debug, PartialEq)]
pub enum OutputSpec {
    /// Tool calls only: to `only` when given, else to any of `tools` (OpenAI shape:
    /// `{"type": "function", "function": {name, parameters}}`); `parallel` allows more than one.
    ToolCalls {
        tools: Vec<Value>,
        only: Option<String>,
        parallel: bool,
    },
    /// One JSON value valid under this schema.
    JsonSchema(Value),
    /// One JSON object.
    JsonObject,
}

/// JSON as the template writes it (`tojson`: `", "` and `": "`), with no optional whitespace, so
/// a noisy model cannot pad forever.
fn compact() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// A Lark string literal for `text`.
fn lit(text: &str) -> String {
    // JSON string syntax is what the Lark front end reads in quotes.
    Value::String(text.to_owned()).to_string()
}

/// `%json { schema }` with the output options; `root` lends its `$defs` / `definitions` so
/// local references inside a property's schema still resolve.
fn json_value(schema: &Value, root: Option<&Value>, lenient: bool) -> String {
    let mut schema = match schema {
        Value::Object(o) => o.clone(),
        Value::Bool(true) => Map::new(),
        other => return format!("%json {}", other),
    };
    if let Some(root) = root {
        for key in ["$defs", "definitions"] {
            if let (Some(defs), false) = (root.get(key), schema.contains_key(key)) {
                schema.insert(key.into(), defs.clone());
            }
        }
    }
    let mut options = compact();
    options["lenient"] = json!(lenient);
    schema.insert("x-guidance".into(), options);
    format!("%json {}", Value::Object(schema))
}

/// Whether a value of this schema is written as raw text (the parser keeps it as a string).
fn is_text(schema: &Value) -> bool {
    let mut types = Vec::new();
    collect_types(schema, &mut types);
    types.contains(&"string")
}

fn collect_types<'a>(schema: &'a Value, out: &mut Vec<&'a str>) {
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            for alt in alts {
                collect_types(alt, out);
            }
        }
    }
}

/// The grammar for `spec`; an error names what in it cannot be turned into a grammar.
pub fn grammar(spec: &OutputSpec) -> Result<String, String> {
    // Whitespace the model writes after `</think>` before the answer.
    let mut g = String::from("start: NL? answer\nNL: /\\n{1,2}/\n");
    match spec {
        OutputSpec::JsonSchema(schema) => {
            g += &format!("answer: {}\n", json_value(schema, None, false));
        }
        OutputSpec::JsonObject => {
            g += &format!(
                "answer: {}\n",
                json_value(&json!({"type": "object"}), None, false)
            );
        }
        OutputSpec::ToolCalls {
            tools,
            only,
            parallel,
        } => tool_calls(&mut g, tools, only.as_deref(), *parallel)?,
    }
    Ok(g)
}

fn tool_calls(
    g: &mut String,
    tools: &[Value],
    only: Option<&str>,
    parallel: bool,
) -> Result<(), String> {
    let mut functions = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        let f = tool.get("function").unwrap_or(tool);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            continue;
        };
        if only.is_some_and(|o| o != name) {
            continue;
        }
        let rule = format!("f{i}");
        function(g, &rule, name, f.get("parameters"))?;
        functions.push(rule);
    }
    if functions.is_empty() {
        return Err(match only {
            Some(name) => format!("no tool named {name:?} to call"),
            None => "no tools to call".into(),
        });
    }
    let calls = if parallel {
        "answer: call (\"\\n\" call)*\n"
    } else {
        "answer: call\n"
    };
    *g += calls;
    *g += &format!(
        "call: {} ({}) {}\n",
        lit("<tool_call>\n"),
        functions.join(" | "),
        lit("</tool_call>")
    );
    Ok(())
}

fn function(
    g: &mut String,
    rule: &str,
    name: &str,
    parameters: Option<&Value>,
) -> Result<(), String> {
    let empty = Map::new();
    let properties = parameters
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = parameters
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut body = vec![lit(&format!("<function={name}>\n"))];
    // Required names the schema gives no property for take any JSON value.
    let any = json!({});
    let extra = required
        .iter()
        .filter(|r| !properties.contains_key(**r))
        .map(|r| (r.to_string(), &any));
    let all = properties.iter().map(|(k, v)| (k.clone(), v)).chain(extra);
    for (j, (param, schema)) in all.enumerate() {
        let prule = format!("{rule}p{j}");
        parameter(g, &prule, &param, schema, parameters)?;
        let optional = if required.contains(&param.as_str()) {
            ""
        } else {
            "?"
        };
        body.push(format!("{prule}{optional}"));
    }
    body.push(lit("</function>\n"));
    *g += &format!("{rule}: {}\n", body.join(" "));
    Ok(())
}

fn parameter(
    g: &mut String,
    rule: &str,
    name: &str,
    schema: &Value,
    root: Option<&Value>,
) -> Result<(), String> {
    let open = lit(&format!("<parameter={name}>\n"));
    let strings: Option<Vec<&str>> = schema
        .get("enum")
        .and_then(Value::as_array)
        .map(|e| e.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
        .unwrap_or_else(|| {
            schema
                .get("const")
                .map(|c| c.as_str().into_iter().collect())
        });
    let close = lit("\n</parameter>\n");
    if let Some(values) = strings.filter(|v| !v.is_empty()) {
        let alts: Vec<String> = values.iter().map(|v| lit(v)).collect();
        *g += &format!("{rule}: {open} ({}) {close}\n", alts.join(" | "));
    } else if is_text(schema) {
        // Raw text that ends at the first `</parameter>`, as the parser reads it; `maxLength`
        // bounds it (in characters, as JSON schema counts).
        let max = schema.get("maxLength").and_then(Value::as_u64);
        let min = schema.get("minLength").and_then(Value::as_u64).unwrap_or(0);
        let count = match max {
            Some(max) if max >= min => format!("{{{min},{max}}}"),
            Some(_) => return Err(format!("parameter {name:?}: minLength exceeds maxLength")),
            None if min > 0 => format!("{{{min},}}"),
            None => "*".into(),
        };
        *g += &format!("{rule}: {open} {rule}v {}\n", lit("\n"));
        *g += &format!("{rule}v[lazy]: /(.|\\n){count}<\\/parameter>/\n");
    } else {
        *g += &format!("{rule}: {open} {rule}v {close}\n");
        *g += &format!("{rule}v: {}\n", json_value(schema, root, true));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_grammar_lists_parameters_in_schema_order() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["C", "F"]}},
              "required": ["city"]}}}),
        ];
        let g = grammar(&OutputSpec::ToolCalls {
            tools,
            only: None,
            parallel: false,
        })
        .unwrap();
        assert!(
            g.contains("f0: \"<function=get_weather>\\n\" f0p0 f0p1? f0p2? \"</function>\\n\""),
            "{g}"
        );
        assert!(
            g.contains("f0p0v[lazy]: /(.|\\n){0,20}<\\/parameter>/"),
            "{g}"
        );
        assert!(
            g.contains("f0p2: \"<parameter=unit>\\n\" (\"C\" | \"F\")"),
            "{g}"
        );
        assert!(g.contains("answer: call\n"), "{g}");
    }

    #[test]
    fn a_named_tool_that_is_missing_is_an_error() {
        let err = grammar(&OutputSpec::ToolCalls {
            tools: vec![json!({"type": "function", "function": {"name": "f"}})],
            only: Some("g".into()),
            parallel: false,
        })
        .unwrap_err();
        assert!(err.contains("\"g\""), "{err}");
    }
}
