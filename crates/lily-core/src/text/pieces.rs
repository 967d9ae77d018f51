//! Long text cut into pieces that encode, one after the other, to exactly the tokens of the whole:
//! encoding costs about a hundred bytes of memory per byte of text, so a prompt of tens of
//! megabytes is encoded a piece at a time, and given up as soon as it holds more tokens than the
//! context (`Tokenizer::encode_within`).
//!
//! A cut is made only where the whole text's encoding has a boundary whatever surrounds it, for
//! the byte-level BPE of Qwen3.6 (its split regex, MODEL.md §4, NFC normalisation, added tokens
//! matched first):
//! - after a letter or digit and before a space, an ASCII digit, common ASCII punctuation or CJK
//!   punctuation: a run of letters ends at a non-letter and a digit is a pre-token of its own, and
//!   none of these characters occurs inside an added token (`<|im_end|>`: only `<|>_/` and letters);
//! - after a newline and before a character that is not whitespace: the run of whitespace that
//!   ends in newlines is one pre-token, which the next character cannot extend.
//!
//! The text before a cut never ends in whitespace, so the split regex's one look-ahead (`\s+(?!\S)`)
//! sees the same thing at the end of a piece as in the whole. BPE merges stay inside a pre-token,
//! so the pieces' tokens are the whole's. `Tokenizer::from_file` checks this on a sample for the
//! tokenizer it loads, and encodes in one go when it does not hold.

/// Characters a cut may come before, after a letter or digit.
fn opens_a_pretoken(c: char) -> bool {
    matches!(
        c,
        ' ' | '0'
            ..='9'
                | '.'
                | ','
                | ';'
                | ':'
                | '!'
                | '?'
                | '('
                | ')'
                | '['
                | ']'
                | '{'
                | '}'
                | '"'
                | '\''
                | '='
                | '+'
                | '-'
                | '*'
    ) || matches!(
        c,
        '\u{3001}' | '\u{3002}' | '\u{FF01}' | '\u{FF0C}' | '\u{FF1A}' | '\u{FF1B}' | '\u{FF1F}'
    )
}

/// A letter or digit (as the split regex's `\p{L}`, `\p{M}` or `\p{N}` classes see it): Rust's
/// alphanumeric, less the symbols that Unicode calls alphabetic (circled and squared letters,
/// which the regex reads as punctuation).
fn ends_a_word(c: char) -> bool {
    c.is_alphanumeric()
        && !matches!(c, '\u{24B6}'..='\u{24E9}' | '\u{1F130}'..='\u{1F149}' | '\u{1F150}'..='\u{1F169}' | '\u{1F170}'..='\u{1F189}')
}

/// Whether a cut may come between `before` and `after`.
fn cut_between(before: char, after: char) -> bool {
    (ends_a_word(before) && opens_a_pretoken(after)) || (before == '\n' && !after.is_whitespace())
}

/// `text` in pieces of about `target` bytes (longer where no cut is possible sooner), each cut
/// made where `cut_between` allows.
pub(crate) fn pieces(text: &str, target: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let piece = match next_cut(rest, target.max(1)) {
            Some(at) => &rest[..at],
            None => rest,
        };
        rest = &rest[piece.len()..];
        Some(piece)
    })
}

/// The first cut at or after byte `from` of `text` (never at 0 or the end).
fn next_cut(text: &str, from: usize) -> Option<usize> {
    if from >= text.len() {
        return None;
    }
    let start = (from..text.len()).find(|&i| text.is_char_boundary(i))?;
    let mut before = text[..start].chars().next_back()?;
    for (i, after) in text[start..].char_indices() {
        if cut_between(before, after) {
            return Some(start + i);
        }
        before = after;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cover_the_text_and_cut_only_where_allowed() {
        let text = "Hello, world 42!\n\nNext  line\t(x)é，中文。<|im_end|>\n<|im_start|>user";
        for target in 1..text.len() + 2 {
            let parts: Vec<&str> = pieces(text, target).collect();
            assert_eq!(parts.concat(), text, "target {target}");
            for pair in parts.windows(2) {
                let before = pair[0].chars().next_back().unwrap();
                let after = pair[1].chars().next().unwrap();
                assert!(cut_between(before, after), "{before:?} | {after:?}");
                assert!(!pair[0].ends_with(' ') && !pair[0].ends_with('\t'));
            }
        }
        // Never inside an added token, never after whitespace other than a newline.
        for parts in (1..20).map(|t| pieces("<|im_end|>  x<think>", t).collect::<Vec<_>>()) {
            assert_eq!(parts, vec!["<|im_end|>  x<think>"]);
        }
    }
}
