//! Tool calls in the model's XML-like format (MODEL.md §4, the qwen3_coder format):
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
//! Each VALUE is typed by the tool's JSON schema: strings are kept verbatim (multi-line included),
//! numbers, booleans, arrays, objects and null are parsed as JSON (the template writes non-string
//! arguments with `tojson`). A call that does not parse is passed on as the text it was, never
//! dropped and never a panic.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::scan::{scan, Scan};
use super::NewlineFrame;

pub const TOOL_CALL: &str = "<tool_call>";
pub const TOOL_CALL_END: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// One parsed call. `arguments` is a JSON object; `arguments_json()` gives the OpenAI string.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// 0, 1, 2… in the order the model wrote them (OpenAI `tool_calls[].index`).
    pub index: usize,
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ToolCall {
    pub fn arguments_json(&self) -> String {
        Value::Object(self.arguments.clone()).to_string()
    }
}

/// The `parameters.properties` of each tool of the request, by function name.
#[derive(Clone, Debug, Default)]
pub struct ToolSchemas {
    properties: HashMap<String, Map<String, Value>>,
}

impl ToolSchemas {
    /// From the request's `tools` (`[{"type": "function", "function": {name, parameters}}]`;
    /// entries without a `function` wrapper are read as the function itself).
    pub fn from_tools(tools: &[Value]) -> Self {
        let mut properties = HashMap::new();
        for tool in tools {
            let f = tool.get("function").unwrap_or(tool);
            let Some(name) = f.get("name").and_then(Value::as_str) else {
                continue;
            };
            let props = f
                .pointer("/parameters/properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            properties.insert(name.to_owned(), props);
        }
        ToolSchemas { properties }
    }

    fn param(&self, function: &str, param: &str) -> Option<&Value> {
        self.properties.get(function)?.get(param)
    }
}

/// A settled piece of content.
#[derive(Clone, Debug, PartialEq)]
pub enum ContentPiece {
    Text(String),
    Call(ToolCall),
}

/// Stream parser over content text.
#[derive(Debug)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    in_call: bool,
    buf: String,
    /// Newlines before a `<tool_call>` (and between calls) only frame it.
    text: NewlineFrame,
    calls: usize,
    /// Bytes of the call's buffer known not to contain the start of `</tool_call>`.
    call_settled: usize,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> Self {
        ToolCallParser {
            schemas,
            in_call: false,
            buf: String::new(),
            text: NewlineFrame::new(false),
            calls: 0,
            call_settled: 0,
        }
    }

    /// Calls parsed so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<ContentPiece>) {
        self.buf.push_str(text);
        loop {
            if self.in_call {
                // A long call arrives in many pieces: search only where the end tag can start.
                let from = self.call_settled;
                let at = match scan(&self.buf[from..], &[TOOL_CALL_END]) {
                    Scan::Found { at, .. } => from + at,
                    Scan::Settled(n) => {
                        self.call_settled = from + n;
                        return;
                    }
                };
                self.call_settled = 0;
                let inner: String = self.buf.drain(..at).collect();
                self.buf.drain(..TOOL_CALL_END.len());
                self.in_call = false;
                self.text = NewlineFrame::new(true);
                self.emit_call(&inner, true, out);
            } else {
                match scan(&self.buf, &[TOOL_CALL]) {
                    Scan::Found { at, .. } => {
                        let before = self.buf[..at].to_owned();
                        self.buf.drain(..at + TOOL_CALL.len());
                        let text = self.text.feed(&before);
                        push_text(out, text);
                        self.text.take_held();
                        self.in_call = true;
                    }
                    Scan::Settled(n) => {
                        let settled: String = self.buf.drain(..n).collect();
                        let text = self.text.feed(&settled);
                        push_text(out, text);
                        return;
                    }
                }
            }
        }
    }

    /// End of output. An unclosed call still counts if its `</function>` arrived (the model
    /// stopped right before `</tool_call>`); otherwise it is returned as text.
    pub fn finish(&mut self, out: &mut Vec<ContentPiece>) {
        let rest = std::mem::take(&mut self.buf);
        if self.in_call {
            self.in_call = false;
            self.call_settled = 0;
            let complete = rest.trim_end().ends_with(FUNCTION_END);
            self.emit_call(&rest, complete, out);
        } else {
            let text = self.text.feed(&rest);
            push_text(out, text);
            push_text(out, self.text.take_held());
        }
    }

    fn emit_call(&mut self, inner: &str, closed: bool, out: &mut Vec<ContentPiece>) {
        match closed.then(|| parse_calls(inner, &self.schemas)).flatten() {
            Some(calls) => {
                for (name, arguments) in calls {
                    out.push(ContentPiece::Call(ToolCall {
                        index: self.calls,
                        name,
                        arguments,
                    }));
                    self.calls += 1;
                }
            }
            None => {
                let end = if closed { TOOL_CALL_END } else { "" };
                push_text(out, format!("{TOOL_CALL}{inner}{end}"));
            }
        }
    }
}

