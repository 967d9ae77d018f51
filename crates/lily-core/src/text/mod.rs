//! Text in and out: the tokenizer, the streaming detokeniser, and `TextStream`, which turns the
//! generated token ids of one request into content / reasoning / tool-call events with stop rules
//! applied (ARCHITECTURE.md §2).

mod detok;
mod stream;
mod tokenizer;

pub use detok::DecodeStream;
pub use stream::{StreamConfig, StreamStep, TextStream};
pub use tokenizer::{ids, Tokenizer};
