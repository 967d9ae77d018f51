//! `WgpuBackend`: the `Backend` contract (lily-core/src/backend.rs) on one wgpu adapter.
//! Prefill runs in chunks of at most `chunk` tokens; greedy decode picks the token on the GPU
//! and the next step embeds it from there, so the id only crosses to the host to be reported.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use lily_core::backend::{Backend, Flow, SeqId, SnapshotId, StepOut};
use lily_core::config::ModelConfig;
use lily_core::logprob::{token_logprob, LogSoftmax};
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::weights::ModelWeights;

use crate::forward::{
    check_attention, check_mm, check_mm_bits, check_rows, conv_bytes, kv_row_bytes, probe_mm,
    state_bytes, uniform_words, DevicePick, Forward, LogitsOut, Scratch, SeqState, HIST_COUNT,
    HIST_SEEN, PICK_MAX_K,
};
use crate::gpu::{describe_adapter, Gpu, Recorder};
use crate::kernels::{
    attend_gqa_for, attend_tile_for, coop_diag, coop_emulated, coop_kernel, coop_variants,
    passthrough_mm, tile_group, Kernels,
};
use crate::weights::{stack_shared, upload_model, GpuMixer, GpuModel};

/// How the backend runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgpuOptions {
    /// Largest prefill chunk in tokens (activation scratch is sized for it). Default 2048
    /// ($LILY_WGPU_CHUNK overrides): a chunk's routed experts average 64 tokens each (256
    /// experts, 8 per token), so each expert's weights serve four tiles of linear_q4_mm and
    /// every dispatch fills the GPU (H200 via Vulkan, 4K prompt: 2,315 tok/s at 512 with the
    /// tiled attention off, 3,175 at 2048 with it on; docs/perf-notes.md, session 7). The
    /// largest activation (the DeltaNet input projections' output) is 101 MB at 2048, under
    /// the 128 MiB binding limit wgpu assumes by default.
    pub chunk: usize,
    /// Most positions whose logits one pass keeps (`prefill_all_logits`).
    pub all_logits_chunk: usize,
    /// Whether a software adapter (lavapipe) may be used.
    pub allow_software: bool,
    /// Keep wgpu's runtime bounds checks in the shaders (debugging; $LILY_WGPU_CHECKED=1).
    pub checked: bool,
    /// Cut weights into slices of at most this many bytes even where the device binds more
    /// (tests: exercises the sliced path on a tiny model).
    pub max_slice_bytes: Option<u64>,
    /// Run prefill's products through linear_q4_mm_coop.wgsl with its cooperative-matrix
    /// operations emulated in plain WGSL where the adapter has none (tests on lavapipe:
    /// `kernels::coop_emulated_source`). Slow; not for use. $LILY_WGPU_COOP_EMULATE=1 sets it
    /// (e.g. `lily-engine selftest --allow-software` on a full-width synthetic model).
    pub emulate_coop: bool,
    /// Prefill attention on attend_tile.wgsl (64 / G tokens × the G query heads of a KV head a
    /// workgroup: K and V read once per tile of tokens) instead of attend_gqa.wgsl, where the
    /// model's shapes allow (`kernels::tile_group`) and its check at load passes. On by
    /// default (H200 via Vulkan, 4K prompt: attention 49.4 → 12.3 µs a token);
    /// $LILY_WGPU_ATTN_TILE=0 turns it off.
    pub attn_tile: bool,
    /// Prefill's fp32 4-bit (and 8-bit) products on linear_q4_mm_t32.wgsl (tiles of 32 items,
    /// 4 × 8 register blocks) in linear_q4_mm.wgsl's place. Default `Dense`: on the H200 the
    /// DeltaNet input projections ran 73.9 → 67.4 µs a token on it while the experts' tiles ran
    /// 42.5 → 43.9 (chunk 2048, 4K prompt). $LILY_WGPU_MM_T32=1 sets `All`, =0 `Off`.
    pub mm_t32: MmT32,
}

/// Where prefill's fp32 products take linear_q4_mm_t32.wgsl (`WgpuOptions::mm_t32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmT32 {
    /// Nowhere: linear_q4_mm.wgsl (tiles of 16 items) throughout.
    Off,
    /// The plain (dense) products; the routed experts' tiles stay on linear_q4_mm.wgsl (an
    /// expert averages 16 items at chunk 512: tiles of 32 would run half empty).
    Dense,
    /// Every product, the routed experts' tiles (of 32) included.
    All,
}

