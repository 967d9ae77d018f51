//! Sampling parameters and the host sampler. `SamplingParams` is a plain struct so a GPU sampler
//! can copy it as is and apply the same steps in the same order:
//!
//! 1. `logit_bias` is added to the raw logits;
//! 2. repetition penalty (HF/CTRL): for every token seen in the prompt or the output, a positive
//!    logit is divided by `repetition_penalty`, a negative one multiplied;
//! 3. presence / frequency penalties (OpenAI): `logit -= presence·[count>0] + frequency·count`
//!    over the tokens generated so far;
//! 4. `temperature == 0` → argmax of the penalised logits (greedy); otherwise logits / temperature;
//! 5. top_k (0 = off), then top_p (smallest set of most likely tokens whose mass reaches top_p),
//!    then min_p (drop tokens whose probability is below min_p × the best one's), HF's order;
//! 6. one uniform draw from the seeded xoshiro256** generator picks a token from what is left.
//!
//! Steps 2–3 need the history, which `Sampler` keeps (`accept`, `with_prompt`).
//!
//! A request with a constraint (a forced tool call, a JSON schema: `constrain`) also has a mask
//! of allowed tokens per step; it is applied first, before step 1 (disallowed logits become −∞).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::constrain::{MaskStats, TokenConstraint, TokenMask};

/// Every knob of token selection. `temperature == 0` means greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables top-k.
    pub top_k: u32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// 1.0 disables it.
    pub repetition_penalty: f32,
    /// Added to the logit of each listed token before anything else (OpenAI range −100..100).
    pub logit_bias: Vec<(u32, f32)>,
    /// Same seed + same logits → same tokens, on any platform.
    pub seed: u64,
}

/// Bits of a device sampler's history word (`Sampler::device_history`): seen by the repetition
/// penalty, and the count of times generated.
pub const HISTORY_SEEN: u32 = 0x8000_0000;
pub const HISTORY_COUNT: u32 = 0x7fff_ffff;

impl SamplingParams {
    /// Greedy with nothing that changes the logits first (no penalty, no logit_bias): the token
    /// is the argmax of the raw logits, which a GPU backend picks on the device.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0
            && self.logit_bias.is_empty()
            && self.presence_penalty == 0.0
            && self.frequency_penalty == 0.0
            && self.repetition_penalty == 1.0
    }

    /// The logit_bias entries inside `vocab`, sorted by id stably (repeated ids keep the
    /// request's order, in which the host adds them): the table a device sampler searches.
    pub fn sorted_logit_bias(&self, vocab: usize) -> Vec<(u32, f32)> {
        let mut bias: Vec<(u32, f32)> = self
            .logit_bias
            .iter()
            .copied()
            .filter(|&(id, _)| (id as usize) < vocab)
            .collect();
        bias.sort_by_key(|e| e.0);
        bias
    }

    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }

    /// The model card's recommendation (MODEL.md §4, "general" rows): thinking T 1.0, top_p 0.95;
    /// non-thinking T 0.7, top_p 0.8; both top_k 20, min_p 0, presence 1.5, repetition 1.0.
    pub fn model_defaults(thinking: bool) -> Self {
        let (temperature, top_p) = if thinking { (1.0, 0.95) } else { (0.7, 0.8) };
        SamplingParams {
            temperature,
            top_p,
            top_k: 20,
            min_p: 0.0,
            presence_penalty: 1.5,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }

    /// Checks the ranges the API accepts; the error names the field. `vocab` bounds logit_bias ids.
    pub fn validate(&self, vocab: usize) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(format!(
                "temperature must be between 0 and 2, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be between 0 and 1, got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return Err(format!(
                "repetition_penalty must be in (0, 10], got {}",
                self.repetition_penalty
            ));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab {
                return Err(format!(
                    "logit_bias token id {id} is outside the vocabulary (0..{vocab})"
                ));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(format!(
                    "logit_bias for token {id} must be between -100 and 100, got {bias}"
                ));
            }
        }
        Ok(())
    }
}

/// A request's sampling fields as the API received them; `None` = the field was left out and
/// the model card's default (`SamplingParams::model_defaults`) applies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 disables top-k (map vLLM's −1 to 0 before this).
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<Vec<(u32, f32)>>,
    pub seed: Option<u64>,
}

