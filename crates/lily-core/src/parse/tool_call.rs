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
//! arguments with `tojson`). Calls are streamed: the name as soon as `<function=NAME>` is read, the
//! arguments one parameter at a time (see `block.rs`). A call that does not parse is passed on as
//! the text it was, never dropped and never a panic.

mod block;

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::scan::{scan, Scan};
use super::{push_event, Event, NewlineFrame};
use block::{Block, Tally};

pub const TOOL_CALL: &str = "<tool_call>";
pub const TOOL_CALL_END: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// One complete call. `arguments` is a JSON object; `arguments_json()` gives the OpenAI string
/// (the concatenation of the call's `ToolCallArguments` fragments).
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

    /// Whether the request declares a function of this name.
    pub fn declares(&self, function: &str) -> bool {
        self.properties.contains_key(function)
    }

    pub(crate) fn param(&self, function: &str, param: &str) -> Option<&Value> {
        self.properties.get(function)?.get(param)
    }
}

/// Stream parser over content text: passes text on, and parses each `<tool_call>` block as it
/// arrives (`block.rs` says which events it gives and how a broken block degrades to text).
#[derive(Debug)]
pub struct ToolCallParser {
    schemas: ToolSchemas,
    /// The block being read, between `<tool_call>` and `</tool_call>`.
    block: Option<Block>,
    /// Text that may be the start of a tag (`<tool_call>` outside a block, `</tool_call>` inside).
    buf: String,
    /// Newlines before a `<tool_call>` (and between calls) only frame it.
    text: NewlineFrame,
    tally: Tally,
}

impl ToolCallParser {
    pub fn new(schemas: ToolSchemas) -> Self {
        ToolCallParser {
            schemas,
            block: None,
            buf: String::new(),
            text: NewlineFrame::new(false),
            tally: Tally::default(),
        }
    }

    /// Calls completed so far.
    pub fn calls(&self) -> usize {
        self.tally.complete
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Event>) {
        self.buf.push_str(text);
        loop {
            if let Some(block) = &mut self.block {
                match scan(&self.buf, &[TOOL_CALL_END]) {
                    Scan::Found { at, .. } => {
                        let inner: String = self.buf.drain(..at).collect();
                        self.buf.drain(..TOOL_CALL_END.len());
                        block.push(&inner, &self.schemas, &mut self.tally, out);
                        block.end(true, &self.schemas, &mut self.tally, out);
                        self.block = None;
                        self.text = NewlineFrame::new(true);
                    }
                    Scan::Settled(n) => {
                        let settled: String = self.buf.drain(..n).collect();
                        block.push(&settled, &self.schemas, &mut self.tally, out);
                        return;
                    }
                }
            } else {
                match scan(&self.buf, &[TOOL_CALL]) {
                    Scan::Found { at, .. } => {
                        let before = self.buf[..at].to_owned();
                        self.buf.drain(..at + TOOL_CALL.len());
                        let text = self.text.feed(&before);
                        push_event(out, Event::Content(text));
                        self.text.take_held();
                        self.block = Some(Block::new());
                    }
                    Scan::Settled(n) => {
                        let settled: String = self.buf.drain(..n).collect();
                        let text = self.text.feed(&settled);
                        push_event(out, Event::Content(text));
                        return;
                    }
                }
            }
        }
    }

    /// End of output. An unclosed block still gives its calls if it ends right after a
    /// `</function>` (the model stopped before `</tool_call>`); otherwise it degrades to text.
    pub fn finish(&mut self, out: &mut Vec<Event>) {
        let rest = std::mem::take(&mut self.buf);
        if let Some(mut block) = self.block.take() {
            block.push(&rest, &self.schemas, &mut self.tally, out);
            block.end(false, &self.schemas, &mut self.tally, out);
        } else {
            let text = self.text.feed(&rest);
            push_event(out, Event::Content(text));
            push_event(out, Event::Content(self.text.take_held()));
        }
    }
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
