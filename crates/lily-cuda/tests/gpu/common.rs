//! Shared by the GPU tests: the random inputs, the CPU references' helpers, the test GPU (`Dev`: a plan, its kernels) and the rigs that run one block or the whole model.

pub use half::bf16;
pub use lily_core::backend::{Backend, Flow};
pub use lily_core::checkpoint::{self, LoadOptions};
pub use lily_core::config::ModelConfig;
pub use lily_core::constrain::{MaskStats, TokenConstraint, TokenMask};
pub use lily_core::cpu::linear::matmul;
pub use lily_core::cpu::{ops, CpuBackend};
pub use lily_core::quant::quantize_linear;
pub use lily_core::sampling::{Sampler, SamplingParams};
pub use lily_core::synth::{preset_text_config, synth, Preset, SynthFormat, SynthOptions};
pub use lily_core::weights::*;
pub use lily_cuda::forward::{Forward, Scratch, SeqState};
pub use lily_cuda::gpu::{DevBuf, Gpu};
pub use lily_cuda::kernels::attention::PrefillKernel;
pub use lily_cuda::kernels::attention::{self as gattn, Attend, AttnShape};
pub use lily_cuda::kernels::decode::{Input, Out, Prologue};
pub use lily_cuda::kernels::embed::Lookup;
pub use lily_cuda::kernels::gemm::{DenseGemm, GroupedGemm};
pub use lily_cuda::kernels::linear::{Gather, GROUP_TILE};
pub use lily_cuda::kernels::moe::{max_group_tiles, Group};
pub use lily_cuda::kernels::norm::RmsNorm;
pub use lily_cuda::kernels::sample::{Argmax, TopLogprobs, LOGPROB_MAX_K, LOGPROB_SCRATCH_WORDS};
pub use lily_cuda::kernels::{ExpertGroups, Grouped, Kernels, Project, Rows, Store};
pub use lily_cuda::pinned::Pinned;
pub use lily_cuda::plan::{Dense, KvCacheKind, LogprobsPath, Router, SamplingPath};
pub use lily_cuda::sampler::DeviceSampler;
pub use lily_cuda::weights::{
    upload_attention, upload_deltanet, upload_linear, upload_moe, DevLinear,
};
pub use lily_cuda::{CudaBackend, CudaOptions, Plan};
pub use std::sync::Arc;

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in ±[0.05, 1) · scale: never zero.
    pub fn val(&mut self, scale: f32) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        let sign = if self.next() & 1 == 0 { 1.0 } else { -1.0 };
        sign * (0.05 + 0.95 * u) * scale
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.val(scale)).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `n` random token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

pub fn bf16_linear(rng: &mut Rng, experts: usize, rows: usize, cols: usize) -> Linear {
    let scale = 1.0 / (cols as f32).sqrt();
    let bytes: Vec<u8> = (0..experts * rows * cols)
        .flat_map(|_| bf16::from_f32(rng.val(scale)).to_bits().to_le_bytes())
        .collect();
    Linear {
        experts,
        rows,
        cols,
        data: WeightData::Bf16 {
            data: Blob::owned(bytes),
        },
    }
}

/// A random matrix stored as `bits` (4, 8: MLX affine g64; 16: bf16).
pub fn linear(rng: &mut Rng, bits: u32, experts: usize, rows: usize, cols: usize) -> Linear {
    let l = bf16_linear(rng, experts, rows, cols);
    if bits == 16 {
        l
    } else {
        quantize_linear(&l, bits, 64)
    }
}

