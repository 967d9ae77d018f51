//! Prometheus text exposition (`GET /metrics`): requests by endpoint and status, prompt and
//! generated tokens, prefill and decode throughput, time to first token, queue time, running and
//! waiting sequences, decode batch sizes, prefix reuse (hits, misses, evictions, bytes held).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;

use lily_core::engine::{FinishReason, Outcome, PrefixStats, SchedulerStats};

/// Upper bounds (seconds) of the time-to-first-token and queue-time histogram buckets.
const SECONDS_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Upper bounds of the decode batch size histogram buckets.
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// A Prometheus histogram: cumulative buckets, sum and count.
struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<u64>,
    count: u64,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            buckets: vec![0; bounds.len()],
            count: 0,
            sum: 0.0,
        }
    }

    /// Records `n` observations of `value`.
    fn observe(&mut self, value: f64, n: u64) {
        self.count += n;
        self.sum += value * n as f64;
        for (bucket, &bound) in self.buckets.iter_mut().zip(self.bounds) {
            if value <= bound {
                *bucket += n;
            }
        }
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        header(out, name, "histogram", help);
        for (bound, n) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {n}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

pub struct Metrics {
    inner: Mutex<Counters>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            inner: Mutex::new(Counters {
                requests: BTreeMap::new(),
                finished: BTreeMap::new(),
                prompt_tokens: 0,
                cached_tokens: 0,
                generated_tokens: 0,
                prefill_seconds: 0.0,
                decode_seconds: 0.0,
                sink_seconds: 0.0,
                mask_seconds: 0.0,
                masks: 0,
                queue_seconds: 0.0,
                queue_time: Histogram::new(&SECONDS_BUCKETS),
                ttft: Histogram::new(&SECONDS_BUCKETS),
                last_prefill_tps: 0.0,
                last_decode_tps: 0.0,
            }),
        }
    }
}

struct Counters {
    /// (endpoint, HTTP status) → count.
    requests: BTreeMap<(String, u16), u64>,
    /// finish reason → count of finished generations.
    finished: BTreeMap<&'static str, u64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    generated_tokens: u64,
    prefill_seconds: f64,
    decode_seconds: f64,
    sink_seconds: f64,
    mask_seconds: f64,
    masks: u64,
    queue_seconds: f64,
    /// Per request: from its queueing to its start on the engine.
    queue_time: Histogram,
    ttft: Histogram,
    last_prefill_tps: f64,
    last_decode_tps: f64,
}

/// Values read from the engine when the page is rendered.
pub struct Gauges {
    pub ready: bool,
    pub prefix: PrefixStats,
    pub scheduler: SchedulerStats,
}

