//! Text in and out: the tokenizer, the streaming detokeniser, and `TextStream`, which turns the
//! generated token ids of one request into content / reasoning / tool-call events with stop rules
//! applied (ARCHITECTURE.md §2).
//!
//! One chat request, end to end (what the server does):
//!
//! ```no_run
//! use lily_core::backend::{Backend, Flow};
//! use lily_core::chat::{ChatOptions, ChatTemplate};
//! use lily_core::parse::{prompt_opens_reasoning, Event};
//! use lily_core::sampling::{Sampler, SamplingRequest};
//! use lily_core::text::{StreamConfig, TextStream, Tokenizer};
//!
//! fn chat(backend: &mut dyn Backend, dir: &std::path::Path, messages: &[serde_json::Value],
//!         tools: Option<Vec<serde_json::Value>>) -> anyhow::Result<()> {
//!     // Once per model.
//!     let tokenizer = Tokenizer::from_dir(dir)?;
//!     let template = ChatTemplate::from_dir(dir)?;
//!     // Per request: render (errors are the client's: HTTP 400), tokenize.
//!     let opts = ChatOptions::generation(); // + request's chat_template_kwargs in opts.kwargs
//!     let prompt = template.render(messages, tools.as_deref(), &opts)?;
//!     let ids = tokenizer.encode(&prompt)?;
//!     // Sampling: fields the request left out take the model card's defaults.
//!     let params = SamplingRequest::default().resolve(opts.thinking_enabled(), 1234);
//!     params.validate(tokenizer.vocab_size()).map_err(anyhow::Error::msg)?;
//!     let mut sampler = Sampler::with_prompt(params, &ids);
//!     let mut stream = TextStream::new(&tokenizer, StreamConfig {
//!         starts_in_reasoning: prompt_opens_reasoning(&prompt),
//!         tools, // None when tool_choice is "none"
//!         max_tokens: Some(512),
//!         stop: vec![],
//!         ..StreamConfig::default()
//!     });
//!     let seq = backend.new_seq(ids.len() + 512)?;
//!     backend.prefill(seq, &ids)?;
//!     backend.decode(seq, &mut sampler, 512, 0, &mut |step| {
//!         let out = stream.push_token(step.token);
//!         for event in out.events {
//!             match event {
//!                 Event::Content(text) => { /* delta.content */ }
//!                 Event::Reasoning(text) => { /* delta.reasoning_content */ }
//!                 Event::ToolCallStart { index, name } => { /* delta.tool_calls: index, id, name */ }
//!                 Event::ToolCallArguments { index, fragment } => { /* ….function.arguments */ }
//!                 Event::ToolCallEnd(call) => { /* a whole call, for a non-streamed answer */ }
//!             }
//!         }
//!         if out.finish.is_some() { Flow::Stop } else { Flow::Continue }
//!     })?;
//!     // The backend stopped without a finish (context full): settle what is held.
//!     let last = stream.finish(lily_core::stop::FinishReason::Length);
//!     let reason = stream.finish_reason(); // "stop" | "length" | "tool_calls"
//!     Ok(())
//! }
//! ```

mod detok;
mod pieces;
mod stream;
mod tokenizer;

pub use detok::DecodeStream;
pub use stream::{StreamConfig, StreamStep, TextStream};
pub use tokenizer::{ids, Bounded, Tokenizer, MAX_PIECE_BYTES};