pub fn rel_l2(what: &str, got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!(
            "{what}: element {i} is {} (unwritten or overflowed)",
            got[i]
        );
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

pub fn check(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = rel_l2(what, got, want);
    println!("KERNEL {what}: rel_l2 {e:.3e} (tol {tol:.0e})");
    assert!(e < tol, "{what}: relative L2 error {e:.3e} >= {tol:.0e}");
}

/// A GPU with every kernel loaded, and the plan of one activation mode (the shipping options
/// otherwise, environment overrides such as LILY_CUDA_SYNC=1 included).
pub struct Dev {
    pub g: Gpu,
    pub k: Kernels,
    /// The options `plan` resolves (`plan_with` derives others from them).
    pub opts: CudaOptions,
    pub plan: Plan,
}

impl std::ops::Deref for Dev {
    type Target = Gpu;
    fn deref(&self) -> &Gpu {
        &self.g
    }
}

/// The kernel tests' options in one activation mode: the plan's paths as they ship, and off the
/// kernel variants a test picks itself (tensor-core decode attention and its fused prep, the
/// wgmma kernels, the router's split, early trigger, the warp-scan pick), with the environment
/// overrides (e.g. LILY_CUDA_SYNC=1) on top.
pub fn kernel_test_options(bf16_activations: bool) -> CudaOptions {
    CudaOptions {
        bf16_activations,
        mma_attention: false,
        fused_attn_prep: false,
        wgmma_gemm: false,
        wgmma_small_tiles: false,
        wgmma_attention: false,
        router_split_k: false,
        early_trigger: false,
        warp_scan_sampling: false,
        ..CudaOptions::default()
    }
    .with_env_overrides()
}

pub fn dev(bf16_activations: bool) -> Dev {
    dev_with(kernel_test_options(bf16_activations))
}

/// The GPU, the plan of `opts` for it and the kernel files in the variants it asks for.
pub fn dev_with(opts: CudaOptions) -> Dev {
    let (g, plan) = Plan::open(&opts).expect("a CUDA GPU and NVRTC");
    let k = Kernels::load(&g, &plan.build()).expect("every kernel loads");
    Dev { g, k, opts, plan }
}

/// The fp32-activation GPU most kernel tests use.
pub fn gpu() -> Dev {
    dev(false)
}

impl Dev {
    /// The plan of this GPU's options changed by `f` (the kernels stay as loaded).
    pub fn plan_with(&self, f: impl FnOnce(&mut CudaOptions)) -> Plan {
        let mut o = self.opts.clone();
        f(&mut o);
        Plan::resolve(&o, self.g.caps())
    }

    /// y (+)= W x through the kernel the plan picks (as Forward::project does).
    #[allow(clippy::too_many_arguments)]
    pub fn project(
        &self,
        w: &DevLinear,
        x: u64,
        xs: usize,
        y: u64,
        ys: usize,
        n: usize,
        store: Store,
    ) {
        self.project_staged(w, x, xs, None, y, ys, n, store)
    }

    /// `project` with x also staged as bf16 (`xb`) for the kernels that read it so.
    #[allow(clippy::too_many_arguments)]
    pub fn project_staged(
        &self,
        w: &DevLinear,
        x: u64,
        xs: usize,
        xb: Option<Rows>,
        y: u64,
        ys: usize,
        n: usize,
        store: Store,
    ) {
        let a = Project {
            w,
            x: Rows::new(x, xs),
            xb,
            y: Rows::new(y, ys),
            n_tok: n,
        };
        match self.plan.dense(&w.shape(), n, xb.is_some()) {
            Dense::Gemm(kernel) => self.k.gemm.dense(&self.g, kernel, &a, store),
            Dense::Linear => self.k.linear.project(&self.g, &a, store),
        }
        .unwrap()
    }

    pub fn rms_norm(&self, x: u64, w: u64, y: u64, cols: usize, rows: usize) {
        let a = RmsNorm {
            x: Rows::new(x, cols),
            weight: w,
            y: Rows::new(y, cols),
            cols,
            eps: 1e-6,
            rows,
        };
        self.k.norm.rms_norm(&self.g, &a).unwrap()
    }
}

pub fn poisoned(g: &Gpu, n_f32: usize) -> DevBuf {
    let b = g.alloc(n_f32 * 4).unwrap();
    g.fill(&b, 0xff).unwrap();
    b
}

pub fn tiny_cfg() -> ModelConfig {
    ModelConfig::from_json(&preset_text_config(Preset::Tiny)).unwrap()
}

/// Routed items grouped on the device by moe_group: `ids` [items] (every other item goes to
/// expert 3, so it spans several tiles; the last expert gets none), and the grouping buffers;
/// with `tail` > 0 also each expert's last ≤ tail items in the second list.
pub struct Grouping {
    pub ids: Vec<i32>,
    pub groups: ExpertGroups,
    pub n_tiles: DevBuf,
    pub _bufs: [DevBuf; 4],
}

impl Grouping {
    pub fn skewed(g: &Dev, rng: &mut Rng, items: usize, e: usize, tile: usize) -> Grouping {
        let ids: Vec<i32> = (0..items)
            .map(|n| {
                if n % 2 == 0 {
                    3
                } else {
                    rng.below(e - 1) as i32
                }
            })
            .collect();
        Grouping::of(g, ids, e, tile, 0)
    }

    /// `ids` (each below `e`) grouped into tiles of `tile` and remainders of ≤ `tail` items.
    pub fn of(g: &Dev, ids: Vec<i32>, e: usize, tile: usize, tail: usize) -> Grouping {
        let items = ids.len();
        let dids = g.upload(&ids).unwrap();
        let max_tiles = max_group_tiles(items, e);
        let (perm, tiles, n_tiles, tail_tiles) = (
            poisoned(g, items),
            poisoned(g, 3 * max_tiles),
            poisoned(g, 2),
            poisoned(g, 3 * e),
        );
        let groups = ExpertGroups {
            perm: perm.ptr,
            tiles: tiles.ptr,
            n_tiles: n_tiles.ptr,
            max_tiles,
            tile,
            tail,
            tail_tiles: tail_tiles.ptr,
        };
        let group = Group {
            ids: dids.ptr,
            n_items: items,
            n_experts: e,
            into: groups,
        };
        g.k.moe.group(g, &group).unwrap();
        Grouping {
            ids,
            groups,
            n_tiles,
            _bufs: [perm, tiles, dids, tail_tiles],
        }
    }

    pub fn tiles_made(&self, g: &Gpu) -> i32 {
        g.read::<i32>(&self.n_tiles, 0, 1).unwrap()[0]
    }

    /// The second list's tiles (with `tail` > 0).
    pub fn tails_made(&self, g: &Gpu) -> i32 {
        g.read::<i32>(&self.n_tiles, 0, 2).unwrap()[1]
    }

    /// The expected rows, item by item: `f(expert's matrix, the item's token row)`.
    pub fn want(
        &self,
        w: &Linear,
        x: &[f32],
        k: usize,
        f: impl Fn(&Linear, &[f32]) -> Vec<f32>,
    ) -> Vec<f32> {
        let cols = w.cols;
        let mut want = Vec::new();
        for (n, &id) in self.ids.iter().enumerate() {
            want.extend(f(
                &w.expert(id as usize),
                &x[(n / k) * cols..(n / k + 1) * cols],
            ));
        }
        want
    }
}

pub struct BlockRig {
    pub g: Dev,
    pub cfg: ModelConfig,
    pub scratch: Scratch,
    pub seq: SeqState,
    /// The fp32 plan with MoE grouping off (the rig's own plan has it on).
    pub gathered: Plan,
    pub moe_grouped: std::cell::Cell<bool>,
}

impl BlockRig {
    pub fn new(chunk: usize) -> BlockRig {
        let g = gpu();
        let cfg = tiny_cfg();
        let scratch = Scratch::new(&g, &cfg, chunk, &g.plan).unwrap();
        let seq = SeqState::new(&g, &cfg, 64, false).unwrap();
        let gathered = g.plan_with(|o| o.moe_grouped = false);
        BlockRig {
            g,
            cfg,
            scratch,
            seq,
            gathered,
            moe_grouped: std::cell::Cell::new(true),
        }
    }
    pub fn fwd(&self) -> Forward<'_> {
        Forward {
            gpu: &self.g.g,
            kernels: &self.g.k,
            plan: if self.moe_grouped.get() {
                &self.g.plan
            } else {
                &self.gathered
            },
            cfg: &self.cfg,
            scratch: &self.scratch,
        }
    }
    /// Poisons the scratch, writes x and xn, runs `f`, returns x_out − x_in.
    pub fn run(&self, x: &[f32], xn: &[f32], f: impl FnOnce(&Forward)) -> Vec<f32> {
        self.scratch.poison(&self.g).unwrap();
        self.g.write(&self.scratch.x, 0, x).unwrap();
        self.g.write(&self.scratch.xn, 0, xn).unwrap();
        f(&self.fwd());
        self.g.sync().unwrap();
        let out: Vec<f32> = self.g.read(&self.scratch.x, 0, x.len()).unwrap();
        out.iter().zip(x).map(|(o, i)| o - i).collect()
    }
}

