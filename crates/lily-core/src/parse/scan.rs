//! Finding markers (`</think>`, `<tool_call>`, a user's stop string) in text that arrives in
//! pieces. A marker may be split across pieces, so the end of the buffer that could still be the
//! start of a marker is held back; everything before it is settled.

/// Where the first marker is, or how much of the buffer is settled if none is there yet.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// `markers[which]` starts at byte `at` (the earliest start; the first listed on a tie).
    Found { at: usize, which: usize },
    /// No marker; `buf[..settled]` cannot be part of one, `buf[settled..]` might be.
    Settled(usize),
}

pub fn scan(buf: &str, markers: &[&str]) -> Scan {
    let mut best: Option<(usize, usize)> = None;
    for (which, m) in markers.iter().enumerate() {
        if m.is_empty() {
            continue;
        }
        if let Some(at) = buf.find(m) {
            if best.is_none_or(|(b, _)| at < b) {
                best = Some((at, which));
            }
        }
    }
    if let Some((at, which)) = best {
        return Scan::Found { at, which };
    }
    Scan::Settled(buf.len() - partial_suffix(buf, markers))
}

/// Length of the longest proper suffix of `buf` that is a prefix of some marker (char-aligned).
fn partial_suffix(buf: &str, markers: &[&str]) -> usize {
    let mut longest = 0;
    for m in markers {
        let max = m.len().saturating_sub(1).min(buf.len());
        for len in (longest + 1..=max).rev() {
            let start = buf.len() - len;
            if buf.is_char_boundary(start) && m.as_bytes().starts_with(&buf.as_bytes()[start..]) {
                longest = len;
                break;
            }
        }
    }
    longest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_earliest_marker() {
        assert_eq!(
            scan("ab</think>cd<tool_call>", &["<tool_call>", "</think>"]),
            Scan::Found { at: 2, which: 1 }
        );
    }

    #[test]
    fn holds_back_a_possible_marker_start() {
        assert_eq!(scan("hello </thi", &["</think>"]), Scan::Settled(6));
        assert_eq!(
            scan("hello <", &["</think>", "<tool_call>"]),
            Scan::Settled(6)
        );
        assert_eq!(scan("hello", &["</think>"]), Scan::Settled(5));
        assert_eq!(scan("日本", &["本語"]), Scan::Settled(3));
    }
}