impl Metrics {
    fn lock(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn record_request(&self, endpoint: &str, status: u16) {
        *self
            .lock()
            .requests
            .entry((endpoint.to_string(), status))
            .or_default() += 1;
    }

    /// Called once per finished generation (also cancelled and failed ones).
    pub fn record_outcome(&self, outcome: &Outcome) {
        let (reason, usage) = match outcome {
            Outcome::Done { reason, usage } => (
                match reason {
                    FinishReason::Stop => "stop",
                    FinishReason::Length => "length",
                    FinishReason::Cancelled => "cancelled",
                },
                usage,
            ),
            Outcome::Failed { usage, .. } => ("error", usage),
        };
        let mut c = self.lock();
        *c.finished.entry(reason).or_default() += 1;
        let prefilled = usage.prompt_tokens.saturating_sub(usage.cached_tokens);
        c.prompt_tokens += usage.prompt_tokens as u64;
        c.cached_tokens += usage.cached_tokens as u64;
        c.generated_tokens += usage.completion_tokens as u64;
        c.queue_seconds += usage.queue_time.as_secs_f64();
        c.queue_time.observe(usage.queue_time.as_secs_f64(), 1);
        let prefill = usage.prefill_time.as_secs_f64();
        let decode = usage.decode_time.as_secs_f64();
        c.prefill_seconds += prefill;
        c.decode_seconds += decode;
        c.sink_seconds += usage.sink_time.as_secs_f64();
        c.mask_seconds += usage.constraint.total.as_secs_f64();
        c.masks += usage.constraint.masks as u64;
        if prefill > 0.0 && prefilled > 0 {
            c.last_prefill_tps = prefilled as f64 / prefill;
        }
        if decode > 0.0 && usage.completion_tokens > 1 {
            c.last_decode_tps = usage.completion_tokens as f64 / decode;
        }
        if let Some(ttft) = usage.time_to_first_token {
            c.ttft.observe(ttft.as_secs_f64(), 1);
        }
    }

    pub fn render(&self, gauges: &Gauges) -> String {
        let c = self.lock();
        let mut out = String::new();
        header(
            &mut out,
            "lily_requests_total",
            "counter",
            "HTTP requests by endpoint and status code.",
        );
        for ((endpoint, status), n) in &c.requests {
            let _ = writeln!(
                out,
                "lily_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        header(
            &mut out,
            "lily_generations_total",
            "counter",
            "Finished generations by finish reason.",
        );
        for (reason, n) in &c.finished {
            let _ = writeln!(
                out,
                "lily_generations_total{{finish_reason=\"{reason}\"}} {n}"
            );
        }
        let p = &gauges.prefix;
        let sched = &gauges.scheduler;
        let scalars: [(&str, &str, &str, String); 22] = [
            (
                "lily_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished generations.",
                c.prompt_tokens.to_string(),
            ),
            (
                "lily_cached_prompt_tokens_total",
                "counter",
                "Prompt tokens served from a reused prefix.",
                c.cached_tokens.to_string(),
            ),
            (
                "lily_generated_tokens_total",
                "counter",
                "Generated (completion) tokens.",
                c.generated_tokens.to_string(),
            ),
            (
                "lily_prefill_seconds_total",
                "counter",
                "Time spent in prefill.",
                c.prefill_seconds.to_string(),
            ),
            (
                "lily_decode_seconds_total",
                "counter",
                "Time spent in decode.",
                c.decode_seconds.to_string(),
            ),
            (
                "lily_decode_sink_seconds_total",
                "counter",
                "Part of the decode time the engine thread spent handing tokens to their requests.",
                c.sink_seconds.to_string(),
            ),
            (
                "lily_constraint_mask_seconds_total",
                "counter",
                "Part of the decode time spent computing token masks of constrained requests (forced tool calls, JSON schemas).",
                c.mask_seconds.to_string(),
            ),
            (
                "lily_constraint_masks_total",
                "counter",
                "Token masks computed for constrained requests (one per constrained decode step).",
                c.masks.to_string(),
            ),
            (
                "lily_queue_seconds_total",
                "counter",
                "Time requests waited in the queue.",
                c.queue_seconds.to_string(),
            ),
            (
                "lily_prefill_tokens_per_second",
                "gauge",
                "Prefill throughput of the last generation.",
                c.last_prefill_tps.to_string(),
            ),
            (
                "lily_decode_tokens_per_second",
                "gauge",
                "Decode throughput of the last generation.",
                c.last_decode_tps.to_string(),
            ),
            (
                "lily_queue_depth",
                "gauge",
                "Requests (sequences) waiting for the engine: queued, or held until their sequence fits in memory.",
                sched.waiting.to_string(),
            ),
            (
                "lily_requests_running",
                "gauge",
                "Requests (sequences) running on the engine, prefilling or decoding.",
                sched.running.to_string(),
            ),
            (
                "lily_max_batch",
                "gauge",
                "Sequences the engine decodes together at most (--max-batch).",
                sched.max_batch.to_string(),
            ),
            (
                "lily_model_ready",
                "gauge",
                "1 once the model is loaded.",
                u8::from(gauges.ready).to_string(),
            ),
            (
                "lily_prefix_cache_hits_total",
                "counter",
                "Generations that resumed from a kept prefix state.",
                p.hits.to_string(),
            ),
            (
                "lily_prefix_cache_misses_total",
                "counter",
                "Generations that found no kept prefix state to resume from (reuse on).",
                p.misses.to_string(),
            ),
            (
                "lily_prefix_cache_evictions_total",
                "counter",
                "Prefix snapshots evicted to stay within the budget.",
                p.evictions.to_string(),
            ),
            (
                "lily_prefix_cache_bytes",
                "gauge",
                "Bytes held by kept sequences (KV cache, state) and their snapshots.",
                p.bytes.to_string(),
            ),
            (
                "lily_prefix_cache_budget_bytes",
                "gauge",
                "The prefix cache budget (0 = reuse off).",
                p.budget.to_string(),
            ),
            (
                "lily_prefix_cache_snapshots",
                "gauge",
                "Prefix snapshots kept.",
                p.snapshots.to_string(),
            ),
            (
                "lily_prefix_cache_sequences",
                "gauge",
                "Sequences kept for reuse.",
                p.sequences.to_string(),
            ),
        ];
        for (name, kind, help, value) in scalars {
            header(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        }
        c.ttft.render(
            &mut out,
            "lily_time_to_first_token_seconds",
            "From the start of a generation (after queueing) to its first token.",
        );
        c.queue_time.render(
            &mut out,
            "lily_queue_time_seconds",
            "Per request, from its queueing to its start on the engine (waiting for a place in the batch or for memory).",
        );
        let mut batches = Histogram::new(&BATCH_BUCKETS);
        for (i, &n) in sched.steps.iter().enumerate() {
            batches.observe((i + 1) as f64, n);
        }
        batches.render(
            &mut out,
            "lily_decode_batch_size",
            "Sequences each decode step advanced by one token.",
        );
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}