fn push_text(out: &mut Vec<ContentPiece>, text: String) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(ContentPiece::Text(s)) => s.push_str(&text),
        _ => out.push(ContentPiece::Text(text)),
    }
}

/// The functions inside one `<tool_call>…</tool_call>`, or `None` if it is malformed.
fn parse_calls(inner: &str, schemas: &ToolSchemas) -> Option<Vec<(String, Map<String, Value>)>> {
    let mut calls = Vec::new();
    let mut rest = inner.trim_start();
    while !rest.is_empty() {
        let after = rest.strip_prefix(FUNCTION)?;
        let name_end = after.find('>')?;
        let name = tag_name(&after[..name_end])?;
        let mut body = &after[name_end + 1..];
        let mut args = Map::new();
        loop {
            body = body.trim_start();
            if let Some(r) = body.strip_prefix(FUNCTION_END) {
                rest = r.trim_start();
                break;
            }
            let after = body.strip_prefix(PARAMETER)?;
            let pname_end = after.find('>')?;
            let pname = tag_name(&after[..pname_end])?;
            let value_and_rest = &after[pname_end + 1..];
            let (raw, next) = match value_and_rest.find(PARAMETER_END) {
                Some(end) => (
                    &value_and_rest[..end],
                    &value_and_rest[end + PARAMETER_END.len()..],
                ),
                // A missing `</parameter>`: the value runs to the next tag.
                None => {
                    let end = [PARAMETER, FUNCTION_END]
                        .iter()
                        .filter_map(|t| value_and_rest.find(t))
                        .min()?;
                    (&value_and_rest[..end], &value_and_rest[end..])
                }
            };
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            args.insert(
                pname.to_owned(),
                typed_value(raw, schemas.param(name, pname)),
            );
            body = next;
        }
        calls.push((name.to_owned(), args));
    }
    (!calls.is_empty()).then_some(calls)
}

/// A function or parameter name: one line, no markup.
fn tag_name(raw: &str) -> Option<&str> {
    let name = raw.trim();
    (!name.is_empty() && !name.contains(['\n', '<', '>'])).then_some(name)
}

/// The JSON types a parameter schema allows (`type` as a string or a list, or inside
/// `anyOf`/`oneOf`).
fn schema_types(schema: &Value) -> Vec<&str> {
    let mut types = Vec::new();
    match schema.get("type") {
        Some(Value::String(t)) => types.push(t.as_str()),
        Some(Value::Array(ts)) => types.extend(ts.iter().filter_map(Value::as_str)),
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            for alt in alts {
                types.extend(schema_types(alt));
            }
        }
    }
    types
}

/// One argument value typed by its schema. Without a usable schema, JSON if it parses, else
/// the string.
pub fn typed_value(raw: &str, schema: Option<&Value>) -> Value {
    let types = schema.map(schema_types).unwrap_or_default();
    let guess =
        || serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_owned()));
    if types.is_empty() {
        return guess();
    }
    let trimmed = raw.trim();
    if types.contains(&"null") && trimmed == "null" {
        return Value::Null;
    }
    if types.contains(&"string") {
        return Value::String(raw.to_owned());
    }
    let json: Option<Value> = serde_json::from_str(trimmed).ok();
    for t in &types {
        let fits = match (*t, &json) {
            ("integer", Some(Value::Number(n))) => n.is_i64() || n.is_u64(),
            ("number", Some(Value::Number(_))) => true,
            ("boolean", Some(Value::Bool(_))) => true,
            ("object", Some(Value::Object(_))) => true,
            ("array", Some(Value::Array(_))) => true,
            _ => false,
        };
        if fits {
            return json.unwrap_or(Value::Null);
        }
        if *t == "boolean" && matches!(trimmed, "True" | "False") {
            return Value::Bool(trimmed == "True");
        }
    }
    guess()
}

#[cfg(test)]
mod tests;
