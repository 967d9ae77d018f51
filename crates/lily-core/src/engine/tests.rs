//! The engine's guarantees, with a backend that replays a token script (the model's numbers are
//! not what is under test here: queueing, stopping and cancellation are).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::*;
use crate::backend::{Backend, Flow, SeqId, SnapshotId, StepOut};
use crate::config::ModelConfig;
use crate::logprob::token_logprob;
use crate::sampling::{Sampler, SamplingParams};
use crate::synth::{preset_text_config, Preset};

const EOS: u32 = 1000;
/// Decoding this token panics (a backend bug the engine must survive).
const PANIC: u32 = 999;

/// Replays `script` (one-hot logits), counting what the engine asks of it.
struct ScriptBackend {
    config: ModelConfig,
    script: Vec<u32>,
    delay: Duration,
    pos: usize,
    decoded: Arc<AtomicUsize>,
    prefilled: Arc<AtomicUsize>,
    snapshots: usize,
    /// What `prefill_chunk` answers, and the size of every piece `prefill` was handed.
    chunk: usize,
    pieces: Arc<std::sync::Mutex<Vec<usize>>>,
    /// Sleep per `prefill` call.
    prefill_delay: Duration,
}

impl ScriptBackend {
    fn new(script: &[u32], delay_ms: u64) -> (Self, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let mut config =
            ModelConfig::from_json(&preset_text_config(Preset::Tiny)).expect("tiny config");
        config.eos_ids = vec![EOS];
        let (decoded, prefilled) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let backend = ScriptBackend {
            config,
            script: script.to_vec(),
            delay: Duration::from_millis(delay_ms),
            pos: 0,
            decoded: decoded.clone(),
            prefilled: prefilled.clone(),
            snapshots: 0,
            chunk: 512,
            pieces: Default::default(),
            prefill_delay: Duration::ZERO,
        };
        (backend, decoded, prefilled)
    }

    fn one_hot(&self, token: u32) -> Vec<f32> {
        // Distinct, random-looking logits with `token` on top.
        let mut logits: Vec<f32> = (0..self.config.vocab)
            .map(|i| ((i * 7919) % 101) as f32 / 50.0)
            .collect();
        logits[token as usize] = 10.0;
        logits
    }
}

impl Backend for ScriptBackend {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn describe(&self) -> String {
        "script".into()
    }
    fn new_seq(&mut self, _max_ctx: usize) -> Result<SeqId> {
        self.pos = 0;
        Ok(SeqId(0))
    }
    fn free_seq(&mut self, _seq: SeqId) {}
    fn seq_len(&self, _seq: SeqId) -> Result<usize> {
        Ok(0)
    }
    fn prefill(&mut self, _seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.prefilled.fetch_add(tokens.len(), Ordering::SeqCst);
        self.pieces.lock().unwrap().push(tokens.len());
        std::thread::sleep(self.prefill_delay);
        Ok(())
    }
    fn prefill_chunk(&self) -> usize {
        self.chunk
    }
    fn logits(&mut self, _seq: SeqId) -> Result<Vec<f32>> {
        Ok(self.one_hot(self.prefilled.load(Ordering::SeqCst) as u32 % 900))
    }
    fn decode(
        &mut self,
        _seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        for i in 0..n {
            let Some(&next) = self.script.get(self.pos) else {
                bail!("script exhausted")
            };
            if next == PANIC {
                panic!("scripted panic");
            }
            std::thread::sleep(self.delay);
            let logits = self.one_hot(next);
            let token = sampler.sample(&logits);
            let (logprob, top) = token_logprob(&logits, token, top_logprobs);
            self.decoded.fetch_add(1, Ordering::SeqCst);
            self.pos += 1;
            if on_token(&StepOut {
                token,
                logprob,
                top,
            }) == Flow::Stop
                || i + 1 == n
            {
                break;
            }
        }
        Ok(())
    }
    fn snapshot(&mut self, _seq: SeqId) -> Result<SnapshotId> {
        self.snapshots += 1;
        Ok(SnapshotId(self.snapshots as u64))
    }
    fn restore(&mut self, _seq: SeqId, _snap: SnapshotId) -> Result<()> {
        Ok(())
    }
    fn drop_snapshot(&mut self, _snap: SnapshotId) {}
}

