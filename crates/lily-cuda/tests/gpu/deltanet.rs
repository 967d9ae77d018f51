//! deltanet.cu: the Gated DeltaNet block and its recurrent and conv state; the recurrence token
//! by token (dn_recurrent) and in chunks on the tensor cores (dn_wy_prep + dn_wy_scan).

use crate::common::*;
use lily_cuda::kernels::deltanet::{wy_records, DnRecurrent, DnScan, DnShape};

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn deltanet_block_and_state_match_cpu_over_chunks() {
    let rig = BlockRig::new(8);
    let c = rig.cfg.clone();
    let mut rng = Rng(6);
    let h = c.hidden;
    let w = random_deltanet(&mut rng, &c);
    let dw = upload_deltanet(&rig.g, &c, "dn", &w).unwrap();
    let mut st = ops::DeltaNetState::new(&c);
    for n in [5usize, 1, 8, 2] {
        let x = rng.vec(n * h, 0.5);
        let xn = rng.vec(n * h, 1.0);
        let (state, conv) = &rig.seq.dn[0];
        let got = rig.run(&x, &xn, |f| {
            f.deltanet(&dw, state.ptr, conv.ptr, n).unwrap()
        });
        let want = ops::deltanet(&c, &w, &xn, &mut st);
        check(&format!("deltanet block T={n}"), &got, &want, 1e-4);
        let s: Vec<f32> = rig.g.read(state, 0, st.state.len()).unwrap();
        check(
            &format!("deltanet recurrent state after T={n}"),
            &s,
            &st.state,
            1e-4,
        );
        let cv: Vec<f32> = rig.g.read(conv, 0, st.conv.len()).unwrap();
        check(
            &format!("deltanet conv state after T={n}"),
            &cv,
            &st.conv,
            1e-6,
        );
    }
}

/// A scan's random inputs: the conv output c [n, conv_dim] (q, k, v), the b and a projections
/// [n, Hv], the heads' A_log and dt_bias [Hv].
struct ScanInputs {
    c: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
}

impl ScanInputs {
    /// `n` tokens; `log_rate` centres ln exp(A_log): −3 gives g ≈ −0.05 a token (weak gates, a
    /// long memory), 2 gives g ≈ −10 (strong: the state mostly replaced at every token).
    fn new(s: DnShape, n: usize, log_rate: f32, seed: u64) -> ScanInputs {
        let mut rng = Rng(seed);
        let conv_dim = 2 * s.n_k * s.dk + s.n_v * s.dv;
        ScanInputs {
            c: rng.vec(n * conv_dim, 1.0),
            b: rng.vec(n * s.n_v, 2.0),
            a: rng.vec(n * s.n_v, 2.0),
            a_log: (0..s.n_v).map(|_| log_rate + rng.val(0.5)).collect(),
            dt_bias: rng.vec(s.n_v, 1.0),
        }
    }
}

/// What one scan left: the outputs [n, Hv·dv], the final state, the normalised q/k [n, Hk, 2, dk]
/// and (g, β) [n, Hv, 2] that dn_prep wrote, and the launches' wall time.
struct ScanRun {
    o: Vec<f32>,
    state: Vec<f32>,
    qk: Vec<f32>,
    ab: Vec<f32>,
    took: std::time::Duration,
}

/// dn_prep + `kernel` over `x`'s n tokens from the state `init`, every output poisoned first.
fn run_scan(
    g: &Dev,
    kernel: DnScan,
    s: DnShape,
    n: usize,
    x: &ScanInputs,
    init: &[f32],
) -> ScanRun {
    let up = |v: &[f32]| g.upload(v).unwrap();
    let (c, b, a, a_log, dt_bias, state) = (
        up(&x.c),
        up(&x.b),
        up(&x.a),
        up(&x.a_log),
        up(&x.dt_bias),
        up(init),
    );
    let o = poisoned(g, n * s.n_v * s.dv);
    let qk = poisoned(g, n * s.n_k * 2 * s.dk);
    let ab = poisoned(g, n * s.n_v * 2);
    let records = poisoned(g, wy_records(s, n));
    let rec = DnRecurrent {
        c: c.ptr,
        b: b.ptr,
        a: a.ptr,
        ba_stride: s.n_v,
        a_log: a_log.ptr,
        dt_bias: dt_bias.ptr,
        state: state.ptr,
        o: o.ptr,
        qk: qk.ptr,
        ab: ab.ptr,
        records: records.ptr,
    };
    g.sync().unwrap();
    let start = std::time::Instant::now();
    g.k.deltanet.scan(g, kernel, s, &rec, n).unwrap();
    g.sync().unwrap();
    let took = start.elapsed();
    ScanRun {
        o: g.read(&o, 0, n * s.n_v * s.dv).unwrap(),
        state: g.read(&state, 0, init.len()).unwrap(),
        qk: g.read(&qk, 0, n * s.n_k * 2 * s.dk).unwrap(),
        ab: g.read(&ab, 0, n * s.n_v * 2).unwrap(),
        took,
    }
}

