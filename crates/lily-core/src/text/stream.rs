//! One request's output, token by token: end-of-sequence ids → incremental detokenisation →
//! stop strings (with hold-back) → reasoning / tool-call parsing → events, plus the finish reason.
//! This is what the server calls from `Backend::decode`'s `on_token`.

use serde_json::Value;

use super::{ids, DecodeStream, Tokenizer};
use crate::parse::{push_event, Event, OutputParser, ParserConfig};
use crate::stop::{FinishReason, StopStrings};

/// Per-request output settings.
#[derive(Clone, Debug)]
pub struct StreamConfig {
    /// Tokens that end generation (not part of the output). Default: 248046, 248044.
    pub eos_ids: Vec<u32>,
    /// User stop strings (OpenAI `stop`); the stop text itself is not emitted.
    pub stop: Vec<String>,
    /// OpenAI `max_tokens` / `max_completion_tokens`; `None` = until EOS (or the caller's limit).
    pub max_tokens: Option<usize>,
    /// The prompt ended inside `<think>` (`parse::prompt_opens_reasoning(prompt)`).
    pub starts_in_reasoning: bool,
    /// Parse tool calls typed by these tools' schemas; `None` leaves `<tool_call>` as text.
    pub tools: Option<Vec<Value>>,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            eos_ids: ids::EOS.to_vec(),
            stop: Vec::new(),
            max_tokens: None,
            starts_in_reasoning: false,
            tools: None,
        }
    }
}

/// What one token (or the end) produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StreamStep {
    pub events: Vec<Event>,
    /// Set once, on the step that ends generation; the caller then stops decoding.
    pub finish: Option<FinishReason>,
}

/// Turns generated token ids into events. Create one per request.
#[derive(Debug)]
pub struct TextStream {
    decode: DecodeStream,
    stop: StopStrings,
    parser: OutputParser,
    eos_ids: Vec<u32>,
    max_tokens: Option<usize>,
    tokens: usize,
    finished: Option<FinishReason>,
}

impl TextStream {
    pub fn new(tokenizer: &Tokenizer, config: StreamConfig) -> Self {
        TextStream {
            // Special tokens (`<|im_start|>`, vision markers) never reach the client as text;
            // `<think>` and `<tool_call>` are not special and go to the parser.
            decode: tokenizer.decode_stream(true),
            stop: StopStrings::new(config.stop),
            parser: OutputParser::new(&ParserConfig {
                starts_in_reasoning: config.starts_in_reasoning,
                tools: config.tools,
            }),
            eos_ids: config.eos_ids,
            max_tokens: config.max_tokens,
            tokens: 0,
            finished: None,
        }
    }

    /// Feeds one generated token. After a step with `finish` set, further tokens are ignored.
    pub fn push_token(&mut self, id: u32) -> StreamStep {
        let mut step = StreamStep::default();
        if self.finished.is_some() {
            return step;
        }
        self.tokens += 1;
        if self.eos_ids.contains(&id) {
            self.end(FinishReason::Stop, true, &mut step);
            return step;
        }
        let delta = self.decode.step(id);
        let scan = self.stop.push(&delta);
        self.parser.push(&scan.text, &mut step.events);
        if scan.stopped {
            // What followed the stop string (even half a character) is dropped.
            self.end(FinishReason::Stop, false, &mut step);
        } else if self.max_tokens.is_some_and(|m| self.tokens >= m) {
            self.end(FinishReason::Length, true, &mut step);
        }
        step
    }

    /// Ends generation from outside (context full → `Length`, cancelled → any): settles
    /// everything held. Returns an empty step if generation had already finished.
    pub fn finish(&mut self, reason: FinishReason) -> StreamStep {
        let mut step = StreamStep::default();
        if self.finished.is_none() {
            self.end(reason, true, &mut step);
        }
        step
    }

    /// Tokens fed so far (the end-of-sequence token included): OpenAI `completion_tokens`.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finished
    }

    /// The user stop string that ended generation, if one did.
    pub fn stop_matched(&self) -> Option<&str> {
        self.stop.matched()
    }

    fn end(&mut self, reason: FinishReason, flush_held: bool, step: &mut StreamStep) {
        if flush_held {
            // Held bytes (an unfinished character becomes U+FFFD, as a full decode shows it) and
            // held stop-string prefixes were text after all.
            let tail = self.decode.flush();
            let mut text = self.stop.push(&tail).text;
            text.push_str(&self.stop.flush());
            self.parser.push(&text, &mut step.events);
        }
        let mut events = Vec::new();
        self.parser.finish(&mut events);
        for e in events {
            push_event(&mut step.events, e);
        }
        let reason = if reason == FinishReason::Stop && self.parser.tool_calls() > 0 {
            FinishReason::ToolCalls
        } else {
            reason
        };
        self.finished = Some(reason);
        step.finish = Some(reason);
    }
}
