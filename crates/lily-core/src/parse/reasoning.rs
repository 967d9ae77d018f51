//! Splits the model's output into reasoning (between `<think>` and `</think>`) and content.
//!
//! With thinking on, the prompt already ends in `<think>\n` (MODEL.md §4), so the output starts
//! inside the reasoning; with thinking off the prompt closed it (`<think>\n\n</think>\n\n`) and
//! the output is content from the first byte. A `<think>` the model writes itself before any
//! content also opens reasoning. Newlines that only frame the tags are dropped, as the chat
//! template drops them (`|trim`) when it renders the turn back: leading and trailing newlines of
//! the reasoning, and the newlines right after `</think>`.

use super::scan::{scan, Scan};
use super::NewlineFrame;

pub const THINK: &str = "<think>";
pub const THINK_END: &str = "</think>";

/// Whether generation continues inside an open `<think>`: the prompt's last turn opened one and
/// did not close it.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    let last_turn = prompt
        .rfind("<|im_start|>")
        .map_or(prompt, |i| &prompt[i..]);
    match (last_turn.rfind(THINK), last_turn.rfind(THINK_END)) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// A settled piece of output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

/// Stream parser, fed text deltas.
#[derive(Debug)]
pub struct ReasoningParser {
    in_reasoning: bool,
    /// Text not yet settled (could be the start of a tag).
    buf: String,
    /// Non-whitespace content was emitted: a later `<think>` is just text.
    content_started: bool,
    reasoning: NewlineFrame,
    /// Drop newlines right after `</think>`.
    content_strip_leading: bool,
}

impl ReasoningParser {
    pub fn new(starts_in_reasoning: bool) -> Self {
        ReasoningParser {
            in_reasoning: starts_in_reasoning,
            buf: String::new(),
            content_started: false,
            reasoning: NewlineFrame::new(true),
            content_strip_leading: false,
        }
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        loop {
            if self.in_reasoning {
                match scan(&self.buf, &[THINK_END]) {
                    Scan::Found { at, .. } => {
                        let text = self.reasoning.feed(&self.buf[..at]);
                        push_reasoning(out, text);
                        self.buf.drain(..at + THINK_END.len());
                        self.in_reasoning = false;
                        self.content_strip_leading = true;
                    }
                    Scan::Settled(n) => {
                        let text = self.reasoning.feed(&self.buf[..n]);
                        push_reasoning(out, text);
                        self.buf.drain(..n);
                        return;
                    }
                }
            } else {
                let markers: &[&str] = if self.content_started { &[] } else { &[THINK] };
                match scan(&self.buf, markers) {
                    Scan::Found { at, .. } if self.buf[..at].trim().is_empty() => {
                        self.buf.drain(..at + THINK.len());
                        self.in_reasoning = true;
                        self.reasoning = NewlineFrame::new(true);
                    }
                    Scan::Found { at, .. } => {
                        // Text came first: this `<think>` is content like any other.
                        let end = at + THINK.len();
                        self.emit_content(end, out);
                    }
                    // Only whitespace so far: a `<think>` may still follow and claim it.
                    Scan::Settled(n)
                        if !self.content_started && self.buf[..n].trim().is_empty() =>
                    {
                        return
                    }
                    Scan::Settled(n) => {
                        self.emit_content(n, out);
                        return;
                    }
                }
            }
        }
    }

    /// End of output: whatever is held is settled as what it was (a trailing partial tag is text).
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        if self.in_reasoning {
            let text = self.reasoning.feed(&self.buf);
            push_reasoning(out, text);
        } else {
            let n = self.buf.len();
            self.emit_content(n, out);
        }
        self.buf.clear();
    }

    fn emit_content(&mut self, n: usize, out: &mut Vec<Piece>) {
        let mut text = &self.buf[..n];
        if self.content_strip_leading {
            text = text.trim_start_matches('\n');
            if !text.is_empty() {
                self.content_strip_leading = false;
            }
        }
        if !text.trim().is_empty() {
            self.content_started = true;
        }
        if !text.is_empty() {
            match out.last_mut() {
                Some(Piece::Content(s)) => s.push_str(text),
                _ => out.push(Piece::Content(text.to_owned())),
            }
        }
        self.buf.drain(..n);
    }
}

fn push_reasoning(out: &mut Vec<Piece>, text: String) {
    if text.is_empty() {
        return;
    }
    match out.last_mut() {
        Some(Piece::Reasoning(s)) => s.push_str(&text),
        _ => out.push(Piece::Reasoning(text)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(start: bool, pieces: &[&str]) -> Vec<Piece> {
        let mut p = ReasoningParser::new(start);
        let mut out = Vec::new();
        for s in pieces {
            p.push(s, &mut out);
        }
        p.finish(&mut out);
        // Merge neighbours so splits do not matter.
        let mut merged: Vec<Piece> = Vec::new();
        for piece in out {
            match (merged.last_mut(), piece) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b)) => a.push_str(&b),
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (_, piece) => merged.push(piece),
            }
        }
        merged
    }

    #[test]
    fn prompt_state_is_read_from_the_last_turn() {
        assert!(prompt_opens_reasoning(
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        ));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_reasoning(
            "<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n"
        ));
    }

    #[test]
    fn thinking_on_output_splits_at_the_closing_tag() {
        let got = run(
            true,
            &[
                "Let me",
                " think.\n",
                "\n</thi",
                "nk>\n\nThe answer",
                " is 4.",
            ],
        );
        assert_eq!(
            got,
            vec![
                Piece::Reasoning("Let me think.".into()),
                Piece::Content("The answer is 4.".into())
            ]
        );
    }

    #[test]
    fn thinking_off_output_is_all_content() {
        let got = run(false, &["Plain answer\n", "with lines."]);
        assert_eq!(
            got,
            vec![Piece::Content("Plain answer\nwith lines.".into())]
        );
    }

    #[test]
    fn model_opened_think_at_start_is_reasoning() {
        let got = run(false, &["<think>\nhmm\n</think>\n\nok"]);
        assert_eq!(
            got,
            vec![Piece::Reasoning("hmm".into()), Piece::Content("ok".into())]
        );
    }

    #[test]
    fn think_tag_after_content_is_text() {
        let got = run(false, &["Use the <think> tag."]);
        assert_eq!(got, vec![Piece::Content("Use the <think> tag.".into())]);
    }

    #[test]
    fn unterminated_reasoning_stays_reasoning() {
        let got = run(true, &["still thinking\n", "</th"]);
        assert_eq!(got, vec![Piece::Reasoning("still thinking\n</th".into())]);
    }

    #[test]
    fn inner_newlines_of_reasoning_are_kept() {
        let got = run(true, &["\na\n\nb\n", "\n</think>c"]);
        assert_eq!(
            got,
            vec![
                Piece::Reasoning("a\n\nb".into()),
                Piece::Content("c".into())
            ]
        );
    }
}
