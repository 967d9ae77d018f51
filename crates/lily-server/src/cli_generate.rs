use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use lily_core::backend::Flow;
use lily_core::sampling::{Sampler, SamplingParams};

use crate::device::{open_backend, CudaArgs, Device};

#[derive(Args)]
pub struct GenerateArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated prompt token ids, e.g. 1,2,3
    #[arg(long)]
    prompt_ids: String,
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Quantise an HF bf16 checkpoint to 4-bit at load.
    #[arg(long)]
    quantize: bool,
    /// auto (CUDA, else wgpu on a hardware GPU, else the CPU), cpu, cuda or wgpu.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    cuda: CudaArgs,
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let prompt: Vec<u32> = a
        .prompt_ids
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<u32>()
                .with_context(|| format!("--prompt-ids: {s:?} is not a token id"))
        })
        .collect::<Result<_>>()?;
    if prompt.is_empty() {
        anyhow::bail!("--prompt-ids is empty");
    }
    let t0 = Instant::now();
    let mut backend = open_backend(&a.model, a.device, a.quantize, &a.cuda)?;
    eprintln!(
        "loaded {} in {:.2} s",
        a.model.display(),
        t0.elapsed().as_secs_f64()
    );
    let seq = backend.new_seq(prompt.len() + a.max_tokens)?;
    let t1 = Instant::now();
    backend.prefill(seq, &prompt)?;
    let prefill_s = t1.elapsed().as_secs_f64();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut out = Vec::new();
    let t2 = Instant::now();
    backend.decode(seq, &mut sampler, a.max_tokens, 0, &mut |step| {
        out.push(step.token);
        Flow::Continue
    })?;
    let decode_s = t2.elapsed().as_secs_f64();
    println!(
        "{}",
        out.iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    eprintln!(
        "prefill {} tokens: {:.1} tok/s; decode {} tokens: {:.1} tok/s ({})",
        prompt.len(),
        prompt.len() as f64 / prefill_s,
        out.len(),
        out.len().saturating_sub(1) as f64 / decode_s.max(1e-9),
        backend.describe()
    );
    Ok(())
}
