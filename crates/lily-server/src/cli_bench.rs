//! `lily-engine bench`: the sweep of docs/PERFORMANCE.md §1. Prefill throughput at prompt
//! length L (first token in → last logits ready on the host) and decode throughput at context L
//! (N greedy steps after a prefill of L), median of `repeat` runs after a warm-up. Each decode row
//! also gives the bytes a step must move (lily_core::traffic) and the fraction of the bandwidth
//! floor reached.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use lily_core::backend::{Backend, DecodeRow, Flow, SeqId};
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::traffic::decode_bytes;
use serde_json::json;

use crate::device::{open_backend_with_weights, BackendArgs, Device};

#[derive(Args)]
pub struct BenchArgs {
    #[arg(long)]
    model: PathBuf,
    /// Prompt lengths for prefill (K = 1024 suffix allowed).
    #[arg(long, value_delimiter = ',', default_value = "256,512,1K,2K,4K")]
    prefill: Vec<String>,
    /// Context lengths for decode.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1K,2K,4K")]
    decode_ctx: Vec<String>,
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Sequences decoding together (docs/batching.md): for each N > 1, N sequences of each
    /// decode context step together through `Backend::decode_step`, one token each a step; the
    /// row gives the aggregate tok/s (N tokens a step). 1 is the one-sequence `decode` above.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Quantise an HF bf16 checkpoint to 4-bit at load.
    #[arg(long)]
    quantize: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Memory bandwidth the decode floor is computed with, GB/s: the bytes a step must move
    /// (active weights, recurrent state, KV cache) over this. Default: the H200's measured
    /// device-to-device copy bandwidth (docs/PERFORMANCE.md §2).
    #[arg(long, default_value_t = 4300.0)]
    bandwidth_gbs: f64,
    /// Decode with sampling instead of greedy: the temperature (with --top-k and --top-p), as a
    /// user's request would (the pick's cost is part of each step).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 20)]
    top_k: u32,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// The presence penalty every step applies (greedy or sampled), as a served request gets
    /// the model card's 1.5 when it names none: the pick then runs the device sampler, whose
    /// history each sequence keeps, instead of the plain argmax (issue 32's served step).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[command(flatten)]
    backend: BackendArgs,
}

fn parse_len(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mult) = match s.strip_suffix(['K', 'k']) {
        Some(n) => (n, 1024),
        None => (s, 1),
    };
    Ok(num
        .parse::<usize>()
        .with_context(|| format!("{s:?} is not a length"))?
        * mult)
}

pub fn prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    // Real-vocabulary range: ids below the first added token (248044) when the model has them.
    let range = vocab.min(248_044) as u64;
    let mut s = seed ^ 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % range) as u32
        })
        .collect()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Feeds `ids` in the backend's `prefill_chunk` pieces, as the serving engine does.
fn prefill(b: &mut dyn Backend, seq: SeqId, ids: &[u32]) -> Result<()> {
    for piece in ids.chunks(b.prefill_chunk().max(1)) {
        b.prefill(seq, piece)?;
    }
    Ok(())
}

fn time_prefill(b: &mut dyn Backend, ids: &[u32]) -> Result<f64> {
    let seq = b.new_seq(ids.len() + 1)?;
    let t = Instant::now();
    let r = prefill(b, seq, ids).and_then(|_| b.logits(seq));
    let s = t.elapsed().as_secs_f64();
    b.free_seq(seq);
    r?;
    Ok(s)
}