fn opts(max_queue: usize) -> EngineOptions {
    EngineOptions {
        max_queue,
        ctx_size: 4096,
        prefix_cache_bytes: 0,
        snapshot_every: 0,
        max_batch: None,
    }
}

#[derive(Debug)]
enum Seen {
    Prompt(Vec<PromptLogprob>),
    Token(u32, Instant),
    /// Boxed: an outcome (usage and timings) is large.
    Done(Box<Outcome>, Instant),
}

/// Records everything into a channel; stops after `stop_after` tokens; can be cancelled.
struct RecordingSink {
    tx: Sender<Seen>,
    stop_after: usize,
    tokens: usize,
    cancelled: Arc<AtomicBool>,
}

fn job(
    prompt: &[u32],
    max_tokens: usize,
    stop_after: usize,
) -> (Job, Receiver<Seen>, Arc<AtomicBool>) {
    let (tx, rx) = channel();
    let cancelled = Arc::new(AtomicBool::new(false));
    let sink = RecordingSink {
        tx,
        stop_after,
        tokens: 0,
        cancelled: cancelled.clone(),
    };
    let job = Job {
        prompt: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        top_logprobs: 0,
        prompt_logprobs: false,
        save_prefix_at: None,
        constraint: None,
        arrived: None,
        sink: Box::new(sink),
    };
    (job, rx, cancelled)
}

impl JobSink for RecordingSink {
    fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }
    fn prompt_logprobs(&mut self, scores: Vec<PromptLogprob>) {
        let _ = self.tx.send(Seen::Prompt(scores));
    }
    fn token(&mut self, step: &StepOut) -> Flow {
        self.tokens += 1;
        let _ = self.tx.send(Seen::Token(step.token, Instant::now()));
        if self.tokens >= self.stop_after {
            Flow::Stop
        } else {
            Flow::Continue
        }
    }
    fn finished(&mut self, outcome: Outcome) {
        let _ = self.tx.send(Seen::Done(Box::new(outcome), Instant::now()));
    }
}

/// Everything a job reported, once it finished.
fn results(rx: &Receiver<Seen>) -> (Vec<u32>, Outcome) {
    let mut tokens = Vec::new();
    loop {
        match rx
            .recv_timeout(Duration::from_secs(10))
            .expect("job finishes")
        {
            Seen::Token(t, _) => tokens.push(t),
            Seen::Done(outcome, _) => return (tokens, *outcome),
            Seen::Prompt(_) => {}
        }
    }
}

fn reason(outcome: &Outcome) -> FinishReason {
    match outcome {
        Outcome::Done { reason, .. } => *reason,
        Outcome::Failed { message, .. } => panic!("job failed: {message}"),
    }
}

fn usage(outcome: &Outcome) -> Usage {
    match outcome {
        Outcome::Done { usage, .. } | Outcome::Failed { usage, .. } => *usage,
    }
}

#[test]
fn end_of_sequence_stops_and_is_not_output() {
    let (backend, _, _) = ScriptBackend::new(&[5, 6, EOS, 7], 0);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (j, rx, _) = job(&[1, 2, 3], 10, usize::MAX);
    engine.submit(j).unwrap();
    let (tokens, outcome) = results(&rx);
    assert_eq!(tokens, vec![5, 6]);
    assert_eq!(reason(&outcome), FinishReason::Stop);
    let u = usage(&outcome);
    assert_eq!((u.prompt_tokens, u.completion_tokens), (3, 2));
    assert!(u.time_to_first_token.is_some());
    assert!(u.sink_time > Duration::ZERO && u.sink_time <= u.decode_time);
    engine.shutdown();
}

