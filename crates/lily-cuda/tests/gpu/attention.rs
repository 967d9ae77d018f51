//! attention.cu: the attention block, split-KV decode attention and the tensor-core prefill kernels.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attention_block_matches_cpu_over_chunks() {
    let rig = BlockRig::new(8);
    let c = rig.cfg.clone();
    let mut rng = Rng(5);
    let w = random_attention(&mut rng, &c);
    let dw = upload_attention(&rig.g, &c, "attn", &w).unwrap();
    let mut kv = ops::KvCache::default();
    let mut pos = 0;
    for n in [5usize, 1, 8, 3] {
        let x = rng.vec(n * c.hidden, 0.5);
        let xn = rng.vec(n * c.hidden, 1.0);
        let (k, v) = &rig.seq.kv[0];
        let got = rig.run(&x, &xn, |f| {
            f.attention(&dw, k.ptr, v.ptr, rig.seq.pos.ptr, pos + n, n)
                .unwrap();
            rig.g
                .k
                .sample
                .advance_pos(&rig.g, rig.seq.pos.ptr, n)
                .unwrap();
        });
        let want = ops::attention(&c, &w, &xn, &mut kv, pos);
        check(
            &format!("attention block pos={pos} T={n}"),
            &got,
            &want,
            1e-4,
        );
        pos += n;
    }
}

/// One sequence's attention layer on the GPU in either activation mode, for the split-KV tests.
struct AttnRig {
    g: Dev,
    cfg: ModelConfig,
    scratch: Scratch,
    seq: SeqState,
    /// The sequence's length as the host knows it (what `Forward::attention` is told).
    len: std::cell::Cell<usize>,
    /// The same plan with split-KV off (the rig's own plan has it on).
    no_split: Plan,
}

impl AttnRig {
    fn new(cfg: &ModelConfig, bf16: bool, max_ctx: usize) -> AttnRig {
        // bf16 mode: the prefix chunks (> 16 tokens) run attn_prefill.
        let g = dev(bf16);
        let scratch = Scratch::new(&g, cfg, 512, &g.plan).unwrap();
        let seq = SeqState::new(&g, cfg, max_ctx, bf16).unwrap();
        let no_split = g.plan_with(|o| o.split_kv = false);
        AttnRig {
            g,
            cfg: cfg.clone(),
            scratch,
            seq,
            len: std::cell::Cell::new(0),
            no_split,
        }
    }
    /// One attention block over `xn` (n tokens) at the sequence's position, NaN-poisoned scratch
    /// first. Returns (x_out − x_in, the gated attention output fed to o_proj). Leaves the
    /// position where it was unless `advance`.
    fn step(
        &self,
        dw: &lily_cuda::weights::DevAttention,
        x: &[f32],
        xn: &[f32],
        split_kv: bool,
        advance: bool,
    ) -> (Vec<f32>, Vec<f32>) {
        let (g, s, c) = (&self.g, &self.scratch, &self.cfg);
        let n = xn.len() / c.hidden;
        s.poison(g).unwrap();
        g.write(&s.x, 0, x).unwrap();
        g.write(&s.xn, 0, xn).unwrap();
        let f = Forward {
            gpu: &g.g,
            kernels: &g.k,
            plan: if split_kv { &g.plan } else { &self.no_split },
            cfg: c,
            scratch: s,
        };
        let (k, v) = &self.seq.kv[0];
        let keys = self.len.get() + n;
        f.attention(dw, k.ptr, v.ptr, self.seq.pos.ptr, keys, n)
            .unwrap();
        if advance {
            g.k.sample.advance_pos(g, self.seq.pos.ptr, n).unwrap();
            self.len.set(keys);
        }
        g.sync().unwrap();
        let out: Vec<f32> = g.read(&s.x, 0, x.len()).unwrap();
        let o = g.read(&s.attn_o, 0, n * c.n_heads * c.head_dim).unwrap();
        (out.iter().zip(x).map(|(a, b)| a - b).collect(), o)
    }
}

