//! Generated token ids → what the client sees: incremental detokenisation, stop strings, then the
//! reasoning / content / tool-call split. Runs on the engine thread inside the job's sink, so a
//! stop string ends decoding at the very token that completed it.

mod route;
mod stop;

use lily_core::text::{DecodeStream, Tokenizer};
use serde_json::Value;

use route::Router;
use stop::StopMatcher;

/// One piece of visible output.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Content(String),
    Reasoning(String),
    /// A complete tool call; `arguments` is a JSON object as a string.
    ToolCall {
        index: usize,
        name: String,
        arguments: String,
    },
}

pub struct Output {
    decode: DecodeStream,
    stops: StopMatcher,
    router: Router,
    stopped: bool,
}

pub struct OutputOptions<'a> {
    pub stops: Vec<String>,
    /// The prompt ends inside `<think>`: output starts as reasoning.
    pub in_reasoning: bool,
    /// Parse tool calls for these tools (None: everything is text).
    pub tools: Option<&'a [Value]>,
    /// `/v1/completions`: raw text, no channel split.
    pub raw: bool,
}

impl Output {
    pub fn new(tokenizer: &Tokenizer, opts: OutputOptions<'_>) -> Self {
        Output {
            // Special tokens (`<|im_end|>`) never reach the client; `<think>`, `<tool_call>` are
            // not special and stay visible to the router.
            decode: tokenizer.decode_stream(true),
            stops: StopMatcher::new(opts.stops),
            router: if opts.raw {
                Router::raw()
            } else {
                Router::new(opts.in_reasoning, opts.tools)
            },
            stopped: false,
        }
    }

    /// Feeds one generated token; returns true if a stop string matched (generation must end).
    pub fn step(&mut self, token: u32, out: &mut Vec<Piece>) -> bool {
        if self.stopped {
            return true;
        }
        let text = self.decode.step(token);
        self.feed(&text, out)
    }

    fn feed(&mut self, text: &str, out: &mut Vec<Piece>) -> bool {
        let (ready, hit) = self.stops.push(text);
        self.router.push(&ready, out);
        if hit {
            self.stopped = true;
            self.router.finish(out);
        }
        hit
    }

    /// End of generation: flushes every held byte.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        if self.stopped {
            return;
        }
        let tail = self.decode.flush();
        if self.feed(&tail, out) {
            return;
        }
        let held = self.stops.finish();
        self.router.push(&held, out);
        self.router.finish(out);
        self.stopped = true;
    }

    pub fn tool_calls(&self) -> usize {
        self.router.tool_calls()
    }
}