#[test]
fn the_prompt_is_fed_in_the_backends_chunks() {
    for (chunk, expected) in [(100, vec![100, 100, 50]), (4096, vec![250])] {
        let (mut backend, _, prefilled) = ScriptBackend::new(&[5, 6], 0);
        backend.chunk = chunk;
        let pieces = backend.pieces.clone();
        let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
        let prompt: Vec<u32> = (0..250).collect();
        let (j, rx, _) = job(&prompt, 1, usize::MAX);
        engine.submit(j).unwrap();
        results(&rx);
        assert_eq!(*pieces.lock().unwrap(), expected, "chunk {chunk}");
        assert_eq!(prefilled.load(Ordering::SeqCst), 250);
        engine.shutdown();
    }
}

#[test]
fn the_phases_before_the_first_token_are_timed() {
    // 3 prefill calls of 15 ms, 30 ms per decoded token (the first pick included), prefix reuse
    // on (a snapshot at the prompt's end), a request that arrived 40 ms before it was queued.
    let (mut backend, _, _) = ScriptBackend::new(&[5, 6, 7], 30);
    backend.chunk = 100;
    backend.prefill_delay = Duration::from_millis(15);
    let engine = Engine::start(
        Box::new(backend),
        EngineOptions {
            prefix_cache_bytes: 1 << 20,
            ..opts(4)
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..250).collect();
    let (mut j, rx, _) = job(&prompt, 2, usize::MAX);
    let arrived = Instant::now() - Duration::from_millis(40);
    j.arrived = Some(arrived);
    engine.submit(j).unwrap();
    let (tokens, outcome) = results(&rx);
    assert_eq!(tokens, vec![5, 6]);
    let u = usage(&outcome);
    let p = u.phases;
    assert_eq!((p.chunks, p.snapshots, p.sequence), (3, 1, SeqSource::New));
    let ms = Duration::from_millis;
    assert!(p.prepare.unwrap() >= ms(40), "{p:?}");
    assert!(p.chunk_time >= ms(45) && p.max_chunk >= ms(15), "{p:?}");
    assert!(p.max_chunk <= p.chunk_time);
    assert!(p.first_pick >= ms(30), "{p:?}");
    let engine_ttft = p.engine_ttft.unwrap();
    assert!(engine_ttft >= p.acquire + p.chunk_time + p.snapshot_time + p.first_pick);
    assert!(engine_ttft >= u.time_to_first_token.unwrap());
    assert!(u.prefill_time >= p.chunk_time + p.snapshot_time);
    let line = super::worker::timing_line(&u, &[ms(15), ms(16), ms(17)]);
    assert!(
        line.starts_with("timing: prompt=250 cached=0 prepare_ms="),
        "{line}"
    );
    for part in [
        " seq=new ",
        " chunks=3 ",
        " chunk_ms=15.00,16.00,17.00 ",
        " snapshots=1 ",
        " tokens=2 ",
    ] {
        assert!(line.contains(part), "{part:?} in {line}");
    }
    assert!(
        line.contains(" ttft_ms=") && line.contains(" engine_ttft_ms="),
        "{line}"
    );
    // Without an arrival time there is no preparation or arrival-to-token figure.
    let (j, rx, _) = job(&[1, 2], 1, usize::MAX);
    engine.submit(j).unwrap();
    let line = super::worker::timing_line(&usage(&results(&rx).1), &[]);
    assert!(
        !line.contains("prepare_ms") && !line.contains(" ttft_ms"),
        "{line}"
    );
    assert!(!line.contains(" chunk_ms="), "{line}");
    engine.shutdown();
}

#[test]
fn max_tokens_ends_with_length() {
    let (backend, _, _) = ScriptBackend::new(&[5, 6, 7, 8, 9], 0);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (j, rx, _) = job(&[1], 3, usize::MAX);
    engine.submit(j).unwrap();
    let (tokens, outcome) = results(&rx);
    assert_eq!(tokens, vec![5, 6, 7]);
    assert_eq!(reason(&outcome), FinishReason::Length);
    engine.shutdown();
}

#[test]
fn a_sink_that_stops_ends_decode_at_that_token() {
    let (backend, decoded, _) = ScriptBackend::new(&[5, 6, 7, 8, 9, 10, 11], 0);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (j, rx, _) = job(&[1], 7, 2);
    engine.submit(j).unwrap();
    let (tokens, outcome) = results(&rx);
    assert_eq!(tokens, vec![5, 6]);
    assert_eq!(reason(&outcome), FinishReason::Stop);
    assert_eq!(
        decoded.load(Ordering::SeqCst),
        2,
        "no token is computed after the stop"
    );
    engine.shutdown();
}

#[test]
fn jobs_run_one_at_a_time_in_fifo_order() {
    let (backend, _, _) = ScriptBackend::new(&[5; 64], 2);
    let engine = Engine::start(Box::new(backend), opts(8)).unwrap();
    let mut rxs = Vec::new();
    for _ in 0..5 {
        let (j, rx, _) = job(&[1], 3, usize::MAX);
        engine.submit(j).unwrap();
        rxs.push(rx);
    }
    let mut spans = Vec::new();
    for rx in &rxs {
        let mut first = None;
        loop {
            match rx.recv_timeout(Duration::from_secs(10)).unwrap() {
                Seen::Token(_, at) => {
                    first.get_or_insert(at);
                }
                Seen::Done(_, at) => {
                    spans.push((first.unwrap(), at));
                    break;
                }
                Seen::Prompt(_) => {}
            }
        }
    }
    for pair in spans.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "job runs only after the one queued before it ended"
        );
    }
    engine.shutdown();
}

