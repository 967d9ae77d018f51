//! Log-probabilities from raw logits, as OpenAI reports them: log-softmax over the whole
//! vocabulary, before any sampling transform (temperature, top-p, penalties).

/// Log-softmax of `logits` at `token`, and the `k` most likely tokens with theirs.
pub fn token_logprob(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let log_z = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - log_z) as f32;
    let logprob = logits
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&x| lp(x));
    let mut top: Vec<(u32, f32)> = Vec::new();
    if k > 0 && !logits.is_empty() {
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(ids.len());
        ids.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize])
        });
        ids.truncate(k);
        ids.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        top = ids
            .into_iter()
            .map(|id| (id, lp(logits[id as usize])))
            .collect();
    }
    (logprob, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_direct_log_softmax_and_orders_alternatives() {
        let logits = [0.3f32, -1.2, 2.5, 0.9, 2.4];
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        let (lp, top) = token_logprob(&logits, 3, 2);
        assert!((lp as f64 - ((0.9f64).exp() / z).ln()).abs() < 1e-6);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 4]);
        assert!((top[0].1 as f64 - ((2.5f64).exp() / z).ln()).abs() < 1e-6);
    }
}
