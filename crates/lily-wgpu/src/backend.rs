//! `WgpuBackend`: the `Backend` contract (lily-core/src/backend.rs) on one wgpu adapter.
//! Prefill runs in chunks of at most `chunk` tokens; greedy decode picks the token on the GPU
//! and the next step embeds it from there, so the id only crosses to the host to be reported.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};
use lily_core::backend::{Backend, Flow, SeqId, SnapshotId, StepOut};
use lily_core::config::ModelConfig;
use lily_core::cpu::ops::KvFormat;
use lily_core::logprob::{token_logprob, LogSoftmax};
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::weights::ModelWeights;

use crate::forward::{
    conv_bytes, kv_row_bytes, state_bytes, uniform_words, DevicePick, Forward, LogitsOut, Scratch,
    SeqState, HIST_COUNT, HIST_SEEN, PICK_MAX_K,
};
use crate::gpu::{describe_adapter, Gpu, Recorder};
use crate::kernels::Kernels;
use crate::options::Choice;
use crate::plan::{
    attend_gqa_spec, attend_tile_spec, products_choice, split_workgroups, DeviceCaps, MmTile, Plan,
    PrefillAttention, ProductsKernel, SplitRule, WgpuOptions,
};
use crate::probes::{
    check_attention, check_coop_emulated, check_dn_step, check_down_lanes, check_down_rows,
    check_mm, check_mm_f16, check_rows, check_rows_one_word, check_rows_persist, DnStep, DownCheck,
    PersistCheck, Sides, F16_STORE,
};
use crate::weights::{stack_shared, upload_model, GpuMixer, GpuModel};

pub struct WgpuBackend {
    // Field order matters for drop: buffers before the device.
    seqs: HashMap<u64, SeqState>,
    snaps: HashMap<u64, SeqState>,
    next_id: u64,
    scratch: Scratch,
    model: GpuModel,
    kernels: Kernels,
    plan: Plan,
    cfg: ModelConfig,
    gpu: Gpu,
}

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

/// Largest relative L2 difference from the host's attention for attend_tile.wgsl to be used
/// (its check at load; a right kernel differs by ≈ 1e-7, and with f16 activations by its
/// output's f16 store, up to `probes::F16_STORE`, added).
const ATTEND_TILE_TOLERANCE: f64 = 1e-4;

/// Largest relative L2 difference of linear_q4_coop.wgsl from the host's product of its
/// f16-staged operands for it to be used (its check at load; the f16 tiles of linear_q4_mm.wgsl
/// differ by ≈ 4e-7: only the f32 sums' order; an f16 output's rounding, up to
/// `probes::F16_STORE`, comes on top with f16 activations).
const COOP_TOLERANCE: f64 = 1e-4 + F16_STORE;

