//! Stop strings over a text stream: text is released only once it cannot be the start of a stop
//! string, so a client never sees part of one; the match itself and everything after are dropped
//! (OpenAI semantics: the stop sequence is not included).

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            done: false,
        }
    }

    /// Adds `text`; returns what is now safe to show and whether a stop string matched.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.done {
            return (String::new(), true);
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let out = self.held[..at].to_string();
            self.held.clear();
            self.done = true;
            return (out, true);
        }
        let keep = self.longest_partial();
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// End of generation: what was held back is plain text after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Bytes at the end of `held` that begin some stop string (on a char boundary).
    fn longest_partial(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            for (i, _) in self.held.char_indices() {
                let tail = &self.held[i..];
                if tail.len() <= best {
                    break;
                }
                if stop.starts_with(tail) {
                    best = tail.len();
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, hit) = m.push(p);
            out.push_str(&text);
            if hit {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_cut_before_the_match() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".to_string(), true)
        );
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(
            run(&["END"], &["abc E", "X", "y"]),
            ("abc EXy".to_string(), false)
        );
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["zz", "b"], &["abzz"]), ("a".to_string(), true));
    }

    #[test]
    fn multibyte_text_is_cut_on_char_boundaries() {
        assert_eq!(
            run(&["é!"], &["caf", "é", "é?"]),
            ("caféé?".to_string(), false)
        );
    }
}
