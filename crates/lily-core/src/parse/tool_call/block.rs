//! One `<tool_call>…</tool_call>` block, parsed as it arrives so that a call's name and each of
//! its arguments can be streamed as soon as they are certain (OpenAI `tool_calls` deltas).
//!
//! Events, in text order:
//! - `ToolCallStart { index, name }` once `<function=NAME>` is complete and NAME is a function the
//!   request declares (another name breaks the block);
//! - `ToolCallArguments { index, fragment }` each time a `<parameter=…>…</parameter>` closes: the
//!   JSON text of that key/value pair (`{"city":"Paris"`, then `,"days":3`), and at `</function>`
//!   the closing `}` (or `{}` for a call without arguments). The fragments of one call concatenate
//!   to exactly `ToolCall::arguments_json()` (compact serde_json, keys in the order written; a
//!   parameter the model repeats is the one exception: both pairs are sent, the whole call keeps the
//!   last value at the first position, which is what JSON parsers make of the string);
//! - `ToolCallEnd(call)` at `</function>`, with the whole call (what a non-streaming answer lists).
//!
//! A block that does not parse is passed on as the text it was. What was already sent cannot be
//! taken back, so: a call whose start was sent and that then breaks (junk where a tag belongs, a
//! bad parameter name, output ending mid-call) gets no `ToolCallEnd` and its arguments stay an
//! unclosed JSON text; the raw text of the call (from `<tool_call>`, or from the end of the
//! previous complete call of the same block) follows as content, then the rest of the block as it
//! arrives. A complete call stays complete whatever follows it. Nothing is ever dropped.
//!
//! The grammar is the one the whole-block parser had (qwen3_coder format, MODEL.md §4): whitespace
//! between tags is free; a value ends at the first `</parameter>`; when the block ends without one,
//! a value runs to the next `<parameter=` or `</function>` (the model forgot the close tag).

use serde_json::{Map, Value};

use super::{
    tag_name, typed_value, ToolCall, ToolSchemas, FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END,
    TOOL_CALL,
};
use crate::parse::scan::{scan, Scan};
use crate::parse::{push_event, Event};

/// Counters shared by all blocks of one output.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    /// Index of the next call started (`tool_calls[].index`; a broken call keeps its index).
    pub(crate) next_index: usize,
    /// Calls completed (they make the finish reason `tool_calls`).
    pub(crate) complete: usize,
}

#[derive(Debug)]
enum State {
    /// Before `<function=`, or after a complete function (then the block may end here).
    Between,
    FunctionName,
    /// Inside a function: `<parameter=` or `</function>` comes next.
    Body,
    ParamName,
    /// A parameter's value; `settled` bytes of it cannot hold the start of `</parameter>`.
    Value {
        param: String,
        settled: usize,
    },
    /// Does not parse: the rest of the block is text.
    Broken,
}

/// The call being parsed.
#[derive(Debug)]
struct Open {
    index: usize,
    name: String,
    arguments: Map<String, Value>,
}

impl Open {
    /// Adds an argument; returns its piece of the arguments string, serialised as
    /// `Value::Object(arguments).to_string()` would write it there.
    fn add(&mut self, param: String, value: Value) -> String {
        let mut fragment = String::from(if self.arguments.is_empty() { "{" } else { "," });
        fragment.push_str(&Value::String(param.clone()).to_string());
        fragment.push(':');
        fragment.push_str(&value.to_string());
        self.arguments.insert(param, value);
        fragment
    }

    /// The last piece of the arguments string.
    fn closing(&self) -> &'static str {
        if self.arguments.is_empty() {
            "{}"
        } else {
            "}"
        }
    }
}

/// What one look at the pending text decided.
enum Step {
    /// More text is needed.
    Wait,
    Break,
    /// `n` bytes consumed; go to the state.
    Take(usize, State),
    /// A name of `n` bytes (its `>` included) was read.
    Name(usize, String),
    /// A value ends at byte `end`; the next tag starts at `next`.
    Value(usize, usize),
    /// `</function>` (`n` bytes) closes the open call.
    CloseFunction(usize),
}

#[derive(Debug)]
pub(crate) struct Block {
    /// The block's text so far, `<tool_call>` included (a break passes it on).
    raw: String,
    /// Bytes of `raw` parsed.
    pos: usize,
    state: State,
    /// Start in `raw` of the text not yet part of a complete call.
    kept_from: usize,
    open: Option<Open>,
    /// Functions completed in this block.
    completed: usize,
}

impl Block {
    /// A block whose `<tool_call>` has just been read.
    pub(crate) fn new() -> Self {
        Block {
            raw: TOOL_CALL.to_owned(),
            pos: TOOL_CALL.len(),
            state: State::Between,
            kept_from: 0,
            open: None,
            completed: 0,
        }
    }

    /// Feeds text of the block (never `</tool_call>` itself, which ends it).
    pub(crate) fn push(
        &mut self,
        text: &str,
        schemas: &ToolSchemas,
        tally: &mut Tally,
        out: &mut Vec<Event>,
    ) {
        if matches!(self.state, State::Broken) {
            push_event(out, Event::Content(text.to_owned()));
            return;
        }
        self.raw.push_str(text);
        self.advance(false, schemas, tally, out);
    }

    /// The block ends: at `</tool_call>` (`closed`) or at the end of output.
    pub(crate) fn end(
        &mut self,
        closed: bool,
        schemas: &ToolSchemas,
        tally: &mut Tally,
        out: &mut Vec<Event>,
    ) {
        if !matches!(self.state, State::Broken) {
            self.advance(true, schemas, tally, out);
            let broken = matches!(self.state, State::Broken);
            let whole = matches!(self.state, State::Between)
                && self.completed > 0
                && self.pos == self.raw.len();
            if !broken && !whole {
                self.break_off(out);
            }
        }
        if closed && matches!(self.state, State::Broken) {
            push_event(out, Event::Content(super::TOOL_CALL_END.to_owned()));
        }
    }