impl Default for WgpuOptions {
    fn default() -> Self {
        let chunk = std::env::var("LILY_WGPU_CHUNK")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or(2048);
        WgpuOptions {
            chunk,
            all_logits_chunk: 32,
            allow_software: true,
            checked: std::env::var("LILY_WGPU_CHECKED").is_ok_and(|v| v == "1"),
            max_slice_bytes: None,
            emulate_coop: std::env::var("LILY_WGPU_COOP_EMULATE").is_ok_and(|v| v == "1"),
            attn_tile: !std::env::var("LILY_WGPU_ATTN_TILE").is_ok_and(|v| v == "0"),
            mm_t32: match std::env::var("LILY_WGPU_MM_T32").as_deref() {
                Ok("1") => MmT32::All,
                Ok("0") => MmT32::Off,
                _ => MmT32::Dense,
            },
        }
    }
}

pub struct WgpuBackend {
    // Field order matters for drop: buffers before the device.
    seqs: HashMap<u64, SeqState>,
    snaps: HashMap<u64, SeqState>,
    next_id: u64,
    scratch: Scratch,
    model: GpuModel,
    kernels: Kernels,
    cfg: ModelConfig,
    gpu: Gpu,
    coop_note: String,
}

/// Largest relative L2 difference between linear_q4_mm_coop.wgsl and the host's product at load
/// (`check_mm`) for the cooperative kernel to be used. Its operands (q − 8)·s are exact in f16
/// and the input's two f16 parts carry ≈ 22 bits, so a right kernel differs by ≈ 1e-7 (1.3e-7
/// emulated; the fp32 linear_q4_mm 4e-7); f16 inputs without their remainder ≈ 2e-4, the
/// former q·s operands rounded to f16 ≈ 4.5e-4 (the H200's probe), a wrong layout or a broken
/// driver path ≈ 1. 1e-4 keeps all but the first out.
const COOP_TOLERANCE: f64 = 1e-4;

/// Whether the device sampler (sample_adjust.wgsl, sample_pick.wgsl) takes these parameters:
/// temperature > 0 with top_k in 1..=256, or greedy on adjusted logits (penalties, logit_bias).
/// top_k 0 (the whole vocabulary) or above 256 samples on the host from read-back logits.
fn device_sampled(p: &SamplingParams) -> bool {
    if p.temperature <= 0.0 {
        !p.is_plain_greedy()
    } else {
        (1..=PICK_MAX_K).contains(&p.top_k)
    }
}


