//! `lily-engine selftest`: runs a (small, synthetic) model on every device this machine has
//! against the CPU backend as the reference, then times a short prefill and decode on each, and
//! prints a plain-text report meant to be pasted into a bug report. Exit status 1 when a device
//! disagrees with the CPU.
//!
//! Agreement, per device: the teacher-forced logits of a seeded random prompt (relative L2 against
//! the CPU's, over every position) and the greedy tokens of `--steps` decode steps (all must be
//! identical). $LILY_SELFTEST_FAULT=DEVICE perturbs that device's results before the comparison
//! (the tests' way to check that a disagreeing device fails the run).
//!
//! The GPU backends are checked as CUDA's parity mode does it: in fp32 (CUDA `--fp32-activations`;
//! wgpu with every f16 option off: activations, KV cache, product tiles, cooperative matrices),
//! where only the kernels' summation order differs from the CPU, against `--tolerance` (1e-3).
//! wgpu is then checked again in the configuration it ships on this adapter (`--wgpu-*` flags
//! as serve takes them; the plan decides the `auto` ones: f16 on Apple and NVIDIA GPUs),
//! where that rounds anything to f16, against `--f16-tolerance`; the report names each
//! configuration, its bound and its error, and a failing f16 check says which flags serve in
//! fp32.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use lily_core::backend::{Backend, Flow};
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_cuda::{cuda_backend, CudaOptions};
use lily_wgpu::{Choice, WgpuBackend, WgpuOptions};

use crate::cli_bench::prompt;
use crate::device::WgpuArgs;

/// `--f16-tolerance`'s default: the largest relative L2 error of the logits (teacher-forced,
/// and of the one-token steps) accepted where the configuration rounds values to f16 (2^-11
/// relative a store, ≈ 6 stores on a layer's longest path, amplified by the random weights and
/// the occasional near-tied routing flip that the DeltaNet state carries over a few positions).
/// Measured with selftest's 32 positions and 16 steps, f16 activations + KV cache on lavapipe
/// (session 18): `tiny` 3.2e-3 / 2.2e-3 (steps), `small` 2.8e-2 / 3.9e-2; f16 activations
/// 2.5e-2 (`tiny`, seed 7) and 1.1e-2 (`small`; session 12); the f16 product tiles 1.9e-2
/// (`small`, the H200); the full model's f16 activations 5.7e-2 from CUDA fp32 over 1,024
/// positions (the H200). 1e-1 lies 2.5× above the largest of selftest's and 2.5× under a
/// perturbation of ±0.5 a logit (LILY_SELFTEST_FAULT: 0.25 on `tiny`); a wrong f16 kernel (an
/// offset, a size, a conversion) moves the logits by O(1).
pub const F16_TOLERANCE: f64 = 1e-1;

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
    /// Largest relative L2 error of the logits accepted in fp32 (the CPU, CUDA's fp32 mode, wgpu
    /// with every f16 option off).
    #[arg(long, default_value_t = 1e-3)]
    tolerance: f64,
    /// Largest relative L2 error of the logits accepted where wgpu's shipping configuration
    /// rounds values to f16 (f16 activations, KV cache or products).
    #[arg(long, default_value_t = F16_TOLERANCE)]
    f16_tolerance: f64,
    /// Prompt length of the short prefill bench.
    #[arg(long, default_value_t = 128)]
    bench_prefill: usize,
    /// Decode steps of the short decode bench.
    #[arg(long, default_value_t = 32)]
    bench_decode: usize,
    /// wgpu's shipping configuration, as serve takes it (`--wgpu-f16-acts on` checks f16
    /// activations on any adapter with SHADER_F16).
    #[command(flatten)]
    wgpu: WgpuArgs,
}

/// A device's backend, or why it was skipped.
type Opened = Result<Box<dyn Backend>, String>;

/// What one device produced for the agreement check.
struct Outputs {
    logits: Vec<f32>,
    tokens: Vec<u32>,
}

