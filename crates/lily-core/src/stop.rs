//! When generation ends and why: end-of-sequence ids, user stop strings, max_tokens. Stop strings
//! are matched on the decoded text, so one may span several tokens; text that could still be the
//! start of a stop string is held back until it is known not to be one, and the stop string itself
//! is never emitted (OpenAI semantics).

use crate::parse::scan::{scan, Scan};

/// OpenAI `finish_reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` (or the context) ran out.
    Length,
    /// The model stopped after calling tools.
    ToolCalls,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// Result of feeding text to `StopStrings`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopScan {
    /// Text that is final: no stop string can start in it.
    pub text: String,
    /// A stop string was found; `text` is everything before it and generation must end.
    pub stopped: bool,
}

/// Text-level stop strings of one request.
#[derive(Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    /// The stop string that ended generation (Anthropic reports it as `stop_sequence`).
    matched: Option<usize>,
}

impl StopStrings {
    /// Empty strings are ignored.
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that matched, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    pub fn push(&mut self, delta: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan {
                text: delta.to_owned(),
                stopped: false,
            };
        }
        self.held.push_str(delta);
        let markers: Vec<&str> = self.stops.iter().map(String::as_str).collect();
        match scan(&self.held, &markers) {
            Scan::Found { at, which } => {
                let text = self.held[..at].to_owned();
                self.held.clear();
                self.matched = Some(which);
                StopScan {
                    text,
                    stopped: true,
                }
            }
            Scan::Settled(n) => StopScan {
                text: self.held.drain(..n).collect(),
                stopped: false,
            },
        }
    }

    /// End of generation for another reason: the held text was not a stop string after all.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = s.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&s.flush());
        (out, false)
    }

    #[test]
    fn stop_string_across_pieces_is_cut_and_not_emitted() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["\n\n"], &["line\n", "\nnext"]), ("line".into(), true));
    }

    #[test]
    fn text_is_held_only_while_it_could_be_a_stop_prefix() {
        let mut s = StopStrings::new(vec!["STOP".into()]);
        assert_eq!(s.push("a ST").text, "a ");
        assert_eq!(s.push("x").text, "STx");
        assert_eq!(s.push("S").text, "");
        assert_eq!(s.flush(), "S");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo w"], &["hello world"]),
            ("hel".into(), true)
        );
    }

    #[test]
    fn the_matched_stop_string_is_reported() {
        let mut s = StopStrings::new(vec![String::new(), "END".into(), "lo w".into()]);
        assert_eq!(s.matched(), None);
        assert!(!s.push("hel").stopped);
        assert!(s.push("lo world END").stopped);
        assert_eq!(s.matched(), Some("lo w"));
    }

    #[test]
    fn no_stops_passes_text_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a"]), ("a".into(), false));
    }

    proptest! {
        #[test]
        fn any_split_gives_the_same_result(text in "[abc\n日]{0,40}", stop in "[abc\n日]{1,4}", cuts in proptest::collection::vec(0usize..64, 0..8)) {
            let chars: Vec<char> = text.chars().collect();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (chars.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut last = 0;
            for c in cuts.into_iter().chain([chars.len()]) {
                pieces.push(chars[last..c].iter().collect::<String>());
                last = c;
            }
            let piece_refs: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let want = match text.find(&stop) {
                Some(at) => (text[..at].to_string(), true),
                None => (text.clone(), false),
            };
            prop_assert_eq!(run(&[&stop], &piece_refs), want);
        }
    }
}