/// Split-KV decode attention vs the CPU reference (`ops::attention`) and vs the one-block-per-head
/// kernel, at contexts 1, 7, 300, 5000 and 20000 (past 16384 keys a split holds more than one
/// tile per warp), for a 1-token step and then a 3-token step, in both activation modes, with the
/// tiny preset's heads (GQA group 2, head_dim 64) and the real model's (group 8, head_dim 256).
/// bf16 runs three times: one-token steps on CUDA cores (attn_split), on the tensor cores
/// (attn_split_mma, which also rounds q and the softmax weights to bf16, as the flash prefill
/// kernel does), and on the tensor cores with the q/k norms, RoPE and cache write inside the split
/// kernel (attn_split_mma_prep; its norms sum in another order than attn_qk_prep's). Tolerances (relative L2): fp32 vs CPU 1e-4 (the attention block's), fp32 split vs
/// one-block 1e-5 (summation order only); bf16 vs CPU 3e-2 (q, k, v, the cache and the output are
/// rounded to bf16, the CPU keeps fp32), bf16 split vs one-block 1e-2 (same roundings; an output
/// may land one bf16 step apart).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn split_kv_decode_attention_matches_cpu_and_one_block_kernel() {
    let tiny = tiny_cfg();
    let mut real_heads = tiny.clone();
    real_heads.n_heads = 16;
    real_heads.n_kv_heads = 2;
    real_heads.head_dim = 256;
    real_heads.rotary_dim = 64;
    let cases: [(&str, &ModelConfig, &[usize]); 2] = [
        ("tiny heads", &tiny, &[1, 7, 300, 5000, 20000]),
        ("real heads", &real_heads, &[1, 7, 300, 2100]),
    ];
    for (label, c, lens) in cases {
        let mut rng = Rng(17);
        let w = random_attention(&mut rng, c);
        // bf16 also with one-token steps on the tensor cores (attn_split_mma), and with the
        // prep fused into them (attn_split_mma_prep); each of those also with the long-context
        // body (head dim 256 fixed at compile time) from the first key on (`split_long_keys` 0;
        // by default it starts at 64K keys).
        let modes = [
            (false, false, false, false),
            (true, false, false, false),
            (true, true, false, false),
            (true, true, true, false),
            (true, true, false, true),
            (true, true, true, true),
        ];
        for (bf16, mma, fused, long) in modes {
            let mode = match (bf16, mma, fused, long) {
                (false, _, _, _) => "fp32",
                (true, false, _, _) => "bf16",
                (true, true, false, false) => "bf16 tensor cores",
                (true, true, true, false) => "bf16 tensor cores, fused prep",
                (true, true, false, true) => "bf16 tensor cores, long-context body",
                (true, true, true, true) => "bf16 tensor cores, fused prep, long-context body",
            };
            let (tol_cpu, tol_old) = if bf16 { (3e-2, 1e-2) } else { (1e-4, 1e-5) };
            for &len in lens {
                let mut rig = AttnRig::new(c, bf16, len + 3);
                rig.g.plan = rig.g.plan_with(|o| {
                    o.mma_attention = mma;
                    o.fused_attn_prep = fused;
                    if long {
                        o.split_long_keys = 0;
                    }
                });
                if fused {
                    let shape = gattn::AttnShape::of(c);
                    assert!(
                        matches!(
                            rig.g.plan.attention(shape, 1, len),
                            lily_cuda::plan::AttentionKernels::Split {
                                prep_fused: true,
                                ..
                            }
                        ),
                        "{label}: prep not fused"
                    );
                }
                let dw = upload_attention(&rig.g, c, "attn", &w).unwrap();
                let mut kv = ops::KvCache::default();
                // The first len − 1 tokens as prefill chunks (one-block kernel for chunks > 4).
                let prefix = rng.vec((len - 1) * c.hidden, 1.0);
                for chunk in prefix.chunks(512 * c.hidden) {
                    let x = rng.vec(chunk.len(), 0.5);
                    rig.step(&dw, &x, chunk, true, true);
                }
                if len > 1 {
                    ops::attention(c, &w, &prefix, &mut kv, 0);
                }
                // A decode step at context len, then a 3-token step.
                let mut pos = len - 1;
                for n in [1usize, 3] {
                    // A small residual: at long context the attention output is small (an
                    // average over many values), and bf16 mode rounds x + output to bf16.
                    let x = rng.vec(n * c.hidden, 1e-3);
                    let xn = rng.vec(n * c.hidden, 1.0);
                    let (_, o_old) = rig.step(&dw, &x, &xn, false, false);
                    let (got, o_split) = rig.step(&dw, &x, &xn, true, true);
                    let want = ops::attention(c, &w, &xn, &mut kv, pos);
                    let what = format!("split-KV {label} {mode} context {} T={n}", pos + n);
                    check(&format!("{what} vs CPU"), &got, &want, tol_cpu);
                    check(
                        &format!("{what} vs one-block kernel"),
                        &o_split,
                        &o_old,
                        tol_old,
                    );
                    pos += n;
                }
            }
        }
    }
}