/// The logits after the prompt `ids` and after each of `tokens` but the last fed one at a time
/// (one-token steps: the decode kernels), i.e. teacher-forced on the reference's greedy tokens:
/// where f16 may flip a near-tied greedy pick and the sequences part, this still compares every
/// step's decode kernels with the CPU's.
fn stepped_logits(b: &mut dyn Backend, ids: &[u32], tokens: &[u32]) -> Result<Vec<f32>> {
    let seq = b.new_seq(ids.len() + tokens.len() + 1)?;
    let r = (|| {
        for piece in ids.chunks(16) {
            b.prefill(seq, piece)?;
        }
        let mut out = b.logits(seq)?;
        for &t in &tokens[..tokens.len().saturating_sub(1)] {
            b.prefill(seq, &[t])?;
            out.extend(b.logits(seq)?);
        }
        Ok(out)
    })();
    b.free_seq(seq);
    r
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

/// wgpu's fp32 configuration: `shipping` with every f16 option off (activations, KV cache,
/// product tiles, cooperative matrices' f16 operands), as CUDA's `--fp32-activations`: only the
/// summation order differs from the CPU.
fn fp32_options(shipping: &WgpuOptions) -> WgpuOptions {
    WgpuOptions {
        f16_acts: Choice::Off,
        f16_kv: Choice::Off,
        f16_tiles: false,
        coop: false,
        ..shipping.clone()
    }
}

/// What `b`'s plan rounds to f16 (empty: nothing, fp32 throughout).
fn f16_parts(b: &WgpuBackend) -> Vec<&'static str> {
    let p = b.plan();
    [
        (p.act_f16, "f16 activations"),
        (p.kv_f16, "f16 KV cache"),
        (p.coop > 0, "f16 operands on cooperative matrices"),
        (p.tile_f16 && p.coop == 0, "f16 product tiles"),
    ]
    .into_iter()
    .filter_map(|(on, what)| on.then_some(what))
    .collect()
}

/// The flags that serve without `parts` (`f16_parts`).
fn fp32_flags(parts: &[&str]) -> String {
    let flag = |part: &str| match part {
        "f16 activations" => "--wgpu-f16-acts off",
        "f16 KV cache" => "--wgpu-f16-kv off",
        "f16 operands on cooperative matrices" => "--wgpu-no-coop",
        _ => "no --wgpu-f16-tiles",
    };
    parts.iter().map(|p| flag(p)).collect::<Vec<_>>().join(" ")
}

/// What the reference (the CPU) gave: the teacher-forced logits and greedy tokens
/// (`run_outputs`) and the logits of one-token steps on those tokens (`stepped_logits`).
struct Reference {
    outputs: Outputs,
    stepped: Vec<f32>,
}

/// Runs the agreement check on `b` and prints its line; whether it agrees with the CPU (`want`).
/// `f16`: `None` for fp32 (the logits within `a.tolerance`, the greedy tokens identical); for a
/// configuration that rounds to f16, its label and bound: the logits and the one-token steps on
/// the CPU's tokens within it, the greedy tokens reported but not required (f16 may flip a
/// near-tied pick, and the sequences part). `label`: the configuration (wgpu's two). `fault`:
/// perturb the outputs first (LILY_SELFTEST_FAULT).
fn agrees(
    b: &mut dyn Backend,
    label: Option<&str>,
    f16: Option<f64>,
    ids: &[u32],
    want: &Reference,
    a: &SelftestArgs,
    fault: Option<&str>,
) -> bool {
    let bound = f16.unwrap_or(a.tolerance);
    let label = label
        .map(|l| format!(" ({l}, bound {bound:e})"))
        .unwrap_or_default();
    let run = |b: &mut dyn Backend| -> Result<(Outputs, Option<Vec<f32>>)> {
        let got = run_outputs(b, ids, a.steps)?;
        let stepped = match f16 {
            Some(_) => Some(stepped_logits(b, ids, &want.outputs.tokens)?),
            None => None,
        };
        Ok((got, stepped))
    };
    let (mut got, mut stepped) = match run(b) {
        Ok(r) => r,
        Err(e) => {
            println!("  agreement{label}: FAILED to run: {}", one_line(&e));
            return false;
        }
    };
    if let Some(name) = fault {
        let perturb = |v: &mut Vec<f32>| {
            for (i, x) in v.iter_mut().enumerate() {
                *x += if i % 2 == 0 { 0.5 } else { -0.5 };
            }
        };
        perturb(&mut got.logits);
        if let Some(s) = stepped.as_mut() {
            perturb(s);
        }
        if let Some(t) = got.tokens.last_mut() {
            *t = (*t + 1) % b.config().vocab as u32;
        }
        println!("  (fault injected by LILY_SELFTEST_FAULT={name})");
    }
    let want_tokens = &want.outputs.tokens;
    let err = rel_l2(&got.logits, &want.outputs.logits);
    let same = got
        .tokens
        .iter()
        .zip(want_tokens)
        .take_while(|(x, y)| x == y)
        .count();
    let (ok, steps) = match &stepped {
        None => (err <= bound && got.tokens == *want_tokens, String::new()),
        Some(s) => {
            let e = rel_l2(s, &want.stepped);
            (
                err <= bound && e <= bound,
                format!(" one-token steps on the CPU's tokens rel. L2 {e:.2e};"),
            )
        }
    };
    let tokens_note = if f16.is_some() && same < want_tokens.len() {
        " (not required in f16: a near-tied pick of the random model may flip)"
    } else {
        ""
    };
    println!(
        "  agreement{label}: logits rel. L2 {err:.2e};{steps} greedy tokens {same}/{} identical{tokens_note}: {}",
        want_tokens.len(),
        if ok { "ok" } else { "DISAGREES with the CPU" }
    );
    if !ok || same < want_tokens.len() {
        println!("    reference tokens: {:?}", want_tokens);
        println!("    device tokens:    {:?}", got.tokens);
    }
    ok
}

