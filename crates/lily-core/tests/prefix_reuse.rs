//! Prefix reuse on the CPU backend with a tiny synthetic model (issue 14): conversations resume
//! from kept states and prefill only their new tokens, answer exactly as without reuse, stay
//! correct when a tiny budget evicts, and never see each other's state.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use lily_core::backend::{Backend, Flow, SeqId, SnapshotId, StepOut};
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::config::ModelConfig;
use lily_core::cpu::CpuBackend;
use lily_core::engine::{
    Engine, EngineOptions, FinishReason, Job, JobSink, Outcome, SeqSource, Usage,
};
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};
use lily_core::weights::ModelWeights;

fn tiny() -> Arc<ModelWeights> {
    // Tests run in parallel: one directory each.
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "lily-prefix-reuse-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthOptions {
        preset: Preset::Tiny,
        format: SynthFormat::Mlx,
        seed: 3,
        out: dir.clone(),
        tokenizer: None,
        layers: None,
    })
    .expect("synth tiny");
    let mut w = load(&dir, &LoadOptions::default()).expect("load tiny");
    let _ = std::fs::remove_dir_all(&dir);
    // Random weights may pick an end-of-sequence id; these tests want every turn to run its
    // max_tokens, so no id ends generation.
    w.config.eos_ids.clear();
    Arc::new(w)
}

/// The CPU backend, counting the prompt tokens it is asked to prefill; its snapshots fail while
/// `full` is set (a device out of memory). With `feeds_stop`, `decode` also feeds the token that
/// ended generation by `Flow::Stop` (as the CUDA backend's pipelined decode does, which queues
/// each token's forward pass before reporting it: `Backend::decode`), except the `n`-th and
/// past the context, as that backend.
struct Counting {
    cpu: CpuBackend,
    prefilled: Arc<AtomicUsize>,
    full: Arc<AtomicBool>,
    feeds_stop: bool,
    /// Each sequence's context, for `feeds_stop`.
    contexts: std::collections::HashMap<SeqId, usize>,
}

impl Backend for Counting {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }
    fn describe(&self) -> String {
        self.cpu.describe()
    }
    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        let seq = self.cpu.new_seq(max_ctx)?;
        self.contexts.insert(seq, max_ctx);
        Ok(seq)
    }
    fn free_seq(&mut self, seq: SeqId) {
        self.cpu.free_seq(seq)
    }
    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        self.cpu.seq_len(seq)
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.prefilled.fetch_add(tokens.len(), Ordering::SeqCst);
        self.cpu.prefill(seq, tokens)
    }
    fn prefill_chunk(&self) -> usize {
        self.cpu.prefill_chunk()
    }
    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        self.cpu.logits(seq)
    }
    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        let (mut reported, mut last, mut stopped) = (0, None, false);
        self.cpu
            .decode(seq, sampler, n, top_logprobs, &mut |step: &StepOut| {
                reported += 1;
                last = Some(step.token);
                let flow = on_token(step);
                stopped = flow == Flow::Stop;
                flow
            })?;
        let room = self.cpu.seq_len(seq)? < self.contexts.get(&seq).copied().unwrap_or(0);
        if let (true, true, true, Some(token)) =
            (self.feeds_stop, stopped && reported < n, room, last)
        {
            self.cpu.prefill(seq, &[token])?;
        }
        Ok(())
    }
    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId> {
        if self.full.load(Ordering::SeqCst) {
            anyhow::bail!("out of device memory");
        }
        self.cpu.snapshot(seq)
    }
    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()> {
        self.cpu.restore(seq, snap)
    }
    fn drop_snapshot(&mut self, snap: SnapshotId) {
        self.cpu.drop_snapshot(snap)
    }
    fn seq_bytes(&self, seq: SeqId) -> usize {
        self.cpu.seq_bytes(seq)
    }
    fn snapshot_bytes(&self, snap: SnapshotId) -> usize {
        self.cpu.snapshot_bytes(snap)
    }
}

struct Server {
    engine: Engine,
    prefilled: Arc<AtomicUsize>,
    full: Arc<AtomicBool>,
}

fn server(w: &Arc<ModelWeights>, budget: usize, snapshot_every: usize) -> Server {
    server_feeding(w, budget, snapshot_every, false)
}