/// One prefill chunk's inputs and output on the device, for the prefill kernels' tests: `n`
/// tokens at `pos`; q as bf16 values (bf16 mode rounds it before attention), large enough that
/// the softmax is far from flat (scores of standard deviation about 1); its gate; `attend` over
/// the caches `kv`.
struct PrefillChunk {
    q: Vec<f32>,
    qg: Vec<f32>,
    out: DevBuf,
    attend: Attend,
    /// q, its gate and the position on the device, which `attend` points at.
    _inputs: [DevBuf; 3],
}

impl PrefillChunk {
    fn new(
        g: &Gpu,
        rng: &mut Rng,
        shape: AttnShape,
        pos: usize,
        n: usize,
        (k, v): (&DevBuf, &DevBuf),
    ) -> PrefillChunk {
        let (n_q, d) = (shape.n_q, shape.d);
        let q: Vec<f32> = (0..n * n_q * d)
            .map(|_| bf16::from_f32(rng.val(3.0)).to_f32())
            .collect();
        let qg = rng.vec(n * n_q * 2 * d, 2.0);
        let (dq, dqg) = (g.upload(&q).unwrap(), g.upload(&qg).unwrap());
        let dpos = g.upload(&[pos as i32]).unwrap();
        let out = g.alloc(n * n_q * d * 4).unwrap();
        let attend = Attend {
            shape,
            q: dq.ptr,
            qg: dqg.ptr,
            k_cache: k.ptr,
            v_cache: v.ptr,
            out: out.ptr,
            pos: dpos.ptr,
            n_tok: n,
        };
        PrefillChunk {
            q,
            qg,
            out,
            attend,
            _inputs: [dq, dqg, dpos],
        }
    }
}

