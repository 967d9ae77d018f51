//! `lily-engine score`: teacher-forced logits of every position of a seeded random prompt, for
//! comparing backends and peers on the full-size model (issue: CUDA parity). Writes
//! `OUT.f32` (little-endian f32, `[len, vocab]`) and `OUT.json` (the token ids, the backend).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use crate::cli_bench::prompt;
use crate::device::{open_backend, CudaArgs, Device};

#[derive(Args)]
pub struct ScoreArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 192)]
    len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Output prefix: writes PREFIX.f32 and PREFIX.json.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    cuda: CudaArgs,
}

pub fn run(a: ScoreArgs) -> Result<()> {
    let mut b = open_backend(&a.model, a.device, false, &a.cuda)?;
    let ids = prompt(a.len, b.config().vocab, a.seed);
    let seq = b.new_seq(ids.len())?;
    let f32_path = a.out.with_extension("f32");
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&f32_path)
            .with_context(|| format!("cannot create {}", f32_path.display()))?,
    );
    let t = std::time::Instant::now();
    for piece in ids.chunks(64) {
        for v in b.prefill_all_logits(seq, piece)? {
            file.write_all(&v.to_le_bytes())?;
        }
    }
    file.flush()?;
    // describe() names the activation mode (e.g. "cuda NVIDIA H200 sm_90a (fp32 activations)").
    let meta = json!({"backend": b.describe(), "model": a.model.display().to_string(), "ids": ids, "seconds": t.elapsed().as_secs_f64()});
    std::fs::write(a.out.with_extension("json"), serde_json::to_string(&meta)?)?;
    eprintln!(
        "scored {} positions on {} in {:.1} s",
        ids.len(),
        b.describe(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
