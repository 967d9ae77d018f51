//! Parser events → Anthropic content blocks. One `Blocks` per answer turns the event stream into
//! block operations (start, delta, stop) — the streaming events themselves — and the same
//! operations, applied in order, build the content list of a non-streamed answer, so the two
//! shapes cannot disagree.

use lily_core::engine::{FinishReason, Outcome, Usage};
use lily_core::parse::Event as Piece;
use serde_json::{json, Value};

use crate::openai::error::ApiError;
use crate::openai::response::new_id;

/// One step of building the content list; each is one streaming event.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockOp {
    /// `content_block_start`: a new block at `index`, with its empty body.
    Start { index: usize, block: Value },
    /// `content_block_delta`: `text_delta`, `thinking_delta` or `input_json_delta`.
    Delta { index: usize, delta: Value },
    /// `content_block_stop`.
    Stop { index: usize },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Thinking,
    Text,
    ToolUse,
}

/// The block being written and how many came before it.
#[derive(Debug, Default)]
pub struct Blocks {
    open: Option<Kind>,
    next: usize,
}

impl Blocks {
    /// The operations `piece` adds.
    pub fn push(&mut self, piece: Piece, out: &mut Vec<BlockOp>) {
        match piece {
            Piece::Reasoning(t) => self.text_like(Kind::Thinking, t, out),
            Piece::Content(t) => self.text_like(Kind::Text, t, out),
            Piece::ToolCallStart { name, .. } => {
                self.close(out);
                self.open(
                    Kind::ToolUse,
                    json!({"type": "tool_use", "id": tool_use_id(), "name": name, "input": {}}),
                    out,
                );
            }
            Piece::ToolCallArguments { fragment, .. } => {
                if self.open == Some(Kind::ToolUse) {
                    out.push(BlockOp::Delta {
                        index: self.next - 1,
                        delta: json!({"type": "input_json_delta", "partial_json": fragment}),
                    });
                }
            }
            Piece::ToolCallEnd(_) => {
                if self.open == Some(Kind::ToolUse) {
                    self.close(out);
                }
            }
        }
    }

    /// Closes the open block, if any (end of the answer).
    pub fn close(&mut self, out: &mut Vec<BlockOp>) {
        if self.open.take().is_some() {
            out.push(BlockOp::Stop {
                index: self.next - 1,
            });
        }
    }

    fn open(&mut self, kind: Kind, block: Value, out: &mut Vec<BlockOp>) {
        out.push(BlockOp::Start {
            index: self.next,
            block,
        });
        self.open = Some(kind);
        self.next += 1;
    }

    fn text_like(&mut self, kind: Kind, text: String, out: &mut Vec<BlockOp>) {
        if text.is_empty() {
            return;
        }
        if self.open != Some(kind) {
            self.close(out);
            let block = match kind {
                // Lily's reasoning carries no signature; clients send back what they got.
                Kind::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                _ => json!({"type": "text", "text": ""}),
            };
            self.open(kind, block, out);
        }
        let delta = match kind {
            Kind::Thinking => json!({"type": "thinking_delta", "thinking": text}),
            _ => json!({"type": "text_delta", "text": text}),
        };
        out.push(BlockOp::Delta {
            index: self.next - 1,
            delta,
        });
    }
}

/// The content list of a non-streamed answer, built from the same operations.
#[derive(Debug, Default)]
pub struct Content {
    blocks: Vec<Value>,
    /// `partial_json` pieces of the tool_use block being built.
    json: String,
}

impl Content {
    pub fn apply(&mut self, op: BlockOp) {
        match op {
            BlockOp::Start { block, .. } => {
                self.json.clear();
                self.blocks.push(block);
            }
            BlockOp::Delta { index, delta } => {
                let Some(block) = self.blocks.get_mut(index) else {
                    return;
                };
                for (field, key) in [("text", "text"), ("thinking", "thinking")] {
                    if let (Some(Value::String(have)), Some(more)) =
                        (block.get_mut(field), delta.get(key).and_then(Value::as_str))
                    {
                        have.push_str(more);
                    }
                }
                if let Some(more) = delta.get("partial_json").and_then(Value::as_str) {
                    self.json.push_str(more);
                }
            }
            BlockOp::Stop { index } => {
                if let Some(block) = self.blocks.get_mut(index) {
                    if block["type"] == "tool_use" {
                        block["input"] = serde_json::from_str(&self.json).unwrap_or(json!({}));
                    }
                }
            }
        }
    }

    pub fn into_json(self) -> Value {
        Value::Array(self.blocks)
    }
}