impl WgpuBackend {
    pub fn new(weights: &ModelWeights, opts: WgpuOptions) -> Result<WgpuBackend> {
        let gpu = Gpu::open(opts.allow_software)?;
        let mut kernels =
            Kernels::load(&gpu, &weights.config, stack_shared(weights), opts.checked)?;
        let mut mm_note = "";
        if opts.mm_t32 != MmT32::Off {
            let t32 = crate::gpu::Kernel::new(
                &gpu,
                "linear_q4_mm_t32",
                crate::kernels::COMMON,
                include_str!("../../../shaders/wgsl/linear_q4_mm_t32.wgsl"),
                opts.checked,
                &[],
            )?;
            let sixteen = std::mem::replace(&mut kernels.linear_q4_mm, t32);
            if opts.mm_t32 == MmT32::Dense {
                kernels.linear_q4_mm_expert = Some(sixteen);
                mm_note = "; fp32 dense products on linear_q4_mm_t32, expert tiles on linear_q4_mm";
            } else {
                mm_note = "; fp32 products on linear_q4_mm_t32 (LILY_WGPU_MM_T32=1)";
            }
        }
        let mut tile_note = String::new();
        if opts.attn_tile {
            let c = &weights.config;
            tile_note = match tile_group(c) {
                None => {
                    "; prefill attention on attend_gqa (attend_tile does not take these shapes)"
                        .into()
                }
                Some(g) => {
                    // Checked as attention is at load: a block of 37 tokens after 268 (tiles
                    // partly filled, several key blocks, the causal edge inside blocks).
                    let d = c.head_dim;
                    let k = attend_tile_for(&gpu, d, g, opts.checked)?;
                    let e = check_attention(&gpu, &k, None, (c.n_kv_heads, g, d), 305, 37)?;
                    if e < 1e-4 {
                        kernels.attend_tile = Some(k);
                        format!("; prefill attention on attend_tile (checked at load: {e:.1e} relative)")
                    } else {
                        format!("; prefill attention on attend_gqa (attend_tile refused at load: {e:.1e} relative)")
                    }
                }
            };
        }
        let mut coop_note = gpu.coop_note.clone();
        if opts.emulate_coop && kernels.linear_q4_mm_coop.is_none() {
            kernels.linear_q4_mm_coop = Some(coop_emulated(&gpu, opts.checked)?);
            coop_note = "cooperative matrices emulated in plain WGSL (a test)".into();
        }
        if kernels.linear_q4_mm_coop.is_some() {
            // The emulation (tests): checked as a real one would be.
            let e = check_mm(&gpu, kernels.linear_q4_mm_coop.as_ref().expect("just set"))?;
            coop_note = format!("{coop_note} (checked at load: {e:.1e} relative)");
            if e >= COOP_TOLERANCE {
                kernels.linear_q4_mm_coop = None;
            }
        } else if gpu.coop {
            let diag = std::env::var("LILY_WGPU_COOP_DIAG").is_ok_and(|v| v == "1");
            if diag {
                // What each cooperative-matrix operation does on this device (coop_diag.wgsl).
                match coop_diag(&gpu) {
                    Ok(lines) => {
                        for l in lines {
                            tracing::info!("wgpu: {l}");
                        }
                    }
                    Err(e) => tracing::info!("wgpu: coop diag failed: {e:#}"),
                }
            }
            // An experimental wgpu feature: the first usable variant whose product is right is
            // used (kernels::coop_variants; none that its check refuses). Under
            // $LILY_WGPU_COOP_DIAG=1 every variant is checked (the first right one still used)
            // and each refused one probed (forward::probe_mm: where its product goes wrong), so
            // that one run tests them all. Non-private variants only where the device takes
            // SPIR-V as is; $LILY_WGPU_COOP_NONPRIVATE=0 leaves them out (should a driver refuse
            // the words).
            let mut tried = Vec::new();
            let nonprivate_ok = gpu.passthrough
                && std::env::var("LILY_WGPU_COOP_NONPRIVATE").map_or(true, |v| v != "0");
            for v in coop_variants() {
                if (v.nonprivate && !nonprivate_ok) || (!v.usable && !diag) {
                    continue;
                }
                if kernels.linear_q4_mm_coop.is_some() && !diag {
                    break;
                }
                let name = v.name;
                let result = coop_kernel(&gpu, &v.source, opts.checked, v.nonprivate)
                    .and_then(|k| check_mm(&gpu, &k).map(|e| (k, e)));
                match result {
                    Ok((k, e)) if e < COOP_TOLERANCE && v.usable => {
                        if kernels.linear_q4_mm_coop.is_none() {
                            kernels.linear_q4_mm_coop = Some(k);
                            tried.push(format!("{name}: {e:.1e} relative, used"));
                        } else {
                            tried.push(format!("{name}: {e:.1e} relative, right"));
                        }
                    }
                    Ok((k, e)) => {
                        let what = if e < COOP_TOLERANCE {
                            "within"
                        } else {
                            "refused"
                        };
                        tried.push(format!("{name}: {e:.1e} relative, {what}"));
                        if diag {
                            match probe_mm(&gpu, &k) {
                                Ok(lines) => {
                                    for l in lines {
                                        tracing::info!("wgpu: {name}: {l}");
                                    }
                                }
                                Err(e) => tracing::info!("wgpu: {name}: coop probe failed: {e:#}"),
                            }
                        }
                    }
                    Err(e) => tried.push(format!("{name}: {e:#}")),
                }
            }
            let tried = tried.join("; ");
            coop_note = if kernels.linear_q4_mm_coop.is_some() {
                format!(
                    "{coop_note} (variants checked at load against the host's product: {tried})"
                )
            } else {
                format!("no cooperative matrices: no variant of linear_q4_mm_coop computed the host's product ({tried})")
            };
            tracing::info!("wgpu: {coop_note}");
        }
        let model = upload_model(&gpu, weights, opts.max_slice_bytes)
            .with_context(|| format!("uploading the weights to {}", gpu.info.name))?;
        let scratch = Scratch::new(
            &gpu,
            &weights.config,
            opts.chunk,
            opts.all_logits_chunk.clamp(1, opts.chunk),
        )?;
        gpu.wait()?;
        // Matrix products per layer's input projections (1 where q/k/v, and qkv/z/b/a, share
        // a format and were joined at load).
        let parts = |attn: bool| {
            model
                .layers
                .iter()
                .find_map(|l| match (&l.mixer, attn) {
                    (GpuMixer::Attention(a), true) => Some(a.qkv.parts.len()),
                    (GpuMixer::DeltaNet(d), false) => Some(d.in_proj.parts.len()),
                    _ => None,
                })
                .unwrap_or(0)
        };
        tracing::info!(
            "wgpu: {}, {:.2} GB of weights on the device, prefill chunk {}, input projections in {} (attention) / {} (DeltaNet) dispatches; {coop_note}{tile_note}{mm_note}",
            describe_adapter(&gpu.info),
            model.bytes as f64 / 1e9,
            opts.chunk,
            parts(true),
            parts(false),
        );
        Ok(WgpuBackend {
            seqs: HashMap::new(),
            snaps: HashMap::new(),
            next_id: 1,
            scratch,
            model,
            kernels,
            cfg: weights.config.clone(),
            gpu,
            coop_note,
        })
    }