pub fn run(a: SelftestArgs) -> Result<()> {
    if a.prompt_len == 0 || a.steps == 0 {
        bail!("--prompt-len and --steps must be at least 1");
    }
    for (flag, t) in [
        ("--tolerance", a.tolerance),
        ("--f16-tolerance", a.f16_tolerance),
    ] {
        if !(t.is_finite() && t >= 0.0) {
            bail!("{flag} must be a non-negative number");
        }
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
        "check: logits of {} teacher-forced positions (rel. L2 <= {:e} in fp32; <= {:e} where wgpu's shipping configuration rounds to f16) and {} greedy tokens identical to the CPU's",
        a.prompt_len, a.tolerance, a.f16_tolerance, a.steps
    );

    let mut reference = CpuBackend::new(weights.clone());
    let outputs = run_outputs(&mut reference, &ids, a.steps)?;
    let stepped = stepped_logits(&mut reference, &ids, &outputs.tokens)?;
    let want = Reference { outputs, stepped };
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
    // wgpu: first in fp32 (the kernels' check), then as it ships on this adapter.
    let shipping = a.wgpu.options();
    let fp32 = fp32_options(&shipping);
    let open_wgpu = |opts: &WgpuOptions, allow_software| {
        WgpuBackend::new(
            &weights,
            WgpuOptions {
                allow_software,
                ..opts.clone()
            },
        )
    };
    let (wgpu, software) = match open_wgpu(&fp32, false) {
        Ok(b) => (Ok(b), false),
        Err(hw) if a.allow_software => (
            open_wgpu(&fp32, true)
                .map_err(|e| format!("not available: {}", one_line(&e)))
                .map_err(|sw| format!("{sw} (hardware adapter: {})", one_line(&hw))),
            true,
        ),
        Err(hw) => (
            Err(format!(
                "no hardware GPU adapter ({}); a software one (lavapipe) is tested only with --allow-software",
                one_line(&hw)
            )),
            false,
        ),
    };
    // What the fp32 configuration still rounds to f16 (only where the environment asked).
    let fp32_parts = wgpu.as_ref().map(f16_parts).unwrap_or_default();
    devices.push(("wgpu", wgpu.map(|b| Box::new(b) as Box<dyn Backend>)));

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
        let fault_here = (fault == name).then_some(name);
        let (label, f16) = match (name, fp32_parts.is_empty()) {
            ("wgpu", true) => (Some("fp32 configuration".to_string()), None),
            // Only where the environment asked for f16 (LILY_WGPU_F16_ACTS=on and the like).
            ("wgpu", false) => (
                Some(format!("{} from the environment", fp32_parts.join(", "))),
                Some(a.f16_tolerance),
            ),
            _ => (None, None),
        };
        let fp32_ok = agrees(
            b.as_mut(),
            label.as_deref(),
            f16,
            &ids,
            &want,
            &a,
            fault_here,
        );
        let mut ok = fp32_ok;
        if name == "wgpu" {
            // The configuration that ships here, checked where it rounds anything to f16 (also
            // where the fp32 check failed: the report shows both).
            match open_wgpu(&shipping, software) {
                Err(e) => {
                    println!("  shipping configuration: FAILED to open: {}", one_line(&e));
                    ok = false;
                }
                Ok(ship) => {
                    let parts = f16_parts(&ship);
                    if parts.is_empty() {
                        let why: Vec<&str> = ship
                            .plan()
                            .notes
                            .iter()
                            .map(String::as_str)
                            .filter(|n| n.starts_with("f16 "))
                            .collect();
                        println!(
                            "  shipping configuration: the fp32 one ({})",
                            if why.is_empty() {
                                "no f16 asked for".to_string()
                            } else {
                                why.join("; ")
                            }
                        );
                    } else {
                        let mut ship: Box<dyn Backend> = Box::new(ship);
                        println!("  backend (shipping configuration): {}", ship.describe());
                        let label = format!("shipping configuration: {}", parts.join(", "));
                        let f16_ok = agrees(
                            ship.as_mut(),
                            Some(&label),
                            Some(a.f16_tolerance),
                            &ids,
                            &want,
                            &a,
                            fault_here,
                        );
                        if f16_ok {
                            // The speed of what ships.
                            b = ship;
                        } else {
                            ok = false;
                            if fp32_ok {
                                println!(
                                    "    the fp32 configuration agrees: to serve in it, run with {} (and please report this output)",
                                    fp32_flags(&parts)
                                );
                            }
                        }
                    }
                }
            }
        }
        if !ok {
            failed.push(name);
            continue;
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