/// `server`, its backend feeding the token that ends generation if `feeds_stop` (`Counting`).
fn server_feeding(
    w: &Arc<ModelWeights>,
    budget: usize,
    snapshot_every: usize,
    feeds_stop: bool,
) -> Server {
    let prefilled = Arc::new(AtomicUsize::new(0));
    let full = Arc::new(AtomicBool::new(false));
    let backend = Counting {
        // A small chunk, so prompts cross chunk boundaries too.
        cpu: CpuBackend::new(w.clone()).with_prefill_chunk(16),
        prefilled: prefilled.clone(),
        full: full.clone(),
        feeds_stop,
        contexts: Default::default(),
    };
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            max_queue: 4,
            ctx_size: 1024,
            prefix_cache_bytes: budget,
            snapshot_every,
            max_batch: None,
        },
    )
    .expect("engine");
    Server {
        engine,
        prefilled,
        full,
    }
}

enum Seen {
    Token(u32),
    /// Boxed: an outcome (usage and timings) is large.
    Done(Box<Outcome>),
}

/// Sends what it sees; stops the generation at the token that leaves `left` at zero (a client
/// that has seen its stop string), never when `left` starts at `usize::MAX`.
struct Sink(Sender<Seen>, usize);

impl JobSink for Sink {
    fn is_cancelled(&self) -> bool {
        false
    }
    fn token(&mut self, step: &StepOut) -> Flow {
        let _ = self.0.send(Seen::Token(step.token));
        self.1 = self.1.saturating_sub(1);
        if self.1 == 0 {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }
    fn finished(&mut self, outcome: Outcome) {
        let _ = self.0.send(Seen::Done(Box::new(outcome)));
    }
}

struct Answer {
    tokens: Vec<u32>,
    usage: Usage,
    /// Prompt tokens the backend was asked to prefill for this job.
    prefilled: usize,
}

/// Tokens that end a "conversation" and open the answer, like the chat template's generation
/// prompt: a request saves its state just before them.
const GENERATION_PROMPT: [u32; 3] = [7, 11, 13];

impl Server {
    /// One greedy request; `max_tokens` tokens always come back (no end-of-sequence id).
    fn ask(&self, prompt: &[u32], max_tokens: usize) -> Answer {
        self.ask_stopping(prompt, max_tokens, usize::MAX)
    }

    /// One greedy request the client stops after `stop_after` tokens (if at most `max_tokens`:
    /// `FinishReason::Stop`, else `Length`).
    fn ask_stopping(&self, prompt: &[u32], max_tokens: usize, stop_after: usize) -> Answer {
        let before = self.prefilled.load(Ordering::SeqCst);
        let (tx, rx) = channel();
        let job = Job {
            prompt: prompt.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens,
            top_logprobs: 0,
            prompt_logprobs: false,
            save_prefix_at: Some(prompt.len() - GENERATION_PROMPT.len()),
            constraint: None,
            arrived: Some(Instant::now()),
            sink: Box::new(Sink(tx, stop_after)),
        };
        self.engine.submit(job).expect("queue");
        let mut tokens = Vec::new();
        loop {
            match rx.recv_timeout(Duration::from_secs(120)).expect("answer") {
                Seen::Token(t) => tokens.push(t),
                Seen::Done(outcome) => match *outcome {
                    Outcome::Done { reason, usage } => {
                        let (want, n) = if stop_after <= max_tokens {
                            (FinishReason::Stop, stop_after)
                        } else {
                            (FinishReason::Length, max_tokens)
                        };
                        assert_eq!(reason, want);
                        assert_eq!(tokens.len(), n);
                        return Answer {
                            tokens,
                            usage,
                            prefilled: self.prefilled.load(Ordering::SeqCst) - before,
                        };
                    }
                    other => panic!("{other:?}"),
                },
            }
        }
    }
}

/// Random token ids (xorshift), never the generation prompt's.
struct Tokens(u64);

impl Tokens {
    fn take(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| loop {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                let t = (self.0 % vocab as u64) as u32;
                if !GENERATION_PROMPT.contains(&t) {
                    break t;
                }
            })
            .collect()
    }
}