    /// The 4-bit product kernels against the host's product on random matrices
    /// (`forward::check_mm`, `forward::check_rows`), relative L2 differences:
    /// linear_q4_mm.wgsl's (4- and 8-bit), linear_q4_rows.wgsl's, and linear_q4_mm_coop.wgsl's
    /// where it is in use.
    pub fn check_products(&self) -> Result<(f64, f64, Option<f64>)> {
        let fp32 = check_mm(&self.gpu, &self.kernels.linear_q4_mm)?.max(check_mm_bits(
            &self.gpu,
            &self.kernels.linear_q4_mm,
            8,
        )?);
        let rows = check_rows(&self.gpu, &self.kernels)?;
        let coop = match &self.kernels.linear_q4_mm_coop {
            Some(k) => Some(check_mm(&self.gpu, k)?),
            None => None,
        };
        Ok((fp32, rows, coop))
    }

    /// `forward::probe_mm` (where the product goes wrong, block by block) on prefill's 4-bit
    /// product kernel: linear_q4_mm_coop.wgsl where it is in use, else linear_q4_mm.wgsl.
    pub fn probe_products(&self) -> Result<Vec<String>> {
        probe_mm(
            &self.gpu,
            self.kernels
                .linear_q4_mm_coop
                .as_ref()
                .unwrap_or(&self.kernels.linear_q4_mm),
        )
    }

    /// `forward::probe_mm` on linear_q4_mm_coop.wgsl changed by `edit` (a known fault, to test
    /// what the probe's map says about it, or one of `kernels::coop_variants`), its cooperative
    /// operations emulated (`kernels::emulate_coop_source`).
    #[doc(hidden)]
    pub fn probe_emulated_with(&self, edit: impl Fn(&str) -> String) -> Result<Vec<String>> {
        let k = self.emulated_coop(&edit(include_str!(
            "../../../shaders/wgsl/linear_q4_mm_coop.wgsl"
        )))?;
        probe_mm(&self.gpu, &k)
    }

    /// linear_q4_mm_coop.wgsl's `source` (or a variant) compiled with its cooperative operations
    /// emulated (`kernels::emulate_coop_source`).
    fn emulated_coop(&self, source: &str) -> Result<crate::gpu::Kernel> {
        let source = crate::kernels::emulate_coop_source(source)?;
        crate::gpu::Kernel::new(
            &self.gpu,
            "linear_q4_mm_coop",
            crate::kernels::COMMON,
            &source,
            true,
            &[],
        )
    }

    /// `probe_emulated_with` on variant `i` of `kernels::coop_variants` (its name and lines).
    #[doc(hidden)]
    pub fn probe_emulated_variant(&self, i: usize) -> Result<(String, Vec<String>)> {
        let variants = crate::kernels::coop_variants();
        let v = variants.get(i).context("no such variant")?;
        Ok((
            v.name.to_string(),
            self.probe_emulated_with(|_| v.source.clone())?,
        ))
    }

    /// Variants `which` of `kernels::coop_variants` with their cooperative operations emulated,
    /// checked against the host's product (`forward::check_mm`) as the backend checks the real
    /// ones at load: (name, relative L2 difference) each.
    #[doc(hidden)]
    pub fn check_emulated_variants(&self, which: &[usize]) -> Result<Vec<(String, f64)>> {
        let mut out = Vec::new();
        let variants = crate::kernels::coop_variants();
        for &i in which {
            let v = variants.get(i).context("no such variant")?;
            let k = self
                .emulated_coop(&v.source)
                .with_context(|| format!("emulating and compiling {}", v.name))?;
            out.push((v.name.to_string(), check_mm(&self.gpu, &k)?));
        }
        Ok(out)
    }

