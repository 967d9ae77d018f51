//! `lily-engine selftest`: runs a (small, synthetic) model on every device this machine has
//! against the CPU backend as the reference, then times a short prefill and decode on each, and
//! prints a plain-text report meant to be pasted into a bug report. Exit status 1 when a device
//! disagrees with the CPU.
//!
//! Agreement, per device: the teacher-forced logits of a seeded random prompt (relative L2 against
//! the CPU's, over every position) and the greedy tokens of `--steps` decode steps (all must be
//! identical). $LILY_SELFTEST_FAULT=DEVICE perturbs that device's results before the comparison
//! (the tests' way to check that a disagreeing device fails the run).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use lily_core::backend::{Backend, Flow};
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_cuda::{cuda_backend, CudaOptions};
use lily_wgpu::{WgpuBackend, WgpuOptions};

use crate::cli_bench::prompt;

#[derive(Args)]
pub struct SelftestArgs {
    /// The model to run (`lily selftest` makes a tiny synthetic one).
    #[arg(long)]
    model: PathBuf,
    /// Also test wgpu on a software adapter (lavapipe): slow, and only the wgpu code is checked,
    /// not a GPU.
    #[arg(long)]
    allow_software: bool,
    /// Prompt length of the agreement check (teacher-forced logits of every position).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Greedy decode steps whose tokens must match the CPU's.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Largest relative L2 error of the logits accepted.
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// Prompt length of the short prefill bench.
    #[arg(long, default_value_t = 128)]
    bench_prefill: usize,
    /// Decode steps of the short decode bench.
    #[arg(long, default_value_t = 32)]
    bench_decode: usize,
}

/// A device's backend, or why it was skipped.
type Opened = Result<Box<dyn Backend>, String>;

/// What one device produced for the agreement check.
struct Outputs {
    logits: Vec<f32>,
    tokens: Vec<u32>,
}

fn run_outputs(b: &mut dyn Backend, ids: &[u32], steps: usize) -> Result<Outputs> {
    let seq = b.new_seq(ids.len() + steps + 1)?;
    let r = (|| {
        let mut logits = Vec::new();
        for piece in ids.chunks(16) {
            logits.extend(b.prefill_all_logits(seq, piece)?);
        }
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let mut tokens = Vec::new();
        b.decode(seq, &mut sampler, steps, 0, &mut |step| {
            tokens.push(step.token);
            Flow::Continue
        })?;
        Ok(Outputs { logits, tokens })
    })();
    b.free_seq(seq);
    r
}

/// Seconds of a prefill of `ids` and of `n` decode steps after it.
fn bench(b: &mut dyn Backend, ids: &[u32], n: usize) -> Result<(f64, f64)> {
    let seq = b.new_seq(ids.len() + n + 2)?;
    let r = (|| {
        let t = Instant::now();
        for piece in ids.chunks(b.prefill_chunk().max(1)) {
            b.prefill(seq, piece)?;
        }
        b.logits(seq)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut sampler = Sampler::new(SamplingParams::greedy());
        let t = Instant::now();
        // n + 1 samples = n forward steps.
        b.decode(seq, &mut sampler, n + 1, 0, &mut |_| Flow::Continue)?;
        Ok((prefill_s, t.elapsed().as_secs_f64()))
    })();
    b.free_seq(seq);
    r
}