impl SamplingRequest {
    /// The parameters to sample with. `thinking` picks the card's row (chat requests: whether the
    /// template's `enable_thinking` is on); `random_seed` is used when the request has no seed.
    pub fn resolve(&self, thinking: bool, random_seed: u64) -> SamplingParams {
        let d = SamplingParams::model_defaults(thinking);
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k: self.top_k.unwrap_or(d.top_k),
            min_p: self.min_p.unwrap_or(d.min_p),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            logit_bias: self.logit_bias.clone().unwrap_or_default(),
            seed: self.seed.unwrap_or(random_seed),
        }
    }
}

/// Stateful sampler: parameters, random state, the token history the penalties need, and the
/// request's constraint if it has one.
pub struct Sampler {
    pub params: SamplingParams,
    rng: Xoshiro256,
    /// Generated tokens and how often each occurred (presence / frequency penalties).
    output_counts: HashMap<u32, u32>,
    /// Prompt and generated tokens, once each (repetition penalty).
    seen: Vec<u32>,
    seen_set: std::collections::HashSet<u32>,
    /// Scratch: candidate (token, logit) pairs, reused between calls.
    candidates: Vec<(u32, f32)>,
    constraint: Option<Box<dyn TokenConstraint>>,
    /// This sampler's identity and the tokens it has accepted (`history_stamp`).
    stamp: HistoryStamp,
}

/// Which sampler a history is (a number no other sampler of this process has) and how many
/// tokens it had accepted: a device copy of the history (`device_history`) stays the sampler's
/// own while the stamp is unchanged, or as far as the device has bumped it for the tokens it
/// picked itself. A GPU backend keeps a sampler's device state between calls on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HistoryStamp {
    pub sampler: u64,
    pub accepted: u64,
}