    fn advance(
        &mut self,
        at_end: bool,
        schemas: &ToolSchemas,
        tally: &mut Tally,
        out: &mut Vec<Event>,
    ) {
        loop {
            match self.look(at_end) {
                Step::Wait => return,
                Step::Break => return self.break_off(out),
                Step::Take(n, state) => {
                    self.pos += n;
                    self.state = state;
                }
                Step::Name(n, name) => {
                    // A function the request did not declare is no call the client can make.
                    if matches!(self.state, State::FunctionName) && !schemas.declares(&name) {
                        return self.break_off(out);
                    }
                    self.pos += n;
                    self.state = match std::mem::replace(&mut self.state, State::Body) {
                        State::FunctionName => {
                            let index = tally.next_index;
                            tally.next_index += 1;
                            out.push(Event::ToolCallStart {
                                index,
                                name: name.clone(),
                            });
                            self.open = Some(Open {
                                index,
                                name,
                                arguments: Map::new(),
                            });
                            State::Body
                        }
                        _ => State::Value {
                            param: name,
                            settled: 0,
                        },
                    };
                }
                Step::Value(end, next) => {
                    let State::Value { param, .. } =
                        std::mem::replace(&mut self.state, State::Body)
                    else {
                        return self.break_off(out);
                    };
                    let raw = &self.raw[self.pos..self.pos + end];
                    let raw = raw.strip_prefix('\n').unwrap_or(raw);
                    let raw = raw.strip_suffix('\n').unwrap_or(raw);
                    let Some(open) = &mut self.open else {
                        return self.break_off(out);
                    };
                    let value = typed_value(raw, schemas.param(&open.name, &param));
                    let fragment = open.add(param, value);
                    out.push(Event::ToolCallArguments {
                        index: open.index,
                        fragment,
                    });
                    self.pos += next;
                }
                Step::CloseFunction(n) => {
                    let Some(open) = self.open.take() else {
                        return self.break_off(out);
                    };
                    self.pos += n;
                    self.state = State::Between;
                    self.kept_from = self.pos;
                    self.completed += 1;
                    tally.complete += 1;
                    out.push(Event::ToolCallArguments {
                        index: open.index,
                        fragment: open.closing().to_owned(),
                    });
                    out.push(Event::ToolCallEnd(ToolCall {
                        index: open.index,
                        name: open.name,
                        arguments: open.arguments,
                    }));
                }
            }
        }
    }

    /// Decides what the pending text `raw[pos..]` means in the current state.
    fn look(&mut self, at_end: bool) -> Step {
        let rest = &self.raw[self.pos..];
        match &mut self.state {
            State::Broken => Step::Wait,
            State::Between | State::Body => {
                let body = rest.trim_start();
                let skipped = rest.len() - body.len();
                if body.is_empty() {
                    // Whitespace only so far: consume it (nothing to decide yet).
                    self.pos += skipped;
                    return Step::Wait;
                }
                let between = matches!(self.state, State::Between);
                let tags: &[&str] = if between {
                    &[FUNCTION]
                } else {
                    &[FUNCTION_END, PARAMETER]
                };
                match tags.iter().find(|t| body.starts_with(**t)) {
                    Some(&tag) if between => Step::Take(skipped + tag.len(), State::FunctionName),
                    Some(&FUNCTION_END) => Step::CloseFunction(skipped + FUNCTION_END.len()),
                    Some(&tag) => Step::Take(skipped + tag.len(), State::ParamName),
                    None if !at_end && tags.iter().any(|t| t.starts_with(body)) => Step::Wait,
                    None => Step::Break,
                }
            }
            State::FunctionName | State::ParamName => match rest.find(['>', '<']) {
                // A name ends at the first `>`; a `<` before it makes it invalid.
                Some(i) if rest.as_bytes()[i] == b'>' => match tag_name(&rest[..i]) {
                    Some(name) => Step::Name(i + 1, name.to_owned()),
                    None => Step::Break,
                },
                None if !at_end && !spans_lines(rest) => Step::Wait,
                _ => Step::Break,
            },
            State::Value { settled, .. } => match scan(&rest[*settled..], &[PARAMETER_END]) {
                Scan::Found { at, .. } => {
                    let end = *settled + at;
                    Step::Value(end, end + PARAMETER_END.len())
                }
                Scan::Settled(n) if !at_end => {
                    *settled += n;
                    Step::Wait
                }
                // The block ended without `</parameter>`: the value runs to the next tag.
                Scan::Settled(_) => match [PARAMETER, FUNCTION_END]
                    .iter()
                    .filter_map(|t| rest.find(t))
                    .min()
                {
                    Some(end) => Step::Value(end, end),
                    None => Step::Break,
                },
            },
        }
    }

    /// The block does not parse: what is not part of a complete call becomes text.
    fn break_off(&mut self, out: &mut Vec<Event>) {
        let text = self.raw.split_off(self.kept_from);
        self.raw.clear();
        self.pos = 0;
        self.kept_from = 0;
        self.open = None;
        self.state = State::Broken;
        push_event(out, Event::Content(text));
    }
}

/// A name still waiting for its `>` that already has text on a second line cannot be valid (a name
/// is one line once trimmed): the block is known to be broken without waiting for its end.
fn spans_lines(pending: &str) -> bool {
    let name = pending.trim_start();
    name.find('\n')
        .is_some_and(|nl| !name[nl..].trim_start().is_empty())
}
