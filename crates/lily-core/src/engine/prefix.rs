//! Prefix reuse (ARCHITECTURE.md §7): saved sequence states keyed by the tokens they hold. A new
//! job resumes from the longest saved state whose tokens begin its prompt and prefills only the
//! rest. DeltaNet state exists only where it was saved, so reuse happens exactly at save points
//! (the caller chooses them: the end of a conversation before the generation prompt).

use crate::backend::{Backend, SnapshotId};

pub struct PrefixCache {
    capacity: usize,
    entries: Vec<Entry>,
    clock: u64,
}

struct Entry {
    tokens: Vec<u32>,
    snap: SnapshotId,
    last_used: u64,
}

impl PrefixCache {
    /// Keeps at most `capacity` saved states (0 disables reuse).
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            capacity,
            entries: Vec::new(),
            clock: 0,
        }
    }

    pub fn enabled(&self) -> bool {
        self.capacity > 0
    }

    /// The longest saved state that is a strict prefix of `prompt` (at least one token must
    /// remain to prefill, so the pending logits are the prompt's own).
    pub fn longest(&mut self, prompt: &[u32]) -> Option<(usize, SnapshotId)> {
        self.clock += 1;
        let clock = self.clock;
        let best = self
            .entries
            .iter_mut()
            .filter(|e| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len())?;
        best.last_used = clock;
        Some((best.tokens.len(), best.snap))
    }

    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Remembers `snap` as the state after `tokens`, evicting the least recently used entry
    /// (its snapshot is dropped from the backend) when full.
    pub fn insert(&mut self, backend: &mut dyn Backend, tokens: Vec<u32>, snap: SnapshotId) {
        if !self.enabled() || self.contains(&tokens) {
            backend.drop_snapshot(snap);
            return;
        }
        if self.entries.len() >= self.capacity {
            if let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
            {
                let evicted = self.entries.swap_remove(oldest);
                backend.drop_snapshot(evicted.snap);
            }
        }
        self.clock += 1;
        self.entries.push(Entry {
            tokens,
            snap,
            last_used: self.clock,
        });
    }

    /// Forgets everything (after a backend failure the saved states are not trusted).
    pub fn clear(&mut self, backend: &mut dyn Backend) {
        for e in self.entries.drain(..) {
            backend.drop_snapshot(e.snap);
        }
    }
}