/// The next `HistoryStamp::sampler`.
static NEXT_SAMPLER: AtomicU64 = AtomicU64::new(0);

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("constrained", &self.constraint.is_some())
            .finish()
    }
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Xoshiro256::seeded(params.seed);
        Sampler {
            params,
            rng,
            output_counts: HashMap::new(),
            seen: Vec::new(),
            seen_set: Default::default(),
            candidates: Vec::new(),
            constraint: None,
            stamp: HistoryStamp {
                sampler: NEXT_SAMPLER.fetch_add(1, Ordering::Relaxed),
                accepted: 0,
            },
        }
    }

    /// Which sampler this is and how many tokens it has accepted (see `HistoryStamp`).
    pub fn history_stamp(&self) -> HistoryStamp {
        self.stamp
    }

    /// Restricts every token this sampler picks to what `constraint` allows.
    pub fn constrained(mut self, constraint: Option<Box<dyn TokenConstraint>>) -> Self {
        self.constraint = constraint;
        self
    }

    /// Whether picks are restricted (a device sampler must then apply `next_mask`, or leave the
    /// pick to `sample` on the host).
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// The tokens allowed for the next pick, or `None` when any token is. Computed once per
    /// step (until `accept`).
    pub fn next_mask(&mut self) -> Option<&TokenMask> {
        self.constraint.as_mut()?.mask()
    }

    /// What the constraint's masks have cost so far (zero without one).
    pub fn mask_stats(&self) -> MaskStats {
        self.constraint
            .as_ref()
            .map(|c| c.stats())
            .unwrap_or_default()
    }

    /// A sampler whose repetition penalty also covers the prompt's tokens (as HF and vLLM do).
    pub fn with_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        let mut s = Self::new(params);
        if s.params.repetition_penalty != 1.0 {
            for &t in prompt {
                s.remember(t);
            }
        }
        s
    }

    /// Picks the next token from raw logits (see the module comment for the exact steps).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if logits.is_empty() {
            return 0;
        }
        let mut adjusted = None;
        if let Some(mask) = self.constraint.as_mut().and_then(|c| c.mask()) {
            let mut l = logits.to_vec();
            mask.apply(&mut l);
            adjusted = Some(l);
        }
        if self.needs_adjusting() {
            let mut l = adjusted.unwrap_or_else(|| logits.to_vec());
            self.adjust(&mut l);
            adjusted = Some(l);
        }
        let logits = adjusted.as_deref().unwrap_or(logits);
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        self.fill_candidates(logits);
        let u = self.next_uniform();
        pick(&self.candidates, u)
    }

    /// The uniform in [0, 1) that `sample` would draw next (step 6), for a device sampler that
    /// applies steps 1–5 itself: calling this instead of `sample` keeps the random stream the
    /// same. `sample` draws exactly one per call when `temperature > 0`, none when greedy.
    pub fn next_uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// Generated tokens and how often each occurred (what presence/frequency penalties read).
    pub fn output_counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.output_counts.iter().map(|(&t, &n)| (t, n))
    }

    /// Tokens the repetition penalty covers (prompt and output, once each; empty when the
    /// penalty is 1).
    pub fn seen_tokens(&self) -> &[u32] {
        &self.seen
    }

    /// The history a device sampler keeps, one word per token of `vocab`: how often the token
    /// was generated (`HISTORY_COUNT` bits, saturating) and `HISTORY_SEEN` when the repetition
    /// penalty covers it (the CUDA and wgpu samplers' layout).
    pub fn device_history(&self, vocab: usize) -> Vec<u32> {
        let mut hist = vec![0u32; vocab];
        for (t, n) in self.output_counts() {
            if let Some(h) = hist.get_mut(t as usize) {
                *h = n.min(HISTORY_COUNT);
            }
        }
        for &t in self.seen_tokens() {
            if let Some(h) = hist.get_mut(t as usize) {
                *h |= HISTORY_SEEN;
            }
        }
        hist
    }

    /// Records a token that was generated (for presence/frequency/repetition penalties, and the
    /// constraint's state).
    pub fn accept(&mut self, token: u32) {
        if let Some(c) = self.constraint.as_mut() {
            c.commit(token);
        }
        self.stamp.accepted += 1;
        *self.output_counts.entry(token).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 {
            self.remember(token);
        }
    }

    fn remember(&mut self, token: u32) {
        if self.seen_set.insert(token) {
            self.seen.push(token);
        }
    }

    fn needs_adjusting(&self) -> bool {
        let p = &self.params;
        !p.logit_bias.is_empty()
            || (p.repetition_penalty != 1.0 && !self.seen.is_empty())
            || ((p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
                && !self.output_counts.is_empty())
    }

    /// Steps 1–3: bias, repetition penalty, presence/frequency penalties.
    fn adjust(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        for (&t, &n) in &self.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * n as f32;
            }
        }
    }

    /// Steps 4–5: the surviving candidates with their unnormalised probabilities, most likely
    /// first.
    fn fill_candidates(&mut self, logits: &[f32]) {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let c = &mut self.candidates;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                // Masked-out tokens (−∞) can never be picked.
                .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if c.is_empty() {
            c.push((0, 0.0));
        }
        // Logits first, weights later: the order is the same.
        let heaviest_first =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = p.top_k as usize;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, heaviest_first);
            c.truncate(k);
        }
        // Probabilities relative to the best token (exp(0) = 1), normalised at the draw.
        let max = c.iter().map(|e| e.1).fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0f64;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            total += e.1 as f64;
        }
        if p.top_p < 1.0 {
            // Tokens lighter than (1 − top_p)·total / n can never be in the nucleus: all of them
            // together weigh less than the 1 − top_p the nucleus leaves out. Dropping them first
            // spares sorting the whole vocabulary.
            let floor = ((1.0 - p.top_p as f64) * total / c.len() as f64) as f32;
            c.retain(|e| e.1 >= floor);
        }
        c.sort_unstable_by(heaviest_first);
        if p.top_p < 1.0 {
            let target = p.top_p as f64 * total;
            let mut mass = 0.0f64;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                mass += e.1 as f64;
                if mass >= target {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
        }
        if p.min_p > 0.0 {
            // The best token has relative probability 1.
            let floor = p.min_p;
            let keep = c.iter().take_while(|e| e.1 >= floor).count().max(1);
            c.truncate(keep);
        }
    }
}

/// Step 6: inverse-CDF pick with `u` in [0, 1) over unnormalised weights.
fn pick(candidates: &[(u32, f32)], u: f64) -> u32 {
    let total: f64 = candidates.iter().map(|e| e.1 as f64).sum();
    let mut target = u * total;
    for &(id, w) in candidates {
        target -= w as f64;
        if target < 0.0 {
            return id;
        }
    }
    candidates.last().map_or(0, |e| e.0)
}

/// Index of the largest logit (the first one on ties); NaN never wins.
pub fn argmax(xs: &[f32]) -> u32 {
    // The largest value first, in independent lanes the compiler vectorises (`f32::max` skips
    // NaN), then where it first occurs: a quarter of the time of one compare-and-branch pass over
    // a 248K vocabulary, which a host-sampled decode step pays per token.
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x);
        }
    }
    let max = tail
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    match xs.iter().position(|&x| x == max) {
        Some(i) => i as u32,
        // Nothing but NaN.
        None => argmax_scalar(xs),
    }
}

/// `argmax` as one pass; the reference for the lane version.
fn argmax_scalar(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] || xs[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// xoshiro256** seeded through splitmix64: small, fast, identical on every platform.
#[derive(Clone, Debug)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seeded(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Xoshiro256 {
            s: [next(), next(), next(), next()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests;