    /// coop_diag_tile.wgsl (the diagnostic's run of linear_q4_mm_coop.wgsl's tile of products)
    /// changed by `edit`, with its cooperative operations emulated in plain WGSL
    /// (`kernels::emulate_coop_source`): its cases' lines, as the H200 would log them.
    #[doc(hidden)]
    pub fn coop_diag_tile_emulated(&self, edit: impl Fn(&str) -> String) -> Result<Vec<String>> {
        let src = edit(include_str!("../../../shaders/wgsl/coop_diag_tile.wgsl"));
        let source = crate::kernels::emulate_coop_source(&src)?;
        let k = crate::gpu::Kernel::new(
            &self.gpu,
            "coop_diag_tile",
            crate::kernels::COMMON,
            &source,
            true,
            &[],
        )?;
        crate::kernels::coop_diag_tile_run(&self.gpu, &k, " (emulated)", true)
    }

    /// linear_q4_mm.wgsl compiled to SPIR-V here, under the Vulkan memory model with its workgroup
    /// accesses marked non-private, handed to the driver as is (the path of the cooperative-matrix
    /// variants `kernels::mark_nonprivate` makes) against the host's product (`check_mm`); None
    /// where the device takes no SPIR-V as is.
    pub fn check_passthrough(&self) -> Result<Option<f64>> {
        if !self.gpu.passthrough {
            return Ok(None);
        }
        let (k, marked) = passthrough_mm(&self.gpu)?;
        if marked == 0 {
            bail!("no workgroup access marked non-private in linear_q4_mm");
        }
        Ok(Some(check_mm(&self.gpu, &k)?))
    }

    /// attend_gqa.wgsl (+ attend_merge.wgsl) against the host's attention in f64
    /// (`forward::check_attention`) at the full model's shapes (2 KV heads of 8 query heads,
    /// head dim 256) and at `tiny`'s (2 of 2, 64): decode at 1,000 and 77 positions (keys split
    /// over workgroups), and 5 tokens after 300 (prefill): the largest relative L2 difference.
    pub fn check_attention(&self) -> Result<f64> {
        let mut worst = 0f64;
        for (hkv, g, d) in [(2usize, 8usize, 256usize), (2, 2, 64)] {
            let k = attend_gqa_for(&self.gpu, d, g, false)?;
            for (n, t) in [(1000usize, 1usize), (77, 1), (305, 5)] {
                let merge = Some(&self.kernels.attend_merge);
                let e = check_attention(&self.gpu, &k, merge, (hkv, g, d), n, t)?;
                worst = worst.max(e);
            }
            // attend_tile.wgsl: tiles partly filled, the whole prompt in one block of tokens
            // (pos0 = 0), a block after a long cache, a single token.
            let k = attend_tile_for(&self.gpu, d, g, false)?;
            for (n, t) in [(305usize, 37usize), (64, 64), (700, 70), (41, 1)] {
                let e = check_attention(&self.gpu, &k, None, (hkv, g, d), n, t)?;
                worst = worst.max(e);
            }
        }
        Ok(worst)
    }

    /// Whether prefill's 4-bit products run on cooperative matrices (linear_q4_mm_coop.wgsl),
    /// and why or why not.
    pub fn coop(&self) -> (bool, &str) {
        (self.kernels.linear_q4_mm_coop.is_some(), &self.coop_note)
    }

    /// Whether prefill attention runs on attend_tile.wgsl (`WgpuOptions::attn_tile`).
    pub fn attn_tile(&self) -> bool {
        self.kernels.attend_tile.is_some()
    }

    /// The adapter in use.
    pub fn adapter(&self) -> &wgpu::AdapterInfo {
        &self.gpu.info
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(&seq.0)
            .with_context(|| format!("unknown sequence {}", seq.0))
    }