/// Anthropic's `stop_reason` and usage of a finished job, or the error its request gets.
pub fn stop_reason(
    outcome: &Outcome,
    tool_calls: usize,
    stop_sequence: Option<&str>,
) -> Result<(&'static str, Usage), ApiError> {
    match outcome {
        Outcome::Done {
            reason: FinishReason::Stop,
            usage,
        } => Ok((
            if stop_sequence.is_some() {
                "stop_sequence"
            } else if tool_calls > 0 {
                "tool_use"
            } else {
                "end_turn"
            },
            *usage,
        )),
        Outcome::Done {
            reason: FinishReason::Length,
            usage,
        } => Ok(("max_tokens", *usage)),
        Outcome::Done {
            reason: FinishReason::Cancelled,
            ..
        } => Err(ApiError::unavailable(
            "the request was cancelled: the server is shutting down",
        )),
        Outcome::Failed { message, .. } => {
            Err(ApiError::internal(format!("generation failed: {message}")))
        }
    }
}

/// Anthropic usage: `input_tokens` counts only the prompt tokens that were computed; those whose
/// state came from a reused prefix are `cache_read_input_tokens`.
pub fn usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

/// Anthropic's tool-use ids read `toolu_…`.
fn tool_use_id() -> String {
    new_id("toolu").replacen('-', "_", 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::parse::ToolCall;
    use serde_json::Map;

    fn ops(pieces: Vec<Piece>) -> Vec<BlockOp> {
        let mut b = Blocks::default();
        let mut out = Vec::new();
        for p in pieces {
            b.push(p, &mut out);
        }
        b.close(&mut out);
        out
    }

    #[test]
    fn blocks_open_and_close_in_order() {
        let mut args = Map::new();
        args.insert("city".into(), json!("Paris"));
        let out = ops(vec![
            Piece::Reasoning("hm".into()),
            Piece::Reasoning("m".into()),
            Piece::Content("".into()),
            Piece::Content("Checking.".into()),
            Piece::ToolCallStart {
                index: 0,
                name: "get_weather".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "{\"city\": \"Paris\"".into(),
            },
            Piece::ToolCallArguments {
                index: 0,
                fragment: "}".into(),
            },
            Piece::ToolCallEnd(ToolCall {
                index: 0,
                name: "get_weather".into(),
                arguments: args,
            }),
        ]);
        let kinds: Vec<(&str, usize)> = out
            .iter()
            .map(|op| match op {
                BlockOp::Start { index, .. } => ("start", *index),
                BlockOp::Delta { index, .. } => ("delta", *index),
                BlockOp::Stop { index } => ("stop", *index),
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                ("start", 0),
                ("delta", 0),
                ("delta", 0),
                ("stop", 0),
                ("start", 1),
                ("delta", 1),
                ("stop", 1),
                ("start", 2),
                ("delta", 2),
                ("delta", 2),
                ("stop", 2)
            ]
        );
        let mut content = Content::default();
        for op in out {
            content.apply(op);
        }
        let c = content.into_json();
        assert_eq!(
            c[0],
            json!({"type": "thinking", "thinking": "hmm", "signature": ""})
        );
        assert_eq!(c[1], json!({"type": "text", "text": "Checking."}));
        assert_eq!(c[2]["type"], "tool_use");
        assert_eq!(c[2]["input"], json!({"city": "Paris"}));
        assert!(c[2]["id"].as_str().unwrap().starts_with("toolu_"));
    }

    #[test]
    fn stop_reasons_follow_the_outcome() {
        let done = |reason| Outcome::Done {
            reason,
            usage: Usage::default(),
        };
        assert_eq!(
            stop_reason(&done(FinishReason::Stop), 0, None).unwrap().0,
            "end_turn"
        );
        assert_eq!(
            stop_reason(&done(FinishReason::Stop), 1, None).unwrap().0,
            "tool_use"
        );
        assert_eq!(
            stop_reason(&done(FinishReason::Stop), 0, Some("END"))
                .unwrap()
                .0,
            "stop_sequence"
        );
        assert_eq!(
            stop_reason(&done(FinishReason::Length), 0, None).unwrap().0,
            "max_tokens"
        );
        assert!(stop_reason(&done(FinishReason::Cancelled), 0, None).is_err());
    }

    #[test]
    fn cached_prompt_tokens_are_cache_reads() {
        let u = Usage {
            prompt_tokens: 100,
            cached_tokens: 60,
            completion_tokens: 7,
            ..Usage::default()
        };
        assert_eq!(
            usage(&u),
            json!({"input_tokens": 40, "output_tokens": 7, "cache_read_input_tokens": 60,
                   "cache_creation_input_tokens": 0})
        );
    }
}