pub fn random_deltanet(rng: &mut Rng, c: &ModelConfig) -> DeltaNetWeights {
    let (h, vd, hv) = (c.hidden, c.dn_value_dim(), c.dn_v_heads);
    DeltaNetWeights {
        in_qkv: linear(rng, 4, 1, c.conv_dim(), h),
        in_z: linear(rng, 4, 1, vd, h),
        in_b: linear(rng, 4, 1, hv, h),
        in_a: linear(rng, 4, 1, hv, h),
        conv: rng.vec(c.conv_dim() * c.conv_kernel, 0.5),
        a_log: rng.vec(hv, 1.0),
        dt_bias: rng.vec(hv, 1.0),
        norm: rng
            .vec(c.dn_v_dim, 1.0)
            .iter()
            .map(|v| 1.0 + 0.3 * v)
            .collect(),
        out_proj: linear(rng, 4, 1, h, vd),
    }
}

pub fn random_moe(rng: &mut Rng, c: &ModelConfig) -> MoeWeights {
    let (h, e, i, si) = (c.hidden, c.n_experts, c.expert_inter, c.shared_inter);
    MoeWeights {
        router: linear(rng, 8, 1, e, h),
        gate: linear(rng, 4, e, i, h),
        up: linear(rng, 4, e, i, h),
        down: linear(rng, 4, e, h, i),
        shared_gate: linear(rng, 4, 1, si, h),
        shared_up: linear(rng, 4, 1, si, h),
        shared_down: linear(rng, 4, 1, h, si),
        shared_expert_gate: linear(rng, 8, 1, 1, h),
    }
}

