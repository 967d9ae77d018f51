//! embed.cu: token embedding rows dequantised from the packed table.

use anyhow::Result;

use super::{config, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};
use crate::weights::DevLinear;

pub const FILE: KernelFile = KernelFile {
    name: "embed",
    source: include_str!("../../../../shaders/cuda/embed.cu"),
    defines: &[],
};

/// x[n, :] = table row tokens[n] for n < n_tok (x rows are `table.cols` apart).
pub struct Lookup<'a> {
    pub table: &'a DevLinear,
    /// i32 [n_tok] token ids on the device.
    pub tokens: u64,
    pub x: u64,
    pub n_tok: usize,
}

pub struct Embed {
    embed: Kernel,
    embed_rows: Kernel,
}

impl Embed {
    pub fn load(m: &Module) -> Result<Embed> {
        Ok(Embed {
            embed: m.kernel("embed")?.waits_for_predecessor(),
            embed_rows: m.kernel("embed_rows")?.waits_for_predecessor(),
        })
    }

    /// One block of 128 threads per token.
    pub fn lookup(&self, gpu: &Gpu, a: &Lookup) -> Result<()> {
        let w = a.table.arg();
        let n_tok = a.n_tok as i32;
        let cfg = config((a.n_tok as u32, 1, 1), 128, 0);
        gpu.launch(&self.embed, cfg, |l| {
            l.arg(&w).arg(&a.tokens).arg(&a.x).arg(&n_tok);
        })
    }

    /// A batched decode step's tokens: x row t = table row of the token at `tokens[t]`, for
    /// `rows` rows (`tokens`: a device table of `rows` pointers to i32 token ids). One block of
    /// 128 threads a row.
    pub fn lookup_rows(
        &self,
        gpu: &Gpu,
        table: &DevLinear,
        tokens: u64,
        x: u64,
        rows: usize,
    ) -> Result<()> {
        if rows == 0 {
            anyhow::bail!("embed_rows: no rows");
        }
        let w = table.arg();
        let cfg = config((rows as u32, 1, 1), 128, 0);
        gpu.launch(&self.embed_rows, cfg, |l| {
            l.arg(&w).arg(&tokens).arg(&x);
        })
    }
}