fn rel_l2(a: &[f32], reference: &[f32]) -> f64 {
    if a.len() != reference.len() {
        return f64::INFINITY;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(reference) {
        let d = *x as f64 - *y as f64;
        num += d * d;
        den += (*y as f64) * (*y as f64);
    }
    if num.is_nan() {
        return f64::INFINITY;
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

pub fn run(a: SelftestArgs) -> Result<()> {
    if a.prompt_len == 0 || a.steps == 0 {
        bail!("--prompt-len and --steps must be at least 1");
    }
    if !(a.tolerance.is_finite() && a.tolerance >= 0.0) {
        bail!("--tolerance must be a non-negative number");
    }
    let weights = std::sync::Arc::new(load(&a.model, &LoadOptions::default())?);
    let config = weights.config.clone();
    let needed = (a.prompt_len + a.steps).max(a.bench_prefill + a.bench_decode) + 2;
    if needed > config.max_position {
        bail!(
            "the test needs {needed} positions but the model's context is {}",
            config.max_position
        );
    }
    let fault = std::env::var("LILY_SELFTEST_FAULT").unwrap_or_default();
    let ids = prompt(a.prompt_len, config.vocab, 7);
    let bench_ids = prompt(a.bench_prefill.max(1), config.vocab, 8);

    println!("== Lily self-test ==");
    println!("lily-engine {}", env!("CARGO_PKG_VERSION"));
    println!(
        "os: {} {} ({})",
        std::env::consts::OS,
        std::env::consts::ARCH,
        os_detail()
    );
    println!("model: {}", a.model.display());
    println!(
        "check: logits of {} teacher-forced positions (rel. L2 <= {:e}) and {} greedy tokens identical to the CPU's",
        a.prompt_len, a.tolerance, a.steps
    );

    let mut reference = CpuBackend::new(weights.clone());
    let want = run_outputs(&mut reference, &ids, a.steps)?;
    drop(reference);

    // The devices: (name, backend or why it was skipped).
    let mut devices: Vec<(&str, Opened)> = vec![(
        "cpu",
        Ok(Box::new(CpuBackend::new(weights.clone())) as Box<dyn Backend>),
    )];
    let cuda_opts = CudaOptions {
        bf16_activations: false,
        ..CudaOptions::default()
    };
    devices.push((
        "cuda",
        cuda_backend(&weights, &cuda_opts).map_err(|e| format!("not available: {}", one_line(&e))),
    ));
    let wgpu = |allow_software| {
        WgpuBackend::new(
            &weights,
            WgpuOptions {
                allow_software,
                ..WgpuOptions::default()
            },
        )
        .map(|b| Box::new(b) as Box<dyn Backend>)
    };
    devices.push((
        "wgpu",
        match wgpu(false) {
            Ok(b) => Ok(b),
            Err(hw) if a.allow_software => {
                wgpu(true).map_err(|e| format!("not available: {}", one_line(&e))).map_err(
                    |sw| format!("{sw} (hardware adapter: {})", one_line(&hw)),
                )
            }
            Err(hw) => Err(format!(
                "no hardware GPU adapter ({}); a software one (lavapipe) is tested only with --allow-software",
                one_line(&hw)
            )),
        },
    ));

    let mut failed = Vec::new();
    let mut skipped = Vec::new();
    println!();
    println!("== devices ==");
    for (name, backend) in devices {
        let mut b = match backend {
            Ok(b) => b,
            Err(why) => {
                skipped.push((name, why));
                continue;
            }
        };
        println!("device: {name}");
        println!("  backend: {}", b.describe());
        let got = match run_outputs(b.as_mut(), &ids, a.steps) {
            Ok(mut got) => {
                if fault == name {
                    for (i, v) in got.logits.iter_mut().enumerate() {
                        *v += if i % 2 == 0 { 0.5 } else { -0.5 };
                    }
                    if let Some(t) = got.tokens.last_mut() {
                        *t = (*t + 1) % config.vocab as u32;
                    }
                    println!("  (fault injected by LILY_SELFTEST_FAULT={name})");
                }
                got
            }
            Err(e) => {
                println!("  agreement: FAILED to run: {}", one_line(&e));
                failed.push(name);
                continue;
            }
        };
        let err = rel_l2(&got.logits, &want.logits);
        let same = got
            .tokens
            .iter()
            .zip(&want.tokens)
            .take_while(|(x, y)| x == y)
            .count();
        let ok = err <= a.tolerance && got.tokens == want.tokens;
        println!(
            "  agreement: logits rel. L2 {err:.2e}; greedy tokens {same}/{} identical: {}",
            want.tokens.len(),
            if ok { "ok" } else { "DISAGREES with the CPU" }
        );
        if !ok {
            println!("    reference tokens: {:?}", want.tokens);
            println!("    device tokens:    {:?}", got.tokens);
            failed.push(name);
        }
        match bench(b.as_mut(), &bench_ids, a.bench_decode.max(1)) {
            Ok((p, d)) => println!(
                "  speed: prefill {:.1} tok/s ({} tokens), decode {:.1} tok/s ({} steps)",
                bench_ids.len() as f64 / p.max(1e-9),
                bench_ids.len(),
                a.bench_decode.max(1) as f64 / d.max(1e-9),
                a.bench_decode.max(1)
            ),
            Err(e) => {
                println!("  speed: FAILED: {}", one_line(&e));
                failed.push(name);
            }
        }
    }
    println!();
    println!("== skipped ==");
    if skipped.is_empty() {
        println!("(none)");
    }
    for (name, why) in &skipped {
        println!("{name}: {why}");
    }
    println!();
    println!("== result ==");
    if failed.is_empty() {
        println!("PASS: every device tested agrees with the CPU");
        Ok(())
    } else {
        println!(
            "FAIL: {} disagree(s) with the CPU or failed",
            failed.join(", ")
        );
        std::process::exit(1);
    }
}

/// The OS release where it can be read cheaply (Linux: /etc/os-release; macOS: sw_vers).
fn os_detail() -> String {
    #[cfg(target_os = "macos")]
    {
        if let Ok(out) = std::process::Command::new("sw_vers")
            .arg("-productVersion")
            .output()
        {
            let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !v.is_empty() {
                return format!("macOS {v}");
            }
        }
    }
    if let Ok(text) = std::fs::read_to_string("/etc/os-release") {
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("PRETTY_NAME=") {
                return v.trim_matches('"').to_string();
            }
        }
    }
    "release unknown".to_string()
}

#[cfg(test)]
mod tests {
    use super::rel_l2;

    #[test]
    fn rel_l2_of_known_vectors() {
        // ||(0.1, -0.2)|| / ||(3, 4)|| = sqrt(0.05) / 5.
        let e = rel_l2(&[3.1, 3.8], &[3.0, 4.0]);
        assert!((e - 0.05f64.sqrt() / 5.0).abs() < 1e-6, "{e}");
        assert_eq!(rel_l2(&[1.0], &[1.0, 2.0]), f64::INFINITY);
        assert_eq!(rel_l2(&[f32::NAN], &[1.0]), f64::INFINITY);
    }
}