pub fn random_attention(rng: &mut Rng, c: &ModelConfig) -> AttentionWeights {
    let (h, hq, hkv, d) = (c.hidden, c.n_heads, c.n_kv_heads, c.head_dim);
    AttentionWeights {
        q_proj: linear(rng, 4, 1, 2 * hq * d, h),
        k_proj: linear(rng, 4, 1, hkv * d, h),
        v_proj: linear(rng, 4, 1, hkv * d, h),
        o_proj: linear(rng, 4, 1, h, hq * d),
        q_norm: rng.vec(d, 1.0).iter().map(|v| 1.0 + 0.3 * v).collect(),
        k_norm: rng.vec(d, 1.0).iter().map(|v| 1.0 + 0.3 * v).collect(),
    }
}

/// A constraint for tests: a fresh pseudo-random eighth of the vocabulary allowed at every step
/// (and about half of `keep`), the same sequence for the same seed.
pub struct RandomMask {
    pub vocab: usize,
    pub rng: Rng,
    pub keep: Vec<u32>,
    pub mask: TokenMask,
}

impl RandomMask {
    pub fn new(vocab: usize, seed: u64, keep: &[u32]) -> RandomMask {
        let mut m = RandomMask {
            vocab,
            rng: Rng(seed),
            keep: keep.to_vec(),
            mask: TokenMask::only(vocab, &[]),
        };
        m.refresh();
        m
    }
    pub fn refresh(&mut self) {
        let mut allowed: Vec<u32> = (0..self.vocab as u32)
            .filter(|_| self.rng.below(8) == 0)
            .collect();
        for i in 0..self.keep.len() {
            if self.rng.below(2) == 0 {
                allowed.push(self.keep[i]);
            }
        }
        self.mask = TokenMask::only(self.vocab, &allowed);
    }
}