/// An agent conversation in tokens. Each request is the last one's prompt and answer (as a client
/// sends it back) plus new tokens (a tool result, a user turn) and the generation prompt; a
/// `rewrite` turn instead replaces the last answer by other tokens, as the chat template does
/// when it drops past reasoning, so only the state before the last generation prompt is reusable.
#[derive(Default)]
struct Conversation {
    prompt: Vec<u32>,
    answer: Vec<u32>,
}

impl Conversation {
    fn next(&mut self, rng: &mut Tokens, vocab: usize, new: usize, rewrite: bool) -> Vec<u32> {
        let mut p = if self.prompt.is_empty() {
            Vec::new()
        } else if rewrite {
            let end = self.prompt.len() - GENERATION_PROMPT.len();
            let mut p = self.prompt[..end].to_vec();
            // The rewritten turn starts with a token the answer did not.
            let first = (self.answer[0] + 1) % vocab as u32;
            p.push(first);
            p.extend(rng.take(3, vocab));
            p
        } else {
            [&self.prompt[..], &self.answer[..]].concat()
        };
        p.extend(rng.take(new, vocab));
        p.extend(GENERATION_PROMPT);
        p
    }
}

#[test]
fn each_turn_of_an_agent_conversation_prefills_only_its_new_tokens_and_answers_as_without_reuse() {
    let w = tiny();
    let vocab = w.config.vocab;
    let on = server(&w, 1 << 30, 0);
    let off = server(&w, 0, 0);
    let mut rng = Tokens(0x9E37_79B9_7F4A_7C15);
    let mut conv = Conversation::default();
    // user; tool call → tool result; tool call → tool result; answer → user (past reasoning
    // dropped: a rewrite); tool call → tool result; answer → user.
    let turns = [
        (40, false),
        (25, false),
        (30, false),
        (20, true),
        (35, false),
        (15, false),
    ];
    for (i, &(new, rewrite)) in turns.iter().enumerate() {
        let prompt = conv.next(&mut rng, vocab, new, rewrite);
        let a = on.ask(&prompt, 5);
        let b = off.ask(&prompt, 5);
        assert_eq!(
            a.tokens, b.tokens,
            "turn {i}: greedy answers differ with reuse"
        );
        assert_eq!(b.usage.cached_tokens, 0);
        assert_eq!(b.prefilled, prompt.len());
        let expected = if i == 0 {
            0
        } else if rewrite {
            // The state before the last generation prompt.
            conv.prompt.len() - GENERATION_PROMPT.len()
        } else {
            // The end of the last generated turn: its prompt and the answer tokens fed back
            // (the CPU backend never feeds the last sampled token).
            conv.prompt.len() + conv.answer.len() - 1
        };
        assert_eq!(a.usage.cached_tokens, expected, "turn {i}");
        assert_eq!(a.prefilled, prompt.len() - expected, "turn {i}");
        // The timing line's account of it: a new sequence, then the one kept sequence rewound;
        // the save points taken on the way (the conversation's end, the prompt's end).
        let p = a.usage.phases;
        let source = if i == 0 {
            SeqSource::New
        } else {
            SeqSource::Rewound
        };
        assert_eq!(p.sequence, source, "turn {i}");
        assert_eq!(b.usage.phases.sequence, SeqSource::New, "turn {i}");
        assert!(p.chunks >= 1 && p.snapshots >= 1, "turn {i}: {p:?}");
        assert!(
            p.prepare.is_some() && p.engine_ttft.is_some(),
            "turn {i}: {p:?}"
        );
        conv.prompt = prompt;
        conv.answer = a.tokens;
    }
    let stats = on.engine.prefix_stats();
    assert_eq!((stats.hits, stats.misses, stats.evictions), (5, 1, 0));
    assert_eq!(stats.sequences, 1, "one conversation keeps one sequence");
    on.engine.shutdown();
    off.engine.shutdown();
}