#[test]
fn a_full_queue_hands_the_job_back() {
    let (backend, _, _) = ScriptBackend::new(&[5; 64], 20);
    let engine = Engine::start(Box::new(backend), opts(1)).unwrap();
    let (running, rx_running, _) = job(&[1], 5, usize::MAX);
    engine.submit(running).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !engine.is_busy() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (waiting, rx_waiting, _) = job(&[1], 1, usize::MAX);
    engine.submit(waiting).unwrap();
    assert_eq!(engine.queue_depth(), 1);
    let (refused, _, _) = job(&[1], 1, usize::MAX);
    assert!(engine.submit(refused).is_err());
    assert_eq!(reason(&results(&rx_running).1), FinishReason::Length);
    assert_eq!(reason(&results(&rx_waiting).1), FinishReason::Length);
    engine.shutdown();
}

#[test]
fn cancelled_jobs_stop_and_waiting_ones_never_start() {
    // 40 ms a token: the test thread has two tokens' time (80 ms) to see the first token and
    // raise the cancel flag, even on a loaded 2-core machine (10 ms was once not enough there).
    let (backend, decoded, prefilled) = ScriptBackend::new(&[5; 64], 40);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (first, rx_first, cancel_first) = job(&[1, 2], 50, usize::MAX);
    let (second, rx_second, cancel_second) = job(&[1, 2, 3, 4], 50, usize::MAX);
    engine.submit(first).unwrap();
    engine.submit(second).unwrap();
    cancel_second.store(true, Ordering::SeqCst);
    // Let the first produce a token, then cancel it: decode ends within one more token.
    match rx_first.recv_timeout(Duration::from_secs(5)).unwrap() {
        Seen::Token(..) => cancel_first.store(true, Ordering::SeqCst),
        other => panic!("{other:?}"),
    }
    let (_, outcome) = results(&rx_first);
    assert_eq!(reason(&outcome), FinishReason::Cancelled);
    assert!(
        decoded.load(Ordering::SeqCst) <= 3,
        "decode stopped soon after the cancel"
    );
    assert_eq!(reason(&results(&rx_second).1), FinishReason::Cancelled);
    assert_eq!(
        prefilled.load(Ordering::SeqCst),
        2,
        "the cancelled waiting job was never prefilled"
    );
    engine.shutdown();
}

