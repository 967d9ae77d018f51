//! The allowed-token set of one step: a bitset over the logit rows.

/// Bit `t % 32` of word `t / 32` is set when token `t` is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    vocab: usize,
}

impl TokenMask {
    /// From llguidance's bitset (same layout), cut or padded to `vocab` tokens.
    pub fn from_words(mut words: Vec<u32>, vocab: usize) -> Self {
        words.resize(vocab.div_ceil(32), 0);
        if !vocab.is_multiple_of(32) {
            if let Some(last) = words.last_mut() {
                *last &= (1u32 << (vocab % 32)) - 1;
            }
        }
        TokenMask { words, vocab }
    }

    /// Only `tokens` (those inside the vocabulary).
    pub fn only(vocab: usize, tokens: &[u32]) -> Self {
        let mut words = vec![0u32; vocab.div_ceil(32)];
        for &t in tokens {
            if (t as usize) < vocab {
                words[t as usize / 32] |= 1 << (t % 32);
            }
        }
        TokenMask { words, vocab }
    }

    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.vocab && self.words[token as usize / 32] & (1 << (token % 32)) != 0
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The bitset as it would be uploaded to a device.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// Sets the logit of every token the mask does not allow to −∞.
    pub fn apply(&self, logits: &mut [f32]) {
        for (w, chunk) in self.words.iter().zip(logits.chunks_mut(32)) {
            if *w == u32::MAX {
                continue;
            }
            for (bit, l) in chunk.iter_mut().enumerate() {
                if w & (1 << bit) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if logits.len() > self.vocab {
            logits[self.vocab..].fill(f32::NEG_INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_keeps_exactly_the_allowed_logits() {
        let vocab = 70;
        let mask = TokenMask::only(vocab, &[0, 31, 32, 69, 500]);
        assert_eq!(mask.count(), 4);
        let mut logits: Vec<f32> = (0..vocab).map(|i| (i as f32 * 0.37).sin()).collect();
        let before = logits.clone();
        mask.apply(&mut logits);
        for (i, (&l, &b)) in logits.iter().zip(&before).enumerate() {
            if [0, 31, 32, 69].contains(&i) {
                assert_eq!(l, b);
                assert!(mask.allows(i as u32));
            } else {
                assert_eq!(l, f32::NEG_INFINITY, "token {i}");
                assert!(!mask.allows(i as u32));
            }
        }
        assert!(!mask.allows(500));
    }

    #[test]
    fn words_past_the_vocabulary_are_cleared() {
        let mask = TokenMask::from_words(vec![u32::MAX; 4], 40);
        assert_eq!(mask.words().len(), 2);
        assert_eq!(mask.count(), 40);
    }
}
