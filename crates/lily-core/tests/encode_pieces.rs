//! Long prompts are encoded a piece at a time (`Tokenizer::encode_within`): the pieces' tokens
//! must be exactly those of the whole text, as the `tokenizers` library encodes it in one go.

mod common;

use std::sync::OnceLock;

use lily_core::text::{Bounded, Tokenizer, MAX_PIECE_BYTES};
use proptest::prelude::*;

use common::tokenizer_dir;

fn tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_dir(&tokenizer_dir()).unwrap())
}

/// Fragments prompts are made of: words in several scripts, digits, punctuation, runs of spaces
/// and newlines, added tokens, combining marks, symbols the split regex reads as punctuation.
const FRAGMENTS: &[&str] = &[
    "the",
    "Word",
    "naïve",
    "São",
    "e\u{301}",
    "\u{301}",
    "Привет",
    "мир",
    "中文",
    "北京",
    "。",
    "，",
    "、",
    "！",
    "？",
    "：",
    "12",
    "3",
    "٣",
    "½",
    "Ⅻ",
    "Ⓐ",
    "🄰",
    "😀",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n",
    "\r\n",
    ".",
    ",",
    ";",
    ":",
    "!",
    "?",
    "(",
    ")",
    "[",
    "]",
    "{",
    "}",
    "\"",
    "'",
    "'s",
    "'LL",
    "=",
    "+",
    "-",
    "*",
    "--",
    "_",
    "|",
    "/",
    "<",
    ">",
    "#",
    "//----",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "<function=get_weather>",
    "x",
    "Q",
    "0",
    "é",
    "ß",
    "가",
    "\u{1100}",
    "\u{1161}",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn pieces_encode_to_the_whole_texts_tokens(
        parts in prop::collection::vec(prop::sample::select(FRAGMENTS), 0..120),
        piece_bytes in 1usize..48,
    ) {
        let text = parts.concat();
        let whole = tokenizer().encode(&text).unwrap();
        let pieces = tokenizer().encode_in_pieces(&text, usize::MAX, piece_bytes).unwrap();
        prop_assert_eq!(pieces, Bounded::Ids(whole));
    }
}

#[test]
fn the_bundled_tokenizer_encodes_in_pieces() {
    assert!(tokenizer().encodes_in_pieces());
}

#[test]
fn encoding_stops_at_the_first_piece_over_the_limit() {
    let text = "Some words, and numbers 123.\n".repeat(2000);
    let whole = tokenizer().encode(&text).unwrap();
    let n = whole.len();
    assert_eq!(
        tokenizer().encode_in_pieces(&text, n, 64).unwrap(),
        Bounded::Ids(whole)
    );
    assert_eq!(
        tokenizer().encode_in_pieces(&text, n - 1, 64).unwrap(),
        Bounded::TooManyTokens
    );
    assert_eq!(
        tokenizer().encode_within(&text, n - 1).unwrap(),
        Bounded::TooManyTokens
    );
}

#[test]
fn text_that_cannot_be_cut_for_a_megabyte_is_refused_not_encoded() {
    let run = "x".repeat(MAX_PIECE_BYTES + 1);
    let text = format!("Some words first.\n{run}");
    assert!(matches!(
        tokenizer().encode_within(&text, usize::MAX).unwrap(),
        Bounded::Unbroken(n) if n > MAX_PIECE_BYTES
    ));
    // As much text of the same letters, cut by spaces, is encoded.
    let words = "xxxxxxx ".repeat(MAX_PIECE_BYTES / 8 + 1);
    assert!(matches!(
        tokenizer().encode_within(&words, usize::MAX).unwrap(),
        Bounded::Ids(_)
    ));
}
