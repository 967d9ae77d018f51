//! Generated token ids → what the client sees. Chat output goes through lily-core's `TextStream`
//! (detokenise → stop strings → reasoning / tool-call parsing); `/v1/completions` output is raw
//! text (detokenise → stop strings, no parsing). Runs on the engine thread inside the job's sink,
//! so a stop string ends decoding at the very token that completed it.

use lily_core::parse::Event;
use lily_core::stop::{FinishReason, StopStrings};
use lily_core::text::{DecodeStream, StreamConfig, TextStream, Tokenizer};
use serde_json::Value;

pub enum Output {
    Chat(Box<TextStream>),
    Raw {
        decode: DecodeStream,
        stop: StopStrings,
        stopped: bool,
    },
}

impl Output {
    /// `starts_in_reasoning`: the rendered prompt left a `<think>` open. `tools`: parse tool calls
    /// for these (None: `<tool_call>` stays text).
    pub fn chat(
        tokenizer: &Tokenizer,
        stop: Vec<String>,
        starts_in_reasoning: bool,
        tools: Option<Vec<Value>>,
    ) -> Self {
        // End-of-sequence ids and max_tokens are the engine's to apply; the stream only sees
        // tokens that are output.
        let config = StreamConfig {
            eos_ids: Vec::new(),
            stop,
            max_tokens: None,
            starts_in_reasoning,
            tools,
        };
        Output::Chat(Box::new(TextStream::new(tokenizer, config)))
    }

    pub fn raw(tokenizer: &Tokenizer, stop: Vec<String>) -> Self {
        Output::Raw {
            decode: tokenizer.decode_stream(true),
            stop: StopStrings::new(stop),
            stopped: false,
        }
    }

    /// Feeds one generated token; returns true if a stop string matched (generation must end).
    pub fn step(&mut self, token: u32, out: &mut Vec<Event>) -> bool {
        match self {
            Output::Chat(stream) => {
                let step = stream.push_token(token);
                out.extend(step.events);
                step.finish.is_some()
            }
            Output::Raw {
                decode,
                stop,
                stopped,
            } => {
                if *stopped {
                    return true;
                }
                let scan = stop.push(&decode.step(token));
                push_text(out, scan.text);
                *stopped = scan.stopped;
                scan.stopped
            }
        }
    }

    /// The user stop string that ended generation, if one did.
    pub fn stop_matched(&self) -> Option<String> {
        match self {
            Output::Chat(stream) => stream.stop_matched().map(str::to_owned),
            Output::Raw { stop, .. } => stop.matched().map(str::to_owned),
        }
    }

    /// End of generation (`reason` as the engine saw it): flushes every held byte.
    pub fn finish(&mut self, reason: FinishReason, out: &mut Vec<Event>) {
        match self {
            Output::Chat(stream) => out.extend(stream.finish(reason).events),
            Output::Raw {
                decode,
                stop,
                stopped,
            } => {
                if !*stopped {
                    let scan = stop.push(&decode.flush());
                    push_text(out, scan.text);
                    if !scan.stopped {
                        push_text(out, stop.flush());
                    }
                    *stopped = true;
                }
            }
        }
    }
}

fn push_text(out: &mut Vec<Event>, text: String) {
    if !text.is_empty() {
        out.push(Event::Content(text));
    }
}
