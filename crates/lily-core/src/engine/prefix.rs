//! Prefix reuse (ARCHITECTURE.md §7). A finished job's sequence is kept as a *session*: the
//! tokens its KV cache holds and snapshots of its DeltaNet state at chosen lengths (the end of
//! the conversation before the generation prompt, every N tokens of a long prefill, the end of
//! the prompt, the end of the generated turn). A snapshot shares the session's KV rows instead of
//! copying them, so a long conversation with many snapshots holds its KV once.
//!
//! A new job resumes from the deepest snapshot, in any session, whose tokens begin its prompt.
//! The job takes that session over and rewinds it in place when nothing worth keeping lies
//! beyond the snapshot: nothing at all (the agent loop: the next request appends to the last
//! one), or only the states of the request that saved it as its conversation end (the template
//! rewrote that request's turn, e.g. dropped its reasoning, so its later states can never match
//! again). Otherwise it forks, copying the KV prefix into a new sequence, so the other branch
//! keeps its state (two conversations sharing a system prompt).
//!
//! Memory is bounded by a byte budget over every kept sequence and snapshot; the least recently
//! used snapshots are evicted first, and a session left without snapshots is freed.

use anyhow::Result;

use super::job::SeqSource;
use crate::backend::{Backend, SeqId, SnapshotId};

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Jobs that resumed from a snapshot.
    pub hits: u64,
    /// Jobs that found no usable snapshot (reuse on).
    pub misses: u64,
    /// Snapshots evicted to stay within the budget.
    pub evictions: u64,
    /// Bytes held now by kept sequences (KV, state) and their snapshots.
    pub bytes: usize,
    pub snapshots: usize,
    pub sequences: usize,
    /// The budget (0 = reuse off).
    pub budget: usize,
}

pub struct PrefixCache {
    budget: usize,
    sessions: Vec<Session>,
    next_session: u64,
    jobs: u64,
    clock: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    /// A snapshot has succeeded once: the backend can take them.
    snapshotted: bool,
}

/// One kept sequence.
struct Session {
    id: u64,
    seq: SeqId,
    /// Tokens the sequence can hold.
    capacity: usize,
    seq_bytes: usize,
    /// The tokens whose KV rows the sequence holds.
    tokens: Vec<u32>,
    /// By increasing length.
    saved: Vec<Saved>,
    /// A job is running in it: its sequence must not be freed.
    busy: bool,
}

struct Saved {
    len: usize,
    snap: SnapshotId,
    bytes: usize,
    last_used: u64,
    /// The job that saved it.
    job: u64,
    /// Saved at the end of a conversation, before the generation prompt.
    conversation_end: bool,
}

/// The sequence a job runs in and how much of its prompt is already in it.
pub struct Lease {
    pub seq: SeqId,
    /// Prompt tokens resumed from a snapshot (the job prefills from here).
    pub resumed: usize,
    /// How the sequence was got (for the job's timing line).
    pub source: SeqSource,
    /// The session the sequence belongs to; `None` when reuse is off for this job.
    session: Option<u64>,
    job: u64,
}

impl Lease {
    /// Whether states of this job are kept for later ones.
    pub fn keeps(&self) -> bool {
        self.session.is_some()
    }
}

