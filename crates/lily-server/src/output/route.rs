//! Splits the generated text into the OpenAI channels: reasoning (before `</think>`), content, and
//! tool calls (`<tool_call>…</tool_call>` blocks in the model's XML-like format, MODEL.md §4).
//! A tag split over several tokens is held back until it is whole; a tool call that does not parse
//! degrades to plain content, never to an error.

use serde_json::{Map, Value};

use super::Piece;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// `/v1/completions`: everything is content, nothing is parsed.
    Raw,
    Reasoning,
    Content,
    ToolCall,
}

pub struct Router {
    mode: Mode,
    held: String,
    /// Parameter types by function name, from the request's `tools` (None: tools off).
    tools: Option<Map<String, Value>>,
    calls: usize,
    /// Content right after `</think>` starts with the template's blank line; drop it.
    trim_content_start: bool,
    any_content: bool,
}

impl Router {
    /// `in_reasoning`: the prompt ended inside `<think>` (thinking on). `tools`: the request's
    /// tools, or None when tool calls are not to be parsed.
    pub fn new(in_reasoning: bool, tools: Option<&[Value]>) -> Self {
        let tools = tools.map(|list| {
            let mut by_name = Map::new();
            for tool in list {
                let f = tool.get("function").unwrap_or(tool);
                if let Some(name) = f.get("name").and_then(Value::as_str) {
                    let props = f
                        .pointer("/parameters/properties")
                        .cloned()
                        .unwrap_or(Value::Null);
                    by_name.insert(name.to_string(), props);
                }
            }
            by_name
        });
        Router {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            held: String::new(),
            tools,
            calls: 0,
            trim_content_start: false,
            any_content: false,
        }
    }

    pub fn raw() -> Self {
        Router {
            mode: Mode::Raw,
            held: String::new(),
            tools: None,
            calls: 0,
            trim_content_start: false,
            any_content: true,
        }
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        if self.mode == Mode::Raw {
            if !text.is_empty() {
                out.push(Piece::Content(text.to_string()));
            }
            return;
        }
        self.held.push_str(text);
        loop {
            let progressed = match self.mode {
                Mode::Reasoning => self.scan(THINK_CLOSE, out),
                Mode::Content if self.tools.is_some() => self.scan(CALL_OPEN, out),
                Mode::Content => self.scan(THINK_CLOSE, out),
                Mode::ToolCall => self.scan(CALL_CLOSE, out),
                Mode::Raw => false,
            };
            if !progressed {
                break;
            }
        }
    }

    /// Looks for `tag` in the held text. Emits what precedes it in the current channel; returns
    /// true if the tag was found (and the mode changed).
    fn scan(&mut self, tag: &str, out: &mut Vec<Piece>) -> bool {
        if let Some(at) = self.held.find(tag) {
            let before: String = self.held[..at].to_string();
            self.held.drain(..at + tag.len());
            match self.mode {
                Mode::Reasoning => {
                    self.emit(before, out);
                    self.mode = Mode::Content;
                    self.trim_content_start = true;
                }
                Mode::Content if tag == CALL_OPEN => {
                    self.emit(before, out);
                    self.mode = Mode::ToolCall;
                }
                // A stray `</think>` in content (thinking off but the model closes anyway).
                Mode::Content => {
                    self.emit(before, out);
                    self.trim_content_start = true;
                }
                Mode::Raw => {}
                Mode::ToolCall => {
                    self.finish_call(&before, out);
                    self.mode = Mode::Content;
                    self.trim_content_start = true;
                }
            }
            return true;
        }
        if self.mode != Mode::ToolCall {
            let keep = partial_suffix(&self.held, tag);
            let cut = self.held.len() - keep;
            let ready: String = self.held[..cut].to_string();
            self.held.drain(..cut);
            self.emit(ready, out);
        }
        false
    }

    fn emit(&mut self, mut text: String, out: &mut Vec<Piece>) {
        if self.mode == Mode::Content || self.mode == Mode::ToolCall {
            if self.trim_content_start {
                let trimmed = text.trim_start_matches('\n');
                if trimmed.is_empty() {
                    return;
                }
                text = trimmed.to_string();
                self.trim_content_start = false;
            }
            // `<think>` opening a non-thinking answer carries nothing.
            if !self.any_content {
                if let Some(rest) = text.strip_prefix(THINK_OPEN) {
                    text = rest.trim_start_matches('\n').to_string();
                }
            }
        }
        if text.is_empty() {
            return;
        }
        match self.mode {
            Mode::Reasoning => out.push(Piece::Reasoning(text)),
            _ => {
                self.any_content = true;
                out.push(Piece::Content(text))
            }
        }
    }