/// `n` steps of `rows` sequences (each prefilled with its own prompt of `ctx` tokens) decoding
/// together: seconds for the `n` steps.
fn time_decode_batch(
    b: &mut dyn Backend,
    ctx: usize,
    rows: usize,
    n: usize,
    params: &SamplingParams,
    seed: u64,
) -> Result<f64> {
    let vocab = b.config().vocab;
    let mut seqs = Vec::with_capacity(rows);
    let r = (|| {
        for row in 0..rows {
            let seq = b.new_seq(ctx + n + 2)?;
            seqs.push(seq);
            prefill(b, seq, &prompt(ctx, vocab, seed + row as u64))?;
        }
        let mut samplers: Vec<Sampler> = (0..rows).map(|_| Sampler::new(params.clone())).collect();
        let step = |b: &mut dyn Backend, samplers: &mut [Sampler]| -> Result<()> {
            let mut batch = DecodeRow::each(&seqs, samplers, 0);
            b.decode_step(&mut batch, &mut |_, _| Flow::Continue)
        };
        // One step first: the batch's graph is captured there, as a server's first step does.
        step(b, &mut samplers)?;
        let t = Instant::now();
        for _ in 0..n {
            step(b, &mut samplers)?;
        }
        // The last step's pass is queued, not waited for: one more pick reads its logits.
        b.decode(seqs[0], &mut samplers[0], 1, 0, &mut |_| Flow::Stop)?;
        Ok(t.elapsed().as_secs_f64())
    })();
    for seq in seqs {
        b.free_seq(seq);
    }
    r
}

fn time_decode(b: &mut dyn Backend, ids: &[u32], n: usize, params: &SamplingParams) -> Result<f64> {
    let seq = b.new_seq(ids.len() + n + 1)?;
    let r = (|| {
        prefill(b, seq, ids)?;
        let mut sampler = Sampler::new(params.clone());
        let t = Instant::now();
        // n + 1 samples = n forward steps.
        b.decode(seq, &mut sampler, n + 1, 0, &mut |_| Flow::Continue)?;
        Ok(t.elapsed().as_secs_f64())
    })();
    b.free_seq(seq);
    r
}

