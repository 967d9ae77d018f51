use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};

#[derive(Args)]
pub struct SynthArgs {
    /// tiny | small | qwen3.6-35b-a3b
    #[arg(long)]
    preset: Preset,
    /// hf (bf16) | mlx (4-bit affine, group 64)
    #[arg(long, default_value = "mlx")]
    format: SynthFormat,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Output directory (must not exist or be empty).
    #[arg(long)]
    out: PathBuf,
    /// A directory with tokenizer.json (and template/config files) to copy in.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Override the preset's layer count (a multiple of 4), keeping its widths.
    #[arg(long)]
    layers: Option<usize>,
}

pub fn run(a: SynthArgs) -> Result<()> {
    let report = synth(&SynthOptions {
        preset: a.preset,
        format: a.format,
        seed: a.seed,
        out: a.out.clone(),
        tokenizer: a.tokenizer,
        layers: a.layers,
    })?;
    println!(
        "wrote {} ({:.3} GB in {} file(s)) in {:.1} s",
        a.out.display(),
        report.bytes as f64 / 1e9,
        report.files,
        report.seconds
    );
    Ok(())
}