impl TokenConstraint for RandomMask {
    fn mask(&mut self) -> Option<&TokenMask> {
        Some(&self.mask)
    }
    fn commit(&mut self, _token: u32) {
        self.refresh();
    }
    fn stats(&self) -> MaskStats {
        MaskStats::default()
    }
}

pub fn synth_model(preset: Preset, format: SynthFormat, seed: u64) -> Arc<ModelWeights> {
    synth_model_layers(preset, format, seed, None)
}

/// `synth_model` with `layers` layers (a multiple of 4) at the preset's widths.
pub fn synth_model_layers(
    preset: Preset,
    format: SynthFormat,
    seed: u64,
    layers: Option<usize>,
) -> Arc<ModelWeights> {
    let dir = std::env::temp_dir().join(format!(
        "lily-gpu-test-{preset:?}-{format:?}-{seed}-{layers:?}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthOptions {
        preset,
        format,
        seed,
        out: dir.clone(),
        tokenizer: None,
        layers,
    })
    .unwrap();
    let w = checkpoint::load(&dir, &LoadOptions::default()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(w)
}

/// Seeded sampling the device sampler covers, with penalties (temperature 0.8, top_k 20, top_p
/// 0.9, presence 1.0, repetition 1.1): the uniform and the device history matter at every pick.
pub fn sampled_params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.9,
        presence_penalty: 1.0,
        repetition_penalty: 1.1,
        seed,
        ..SamplingParams::greedy()
    }
}

/// Seeded sampling over the whole vocabulary (top_k 0): the host sampler's path.
pub fn host_sampled_params(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 0,
        seed,
        ..SamplingParams::greedy()
    }
}

/// What one decode call reported: (token, log-probability, top alternatives) per token.
pub type Reported = Vec<(u32, f32, Vec<(u32, f32)>)>;

/// Decodes up to `n` tokens, stopping at the `stop_at`-th (1-based) if given; the tokens
/// reported and the call's result.
pub fn decode_into(
    b: &mut CudaBackend,
    s: lily_core::backend::SeqId,
    sampler: &mut Sampler,
    n: usize,
    top_logprobs: usize,
    stop_at: Option<usize>,
) -> (Reported, anyhow::Result<()>) {
    let mut out = Vec::new();
    let r = b.decode(s, sampler, n, top_logprobs, &mut |o| {
        out.push((o.token, o.logprob, o.top.clone()));
        if Some(out.len()) == stop_at {
            Flow::Stop
        } else {
            Flow::Continue
        }
    });
    (out, r)
}

/// Reported tokens equal: ids exactly, log-probabilities (and the alternatives') within `lp_tol`
/// (0 in fp32: the same kernels on the same inputs repeat bit for bit).
pub fn same_reported(what: &str, got: &Reported, want: &Reported, lp_tol: f32) {
    let ids = |r: &Reported| r.iter().map(|t| t.0).collect::<Vec<_>>();
    assert_eq!(ids(got), ids(want), "{what}: tokens");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.1 - w.1).abs() <= lp_tol,
            "{what}: token {i}: logprob {} vs {}",
            g.1,
            w.1
        );
        assert_eq!(g.2.len(), w.2.len(), "{what}: token {i}: alternatives");
        for (a, b) in g.2.iter().zip(&w.2) {
            assert!(
                a.0 == b.0 && (a.1 - b.1).abs() <= lp_tol,
                "{what}: token {i}: alternatives {:?} vs {:?}",
                g.2,
                w.2
            );
        }
    }
}