    fn forward(&self) -> Forward<'_> {
        Forward {
            gpu: &self.gpu,
            k: &self.kernels,
            model: &self.model,
            s: &self.scratch,
            cfg: &self.cfg,
        }
    }

    fn check_tokens(&self, seq: &SeqState, tokens: &[u32]) -> Result<()> {
        lily_core::backend::check_tokens(self.cfg.vocab, seq.len, seq.max_ctx, tokens)
    }

    /// Feeds `piece` (at most one chunk) from the host.
    fn feed(&mut self, seq: SeqId, piece: &[u32], out: LogitsOut) -> Result<()> {
        self.gpu
            .queue
            .write_buffer(&self.scratch.tokens, 0, bytemuck::cast_slice(piece));
        let s = self.seq(seq)?;
        self.forward()
            .run(s, &self.scratch.tokens, piece.len(), out)?;
        self.seqs.get_mut(&seq.0).expect("checked above").len += piece.len();
        Ok(())
    }

    /// One pick from `logits` (the vocabulary's) by the device sampler, as a decode step makes
    /// it: the sampler's uniform drawn where the host would draw it, its history and
    /// logit_bias applied. `None` where these parameters sample on the host (or greedy
    /// without adjustments: argmax_part/argmax_final). For tests against `Sampler::sample`.
    pub fn sample_on_device(
        &mut self,
        logits: &[f32],
        sampler: &mut Sampler,
    ) -> Result<Option<(u32, f32)>> {
        let p = &sampler.params;
        if logits.len() != self.cfg.vocab {
            bail!(
                "{} logits for a vocabulary of {}",
                logits.len(),
                self.cfg.vocab
            );
        }
        if p.is_plain_greedy() || !device_sampled(p) {
            return Ok(None);
        }
        let d = self.device_pick(sampler)?;
        let l = self.gpu.upload_f32("sample_test.logits", logits)?;
        let out = self.gpu.storage("sample_test.out", 8)?;
        let u = if p.temperature > 0.0 {
            sampler.next_uniform()
        } else {
            0.0
        };
        self.forward().sample(&l, &out, &d, u)?;
        let r = self.gpu.read_u32(&out, 2)?;
        Ok(Some((r[0], f32::from_bits(r[1]))))
    }

    /// Decode picked on the GPU (greedy, or the device sampler `dev`) without a constraint or
    /// top log-probabilities, pipelined: while the GPU runs step s (forward pass, pick, the
    /// token copied into a mapped buffer), the host encodes step s + 1 (which embeds the token
    /// straight from `next`), then reads token s, reports it and submits step s + 1 only if the
    /// caller continues, drawing its uniform then (as the host path draws it). The host's
    /// encoding is off the critical path; one submission and one small read per token.
    fn decode_pipelined(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        dev: Option<&DevicePick>,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        let rb = self.gpu.readback("decode.token", 8);
        let draws = dev.is_some() && sampler.params.temperature > 0.0;
        let s = self.seq(seq)?;
        match dev {
            Some(d) => {
                let u = if draws { sampler.next_uniform() } else { 0.0 };
                self.forward().sample_into(s, d, u, &rb)?;
            }
            None => self.forward().argmax_into(s, &rb)?,
        }
        for step in 0..n {
            let s = self.seq(seq)?;
            let more = step + 1 < n && s.len < s.max_ctx;
            let fwd = self.forward();
            let prepared = match (more, dev) {
                (false, _) => None,
                (true, Some(d)) => Some(fwd.prepare_sample_step(s, &s.next, d, &rb)?),
                (true, None) => Some(fwd.prepare_step(s, &s.next, &rb)?),
            };
            let out = self.gpu.read_mapped_u32(&rb, 2)?;
            if out[0] as usize >= self.cfg.vocab {
                bail!("the GPU picked token {}, outside the vocabulary", out[0]);
            }
            let token = out[0];
            sampler.accept(token);
            let flow = on_token(&StepOut {
                token,
                logprob: f32::from_bits(out[1]),
                top: Vec::new(),
            });
            if flow == Flow::Stop || step + 1 == n {
                break;
            }
            let Some(p) = prepared else {
                bail!("the sequence's context of {} tokens is full", s.max_ctx);
            };
            if draws {
                p.submit_with_uniform(uniform_words(sampler.next_uniform()))?;
            } else {
                p.submit()?;
            }
            self.seqs.get_mut(&seq.0).expect("checked above").len += 1;
        }
        self.gpu.wait()
    }

    /// The device sampler for `sampler`: its parameters, history and logit_bias uploaded.
    fn device_pick(&self, sampler: &Sampler) -> Result<DevicePick> {
        let p = &sampler.params;
        let vocab = self.cfg.vocab;
        let hist = sampler.device_history(vocab);
        let bias = p.sorted_logit_bias(vocab);
        let words: Vec<u32> = bias.iter().flat_map(|e| [e.0, e.1.to_bits()]).collect();
        let greedy = p.temperature <= 0.0;
        Ok(DevicePick {
            hist: self
                .gpu
                .upload("sampler.hist", bytemuck::cast_slice(&hist))?,
            bias: self
                .gpu
                .upload("sampler.bias", bytemuck::cast_slice(&words))?,
            n_bias: bias.len() as u32,
            scaled: self.gpu.storage("sampler.scaled", vocab as u64 * 4)?,
            cand: self.gpu.storage(
                "sampler.candidates",
                (vocab.div_ceil(1024) * PICK_MAX_K as usize * 8) as u64,
            )?,
            parts: self
                .gpu
                .storage("sampler.parts", (vocab.div_ceil(1024) * 8) as u64)?,
            inv_t: if greedy { 1.0 } else { 1.0 / p.temperature },
            top_k: if greedy { 1 } else { p.top_k },
            top_p: if greedy { 1.0 } else { p.top_p },
            min_p: if greedy { 0.0 } else { p.min_p },
            repetition: p.repetition_penalty,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
        })
    }

    /// A copy of every buffer of `s` (KV rows up to its length) made on the device, in one
    /// submission.
    fn duplicate(&self, s: &SeqState, max_ctx: usize) -> Result<SeqState> {
        let c = &self.cfg;
        let d = SeqState::new(&self.gpu, c, max_ctx)?;
        let mut r = Recorder::new(&self.gpu);
        let kv = s.len as u64 * kv_row_bytes(c);
        for (a, b) in s.kv.iter().zip(&d.kv) {
            if let (Some((ka, va)), Some((kb, vb))) = (a, b) {
                r.copy(ka, 0, kb, 0, kv);
                r.copy(va, 0, vb, 0, kv);
            }
        }
        for (a, b) in s.dn.iter().zip(&d.dn) {
            if let (Some((sa, ca)), Some((sb, cb))) = (a, b) {
                r.copy(sa, 0, sb, 0, state_bytes(c));
                r.copy(ca, 0, cb, 0, conv_bytes(c));
            }
        }
        r.copy(&s.logits, 0, &d.logits, 0, s.logits.size());
        r.copy(&s.next, 0, &d.next, 0, 8);
        r.submit()?;
        Ok(SeqState { len: s.len, ..d })
    }
}