#[test]
fn interleaved_conversations_never_see_each_others_state() {
    let w = tiny();
    let vocab = w.config.vocab;
    // Snapshots every 16 tokens, so the second conversation can resume inside the shared
    // system prompt.
    let on = server(&w, 1 << 30, 16);
    let off = server(&w, 0, 0);
    let mut rng = Tokens(0x2545_F491_4F6C_DD1D);
    let system = rng.take(40, vocab);
    let mut convs = [Conversation::default(), Conversation::default()];
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            let mut prompt = conv.next(&mut rng, vocab, 12, false);
            if turn == 0 {
                prompt = [&system[..], &prompt[..]].concat();
            }
            let a = on.ask(&prompt, 4);
            let b = off.ask(&prompt, 4);
            assert_eq!(a.tokens, b.tokens, "conversation {c}, turn {turn}");
            let expected = match (turn, c) {
                (0, 0) => 0,
                // The deepest snapshot inside the shared system prompt (a multiple of 16),
                // copied out of the first conversation's sequence.
                (0, _) => 32,
                _ => conv.prompt.len() + conv.answer.len() - 1,
            };
            assert_eq!(
                a.usage.cached_tokens, expected,
                "conversation {c}, turn {turn}"
            );
            let source = match (turn, c) {
                (0, 0) => SeqSource::New,
                // The shared system prompt's state copied into a new sequence.
                (0, _) => SeqSource::Forked,
                _ => SeqSource::Rewound,
            };
            assert_eq!(
                a.usage.phases.sequence, source,
                "conversation {c}, turn {turn}"
            );
            assert_eq!(a.prefilled, prompt.len() - expected);
            conv.prompt = prompt;
            conv.answer = a.tokens;
        }
    }
    let stats = on.engine.prefix_stats();
    assert_eq!(
        stats.sequences, 2,
        "each conversation keeps its own sequence"
    );
    assert_eq!((stats.hits, stats.misses), (5, 1));
    on.engine.shutdown();
    off.engine.shutdown();
}

#[test]
fn a_tiny_budget_evicts_and_answers_stay_the_same() {
    let w = tiny();
    let vocab = w.config.vocab;
    // Measure what one conversation's first turn keeps, then allow a little more than that:
    // two interleaved conversations cannot both stay.
    let probe = server(&w, 1 << 30, 0);
    let mut rng = Tokens(0xD1B5_4A32_D192_ED03);
    let first = [rng.take(30, vocab), GENERATION_PROMPT.to_vec()].concat();
    probe.ask(&first, 4);
    let one = probe.engine.prefix_stats().bytes;
    probe.engine.shutdown();
    assert!(one > 0);
    let budget = one * 3 / 2;
    let on = server(&w, budget, 0);
    let off = server(&w, 0, 0);
    let mut convs = [Conversation::default(), Conversation::default()];
    for turn in 0..3 {
        for (c, conv) in convs.iter_mut().enumerate() {
            let prompt = conv.next(&mut rng, vocab, 20, false);
            let a = on.ask(&prompt, 4);
            let b = off.ask(&prompt, 4);
            assert_eq!(a.tokens, b.tokens, "conversation {c}, turn {turn}");
            assert_eq!(a.prefilled, prompt.len() - a.usage.cached_tokens);
            let stats = on.engine.prefix_stats();
            assert!(stats.bytes <= budget, "{} > {budget}", stats.bytes);
            conv.prompt = prompt;
            conv.answer = a.tokens;
        }
    }
    let stats = on.engine.prefix_stats();
    assert!(stats.evictions > 0, "{stats:?}");
    on.engine.shutdown();
    off.engine.shutdown();
    // A budget smaller than any state keeps nothing and still answers.
    let none = server(&w, 1, 0);
    let prompt = [rng.take(20, vocab), GENERATION_PROMPT.to_vec()].concat();
    let a = none.ask(&prompt, 3);
    let again = none.ask(&[&prompt[..], &a.tokens, &[5, 6, 7]].concat(), 3);
    assert_eq!(again.usage.cached_tokens, 0);
    let stats = none.engine.prefix_stats();
    assert_eq!((stats.bytes, stats.sequences, stats.snapshots), (0, 0, 0));
    none.engine.shutdown();
}