impl WgpuBackend {
    /// The backend on the adapter `opts` asks for, with the environment's overrides applied on
    /// top (`WgpuOptions::with_env_overrides`) and the plan resolved for this model and device.
    pub fn new(weights: &ModelWeights, opts: WgpuOptions) -> Result<WgpuBackend> {
        let opts = opts.with_env_overrides();
        let gpu = Gpu::open(
            opts.allow_software,
            opts.adapter.as_deref(),
            opts.profile,
            opts.limits,
            opts.subgroups,
            opts.f16_kv != Choice::Off
                || opts.f16_tiles
                || opts.f16_acts != Choice::Off
                || opts.coop,
            opts.coop,
        )?;
        let c = &weights.config;
        let caps = DeviceCaps {
            limits: gpu.limits.clone(),
            subgroups: gpu.subgroups,
            f16: gpu.f16,
            device_type: gpu.info.device_type,
            coop: gpu.coop,
            metal: gpu.info.backend == wgpu::Backend::Metal,
            vendor: gpu.info.vendor,
        };
        let mut plan = Plan::resolve(&opts, c, stack_shared(weights), &caps)?;
        // The kernels the coop check loaded, kept for the backend while its plan stands.
        let mut checked_kernels = None;
        if plan.coop > 0 {
            // linear_q4_coop.wgsl checked at load against the host's product of its f16-staged
            // operands (every tile size, 4- and 8-bit, each form): a wrong layout or subgroup
            // width shows as an O(1) difference, a driver that does not take the module as an
            // error. Which kernel is tried after a refusal is the plan's (`products_choice`:
            // linear_q4_coop_big on 128 rows, on 64, then linear_q4_coop, then linear_q4_mm);
            // here each is only built, checked, and its refusal reported.
            let mut refused = Vec::new();
            let mut refusals = Vec::new();
            while plan.coop > 0 {
                let kernel = ProductsKernel::of(&plan.options);
                let checked = Kernels::load(&gpu, &plan.specs, plan.checked).and_then(|k| {
                    check_products_f16(&gpu, &k, plan.act_f16).map(|(_, staged)| (k, staged))
                });
                let why = match checked {
                    Ok((k, staged)) if staged < COOP_TOLERANCE => {
                        plan.notes.push(format!(
                            "{} checked at load: {staged:.1e} relative",
                            kernel.name()
                        ));
                        checked_kernels = Some(k);
                        break;
                    }
                    Ok((_, staged)) => format!("{staged:.1e} relative from the host's product"),
                    Err(e) => format!("{e:#}"),
                };
                refusals.push(format!("{} refused at load: {why}", kernel.name()));
                refused.push(kernel);
                let next = products_choice(&opts, &refused);
                plan = Plan::resolve(&next.options(&opts), c, stack_shared(weights), &caps)?;
            }
            if !refused.is_empty() {
                let taken = ProductsKernel::of(&plan.options);
                refusals.push(format!(
                    "prefill products on {} ({} refused at load)",
                    taken.name(),
                    refused
                        .iter()
                        .map(|k| k.name())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            plan.notes.extend(refusals);
        }
        if let (PrefillAttention::Tile { g, .. }, Some(spec)) =
            (plan.prefill_attention, &plan.specs.attend_tile)
        {
            // Checked as attention is at load: a block of 37 tokens after 268 (tiles partly
            // filled, several key blocks, the causal edge inside blocks).
            let k = crate::gpu::Kernel::new(&gpu, spec, plan.checked)?;
            let shape = (c.n_kv_heads, g, c.head_dim);
            let e = check_attention(&gpu, &k, None, shape, 305, 37, plan.kv_f16, plan.act_f16)?;
            let store = if plan.act_f16 { F16_STORE } else { 0.0 };
            if e < ATTEND_TILE_TOLERANCE + store {
                plan.notes
                    .push(format!("attend_tile checked at load: {e:.1e} relative"));
            } else {
                plan.refuse_attend_tile(format!(
                    "attend_tile refused at load: {e:.1e} relative from the host's attention"
                ));
                checked_kernels = None; // the plan's kernels changed
            }
        }
        let kernels = match checked_kernels {
            Some(k) => k,
            None => Kernels::load(&gpu, &plan.specs, plan.checked)?,
        };
        let model = upload_model(&gpu, weights, plan.max_slice_bytes)
            .with_context(|| format!("uploading the weights to {}", gpu.info.name))?;
        let scratch = Scratch::new(&gpu, c, plan.chunk, plan.all_logits_chunk, plan.act_f16)?;
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
            "wgpu: {}, {:.2} GB of weights on the device, input projections in {} (attention) / {} (DeltaNet) dispatches; {}",
            describe_adapter(&gpu.info),
            model.bytes as f64 / 1e9,
            parts(true),
            parts(false),
            plan.describe(),
        );
        Ok(WgpuBackend {
            seqs: HashMap::new(),
            snaps: HashMap::new(),
            next_id: 1,
            scratch,
            model,
            kernels,
            plan,
            cfg: c.clone(),
            gpu,
        })
    }

    /// The plan in use (the kernel at each launch site).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// moe_down_rows.wgsl as this plan compiles it (reductions, activations), one item at a time
    /// and in rounds (`moe_rounds`), against the host on the full model's shape and two others
    /// (`probes::check_down_rows`): the largest relative L2 difference, and whether the rounds
    /// are bit for bit the other form.
    pub fn check_down_rows(&self) -> Result<DownCheck> {
        check_down_rows(
            &self.gpu,
            self.plan.subgroups,
            self.plan.act_f16,
            self.plan.down_rb,
        )
    }

    /// moe_down_lanes.wgsl (`down_item_lanes`: one item a lane) and moe_down_rows.wgsl in rounds
    /// with this plan's reductions, activations and rows a workgroup, against the host on
    /// `check_down_rows`' shapes and against each other, within rounding and whether bit for bit
    /// (`probes::check_down_lanes`).
    pub fn check_down_lanes(&self) -> Result<DownCheck> {
        check_down_lanes(
            &self.gpu,
            self.plan.subgroups,
            self.plan.act_f16,
            self.plan.down_rb,
        )
    }

    /// linear_q4_rows.wgsl's persistent kernel (`rows_persist`) with this plan's reductions, on
    /// fewer workgroups than row blocks, against the host and bit for bit against the kernel
    /// with one workgroup a block (`probes::check_rows_persist`).
    pub fn check_rows_persist(&self) -> Result<PersistCheck> {
        check_rows_persist(&self.gpu, self.plan.subgroups)
    }

    /// linear_q4_rows.wgsl's 16-row kernel for one-word rows (`rows_one_word`) with this plan's
    /// reductions against the host and, bit for bit, today's kernel
    /// (`probes::check_rows_one_word`).
    pub fn check_rows_one_word(&self) -> Result<PersistCheck> {
        check_rows_one_word(&self.gpu, self.plan.subgroups)
    }

    /// dn_recur_norm.wgsl as this plan compiles it (reductions, activations) but for
    /// key dim `dk` and value dim `dv` (`dn_one_sync`'s form where the plan has it), against the
    /// host (`probes::check_dn_step`).
    pub fn check_dn_step(&self, dk: usize, dv: usize) -> Result<DnStep> {
        check_dn_step(
            &self.gpu,
            self.plan.subgroups,
            self.plan.act_f16,
            self.plan.options.dn_one_sync,
            (dk, dv),
        )
    }

    /// The 4-bit product kernels against the host's product on random matrices
    /// (`probes::check_mm`, `probes::check_rows`), relative L2 differences: linear_q4_mm.wgsl's
    /// (tiles of 16 and 32 items, 4- and 8-bit; with f16 tiles, `Plan::tile_f16`, every tile
    /// compiled, 64 too, against the product of the operands as the kernel stages them in f16:
    /// `check_products_f16`) and linear_q4_rows.wgsl's; each in every form compiled (with f16
    /// activations, `Plan::act_f16`, inputs rounded to f16 as the kernels read them, outputs to
    /// f16 where they are activations: `probes::Sides`).
    pub fn check_products(&self) -> Result<(f64, f64)> {
        let act = self.plan.act_f16;
        let rows = check_rows(
            &self.gpu,
            &self.kernels,
            act,
            self.plan.glu_items,
            self.plan.glu_rb,
            self.plan.options.rows_one_word,
        )?;
        if self.plan.tile_f16 {
            // Against the f16-staged operands (the kernel's own rounding taken out).
            let (_, staged) = self.check_products_f16()?;
            return Ok((staged, rows));
        }
        let mut mm = 0f64;
        for (tile, forms) in self.kernels.products() {
            for (form, kernel) in forms.iter() {
                for bits in [4, 8] {
                    let sides = Sides::of(form, act);
                    mm = mm.max(check_mm(&self.gpu, kernel, tile, bits, sides)?);
                }
            }
        }
        Ok((mm, rows))
    }

    /// With f16 tiles (`Plan::tile_f16`): every linear_q4_mm.wgsl tile compiled (16, 32, 64
    /// items; 4- and 8-bit) against the host (`probes::check_mm_f16`): the largest relative L2
    /// difference from the exact product and from the product of the f16-staged operands.
    pub fn check_products_f16(&self) -> Result<(f64, f64)> {
        check_products_f16(&self.gpu, &self.kernels, self.plan.act_f16)
    }

    /// linear_q4_coop.wgsl (`big`: linear_q4_coop_big.wgsl, on workgroups of `rows` rows: 64,
    /// or 128 as `coop_rows` 128) with its cooperative operations emulated, on matrices of
    /// `size` (8 or 16), activations as this plan's (`probes::check_coop_emulated`): the largest
    /// relative L2 difference from the host's product of the f16-staged operands, with the tile
    /// sizes run (those that fit this device).
    pub fn check_coop_emulated(
        &self,
        size: u32,
        big: bool,
        rows: u32,
    ) -> Result<(Vec<MmTile>, f64)> {
        check_coop_emulated(&self.gpu, size, self.plan.act_f16, big, rows)
    }

    /// Where linear_q4_coop.wgsl (`big`: linear_q4_coop_big.wgsl on workgroups of `rows` rows,
    /// 64 or 128) goes wrong (`probes::coop_map`: errors and block maps on three shapes), on
    /// this device's cooperative matrices (None where it has none), or `emulated` on 16 × 16
    /// (any adapter): what a device call prints after a refusal at load.
    pub fn coop_map(&self, emulated: bool, big: bool, rows: u32) -> Result<Option<String>> {
        let size = if emulated { 16 } else { self.gpu.coop };
        if size == 0 {
            return Ok(None);
        }
        let mut spec = crate::plan::coop_spec(MmTile::T64, size, big);
        spec.coop_emulated = emulated;
        spec.coop_rows = rows;
        let kernel = crate::gpu::Kernel::new(&self.gpu, &spec, false)?;
        crate::probes::coop_map(&self.gpu, &kernel, size as usize).map(Some)
    }

    /// attend_gqa.wgsl (+ attend_merge.wgsl) against the host's attention in f64
    /// (`probes::check_attention`) at the full model's shapes (2 KV heads of 8 query heads, head
    /// dim 256) and at `tiny`'s (2 of 2, 64): decode at 1,000 and 77 positions (keys split over
    /// workgroups), and 5 tokens after 300 (prefill), with its reads conditional and flat
    /// (`FLAT`, and `FLAT` with a block's values requested after its key products, `VEARLY`:
    /// their outputs must equal the conditional reads' bit for bit), the keys split as today
    /// (`SplitRule::WIDE`) and as `attn_split` on a discrete GPU (`SplitRule::decode`: at 2,500
    /// positions 79 splits of 32 keys, more than one per invocation of attend_merge);
    /// attend_tile.wgsl with blocks of 32 and 16 keys where they fit this device: the largest
    /// relative L2 difference, and the attend_tile variants checked (head dim, heads a KV head,
    /// keys a block).
    pub fn check_attention(&self) -> Result<(f64, Vec<[usize; 3]>)> {
        let mut worst = 0f64;
        let mut tiles = Vec::new();
        for (hkv, g, d) in [(2usize, 8usize, 256usize), (2, 2, 64)] {
            let sg = self.plan.subgroups;
            let (f16, act) = (self.plan.kv_f16, self.plan.act_f16);
            let split = SplitRule::decode(split_workgroups(wgpu::DeviceType::DiscreteGpu), 256 / g);
            let kernels = [(false, false), (true, false), (true, true)].map(|(flat, early)| {
                let mut spec = attend_gqa_spec(d, g, flat, early).with_subgroups(sg);
                spec.kv_f16 = f16;
                spec.act_f16 = act;
                crate::gpu::Kernel::new(&self.gpu, &spec, false)
            });
            for rule in [SplitRule::WIDE, split] {
                for (n, t) in [(1000usize, 1usize), (77, 1), (305, 5), (2500, 1)] {
                    let mut got = [0f64; 3];
                    for (k, e) in kernels.iter().zip(got.iter_mut()) {
                        let k = k.as_ref().map_err(|e| anyhow::anyhow!("{e:#}"))?;
                        let merge = Some((&self.kernels.attend_merge, &rule));
                        *e = check_attention(&self.gpu, k, merge, (hkv, g, d), n, t, f16, act)?;
                    }
                    for (form, e) in [("FLAT", got[1]), ("FLAT and VEARLY", got[2])] {
                        if e.to_bits() != got[0].to_bits() {
                            anyhow::bail!(
                                "attend_gqa with {form} differs from without: {e:e} against {:e} ({hkv} KV heads of {g}, head dim {d}, {n} positions, {t} tokens, {rule:?})",
                                got[0]
                            );
                        }
                    }
                    worst = worst.max(got[0]);
                }
            }
            // attend_tile.wgsl: tiles partly filled, the whole prompt in one block of tokens
            // (pos0 = 0), a block after a long cache, a single token.
            for keys in [32, 16] {
                let mut spec = attend_tile_spec(d, g, keys)?.with_subgroups(sg);
                spec.kv_f16 = f16;
                spec.act_f16 = act;
                if spec.needs()?.exceeds(&self.gpu.limits).is_some() {
                    continue;
                }
                let k = crate::gpu::Kernel::new(&self.gpu, &spec, false)?;
                for (n, t) in [(305usize, 37usize), (64, 64), (700, 70), (41, 1)] {
                    let e = check_attention(&self.gpu, &k, None, (hkv, g, d), n, t, f16, act)?;
                    worst = worst.max(e);
                }
                tiles.push([d, g, keys]);
            }
        }
        Ok((worst, tiles))
    }

    /// Whether prefill attention runs on attend_tile.wgsl (`WgpuOptions::attn_tile`).
    pub fn attn_tile(&self) -> bool {
        self.kernels.attend_tile.is_some()
    }

    /// The adapter in use.
    pub fn adapter(&self) -> &wgpu::AdapterInfo {
        &self.gpu.info
    }

    /// The limits the device was created with (the adapter's, or Apple's: `WgpuOptions::limits`).
    pub fn device_limits(&self) -> &wgpu::Limits {
        &self.gpu.limits
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(&seq.0)
            .with_context(|| format!("unknown sequence {}", seq.0))
    }

    fn forward(&self) -> Forward<'_> {
        Forward {
            gpu: &self.gpu,
            plan: &self.plan,
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
        let d = SeqState::new(&self.gpu, c, max_ctx, self.plan.kv_f16)?;
        let mut r = Recorder::new(&self.gpu);
        let kv = s.len as u64 * kv_row_bytes(c, self.plan.kv_f16);
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

    /// The adapter, the limits in use, its subgroup sizes and the plan: what a bug report needs
    /// (`lily-engine bench` and `selftest` print it).
    fn describe(&self) -> String {
        let i = &self.gpu.info;
        let l = &self.gpu.limits;
        format!(
            "wgpu {} ({:?}, {:?}; {} B workgroup memory, {} invocations, subgroups of {}..{} lanes{}): {}",
            i.name,
            i.backend,
            i.device_type,
            l.max_compute_workgroup_storage_size,
            l.max_compute_invocations_per_workgroup,
            i.subgroup_min_size,
            i.subgroup_max_size,
            if self.gpu.subgroups { " in use" } else { " not used" },
            self.plan.describe()
        )
    }

    /// f16 rows where the plan keeps an f16 cache (two bytes a value, as bf16), f32 otherwise.
    fn kv_format(&self) -> KvFormat {
        if self.plan.kv_f16 {
            KvFormat::Bf16
        } else {
            KvFormat::Full
        }
    }

    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        if max_ctx == 0 {
            bail!("a sequence needs a context of at least one token");
        }
        let s = SeqState::new(&self.gpu, &self.cfg, max_ctx, self.plan.kv_f16)?;
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

/// `WgpuBackend::check_products_f16` on `kernels` (the plan's tile products: linear_q4_mm.wgsl
/// with f16 tiles, or linear_q4_coop.wgsl), `act_f16`: the activations' type.
fn check_products_f16(gpu: &Gpu, kernels: &Kernels, act_f16: bool) -> Result<(f64, f64)> {
    let (mut exact, mut staged) = (0f64, 0f64);
    for (tile, forms) in kernels.products() {
        for (form, kernel) in forms.iter() {
            for bits in [4, 8] {
                let sides = Sides::of(form, act_f16);
                let (e, s) = check_mm_f16(gpu, kernel, tile, bits, sides)?;
                exact = exact.max(e);
                staged = staged.max(s);
            }
        }
    }
    Ok((exact, staged))
}