/// lily_core::cpu::chunked::scan (the CPU reference: its tests hold it to an f64 token-by-token
/// recurrence within 2e-5) for every value head, on the q/k and gates dn_prep wrote and the values
/// of `x`: outputs [n, Hv·dv] and the final state [Hv, dk, dv].
fn cpu_scan(
    s: DnShape,
    n: usize,
    x: &ScanInputs,
    run: &ScanRun,
    init: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    use lily_core::cpu::chunked::{scan, HeadInputs};
    let conv_dim = 2 * s.n_k * s.dk + s.n_v * s.dv;
    let heads: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|sc| {
        let jobs: Vec<_> = (0..s.n_v)
            .map(|hv| {
                sc.spawn(move || {
                    let hk = hv / (s.n_v / s.n_k);
                    let qk_row = |t: usize, which: usize| {
                        let at = ((t * s.n_k + hk) * 2 + which) * s.dk;
                        run.qk[at..at + s.dk].to_vec()
                    };
                    let q: Vec<f32> = (0..n).flat_map(|t| qk_row(t, 0)).collect();
                    let k: Vec<f32> = (0..n).flat_map(|t| qk_row(t, 1)).collect();
                    let v0 = 2 * s.n_k * s.dk + hv * s.dv;
                    let v: Vec<f32> = (0..n)
                        .flat_map(|t| x.c[t * conv_dim + v0..t * conv_dim + v0 + s.dv].to_vec())
                        .collect();
                    let gate = |t: usize, i: usize| run.ab[(t * s.n_v + hv) * 2 + i];
                    let log_alpha: Vec<f32> = (0..n).map(|t| gate(t, 0)).collect();
                    let beta: Vec<f32> = (0..n).map(|t| gate(t, 1)).collect();
                    let head = HeadInputs {
                        q: &q,
                        k: &k,
                        v: &v,
                        beta: &beta,
                        log_alpha: &log_alpha,
                    };
                    let mut state = init[hv * s.dk * s.dv..(hv + 1) * s.dk * s.dv].to_vec();
                    let mut out = vec![f32::NAN; n * s.dv];
                    scan(&head, s.dk, s.dv, 64, &mut state, &mut out);
                    (out, state)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let mut o = vec![0f32; n * s.n_v * s.dv];
    let mut state = Vec::with_capacity(init.len());
    for (hv, (out, st)) in heads.iter().enumerate() {
        for t in 0..n {
            let at = (t * s.n_v + hv) * s.dv;
            o[at..at + s.dv].copy_from_slice(&out[t * s.dv..(t + 1) * s.dv]);
        }
        state.extend_from_slice(st);
    }
    (o, state)
}

/// Relative L2 error allowed between the tensor-core scan and the fp32 references: its products
/// round their operands to tf32 (2⁻¹¹ relative, ≈ 3e-4 on a product of 128 random terms, METHOD.md),
/// chained through T, W, Δ and the state; fp32 forms of the same algebra agree to ≈ 1e-5. A wrong
/// fragment, mask, decay or chunk boundary gives errors of order 1e-1 to 1.
const TC_SCAN_TOL: f64 = 3e-3;

/// The tensor-core scan (`DnScan::Chunked`: dn_wy_prep + dn_wy_scan) against dn_recurrent (token
/// by token) and against lily_core::cpu::chunked::scan on dn_prep's own q/k and gates, from the
/// same random non-zero initial state: outputs and the final state (what decode continues from),
/// for Qwen3.6's heads (16 K heads, 32 V heads, 128 × 128) and the tiny preset's (2 / 4, 32 × 32),
/// lengths 1, 7, 63, 64, 65, 200 and 1,000 (a partial chunk alone, whole chunks, a partial last
/// one) and a full 4,096-token prefill chunk at the real shape, with weak (g ≈ −0.05 a token)
/// and strong (g ≈ −10) gates. Times are printed, never asserted. (fp32 activations: the outputs
/// are compared unrounded.)
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_scan_matches_the_recurrence_and_the_cpu_reference() {
    let g = gpu();
    let full = DnShape {
        n_k: 16,
        n_v: 32,
        dk: 128,
        dv: 128,
    };
    let tiny = DnShape::of(&tiny_cfg());
    let mut seed = 90;
    for s in [full, tiny] {
        let lengths: &[usize] = if s.dk == 128 {
            &[1, 7, 63, 64, 65, 200, 1000, 4096]
        } else {
            &[1, 7, 63, 64, 65, 200, 1000]
        };
        for &n in lengths {
            for (gates, log_rate) in [("weak", -3.0f32), ("strong", 2.0)] {
                seed += 1;
                let x = ScanInputs::new(s, n, log_rate, seed);
                let init = Rng(seed + 1000).vec(s.n_v * s.dk * s.dv, 0.3);
                let rec = run_scan(&g, DnScan::Recurrent, s, n, &x, &init);
                let tc = run_scan(&g, DnScan::Chunked, s, n, &x, &init);
                let what = format!(
                    "{}x{} heads {}/{} T={n} {gates} gates",
                    s.dk, s.dv, s.n_k, s.n_v
                );
                println!(
                    "KERNEL {what}: dn_recurrent {:.2?}, dn_wy_prep + dn_wy_scan {:.2?}",
                    rec.took, tc.took
                );
                assert_eq!(tc.qk, rec.qk, "{what}: dn_prep is the same launch");
                let (want_o, want_s) = cpu_scan(s, n, &x, &rec, &init);
                check(
                    &format!("{what}: dn_recurrent outputs vs CPU"),
                    &rec.o,
                    &want_o,
                    1e-4,
                );
                check(
                    &format!("{what}: dn_recurrent state vs CPU"),
                    &rec.state,
                    &want_s,
                    1e-4,
                );
                check(
                    &format!("{what}: tensor-core outputs vs CPU"),
                    &tc.o,
                    &want_o,
                    TC_SCAN_TOL,
                );
                check(
                    &format!("{what}: tensor-core state vs CPU"),
                    &tc.state,
                    &want_s,
                    TC_SCAN_TOL,
                );
                check(
                    &format!("{what}: tensor-core outputs vs dn_recurrent"),
                    &tc.o,
                    &rec.o,
                    TC_SCAN_TOL,
                );
                check(
                    &format!("{what}: tensor-core state vs dn_recurrent"),
                    &tc.state,
                    &rec.state,
                    TC_SCAN_TOL,
                );
            }
        }
    }
}

/// The comparison has teeth: the tensor-core scan of one input set, held to the CPU reference of
/// another, fails the very check `tensor_core_scan_matches_the_recurrence_and_the_cpu_reference`
/// makes (rel. L2 above TC_SCAN_TOL). The other set changes the gates where a chunked scan is
/// most likely to go wrong, at chunk boundaries: the first token of the second and third chunks
/// (t = 64 and 128), every value head, `a` + 3 (a stronger decay at those tokens). The two CPU
/// references differ by 7.0e-2 (lily_core::cpu::chunked in f32 on these inputs), 23× the tolerance,
/// and the tf32 scan's own error (≤ 8e-4, emulated) cannot close that. An earlier form changed one
/// token inside a chunk on one head and asked for 10× the tolerance: the H200 measured 9.88e-3
/// (the CPU says 9.87e-3), caught by the real check but not by that guessed margin (session 13).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_scan_check_catches_a_changed_gate() {
    let g = gpu();
    let s = DnShape::of(&tiny_cfg());
    let n = 150;
    let x = ScanInputs::new(s, n, -1.0, 7);
    let init = Rng(8).vec(s.n_v * s.dk * s.dv, 0.3);
    let tc = run_scan(&g, DnScan::Chunked, s, n, &x, &init);
    let mut bent = ScanInputs::new(s, n, -1.0, 7);
    for t in [64, 128] {
        for hv in 0..s.n_v {
            bent.a[t * s.n_v + hv] += 3.0;
        }
    }
    let other = run_scan(&g, DnScan::Recurrent, s, n, &bent, &init);
    let (want_o, _) = cpu_scan(s, n, &bent, &other, &init);
    let e = rel_l2("changed gates", &tc.o, &want_o);
    println!(
        "KERNEL tensor-core scan against changed gates' reference: rel_l2 {e:.3e} (fails above {TC_SCAN_TOL:.0e}; CPU: 7.0e-2)"
    );
    assert!(
        e > TC_SCAN_TOL,
        "changed gates at the chunk boundaries went unnoticed: {e:.3e}"
    );
}
