//! Constrained decoding: before each sampled token, the set of tokens the output may continue
//! with, as a mask over the vocabulary; tokens outside it get a logit of −∞. Forced tool calls and
//! JSON answers (`OutputSpec`) are grammars run by llguidance (`grammar.rs`, grammar text in
//! `lark.rs`); the reasoning block stays free and the grammar starts after `</think>`.
//!
//! The `Sampler` holds a request's constraint: `Sampler::sample` applies the mask on the host, and
//! a device sampler can take it from `Sampler::next_mask` (`TokenMask::words` is the bitset to
//! upload). Mask time is counted (`MaskStats`) so its cost per decode step can be measured.

mod grammar;
mod lark;
mod mask;

use std::time::Duration;

pub use grammar::{Grammar, Grammars, Reasoning};
pub use lark::OutputSpec;
pub use mask::TokenMask;

/// A per-step restriction on the next token.
pub trait TokenConstraint: Send {
    /// The tokens allowed next; `None` when any token is (the model is still reasoning).
    /// Computed once per step: calls before the next `commit` return the same mask.
    fn mask(&mut self) -> Option<&TokenMask>;
    /// The token that was chosen (whether or not a mask was asked for).
    fn commit(&mut self, token: u32);
    /// What computing the masks has cost so far.
    fn stats(&self) -> MaskStats;
}

/// Masks computed and the time they took.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MaskStats {
    pub masks: usize,
    pub total: Duration,
    /// The slowest single mask.
    pub max: Duration,
}

impl MaskStats {
    pub fn add(&mut self, took: Duration) {
        self.masks += 1;
        self.total += took;
        self.max = self.max.max(took);
    }
}