/// "mlx-4bit" for an MLX affine checkpoint (or HF quantised at load), "hf-bf16" otherwise.
fn checkpoint_format(model: &std::path::Path, quantize: bool) -> &'static str {
    let quantised = std::fs::read_to_string(model.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|c| c.get("quantization").is_some() || c.get("quantization_config").is_some());
    if quantised || quantize {
        "mlx-4bit"
    } else {
        "hf-bf16"
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    let prefill: Vec<usize> = a
        .prefill
        .iter()
        .map(|s| parse_len(s))
        .collect::<Result<_>>()?;
    let decode: Vec<usize> = a
        .decode_ctx
        .iter()
        .map(|s| parse_len(s))
        .collect::<Result<_>>()?;
    let repeat = a.repeat.max(1);
    if a.batch.contains(&0) {
        anyhow::bail!("--batch takes sequence counts of 1 or more");
    }
    if !(a.bandwidth_gbs.is_finite() && a.bandwidth_gbs > 0.0) {
        anyhow::bail!("--bandwidth-gbs must be a positive number of GB/s");
    }
    let sampling = if a.temperature > 0.0 {
        SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
            ..SamplingParams::greedy()
        }
    } else {
        SamplingParams::greedy()
    };
    let sampling = SamplingParams {
        presence_penalty: a.presence_penalty,
        ..sampling
    };
    // Checked before the model loads (no logit_bias here, so no vocabulary to bound it).
    sampling
        .validate(usize::MAX)
        .map_err(|e| anyhow::anyhow!("--{}", e.replace('_', "-")))?;
    let (mut b, weights) = open_backend_with_weights(&a.model, a.device, a.quantize, &a.backend)?;
    let vocab = b.config().vocab;
    let device = b.describe();
    eprintln!("bench on {device}");
    // Warm-up: compile/caches/first-touch of weights.
    time_prefill(b.as_mut(), &prompt(64, vocab, a.seed))?;
    time_decode(b.as_mut(), &prompt(16, vocab, a.seed), 4, &sampling)?;
    // LILY_PROFILE=1: the per-kernel GPU times of the measured runs only.
    lily_wgpu::profile::reset();
    lily_cuda::gpu::reset_profiles();

    let mut prefill_rows = Vec::new();
    println!("{:>8} {:>12} {:>10}", "prefill", "tok/s", "ms");
    for &len in &prefill {
        let ids = prompt(len, vocab, a.seed);
        let s = median(
            (0..repeat)
                .map(|_| time_prefill(b.as_mut(), &ids))
                .collect::<Result<_>>()?,
        );
        println!("{len:>8} {:>12.1} {:>10.2}", len as f64 / s, s * 1e3);
        prefill_rows.push(json!({"len": len, "tok_s": len as f64 / s, "ms": s * 1e3}));
    }
    let mut decode_rows = Vec::new();
    if a.temperature > 0.0 {
        println!(
            "decode sampled: temperature {}, top_k {}, top_p {}",
            a.temperature, a.top_k, a.top_p
        );
    }
    // The cache the backend keeps: int8 rows (CUDA's `kv_cache int8`, its default on compute
    // capability 9 and later), bf16 elsewhere on CUDA's production path, f16 where wgpu's plan says
    // so, fp32 on the CPU and in fp32 modes.
    let kv = b.kv_format();
    println!(
        "{:>8} {:>12} {:>10} {:>10} {:>8}",
        "ctx", "tok/s", "ms/tok", "GB/tok", "floor %"
    );
    for &ctx in &decode {
        let ids = prompt(ctx.max(1), vocab, a.seed);
        let n = a.decode_tokens.max(1);
        let s = median(
            (0..repeat)
                .map(|_| time_decode(b.as_mut(), &ids, n, &sampling))
                .collect::<Result<_>>()?,
        );
        // The step at the middle of the timed tokens.
        let bytes = decode_bytes(&weights, ctx + n / 2, kv);
        let floor_s = bytes.total() as f64 / (a.bandwidth_gbs * 1e9);
        let per_tok = s / n as f64;
        println!(
            "{ctx:>8} {:>12.1} {:>10.3} {:>10.3} {:>8.1}",
            n as f64 / s,
            per_tok * 1e3,
            bytes.total() as f64 / 1e9,
            100.0 * floor_s / per_tok
        );
        decode_rows.push(json!({
            "ctx": ctx,
            "tok_s": n as f64 / s,
            "ms_per_tok": per_tok * 1e3,
            "bytes_per_tok": {"weights": bytes.weights, "state": bytes.state, "kv": bytes.kv},
            "floor_fraction": floor_s / per_tok,
            "bandwidth_gbs": a.bandwidth_gbs,
        }));
    }
    let batches: Vec<usize> = a.batch.iter().copied().filter(|&n| n > 1).collect();
    let mut batch_rows = Vec::new();
    if !batches.is_empty() {
        println!(
            "{:>8} {:>8} {:>12} {:>10} {:>10}",
            "batch", "ctx", "tok/s", "ms/step", "× one"
        );
    }
    for &rows in &batches {
        for (&ctx, one) in decode.iter().zip(&decode_rows) {
            let n = a.decode_tokens.max(1);
            let s = median(
                (0..repeat)
                    .map(|_| time_decode_batch(b.as_mut(), ctx.max(1), rows, n, &sampling, a.seed))
                    .collect::<Result<_>>()?,
            );
            let tok_s = (rows * n) as f64 / s;
            let ratio = tok_s / one["tok_s"].as_f64().unwrap_or(f64::NAN);
            println!(
                "{rows:>8} {ctx:>8} {tok_s:>12.1} {:>10.3} {ratio:>10.2}",
                s / n as f64 * 1e3
            );
            batch_rows.push(json!({
                "batch": rows,
                "ctx": ctx,
                "tok_s": tok_s,
                "ms_per_step": s / n as f64 * 1e3,
                "vs_one": ratio,
            }));
        }
    }
    if let Some(profile) = lily_wgpu::profile::take_report() {
        eprintln!("{profile}");
        // The results again below the profile, for logs that keep only their tail.
        let rows = |v: &[serde_json::Value], key: &str| {
            v.iter()
                .map(|r| format!("{} {:.1} tok/s", r[key], r["tok_s"].as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        };
        eprintln!(
            "bench results: prefill {}; decode at context {}",
            rows(&prefill_rows, "len"),
            rows(&decode_rows, "ctx")
        );
    }
    if let Some(path) = &a.json {
        let report = json!({
            "engine": "lily",
            "version": env!("CARGO_PKG_VERSION"),
            "gpu": device,
            "model": a.model.display().to_string(),
            "format": checkpoint_format(&a.model, a.quantize),
            "prefill": prefill_rows,
            "decode": decode_rows,
            "decode_batch": batch_rows,
        });
        let tmp = path.with_extension("json.partial");
        std::fs::write(&tmp, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}
