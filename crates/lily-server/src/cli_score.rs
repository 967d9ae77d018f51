//! `lily-engine score`: teacher-forced logits of every position of a seeded random prompt, for
//! comparing backends and peers on the full-size model (issue: CUDA parity). Writes
//! `OUT.f32` (little-endian f32, `[len, vocab]`) and `OUT.json` (the token ids, the backend).
//! `OUT.json` is written before the first position and again at the end (with the time), and each
//! piece's rows are flushed as they are done, so a run stopped early (e.g. by `timeout`) leaves
//! its first positions complete and usable (scripts/agreement_table.py reads whole rows only).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use crate::cli_bench::prompt;
use crate::device::{open_backend, BackendArgs, Device};

#[derive(Args)]
pub struct ScoreArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 192)]
    len: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Positions handed to the backend per call (its own prefill chunk may split them further).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    piece: u64,
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// Output prefix: writes PREFIX.f32 and PREFIX.json.
    #[arg(long)]
    out: PathBuf,
    #[command(flatten)]
    backend: BackendArgs,
}

pub fn run(a: ScoreArgs) -> Result<()> {
    let t_load = std::time::Instant::now();
    let mut b = open_backend(&a.model, a.device, false, &a.backend)?;
    let load_seconds = t_load.elapsed().as_secs_f64();
    let b_desc = b.describe();
    let vocab = b.config().vocab;
    let ids = prompt(a.len, vocab, a.seed);
    let seq = b.new_seq(ids.len())?;
    let f32_path = a.out.with_extension("f32");
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(&f32_path)
            .with_context(|| format!("cannot create {}", f32_path.display()))?,
    );
    // `seconds`: scoring only (null until done); `load_seconds`: opening the backend.
    let meta = |seconds: Option<f64>, done: usize| {
        json!({"backend": b_desc, "model": a.model.display().to_string(), "ids": ids, "vocab": vocab,
               "positions_done": done, "seconds": seconds, "load_seconds": load_seconds})
    };
    let json_path = a.out.with_extension("json");
    let write_meta = |m: serde_json::Value| -> Result<()> {
        std::fs::write(&json_path, serde_json::to_string(&m)?)
            .with_context(|| format!("cannot write {}", json_path.display()))
    };
    write_meta(meta(None, 0))?;
    let t = std::time::Instant::now();
    let mut done = 0;
    for piece in ids.chunks(a.piece as usize) {
        for v in b.prefill_all_logits(seq, piece)? {
            file.write_all(&v.to_le_bytes())?;
        }
        file.flush()?;
        done += piece.len();
        eprintln!(
            "scored {done}/{} positions in {:.1} s",
            ids.len(),
            t.elapsed().as_secs_f64()
        );
    }
    // describe() names the activation mode (e.g. "cuda NVIDIA H200 sm_90a (fp32 activations)").
    write_meta(meta(Some(t.elapsed().as_secs_f64()), done))?;
    eprintln!(
        "scored {} positions on {} in {:.1} s",
        ids.len(),
        b_desc,
        t.elapsed().as_secs_f64()
    );
    Ok(())
}
