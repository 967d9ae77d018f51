//! Incremental detokenisation for streaming. A byte-level token can end in the middle of a UTF-8
//! character (emoji, CJK are often split over 2–4 tokens), so bytes wait here until they form
//! whole characters; only complete, valid text leaves. Bytes that can never become valid UTF-8
//! leave as U+FFFD at once (as HF `decode(errors="replace")` renders them), so nothing is held
//! forever and concatenating the deltas gives exactly `Tokenizer::decode` of all ids.

use std::sync::Arc;

use super::tokenizer::TokenTable;

/// Streaming decoder of one generation. Feed ids with `step`; call `flush` at the end.
#[derive(Debug)]
pub struct DecodeStream {
    table: Arc<TokenTable>,
    skip_special: bool,
    /// Bytes of an unfinished character (at most 3).
    pending: Vec<u8>,
}

impl DecodeStream {
    pub(crate) fn new(table: Arc<TokenTable>, skip_special: bool) -> Self {
        DecodeStream {
            table,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Text completed by token `id` (possibly empty). Unknown ids and skipped special tokens add
    /// nothing.
    pub fn step(&mut self, id: u32) -> String {
        match self.table.piece(id, self.skip_special) {
            Some(piece) => {
                self.pending.extend_from_slice(piece);
                self.take_complete()
            }
            None => String::new(),
        }
    }

    /// End of the stream: an unfinished character becomes U+FFFD, as a full decode renders it.
    pub fn flush(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }

    /// Whether bytes of an unfinished character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Moves every byte that is settled out of `pending`: valid characters as they are, invalid
    /// sequences as U+FFFD; keeps only a trailing prefix that may still become a character.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // Safe by construction: from_utf8 vouched for these bytes.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        // Incomplete character at the end: wait for the next token.
                        None => {
                            rest = after;
                            break;
                        }
                        // A maximal invalid subsequence: one U+FFFD, like from_utf8_lossy.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[bad..];
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