#[test]
fn a_snapshot_shares_its_sequences_kv_and_forks_or_rewinds_exactly() {
    let w = tiny();
    let vocab = w.config.vocab;
    let mut rng = Tokens(0x1234_5678_9ABC_DEF1);
    let ids = rng.take(50, vocab);
    let fresh = |n: usize| {
        let mut cpu = CpuBackend::new(w.clone());
        let seq = cpu.new_seq(64).expect("seq");
        cpu.prefill(seq, &ids[..n]).expect("prefill");
        cpu.logits(seq).expect("logits")
    };
    let mut cpu = CpuBackend::new(w.clone());
    let a = cpu.new_seq(64).expect("seq");
    cpu.prefill(a, &ids[..20]).expect("prefill");
    let at20 = cpu.snapshot(a).expect("snapshot");
    let bytes_at20 = cpu.seq_bytes(a);
    cpu.prefill(a, &ids[20..35]).expect("prefill");
    let at35 = cpu.snapshot(a).expect("snapshot");
    // A snapshot holds the recurrent state and logits, not the KV rows it shares.
    assert!(cpu.snapshot_bytes(at35) < cpu.seq_bytes(a));
    assert_eq!(cpu.snapshot_bytes(at20), cpu.snapshot_bytes(at35));
    assert!(cpu.seq_bytes(a) > bytes_at20);
    // Fork: another sequence resumes at 20 and continues as a fresh prefill would.
    let b = cpu.new_seq(64).expect("seq");
    cpu.restore(b, at20).expect("fork");
    assert_eq!(cpu.seq_len(b).unwrap(), 20);
    cpu.prefill(b, &ids[20..50]).expect("prefill");
    assert_eq!(cpu.logits(b).unwrap(), fresh(50));
    // The source is untouched: its longer snapshot still resumes it.
    let c = cpu.new_seq(64).expect("seq");
    cpu.restore(c, at35).expect("fork at 35");
    cpu.prefill(c, &ids[35..40]).expect("prefill");
    assert_eq!(cpu.logits(c).unwrap(), fresh(40));
    // Rewind in place: back to 20, the longer snapshot is gone (its rows get overwritten).
    cpu.restore(a, at20).expect("rewind");
    assert_eq!(cpu.seq_bytes(a), bytes_at20);
    assert!(cpu.restore(c, at35).is_err());
    cpu.prefill(a, &ids[20..45]).expect("prefill");
    assert_eq!(cpu.logits(a).unwrap(), fresh(45));
    // Freeing a sequence drops its snapshots.
    cpu.free_seq(a);
    assert!(cpu.restore(b, at20).is_err());
}

#[test]
fn the_least_recently_used_conversation_is_evicted_first() {
    let w = tiny();
    let vocab = w.config.vocab;
    let mut rng = Tokens(0x5851_F42D_4C95_7F2D);
    // What one conversation's first turn keeps; the budget holds about two and a half of them.
    let probe = server(&w, 1 << 30, 0);
    probe.ask(
        &[rng.take(30, vocab), GENERATION_PROMPT.to_vec()].concat(),
        4,
    );
    let one = probe.engine.prefix_stats().bytes;
    probe.engine.shutdown();
    let on = server(&w, one * 5 / 2, 0);
    let [mut a, mut b, mut c] = [(); 3].map(|_| Conversation::default());
    let turn = |conv: &mut Conversation, rng: &mut Tokens| {
        let prompt = conv.next(rng, vocab, 30, false);
        let answer = on.ask(&prompt, 4);
        conv.prompt = prompt;
        conv.answer = answer.tokens;
        answer.usage.cached_tokens
    };
    assert_eq!(turn(&mut a, &mut rng), 0);
    assert_eq!(turn(&mut b, &mut rng), 0);
    assert!(turn(&mut a, &mut rng) > 0, "A's second turn resumes");
    // C's first turn does not fit with A's and B's states: B, used least recently, goes.
    assert_eq!(turn(&mut c, &mut rng), 0);
    assert_eq!(on.engine.prefix_stats().sequences, 2);
    assert!(
        turn(&mut a, &mut rng) > 0,
        "A was used more recently than B: kept"
    );
    assert_eq!(turn(&mut b, &mut rng), 0, "B was evicted");
    assert!(on.engine.prefix_stats().evictions > 0);
    on.engine.shutdown();
}

