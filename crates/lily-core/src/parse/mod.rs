//! Stream parsers over the generated text: reasoning (`<think>…</think>`) and tool calls
//! (`<tool_call>…</tool_call>`). Fed text deltas in any split, they produce the same events
//! (tests/parse_props.rs); nothing they are given is lost or makes them panic.
//!
//! `OutputParser` chains the two: text → `ReasoningParser` → content → `ToolCallParser`.

pub mod reasoning;
pub(crate) mod scan;
pub mod tool_call;

use serde_json::Value;

pub use reasoning::{prompt_opens_reasoning, Piece, ReasoningParser};
pub use tool_call::{ToolCall, ToolCallParser, ToolSchemas};

/// What the server turns into OpenAI deltas.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// `delta.content`
    Content(String),
    /// `delta.reasoning_content`
    Reasoning(String),
    /// A tool call begins: its `<function=NAME>` is read. OpenAI's first `delta.tool_calls`
    /// entry of the call (`index`, a new `id`, `type`, `function.name`, `arguments: ""`).
    ToolCallStart { index: usize, name: String },
    /// The next piece of the call's `function.arguments` string (one per parameter, then the
    /// closing `}`); together they are the call's `arguments_json()`.
    ToolCallArguments { index: usize, fragment: String },
    /// The call is complete and well-formed: all of it, for answers that are not streamed. A call
    /// that started but breaks never gets this; its raw text follows as `Content` instead.
    ToolCallEnd(ToolCall),
}

/// How to read one generation's output.
#[derive(Clone, Debug, Default)]
pub struct ParserConfig {
    /// The prompt ended inside `<think>` (see `prompt_opens_reasoning`).
    pub starts_in_reasoning: bool,
    /// The request's tools; `None` (no tools, or `tool_choice: "none"`) leaves `<tool_call>` as text.
    pub tools: Option<Vec<Value>>,
}

/// Reasoning + tool-call parser for one generation.
#[derive(Debug)]
pub struct OutputParser {
    reasoning: ReasoningParser,
    tools: Option<ToolCallParser>,
    pieces: Vec<Piece>,
}

impl OutputParser {
    pub fn new(config: &ParserConfig) -> Self {
        OutputParser {
            reasoning: ReasoningParser::new(config.starts_in_reasoning),
            tools: config
                .tools
                .as_deref()
                .map(|t| ToolCallParser::new(ToolSchemas::from_tools(t))),
            pieces: Vec::new(),
        }
    }

    /// Feeds a text delta; appends the events it settles to `out`.
    pub fn push(&mut self, text: &str, out: &mut Vec<Event>) {
        self.reasoning.push(text, &mut self.pieces);
        self.route(false, out);
    }

    /// End of output: settles everything still held.
    pub fn finish(&mut self, out: &mut Vec<Event>) {
        self.reasoning.finish(&mut self.pieces);
        self.route(true, out);
    }

    /// Tool calls completed so far.
    pub fn tool_calls(&self) -> usize {
        self.tools.as_ref().map_or(0, ToolCallParser::calls)
    }

    fn route(&mut self, finish: bool, out: &mut Vec<Event>) {
        for piece in self.pieces.drain(..) {
            match piece {
                Piece::Reasoning(r) => push_event(out, Event::Reasoning(r)),
                Piece::Content(c) => match &mut self.tools {
                    Some(tools) => tools.push(&c, out),
                    None => push_event(out, Event::Content(c)),
                },
            }
        }
        if finish {
            if let Some(tools) = &mut self.tools {
                tools.finish(out);
            }
        }
    }
}

/// Appends, merging with a previous event of the same text kind.
pub fn push_event(out: &mut Vec<Event>, event: Event) {
    match (out.last_mut(), event) {
        (_, Event::Content(s) | Event::Reasoning(s)) if s.is_empty() => {}
        (Some(Event::Content(a)), Event::Content(b)) => a.push_str(&b),
        (Some(Event::Reasoning(a)), Event::Reasoning(b)) => a.push_str(&b),
        (_, e) => out.push(e),
    }
}

/// The text of one section with its framing newlines removed: leading ones dropped when asked,
/// trailing ones held until more text follows (and dropped if the section ends first).
#[derive(Debug, Default)]
pub(crate) struct NewlineFrame {
    strip_leading: bool,
    held: String,
}

impl NewlineFrame {
    pub(crate) fn new(strip_leading: bool) -> Self {
        NewlineFrame {
            strip_leading,
            held: String::new(),
        }
    }

    /// What of `text` can be emitted now.
    pub(crate) fn feed(&mut self, text: &str) -> String {
        let mut text = text;
        if self.strip_leading {
            text = text.trim_start_matches('\n');
            if text.is_empty() {
                return String::new();
            }
            self.strip_leading = false;
        }
        let body = text.trim_end_matches('\n');
        let mut out = String::new();
        if !body.is_empty() {
            out = std::mem::take(&mut self.held);
            out.push_str(body);
        }
        self.held.push_str(&text[body.len()..]);
        out
    }

    /// The held newlines (the section goes on after all).
    pub(crate) fn take_held(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}
