//! The model's tokenizer (MODEL.md §4): byte-level BPE from `tokenizer.json`, loaded with the
//! `tokenizers` crate for encoding. Decoding goes through our own id → bytes table, which is exact
//! for a byte-level vocabulary and lets `DecodeStream` work one token at a time.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::{DecoderWrapper, Tokenizer as HfTokenizer};

/// Ids of the tokens the engine treats specially (MODEL.md §4, PROVENANCE.md table).
pub mod ids {
    pub const ENDOFTEXT: u32 = 248044;
    pub const IM_START: u32 = 248045;
    pub const IM_END: u32 = 248046;
    pub const TOOL_CALL: u32 = 248058;
    pub const TOOL_CALL_END: u32 = 248059;
    pub const TOOL_RESPONSE: u32 = 248066;
    pub const TOOL_RESPONSE_END: u32 = 248067;
    pub const THINK: u32 = 248068;
    pub const THINK_END: u32 = 248069;
    /// generation_config.json `eos_token_id`: generation ends on either.
    pub const EOS: [u32; 2] = [IM_END, ENDOFTEXT];
}

/// What decoding needs to know about each id: its bytes and whether it is a `special` added token
/// (those are dropped by `skip_special_tokens`; `<think>`, `<tool_call>` are added but not special).
#[derive(Debug)]
pub(crate) struct TokenTable {
    bytes: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

impl TokenTable {
    /// Bytes of `id`, or `None` for ids outside the vocabulary (the padded LM-head rows
    /// 248077..248320 a random model can sample) and for special tokens when `skip_special`.
    pub(crate) fn piece(&self, id: u32, skip_special: bool) -> Option<&[u8]> {
        let i = id as usize;
        let bytes = self.bytes.get(i)?;
        if skip_special && self.special[i] {
            return None;
        }
        Some(bytes)
    }
}

/// Encoder + decoder for Qwen3.6. Cheap to clone (shared inside).
#[derive(Clone)]
pub struct Tokenizer {
    hf: Arc<HfTokenizer>,
    table: Arc<TokenTable>,
    path: PathBuf,
    /// Long text may be encoded in pieces (`pieces.rs`): checked on a sample at load.
    pieces_exact: bool,
}

/// Bytes of text `encode_within` encodes at a time.
const PIECE_BYTES: usize = 64 << 10;

/// Longest piece `encode_within` encodes: text with no place to cut it for longer than this (a
/// megabyte of letters without a space, digit, punctuation or line break) is refused rather than
/// encoded whole at a hundred bytes of memory per byte.
pub const MAX_PIECE_BYTES: usize = 1 << 20;

/// What `encode_within` made of a text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bounded {
    Ids(Vec<u32>),
    /// More tokens than the limit (counted only that far).
    TooManyTokens,
    /// A stretch of this many bytes with no place to cut it (see `MAX_PIECE_BYTES`).
    Unbroken(usize),
}

/// Text that `pieces.rs` cuts in many places, some of them around added tokens and digits.
const PIECES_SAMPLE: &str = "<|im_start|>system\nBe brief, 1st.<|im_end|>\n<|im_start|>user\n\
    Hello, world: 12,345.67 (x=y+1) [a]{b} \"q\" it's -- São Paulo! 北京，中文。\n\n\
    def f(x):\n    return x*2  # two\n\t\tend\n<tool_call>\n<function=f>\n<parameter=x>\n3\n\
    </parameter>\n</function>\n</tool_call><|im_end|>\n<|im_start|>assistant\n<think>\n";

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

