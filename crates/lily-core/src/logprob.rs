//! Log-probabilities from raw logits, as OpenAI reports them: log-softmax over the whole
//! vocabulary, before any sampling transform (temperature, top-p, penalties). Every backend and
//! the engine use this one module: the log-sum-exp is computed once per step (summed in f64: 248K
//! f32 terms would lose ~1e-4 of it), so `k` alternatives cost O(V + k log k), not O(k·V).

use std::cmp::Ordering;

/// The log-softmax of one row of logits, its normaliser computed once.
pub struct LogSoftmax<'a> {
    logits: &'a [f32],
    log_z: f64,
}

impl<'a> LogSoftmax<'a> {
    pub fn new(logits: &'a [f32]) -> Self {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
        LogSoftmax {
            logits,
            log_z: max as f64 + sum.ln(),
        }
    }

    /// log p(`token`); `-inf` for an id outside the vocabulary.
    pub fn at(&self, token: u32) -> f32 {
        self.logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&x| (x as f64 - self.log_z) as f32)
    }

    /// The `k` most likely tokens, most likely first (ties: lower id first), with their
    /// log-probabilities. One selection pass over the vocabulary, then a sort of the `k`.
    pub fn top(&self, k: usize) -> Vec<(u32, f32)> {
        let k = k.min(self.logits.len());
        if k == 0 {
            return Vec::new();
        }
        let logits = self.logits;
        let order = |a: &u32, b: &u32| -> Ordering {
            logits[*b as usize]
                .total_cmp(&logits[*a as usize])
                .then(a.cmp(b))
        };
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
        ids.sort_unstable_by(order);
        ids.into_iter().map(|id| (id, self.at(id))).collect()
    }
}

/// log p(`token`) and the `k` most likely tokens with theirs (none when `k` is 0).
pub fn token_logprob(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let ls = LogSoftmax::new(logits);
    (ls.at(token), ls.top(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct log-softmax in f64, one term at a time: the reference.
    fn direct(logits: &[f32], id: usize) -> f64 {
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        ((logits[id] as f64).exp() / z).ln()
    }

    #[test]
    fn matches_a_direct_log_softmax_and_orders_alternatives() {
        let logits = [0.3f32, -1.2, 2.5, 0.9, 2.4];
        let (lp, top) = token_logprob(&logits, 3, 2);
        assert!((lp as f64 - direct(&logits, 3)).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 4]);
        assert!((top[0].1 as f64 - direct(&logits, 2)).abs() < 1e-6);
    }

    #[test]
    fn top_k_of_a_random_vocabulary_equals_a_full_sort() {
        // A xorshift stream: random logits over a vocabulary of 5,000 with repeated values (ties).
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let logits: Vec<f32> = (0..5000)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) % 2000) as f32 / 100.0 - 10.0
            })
            .collect();
        let mut want: Vec<usize> = (0..logits.len()).collect();
        want.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        for k in [1, 2, 20, 5000, 9000] {
            let (lp, top) = token_logprob(&logits, 17, k);
            assert!((lp as f64 - direct(&logits, 17)).abs() < 1e-5);
            assert_eq!(top.len(), k.min(logits.len()));
            for (i, &(id, l)) in top.iter().enumerate() {
                assert_eq!(id as usize, want[i], "k {k}, rank {i}");
                assert!((l as f64 - direct(&logits, id as usize)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn out_of_vocabulary_and_empty_rows() {
        let (lp, top) = token_logprob(&[1.0, 2.0], 7, 3);
        assert_eq!(lp, f32::NEG_INFINITY);
        assert_eq!(top.len(), 2);
        assert!(token_logprob(&[], 0, 4).1.is_empty());
    }
}