impl PrefixCache {
    /// Keeps at most `budget` bytes of sequences and snapshots (0 disables reuse).
    pub fn new(budget: usize) -> Self {
        PrefixCache {
            budget,
            sessions: Vec::new(),
            next_session: 1,
            jobs: 0,
            clock: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
            snapshotted: false,
        }
    }

    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats {
            hits: self.hits,
            misses: self.misses,
            evictions: self.evictions,
            bytes: self.bytes(),
            snapshots: self.sessions.iter().map(|s| s.saved.len()).sum(),
            sequences: self.sessions.len(),
            budget: self.budget,
        }
    }

    fn bytes(&self) -> usize {
        self.sessions
            .iter()
            .map(|s| s.seq_bytes + s.saved.iter().map(|v| v.bytes).sum::<usize>())
            .sum()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A sequence for a job with `prompt`, needing room for `needed` tokens (allocated with
    /// `capacity` ≥ `needed`), resumed from the deepest snapshot that is a strict prefix of the
    /// prompt (at least one token must remain to prefill, so the pending logits are the
    /// prompt's own). With `reuse` false the job gets a plain sequence and nothing is kept.
    pub fn acquire(
        &mut self,
        backend: &mut dyn Backend,
        prompt: &[u32],
        needed: usize,
        capacity: usize,
        reuse: bool,
    ) -> Result<Lease> {
        self.jobs += 1;
        if !reuse || !self.enabled() {
            return Ok(Lease {
                seq: self.new_seq(backend, capacity)?,
                resumed: 0,
                source: SeqSource::New,
                session: None,
                job: self.jobs,
            });
        }
        let clock = self.tick();
        let best = self
            .sessions
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.busy)
            .filter_map(|(i, s)| {
                let common = common_prefix(&s.tokens, prompt);
                let j = s
                    .saved
                    .iter()
                    .rposition(|v| v.len <= common && v.len < prompt.len())?;
                Some((i, j, s.saved[j].len))
            })
            .max_by_key(|&(_, _, len)| len);
        let Some((i, j, len)) = best else {
            self.misses += 1;
            let seq = self.new_seq(backend, capacity)?;
            return Ok(self.open(backend, seq, capacity, Vec::new()));
        };
        self.hits += 1;
        let source = &mut self.sessions[i];
        source.saved[j].last_used = clock;
        let snap = source.saved[j].snap;
        let at = &source.saved[j];
        let beyond = &source.saved[j + 1..];
        let disposable =
            beyond.is_empty() || (at.conversation_end && beyond.iter().all(|v| v.job == at.job));
        if disposable && source.capacity >= needed {
            // Rewind in place; the backend drops the longer snapshots.
            backend.restore(source.seq, snap)?;
            for v in source.saved.drain(j + 1..) {
                backend.drop_snapshot(v.snap);
            }
            source.tokens.truncate(len);
            source.busy = true;
            return Ok(Lease {
                seq: source.seq,
                resumed: len,
                source: SeqSource::Rewound,
                session: Some(source.id),
                job: self.jobs,
            });
        }
        let source_id = source.id;
        let seq = match self.new_seq_keeping(backend, capacity, source_id) {
            Some(seq) => seq,
            None => {
                // No room for a copy: run without reuse rather than fail.
                self.hits -= 1;
                self.misses += 1;
                let seq = self.new_seq(backend, capacity)?;
                return Ok(self.open(backend, seq, capacity, Vec::new()));
            }
        };
        if let Err(e) = backend.restore(seq, snap) {
            backend.free_seq(seq);
            return Err(e);
        }
        let mut lease = self.open(backend, seq, capacity, prompt[..len].to_vec());
        lease.resumed = len;
        lease.source = SeqSource::Forked;
        Ok(lease)
    }

    fn open(
        &mut self,
        backend: &mut dyn Backend,
        seq: SeqId,
        capacity: usize,
        tokens: Vec<u32>,
    ) -> Lease {
        let id = self.next_session;
        self.next_session += 1;
        self.sessions.push(Session {
            id,
            seq,
            capacity,
            seq_bytes: backend.seq_bytes(seq),
            tokens,
            saved: Vec::new(),
            busy: true,
        });
        Lease {
            seq,
            resumed: 0,
            source: SeqSource::New,
            session: Some(id),
            job: self.jobs,
        }
    }

    /// A new sequence; if the backend is out of memory, the kept sessions are freed and it is
    /// asked once more.
    fn new_seq(&mut self, backend: &mut dyn Backend, capacity: usize) -> Result<SeqId> {
        match backend.new_seq(capacity) {
            Ok(seq) => Ok(seq),
            Err(e) if self.sessions.iter().any(|s| !s.busy) => {
                tracing::warn!("new sequence failed ({e:#}); freeing kept prefixes and retrying");
                self.free_idle(backend, None);
                backend.new_seq(capacity)
            }
            Err(e) => Err(e),
        }
    }

    /// Like `new_seq`, but never frees session `keep` (the fork source); `None` if no room.
    fn new_seq_keeping(
        &mut self,
        backend: &mut dyn Backend,
        capacity: usize,
        keep: u64,
    ) -> Option<SeqId> {
        if let Ok(seq) = backend.new_seq(capacity) {
            return Some(seq);
        }
        self.free_idle(backend, Some(keep));
        backend.new_seq(capacity).ok()
    }

    fn free_idle(&mut self, backend: &mut dyn Backend, keep: Option<u64>) {
        let mut kept = Vec::new();
        for s in self.sessions.drain(..) {
            if s.busy || Some(s.id) == keep {
                kept.push(s);
            } else {
                self.evictions += s.saved.len() as u64;
                free_session(backend, s);
            }
        }
        self.sessions = kept;
    }

    /// Saves the job's state now: the sequence holds `tokens` (the end of the conversation,
    /// before the generation prompt, if `conversation_end`). Skipped when reuse is off for the
    /// job or a snapshot that long is already kept. A backend that cannot snapshot turns reuse
    /// off.
    pub fn save(
        &mut self,
        backend: &mut dyn Backend,
        lease: &Lease,
        tokens: &[u32],
        conversation_end: bool,
    ) {
        let Some(i) = self.index(lease) else { return };
        let s = &mut self.sessions[i];
        if s.saved.last().is_some_and(|v| v.len >= tokens.len()) {
            return;
        }
        match backend.snapshot(s.seq) {
            Ok(snap) => {
                self.snapshotted = true;
                let clock = self.tick();
                let s = &mut self.sessions[i];
                s.tokens = tokens.to_vec();
                s.seq_bytes = backend.seq_bytes(s.seq);
                s.saved.push(Saved {
                    len: tokens.len(),
                    snap,
                    bytes: backend.snapshot_bytes(snap),
                    last_used: clock,
                    job: lease.job,
                    conversation_end,
                });
                self.evict(backend);
            }
            // A backend that has snapshotted before is short of memory: free what is kept
            // and go on without this one.
            Err(e) if self.snapshotted => {
                tracing::warn!("snapshot failed ({e:#}); freeing the kept prefixes");
                self.free_idle(backend, None);
            }
            Err(e) => {
                tracing::warn!("prefix reuse off: the backend cannot snapshot ({e:#})");
                self.clear(backend);
                self.budget = 0;
            }
        }
    }

    /// The job is over: its sequence is kept for later jobs (or freed if it has no snapshot or
    /// reuse was off for it).
    pub fn release(&mut self, backend: &mut dyn Backend, lease: Lease) {
        let Some(i) = self.index(&lease) else {
            backend.free_seq(lease.seq);
            return;
        };
        let s = &mut self.sessions[i];
        s.busy = false;
        s.seq_bytes = backend.seq_bytes(s.seq);
        if s.saved.is_empty() {
            let s = self.sessions.swap_remove(i);
            free_session(backend, s);
        }
        self.evict(backend);
    }

    fn index(&self, lease: &Lease) -> Option<usize> {
        let id = lease.session?;
        self.sessions.iter().position(|s| s.id == id)
    }

    /// Evicts least recently used snapshots until the budget holds; an idle session left
    /// without snapshots is freed with them.
    fn evict(&mut self, backend: &mut dyn Backend) {
        while self.bytes() > self.budget {
            let oldest = self
                .sessions
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.saved.iter().enumerate().map(move |(j, v)| (i, j, v)))
                .min_by_key(|(_, _, v)| v.last_used)
                .map(|(i, j, _)| (i, j));
            let Some((i, j)) = oldest else { break };
            let v = self.sessions[i].saved.remove(j);
            backend.drop_snapshot(v.snap);
            self.evictions += 1;
            let s = &self.sessions[i];
            if s.saved.is_empty() && !s.busy {
                let s = self.sessions.swap_remove(i);
                free_session(backend, s);
            }
        }
    }

    /// Forgets everything (after a backend failure the saved states are not trusted). Leases
    /// still out are freed by their `release`.
    pub fn clear(&mut self, backend: &mut dyn Backend) {
        let mut kept = Vec::new();
        for mut s in self.sessions.drain(..) {
            for v in s.saved.drain(..) {
                backend.drop_snapshot(v.snap);
            }
            if s.busy {
                kept.push(s);
            } else {
                backend.free_seq(s.seq);
            }
        }
        self.sessions = kept;
    }
}

fn free_session(backend: &mut dyn Backend, s: Session) {
    for v in s.saved {
        backend.drop_snapshot(v.snap);
    }
    backend.free_seq(s.seq);
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