#[test]
fn failing_snapshots_free_the_kept_states_or_turn_reuse_off() {
    let w = tiny();
    let vocab = w.config.vocab;
    let mut rng = Tokens(0x3C6E_F372_FE94_F82B);
    let on = server(&w, 1 << 30, 0);
    let off = server(&w, 0, 0);
    let [mut a, mut b, mut c] = [(); 3].map(|_| Conversation::default());
    let mut turn = |server: &Server, conv: &mut Conversation| {
        let prompt = conv.next(&mut rng, vocab, 20, false);
        let answer = server.ask(&prompt, 4);
        assert_eq!(answer.tokens, off.ask(&prompt, 4).tokens);
        let cached = answer.usage.cached_tokens;
        let whole = conv.prompt.len() + conv.answer.len();
        conv.prompt = prompt;
        conv.answer = answer.tokens;
        (cached, whole.saturating_sub(1))
    };
    assert_eq!(turn(&on, &mut a).0, 0);
    assert_eq!(turn(&on, &mut b).0, 0);
    let a1_end = a.prompt.len() + a.answer.len() - 1;
    // Out of memory during A's second turn: it still resumes and answers; B's kept state is
    // freed, A's snapshots of this turn are not taken.
    on.full.store(true, Ordering::SeqCst);
    let (cached, whole) = turn(&on, &mut a);
    assert_eq!(cached, whole);
    assert_eq!(on.engine.prefix_stats().sequences, 1);
    on.full.store(false, Ordering::SeqCst);
    // A resumes from the state its first turn kept; B starts over; reuse goes on.
    assert_eq!(turn(&on, &mut a).0, a1_end);
    assert_eq!(turn(&on, &mut b).0, 0);
    let (cached, whole) = turn(&on, &mut a);
    assert_eq!(cached, whole);
    // A backend that never could snapshot: reuse is turned off.
    let never = server(&w, 1 << 30, 0);
    never.full.store(true, Ordering::SeqCst);
    assert_eq!(turn(&never, &mut c).0, 0);
    assert_eq!(never.engine.prefix_stats().budget, 0);
    for s in [on, off, never] {
        s.engine.shutdown();
    }
}

/// A backend may feed the token that ends generation (the CUDA backend's pipelined decode;
/// `Backend::decode`): the engine keeps the state `seq_len` says it holds, so the next turn
/// resumes after the whole answer, prefills only what follows it and answers as without reuse
/// and as a backend that never feeds that token. A turn that ends at `max_tokens` is never fed
/// past its last token, by either backend.
#[test]
fn a_backend_that_feeds_the_stopping_token_resumes_after_the_whole_answer() {
    let w = tiny();
    let vocab = w.config.vocab;
    let feeding = server_feeding(&w, 1 << 30, 0, true);
    let plain = server(&w, 1 << 30, 0);
    let off = server(&w, 0, 0);
    let mut rng = Tokens(0x7F4A_7C15_9E37_79B9);
    let mut conv = Conversation::default();
    // (new tokens, the client's stop after so many tokens of at most 6: at the 6th, the last
    // allowed, which is never fed; past it, never: the turn ends by its length)
    let turns = [(30, 3), (20, 1), (25, 6), (15, 4), (12, 7), (10, 2)];
    let mut ended_by_stop = false;
    for (i, &(new, stop_after)) in turns.iter().enumerate() {
        let prompt = conv.next(&mut rng, vocab, new, false);
        let a = feeding.ask_stopping(&prompt, 6, stop_after);
        let b = plain.ask_stopping(&prompt, 6, stop_after);
        let c = off.ask_stopping(&prompt, 6, stop_after);
        assert_eq!(a.tokens, c.tokens, "turn {i}: the feeding backend's answer");
        assert_eq!(b.tokens, c.tokens, "turn {i}: the plain backend's answer");
        if i > 0 {
            let whole = conv.prompt.len() + conv.answer.len();
            let fed_last = if ended_by_stop { whole } else { whole - 1 };
            assert_eq!(a.usage.cached_tokens, fed_last, "turn {i}: feeding");
            assert_eq!(b.usage.cached_tokens, whole - 1, "turn {i}: plain");
            assert_eq!(a.usage.phases.sequence, SeqSource::Rewound, "turn {i}");
        }
        assert_eq!(a.prefilled, prompt.len() - a.usage.cached_tokens);
        assert_eq!(b.prefilled, prompt.len() - b.usage.cached_tokens);
        ended_by_stop = stop_after < 6;
        conv.prompt = prompt;
        conv.answer = a.tokens;
    }
    for s in [feeding, plain, off] {
        s.engine.shutdown();
    }
}