    fn finish_call(&mut self, body: &str, out: &mut Vec<Piece>) {
        match parse_call(body, self.tools.as_ref()) {
            Some((name, arguments)) => {
                out.push(Piece::ToolCall {
                    index: self.calls,
                    name,
                    arguments,
                });
                self.calls += 1;
            }
            None => {
                self.mode = Mode::Content;
                self.emit(format!("{CALL_OPEN}{body}{CALL_CLOSE}"), out);
            }
        }
    }

    /// End of generation: held text goes out as it is (an unfinished tool call as content).
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.held);
        if self.mode == Mode::ToolCall {
            self.mode = Mode::Content;
            self.emit(format!("{CALL_OPEN}{rest}"), out);
        } else {
            self.emit(rest, out);
        }
    }

    pub fn tool_calls(&self) -> usize {
        self.calls
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
fn partial_suffix(text: &str, tag: &str) -> usize {
    for (i, _) in text.char_indices() {
        let tail = &text[i..];
        if tail.len() < tag.len() && tag.starts_with(tail) {
            return tail.len();
        }
    }
    0
}

/// `\n<function=NAME>\n<parameter=K>\nV\n</parameter>\n…</function>\n` → (NAME, arguments JSON).
fn parse_call(body: &str, tools: Option<&Map<String, Value>>) -> Option<(String, String)> {
    let rest = body.trim();
    let rest = rest.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    let props = tools.and_then(|t| t.get(name));
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let after = rest.strip_prefix("<parameter=")?;
        let (key, after) = after.split_once('>')?;
        let (value, after) = after.split_once("</parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let declared = props
            .and_then(|p| p.pointer(&format!("/{key}/type")))
            .and_then(Value::as_str);
        args.insert(key.trim().to_string(), typed_value(value, declared));
        rest = after;
    }
    Some((name.to_string(), Value::Object(args).to_string()))
}

/// The template writes non-string arguments with `tojson`; read them back the same way unless the
/// tool declares the parameter a string.
fn typed_value(raw: &str, declared: Option<&str>) -> Value {
    if declared == Some("string") {
        return Value::String(raw.to_string());
    }
    match serde_json::from_str::<Value>(raw) {
        Ok(v) if declared.is_some() || !v.is_string() => v,
        _ => Value::String(raw.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn route(in_reasoning: bool, tools: Option<&[Value]>, pieces: &[&str]) -> Vec<Piece> {
        let mut r = Router::new(in_reasoning, tools);
        let mut out = Vec::new();
        for p in pieces {
            r.push(p, &mut out);
        }
        r.finish(&mut out);
        merge(out)
    }

    /// Adjacent pieces of one channel joined, so tests do not depend on how text was split.
    fn merge(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            match (out.last_mut(), p) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    #[test]
    fn reasoning_then_content_however_the_tag_is_split() {
        let want = vec![
            Piece::Reasoning("Let me think.\n".into()),
            Piece::Content("Hi!".into()),
        ];
        assert_eq!(route(true, None, &["Let me think.\n</think>\n\nHi!"]), want);
        assert_eq!(
            route(
                true,
                None,
                &["Let me think.\n</th", "ink>", "\n", "\nHi", "!"]
            ),
            want
        );
    }

    #[test]
    fn tool_call_becomes_name_and_json_arguments() {
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}),
        ];
        let text = "I will check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let got = route(false, Some(&tools), &[text]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0], Piece::Content("I will check.\n\n".into()));
        match &got[1] {
            Piece::ToolCall {
                index,
                name,
                arguments,
            } => {
                assert_eq!((*index, name.as_str()), (0, "get_weather"));
                let args: Value = serde_json::from_str(arguments).unwrap();
                assert_eq!(args, json!({"city": "Paris", "days": 3}));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_tool_call_degrades_to_content() {
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let got = route(false, Some(&tools), &["<tool_call>\n<oops>\n</tool_call>"]);
        assert_eq!(
            got,
            vec![Piece::Content("<tool_call>\n<oops>\n</tool_call>".into())]
        );
    }
}