/// The tensor-core prefill kernels vs the one-block-per-(token, head) kernel on the same random
/// inputs in bf16 mode (q and the caches bf16 values, never zero), outputs NaN-poisoned before
/// each run: the real model's heads (16 q, 2 kv, head_dim 256) and the tiny preset's (4, 2, 64),
/// chunks of 100 tokens at position 0, 77 at 300 (neither a multiple of the 64-query block, a
/// long prefix), 512 at 3000, 1,100 at 5,000 and 4,096 at 28,672 (a 32K prompt's last chunk;
/// timed). attn_prefill (mma.sync) always; attn_prefill_wg and attn_prefill_wg_pipe (wgmma)
/// where they run (sm_90a, head dim 256), whatever the chunk's length. Tolerance: relative L2 < 1e-2, since both round the
/// softmax weights to bf16 before P·V and an output may then land one bf16 step from
/// attn_decode's (which keeps them fp32).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attn_prefill_matches_attn_decode() {
    let g = dev(true);
    let chunks = [
        (0usize, 100usize),
        (300, 77),
        (3000, 512),
        (5000, 1100),
        (28672, 4096),
    ];
    let max_ctx = chunks.iter().map(|&(pos, n)| pos + n).max().unwrap();
    for (n_q, n_kv, d) in [(16usize, 2usize, 256usize), (4, 2, 64)] {
        let mut rng = Rng(23);
        let shape = AttnShape {
            n_q,
            n_kv,
            d,
            rotary: d,
            theta: 1e7,
            eps: 1e-6,
        };
        let wg = lily_cuda::kernels::gemm::runs_wgmma(&g) && gattn::prefill_wg_fits(shape);
        let mut cache = || -> DevBuf {
            let bits: Vec<u16> = (0..max_ctx * n_kv * d)
                .map(|_| bf16::from_f32(rng.val(1.0)).to_bits())
                .collect();
            g.upload(&bits).unwrap()
        };
        let (k, v) = (cache(), cache());
        for (pos, n) in chunks {
            assert!(gattn::prefill_fits(shape) && n >= lily_cuda::plan::TENSOR_CORE_MIN_TOK);
            let chunk = PrefillChunk::new(&g, &mut rng, shape, pos, n, (&k, &v));
            let (out, attend) = (&chunk.out, chunk.attend);
            // 0: attn_decode (one block per token and head), 1: attn_prefill, 2: attn_prefill_wg,
            // 3: attn_prefill_wg_pipe.
            let run = |kernel: usize| -> (Vec<f32>, std::time::Duration) {
                g.fill(out, 0xff).unwrap();
                g.sync().unwrap();
                let t = std::time::Instant::now();
                let a = &g.k.attention;
                match kernel {
                    0 => a.one_block_per_head(&g, &attend).unwrap(),
                    1 => a.flash_prefill(&g, PrefillKernel::Mma, &attend).unwrap(),
                    2 => a.flash_prefill(&g, PrefillKernel::Wgmma, &attend).unwrap(),
                    _ => a
                        .flash_prefill(&g, PrefillKernel::WgmmaPipelined, &attend)
                        .unwrap(),
                }
                g.sync().unwrap();
                let dt = t.elapsed();
                (g.read(out, 0, n * n_q * d).unwrap(), dt)
            };
            let (want, _) = run(0);
            assert!(
                want.iter().all(|x| x.is_finite()),
                "attn_decode left an output unwritten"
            );
            let max_want = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            // Causal multiply-adds: Q·Kᵀ and P·V over every (query, visible key) pair.
            let pairs: f64 = (0..n).map(|t| (pos + t + 1) as f64).sum();
            let flops = 4.0 * (n_q * d) as f64 * pairs;
            for (kernel, name) in [
                (1, "attn_prefill"),
                (2, "attn_prefill_wg"),
                (3, "attn_prefill_wg_pipe"),
            ] {
                if kernel >= 2 && !wg {
                    continue;
                }
                let (got, _) = run(kernel);
                let (_, took) = run(kernel); // warm
                let max_abs = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                let what = format!("{name} Hq {n_q} Hkv {n_kv} D {d} pos {pos} T {n}");
                println!(
                    "KERNEL {what}: max abs diff {max_abs:.3e} (max |out| {max_want:.3e}); \
                     {took:.2?}, {:.0} TFLOP/s",
                    flops / took.as_secs_f64() / 1e12
                );
                check(&format!("{what} vs attn_decode"), &got, &want, 1e-2);
            }
        }
    }
}