#[test]
fn a_panicking_backend_fails_the_job_and_the_engine_keeps_serving() {
    let (backend, _, _) = ScriptBackend::new(&[PANIC, 5, 6], 0);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (j, rx, _) = job(&[1], 2, usize::MAX);
    engine.submit(j).unwrap();
    match results(&rx).1 {
        Outcome::Failed { message, .. } => assert!(message.contains("scripted panic"), "{message}"),
        other => panic!("{other:?}"),
    }
    // A fresh sequence replays the script from the start, which panics again; an error result
    // (not a dead engine thread) is what matters.
    let (j, rx, _) = job(&[1], 2, usize::MAX);
    engine.submit(j).unwrap();
    assert!(matches!(results(&rx).1, Outcome::Failed { .. }));
    engine.shutdown();
}

#[test]
fn prompt_logprobs_score_every_prompt_token_but_the_first() {
    let (backend, _, _) = ScriptBackend::new(&[5], 0);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (mut j, rx, _) = job(&[10, 2, 3], 0, usize::MAX);
    j.prompt_logprobs = true;
    j.top_logprobs = 2;
    engine.submit(j).unwrap();
    let Seen::Prompt(scores) = rx.recv_timeout(Duration::from_secs(5)).unwrap() else {
        panic!("prompt scores first")
    };
    assert_eq!(
        scores.iter().map(|s| s.token).collect::<Vec<_>>(),
        vec![10, 2, 3]
    );
    assert_eq!(scores[0].logprob, None);
    // The fake's logits after k prompt tokens peak at token k: position 2 (token 3) is scored
    // after 2 tokens, so 2 is the favourite there.
    assert_eq!(scores[2].top[0].0, 2);
    assert!(scores[1].logprob.unwrap() < 0.0 && scores[2].top.len() == 2);
    let (tokens, outcome) = results(&rx);
    assert!(tokens.is_empty());
    assert_eq!(reason(&outcome), FinishReason::Length);
    engine.shutdown();
}

#[test]
fn shutdown_cancels_waiting_jobs_and_refuses_new_ones() {
    let (backend, _, _) = ScriptBackend::new(&[5; 64], 20);
    let engine = Engine::start(Box::new(backend), opts(4)).unwrap();
    let (running, rx_running, _) = job(&[1], 60, usize::MAX);
    let (waiting, rx_waiting, _) = job(&[1], 60, usize::MAX);
    engine.submit(running).unwrap();
    engine.submit(waiting).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    engine.shutdown();
    assert_eq!(reason(&results(&rx_running).1), FinishReason::Cancelled);
    assert_eq!(reason(&results(&rx_waiting).1), FinishReason::Cancelled);
    let (late, _, _) = job(&[1], 1, usize::MAX);
    assert!(engine.submit(late).is_err());
}

#[test]
fn a_saved_prefix_is_reused_by_prompts_that_start_with_it() {
    let (backend, _, prefilled) = ScriptBackend::new(&[5; 64], 0);
    let options = EngineOptions {
        max_queue: 4,
        ctx_size: 4096,
        prefix_cache_bytes: 1 << 20,
        snapshot_every: 0,
        max_batch: None,
    };
    let engine = Engine::start(Box::new(backend), options).unwrap();
    let run = |prompt: &[u32], save_at: Option<usize>| {
        let before = prefilled.load(Ordering::SeqCst);
        let (mut j, rx, _) = job(prompt, 1, usize::MAX);
        j.save_prefix_at = save_at;
        engine.submit(j).unwrap();
        let u = usage(&results(&rx).1);
        (u.cached_tokens, prefilled.load(Ordering::SeqCst) - before)
    };
    assert_eq!(run(&[1, 2, 3, 4], Some(3)), (0, 4));
    // Same conversation, next turn: resumes after [1, 2, 3], prefills only the rest.
    assert_eq!(run(&[1, 2, 3, 8, 9], Some(4)), (3, 2));
    assert_eq!(run(&[1, 2, 3, 8, 7, 7], None), (4, 2));
    // A different conversation shares nothing.
    assert_eq!(run(&[6, 2, 3, 4], None), (0, 4));
    // A prompt equal to a saved prefix still prefills its last token (fresh logits).
    assert_eq!(run(&[1, 2, 3], None), (0, 3));
    engine.shutdown();
}