impl Tokenizer {
    /// Loads `DIR/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("tokenizer.json"))
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read tokenizer {}", path.display()))?;
        let hf = HfTokenizer::from_bytes(text.as_bytes())
            .map_err(|e| anyhow!("{}: not a valid tokenizer.json: {e}", path.display()))?;
        let table = build_table(&hf).with_context(|| format!("in {}", path.display()))?;
        let mut tokenizer = Tokenizer {
            hf: Arc::new(hf),
            table: Arc::new(table),
            path: path.to_path_buf(),
            pieces_exact: false,
        };
        tokenizer.pieces_exact = tokenizer.pieces_encode_as_the_whole(PIECES_SAMPLE)?;
        if !tokenizer.pieces_exact {
            tracing::warn!(
                "{}: text cut into pieces does not encode as the whole; long prompts are encoded in one go",
                path.display()
            );
        }
        Ok(tokenizer)
    }

    /// Whether long text is encoded in pieces (the check at load held).
    pub fn encodes_in_pieces(&self) -> bool {
        self.pieces_exact
    }

    /// Whether `text`, cut at every place `pieces.rs` allows, encodes to the whole's tokens.
    fn pieces_encode_as_the_whole(&self, text: &str) -> Result<bool> {
        let mut ids = Vec::new();
        for piece in super::pieces::pieces(text, 1) {
            ids.extend(self.encode(piece)?);
        }
        Ok(ids == self.encode(text)?)
    }

    /// Token ids of `text` if there are at most `max_tokens` of them. Long text is encoded a
    /// piece at a time and given up on at the first piece over the limit, so memory and time stay
    /// bounded by the limit rather than by the text (a prompt of tens of megabytes would take
    /// gigabytes encoded whole).
    pub fn encode_within(&self, text: &str, max_tokens: usize) -> Result<Bounded> {
        self.encode_in_pieces(text, max_tokens, PIECE_BYTES)
    }

    /// `encode_within`, encoding about `piece_bytes` of text at a time.
    pub fn encode_in_pieces(
        &self,
        text: &str,
        max_tokens: usize,
        piece_bytes: usize,
    ) -> Result<Bounded> {
        if !self.pieces_exact {
            let ids = self.encode(text)?;
            return Ok(if ids.len() <= max_tokens {
                Bounded::Ids(ids)
            } else {
                Bounded::TooManyTokens
            });
        }
        let mut ids = Vec::new();
        for piece in super::pieces::pieces(text, piece_bytes) {
            if piece.len() > MAX_PIECE_BYTES.max(piece_bytes) {
                return Ok(Bounded::Unbroken(piece.len()));
            }
            ids.extend(self.encode(piece)?);
            if ids.len() > max_tokens {
                return Ok(Bounded::TooManyTokens);
            }
        }
        Ok(Bounded::Ids(ids))
    }

    /// Token ids of `text`. No BOS or other tokens are added; added tokens written in the text
    /// (`<|im_start|>`, `<think>`, …) become their single ids, as in HF `encode(add_special_tokens=False)`.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .hf
            .encode_fast(text, false)
            .map_err(|e| anyhow!("tokenizer {}: cannot encode: {e}", self.path.display()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, as HF `decode` (invalid UTF-8 becomes U+FFFD; unknown ids are skipped).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if let Some(piece) = self.table.piece(id, skip_special_tokens) {
                bytes.extend_from_slice(piece);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The raw bytes of one token (a byte-level token may be part of a UTF-8 character), as
    /// OpenAI log-probabilities report them; `None` outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.table.piece(id, false)
    }

    /// A streaming decoder for one generation (see `DecodeStream`).
    pub fn decode_stream(&self, skip_special_tokens: bool) -> super::DecodeStream {
        super::DecodeStream::new(self.table.clone(), skip_special_tokens)
    }

    /// Ids 0..vocab_size() exist (248,077 for Qwen3.6: 248,044 BPE tokens + 33 added).
    pub fn vocab_size(&self) -> usize {
        self.table.bytes.len()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.hf.token_to_id(token)
    }

    /// Whether `id` is an added token marked `special` (dropped when skipping special tokens).
    pub fn is_special(&self, id: u32) -> bool {
        self.table
            .special
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }
}

/// GPT-2's byte ↔ printable-char map used by byte-level BPE vocabularies: printable Latin-1 bytes
/// stand for themselves, the other 68 bytes are shifted to U+0100.. in byte order.
fn byte_level_char_to_byte() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::with_capacity(256);
    let mut shifted = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            shifted += 1;
            char::from_u32(255 + shifted).unwrap_or('\0')
        };
        map.insert(c, b);
    }
    map
}

fn build_table(hf: &HfTokenizer) -> Result<TokenTable> {
    match hf.get_decoder() {
        Some(DecoderWrapper::ByteLevel(_)) => {}
        Some(other) => {
            bail!("decoder is {other:?}; Lily's decoder expects ByteLevel (MODEL.md §4)")
        }
        None => bail!("no decoder; Lily's decoder expects ByteLevel (MODEL.md §4)"),
    }
    let added = hf.get_added_tokens_decoder();
    let vocab = hf.get_vocab(true);
    let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let mut bytes: Vec<Option<Box<[u8]>>> = vec![None; n];
    let mut special = vec![false; n];
    let char_to_byte = byte_level_char_to_byte();
    for (token, &id) in &vocab {
        let i = id as usize;
        let piece: Vec<u8> = match added.get(&id) {
            // Added tokens are stored as plain text, not in the byte-level alphabet.
            Some(tok) => {
                special[i] = tok.special;
                tok.content.as_bytes().to_vec()
            }
            None => token
                .chars()
                .map(|c| char_to_byte.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .ok_or_else(|| {
                    anyhow!("token {id} {token:?} has a char outside the byte-level alphabet")
                })?,
        };
        bytes[i] = Some(piece.into_boxed_slice());
    }
    let bytes = bytes
        .into_iter()
        .enumerate()
        .map(|(id, b)| {
            b.ok_or_else(|| {
                anyhow!("vocabulary has no token with id {id} (ids must be contiguous)")
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TokenTable { bytes, special })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_is_a_bijection_with_gpt2_anchors() {
        let m = byte_level_char_to_byte();
        assert_eq!(m.len(), 256);
        let mut seen: Vec<u8> = m.values().copied().collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        // Well-known GPT-2 alphabet entries: 'Ġ' is space, 'Ċ' is newline, 'ĉ' is tab.
        assert_eq!(m[&'Ġ'], b' ');
        assert_eq!(m[&'Ċ'], b'\n');
        assert_eq!(m[&'ĉ'], b'\t');
        assert_eq!(m[&'A'], b'A');
    }
}
