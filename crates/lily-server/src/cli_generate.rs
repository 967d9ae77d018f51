use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use lily_core::backend::Flow;
use lily_core::config::ModelConfig;
use lily_core::sampling::{Sampler, SamplingParams};

use crate::device::{open_backend, BackendArgs, Device};

#[derive(Args)]
pub struct GenerateArgs {
    #[arg(long)]
    model: PathBuf,
    /// Comma-separated prompt token ids, e.g. 1,2,3
    #[arg(long)]
    prompt_ids: String,
    /// Tokens to generate; prompt plus these must fit the model's context.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Quantise an HF bf16 checkpoint to 4-bit at load.
    #[arg(long)]
    quantize: bool,
    /// auto (CUDA, else wgpu on a hardware GPU, else the CPU), cpu, cuda or wgpu.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    #[command(flatten)]
    backend: BackendArgs,
}

/// Prompt plus generated tokens must fit the model's context (`max_position_embeddings`).
fn check_fits(prompt: usize, max_tokens: usize, context: usize) -> Result<()> {
    if prompt.saturating_add(max_tokens) > context {
        anyhow::bail!(
            "--max-tokens {max_tokens} with a {prompt}-token prompt does not fit the model's context of {context} tokens: at most {} can be generated",
            context.saturating_sub(prompt)
        );
    }
    Ok(())
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
    let config = ModelConfig::from_dir(&a.model)?;
    check_fits(prompt.len(), a.max_tokens, config.max_position)?;
    let t0 = Instant::now();
    let mut backend = open_backend(&a.model, a.device, a.quantize, &a.backend)?;
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
    // Each id goes out as it is generated: `1,2,3` on one line, as before, but flushed token by
    // token so a long run shows progress (and a killed one keeps what it made).
    let mut stdout = std::io::stdout().lock();
    let mut write_error = None;
    backend.decode(seq, &mut sampler, a.max_tokens, 0, &mut |step| {
        let sep = if out.is_empty() { "" } else { "," };
        out.push(step.token);
        match write!(stdout, "{sep}{}", step.token).and_then(|()| stdout.flush()) {
            Ok(()) => Flow::Continue,
            Err(e) => {
                // stdout closed (`| head`): nobody reads the rest.
                write_error = Some(e);
                Flow::Stop
            }
        }
    })?;
    let decode_s = t2.elapsed().as_secs_f64();
    if let Some(e) = write_error {
        return Err(e).context("cannot write the generated ids to stdout");
    }
    writeln!(stdout).context("cannot write to stdout")?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_and_max_tokens_must_fit_the_context() {
        assert!(check_fits(3, 262_141, 262_144).is_ok());
        let err = check_fits(3, 262_142, 262_144).unwrap_err().to_string();
        assert!(err.contains("262144") && err.contains("262141"), "{err}");
        assert!(check_fits(3, usize::MAX, 262_144).is_err());
    }
}