impl Drop for WgpuBackend {
    fn drop(&mut self) {
        if let Some(r) = crate::gpu::profile::take_report() {
            tracing::info!("{r}");
        }
    }
}

impl Backend for WgpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn describe(&self) -> String {
        format!(
            "wgpu {} ({:?}, fp32 activations)",
            self.gpu.info.name, self.gpu.info.backend
        )
    }

    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        if max_ctx == 0 {
            bail!("a sequence needs a context of at least one token");
        }
        let s = SeqState::new(&self.gpu, &self.cfg, max_ctx)?;
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, s);
        Ok(SeqId(id))
    }

    fn free_seq(&mut self, seq: SeqId) {
        if self.seqs.remove(&seq.0).is_some() {
            self.gpu.forget_bind_groups();
        }
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.check_tokens(self.seq(seq)?, tokens)?;
        for piece in tokens.chunks(self.scratch.chunk) {
            self.feed(seq, piece, LogitsOut::Last)?;
        }
        self.gpu.wait()
    }

    fn prefill_chunk(&self) -> usize {
        self.scratch.chunk
    }

    fn prefill_all_logits(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_tokens(self.seq(seq)?, tokens)?;
        let v = self.cfg.vocab;
        let mut all = Vec::with_capacity(tokens.len() * v);
        for piece in tokens.chunks(self.scratch.all_chunk) {
            self.feed(seq, piece, LogitsOut::All)?;
            all.extend(
                self.gpu
                    .read_f32(&self.scratch.all_logits, 0, piece.len() * v)?,
            );
        }
        Ok(all)
    }

    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        let s = self.seq(seq)?;
        if s.len == 0 {
            bail!("the sequence has no logits yet: prefill first");
        }
        self.gpu.read_f32(&s.logits, 0, self.cfg.vocab)
    }

    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        if self.seq(seq)?.len == 0 {
            bail!("decode before prefill: no logits to sample from");
        }
        let greedy = sampler.params.is_plain_greedy();
        let dev = if !greedy && device_sampled(&sampler.params) {
            Some(self.device_pick(sampler)?)
        } else {
            None
        };
        if (greedy || dev.is_some()) && !sampler.is_constrained() && top_logprobs == 0 {
            return self.decode_pipelined(seq, sampler, n, dev.as_ref(), on_token);
        }
        // The device sampler draws the host's uniform only where the host would (temperature).
        let draws = sampler.params.temperature > 0.0;
        // Whether `next` already holds the GPU's pick from the pending logits (a step records
        // the pick with the forward pass).
        let mut picked = false;
        for step in 0..n {
            // A constrained step (a grammar's token mask; lily-core `constrain`) picks on the
            // host, where the mask applies: the GPU's kernels take no mask.
            let masked = sampler.next_mask().is_some();
            let s = self.seq(seq)?;
            let (token, logprob, top) = if (greedy || dev.is_some()) && !masked {
                if !picked {
                    match &dev {
                        Some(d) => {
                            let u = if draws { sampler.next_uniform() } else { 0.0 };
                            self.forward().sample(&s.logits, &s.next, d, u)?;
                        }
                        None => self.forward().argmax(s)?,
                    }
                }
                let out = self.gpu.read_u32(&s.next, 2)?;
                if out[0] as usize >= self.cfg.vocab {
                    bail!("the GPU picked token {}, outside the vocabulary", out[0]);
                }
                let top = if top_logprobs > 0 {
                    let logits = self.gpu.read_f32(&s.logits, 0, self.cfg.vocab)?;
                    LogSoftmax::new(&logits).top(top_logprobs)
                } else {
                    Vec::new()
                };
                (out[0], f32::from_bits(out[1]), top)
            } else {
                let logits = self.gpu.read_f32(&s.logits, 0, self.cfg.vocab)?;
                let id = sampler.sample(&logits);
                if id as usize >= self.cfg.vocab {
                    bail!("the sampler chose token {id}, outside the vocabulary");
                }
                self.gpu
                    .queue
                    .write_buffer(&s.next, 0, bytemuck::bytes_of(&id));
                let (lp, top) = token_logprob(&logits, id, top_logprobs);
                (id, lp, top)
            };
            sampler.accept(token);
            if masked {
                if let Some(d) = &dev {
                    // The host picked: the device history follows, as the kernel would have.
                    let count = sampler
                        .output_counts()
                        .find(|e| e.0 == token)
                        .map_or(0, |e| e.1)
                        .min(HIST_COUNT);
                    let seen = if d.repetition != 1.0 { HIST_SEEN } else { 0 };
                    let entry = count | seen;
                    self.gpu.queue.write_buffer(
                        &d.hist,
                        token as u64 * 4,
                        bytemuck::bytes_of(&entry),
                    );
                }
            }
            let flow = on_token(&StepOut {
                token,
                logprob,
                top,
            });
            if flow == Flow::Stop || step + 1 == n {
                break;
            }
            let s = self.seq(seq)?;
            if s.len + 1 > s.max_ctx {
                bail!("the sequence's context of {} tokens is full", s.max_ctx);
            }
            let next_masked = sampler.next_mask().is_some();
            if greedy {
                self.forward().run_and_pick(s, &s.next)?;
                picked = true;
            } else if let (Some(d), false) = (&dev, next_masked) {
                let u = if draws { sampler.next_uniform() } else { 0.0 };
                self.forward().run_and_sample(s, &s.next, d, u)?;
                picked = true;
            } else {
                self.forward().run(s, &s.next, 1, LogitsOut::Last)?;
                picked = false;
            }
            self.seqs.get_mut(&seq.0).expect("checked above").len += 1;
        }
        self.gpu.wait()
    }

    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId> {
        let s = self.seq(seq)?;
        let copy = self.duplicate(s, s.len.max(1))?;
        let id = self.next_id;
        self.next_id += 1;
        self.snaps.insert(id, copy);
        Ok(SnapshotId(id))
    }

    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()> {
        let saved = self
            .snaps
            .get(&snap.0)
            .with_context(|| format!("unknown snapshot {}", snap.0))?;
        let max_ctx = self.seq(seq)?.max_ctx;
        if saved.len > max_ctx {
            bail!(
                "snapshot of {} tokens does not fit the sequence's context of {max_ctx}",
                saved.len
            );
        }
        let restored = self.duplicate(saved, max_ctx)?;
        self.seqs.insert(seq.0, restored);
        self.gpu.forget_bind_groups();
        Ok(())
    }

    fn drop_snapshot(&mut self, snap: SnapshotId) {
        if self.snaps.remove(&snap.0).is_some() {
            self.gpu.forget_bind_groups();
        }
    }
}