/// attn_prefill_wg_pipe (the plan's `wgmma_attention_pipelined`) gives attn_prefill_wg's output
/// bit for bit, on the real model's heads (16 q, 2 kv, head_dim 256; sm_90a only): chunks of
/// 1,024 and 4,096 tokens at position 0, 1,100 at 3,000 (not a multiple of the 64-query block),
/// 4,096 at 28,672 (a 32K prompt's last chunk) and at 126,976 (a 128K prompt's). Both are also
/// held to an f64 reference (softmax(q·kᵀ/√d)·v, gated by sigmoid(gate)) on sampled tokens of
/// every head: relative L2 < 1e-2 (P is rounded to bf16 before P·V, the output to bf16). Each
/// kernel is timed (best of three) with its TFLOP/s: `KERNEL attn_prefill_wg{,_pipe} …` lines.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn attn_prefill_wg_pipe_gives_attn_prefill_wg_bits() {
    let g = dev(true);
    let (n_q, n_kv, d) = (16usize, 2usize, 256usize);
    let shape = AttnShape {
        n_q,
        n_kv,
        d,
        rotary: 64,
        theta: 1e7,
        eps: 1e-6,
    };
    if !(lily_cuda::kernels::gemm::runs_wgmma(&g) && gattn::prefill_wg_fits(shape)) {
        eprintln!("attn_prefill_wg_pipe: no sm_90a device, nothing to compare");
        return;
    }
    let chunks = [
        (0usize, 1024usize),
        (0, 4096),
        (3000, 1100),
        (28672, 4096),
        (126_976, 4096),
    ];
    let max_ctx = chunks.iter().map(|&(pos, n)| pos + n).max().unwrap();
    let mut rng = Rng(29);
    let mut cache = || -> (Vec<u16>, DevBuf) {
        let bits: Vec<u16> = (0..max_ctx * n_kv * d)
            .map(|_| bf16::from_f32(rng.val(1.0)).to_bits())
            .collect();
        let dev = g.upload(&bits).unwrap();
        (bits, dev)
    };
    let ((k_bits, k), (v_bits, v)) = (cache(), cache());
    let to_f32 =
        |bits: &[u16]| -> Vec<f32> { bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect() };
    let (k_f, v_f) = (to_f32(&k_bits), to_f32(&v_bits));
    drop((k_bits, v_bits));
    for (pos, n) in chunks {
        let chunk = PrefillChunk::new(&g, &mut rng, shape, pos, n, (&k, &v));
        let (out, attend) = (&chunk.out, chunk.attend);
        let run = |kernel: PrefillKernel| -> (Vec<f32>, std::time::Duration) {
            let mut best = std::time::Duration::MAX;
            for _ in 0..3 {
                g.fill(out, 0xff).unwrap();
                g.sync().unwrap();
                let t = std::time::Instant::now();
                g.k.attention.flash_prefill(&g, kernel, &attend).unwrap();
                g.sync().unwrap();
                best = best.min(t.elapsed());
            }
            (g.read(out, 0, n * n_q * d).unwrap(), best)
        };
        let pairs: f64 = (0..n).map(|t| (pos + t + 1) as f64).sum();
        let flops = 4.0 * (n_q * d) as f64 * pairs;
        let (want, t_wg) = run(PrefillKernel::Wgmma);
        let (got, t_pipe) = run(PrefillKernel::WgmmaPipelined);
        for (name, took) in [("attn_prefill_wg", t_wg), ("attn_prefill_wg_pipe", t_pipe)] {
            println!(
                "KERNEL {name} Hq {n_q} Hkv {n_kv} D {d} pos {pos} T {n}: {:.1} µs, {:.0} TFLOP/s",
                took.as_secs_f64() * 1e6,
                flops / took.as_secs_f64() / 1e12
            );
        }
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert!(
            want.iter().all(|x| x.is_finite()),
            "attn_prefill_wg pos {pos} T {n}: an output unwritten"
        );
        assert_eq!(
            differ, 0,
            "attn_prefill_wg_pipe pos {pos} T {n}: {differ} of {} outputs differ from attn_prefill_wg's bits",
            got.len()
        );
        // The f64 reference on the chunk's first, last and a middle token, every head (a thread
        // a head).
        let scale = 1.0 / (d as f64).sqrt();
        let (mut ref_rows, mut got_rows) = (Vec::new(), Vec::new());
        for t in [0, n / 2 + 1, n - 1] {
            let keys = pos + t + 1;
            let heads: Vec<Vec<f32>> = std::thread::scope(|sc| {
                let (q, qg, k_f, v_f) = (&chunk.q, &chunk.qg, &k_f, &v_f);
                let jobs: Vec<_> = (0..n_q)
                    .map(|h| {
                        sc.spawn(move || {
                            let kvh = h / (n_q / n_kv);
                            let qrow = &q[(t * n_q + h) * d..][..d];
                            let at = |key: usize| (key * n_kv + kvh) * d;
                            let s: Vec<f64> = (0..keys)
                                .map(|key| {
                                    let kr = &k_f[at(key)..][..d];
                                    (0..d).map(|c| qrow[c] as f64 * kr[c] as f64).sum::<f64>()
                                        * scale
                                })
                                .collect();
                            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let p: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                            let l: f64 = p.iter().sum();
                            let mut o = vec![0f64; d];
                            for (key, pk) in p.iter().enumerate() {
                                for (oc, vc) in o.iter_mut().zip(&v_f[at(key)..][..d]) {
                                    *oc += pk * *vc as f64;
                                }
                            }
                            (0..d)
                                .map(|c| {
                                    let gate = qg[(t * n_q + h) * 2 * d + d + c] as f64;
                                    (o[c] / l / (1.0 + (-gate).exp())) as f32
                                })
                                .collect()
                        })
                    })
                    .collect();
                jobs.into_iter().map(|j| j.join().unwrap()).collect()
            });
            for (h, r) in heads.into_iter().enumerate() {
                ref_rows.extend(r);
                got_rows.extend_from_slice(&got[(t * n_q + h) * d..][..d]);
            }
        }
        check(
            &format!("attn_prefill_wg_pipe pos {pos} T {n} vs f64"),
            &got_rows,
            &ref_rows,
            1e-2,
        );
    }
}
