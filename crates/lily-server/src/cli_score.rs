//! `lily-engine score`: teacher-forced logits of every position of a seeded random prompt, for
//! comparing backends and peers on the full-size model (issue: CUDA parity). Writes
//! `OUT.f32` (little-endian f32, `[len, vocab]`) and `OUT.json` (the token ids, the backend).
//! `OUT.json` is written before the first position and again at the end (with the time), and each
//! piece's rows are flushed as they are done, so a run stopped early (e.g. by `timeout`) leaves
//! its first positions complete and usable (scripts/agreement_table.py reads whole rows only).
//!
//! `--rows N` (N ≥ 2) scores the same positions through the batched decode step
//! (`Backend::decode_step`, issue 32's path for several conversations): the prompt is row 0 of N
//! sequences stepped together, one position a step, each row held to its own next token by a
//! one-token mask (teacher forcing); rows 1.. are companions with prompts of their own seeds, so
//! row 0's step routes beside other rows' picks as a served batch does. Only row 0 is written, so
//! the output compares with any other run's of the same prompt.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;

use lily_core::backend::{Backend, DecodeRow, Flow, SeqId};
use lily_core::constrain::{MaskStats, TokenConstraint, TokenMask};
use lily_core::sampling::{Sampler, SamplingParams};

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
    /// Score through the batched decode step with this many sequences stepped together (the
    /// prompt and N − 1 companions; 1 = `--piece`'s prefill path).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    rows: u64,
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
    if a.rows > 1 {
        let companions: Vec<Vec<u32>> = (1..a.rows)
            .map(|r| prompt(a.len, vocab, a.seed.wrapping_add(1_000 + r)))
            .collect();
        let mut prompts = vec![ids.clone()];
        prompts.extend(companions);
        score_rows(b.as_mut(), seq, &prompts, &mut |pos, logits| {
            for v in logits {
                file.write_all(&v.to_le_bytes())?;
            }
            file.flush()?;
            done = pos + 1;
            if done % 64 == 0 || done == ids.len() {
                eprintln!(
                    "scored {done}/{} positions in {:.1} s ({} rows a step)",
                    ids.len(),
                    t.elapsed().as_secs_f64(),
                    a.rows
                );
            }
            Ok(())
        })?;
    } else {
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

/// Allows exactly the prompt's next token at each step (teacher forcing through a sampler).
struct Forced {
    tokens: Vec<u32>,
    next: usize,
    vocab: usize,
    mask: Option<TokenMask>,
}

impl TokenConstraint for Forced {
    fn mask(&mut self) -> Option<&TokenMask> {
        if self.mask.is_none() {
            let t = self.tokens.get(self.next).copied().unwrap_or(0);
            self.mask = Some(TokenMask::only(self.vocab, &[t]));
        }
        self.mask.as_ref()
    }

    fn commit(&mut self, _token: u32) {
        self.next += 1;
        self.mask = None;
    }

    fn stats(&self) -> MaskStats {
        MaskStats::default()
    }
}

/// Teacher-forces `prompts` (equal lengths; row 0 in `seq0`, new sequences for the others)
/// through `decode_step`, all rows one position a step, and hands row 0's logits of each position
/// to `out` (position, logits). Each row's first token is prefilled; the step's picks must be
/// the prompts' tokens (the one-token masks), which is checked.
fn score_rows(
    b: &mut dyn Backend,
    seq0: SeqId,
    prompts: &[Vec<u32>],
    out: &mut dyn FnMut(usize, Vec<f32>) -> Result<()>,
) -> Result<()> {
    let len = prompts[0].len();
    let vocab = b.config().vocab;
    let mut seqs = vec![seq0];
    for p in &prompts[1..] {
        seqs.push(b.new_seq(p.len())?);
    }
    for (s, p) in seqs.iter().zip(prompts) {
        b.prefill(*s, &p[..1])?;
    }
    out(0, b.logits(seq0)?)?;
    let mut samplers: Vec<Sampler> = prompts
        .iter()
        .map(|p| {
            let forced = Forced {
                tokens: p[1..].to_vec(),
                next: 0,
                vocab,
                mask: None,
            };
            Sampler::new(SamplingParams::greedy()).constrained(Some(Box::new(forced)))
        })
        .collect();
    for pos in 1..len {
        let mut picked = vec![None; seqs.len()];
        let mut rows = DecodeRow::each(&seqs, &mut samplers, 0);
        b.decode_step(&mut rows, &mut |r, o| {
            picked[r] = Some(o.token);
            Flow::Continue
        })?;
        for (r, p) in prompts.iter().enumerate() {
            anyhow::ensure!(
                picked[r] == Some(p[pos]),
                "row {r} position {pos}: the step picked {:?}, its mask allowed only {}",
                picked[r],
                p[pos]
            );
        }
        out(pos, b.logits(seq0)?)?;
    }
    for s in &seqs[1..] {
        b.free_seq(*s);
    }
    Ok(())
}
