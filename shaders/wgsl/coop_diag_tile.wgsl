enable f16;
enable wgpu_cooperative_matrix;

// linear_q4_mm_coop.wgsl's tile of cooperative products alone, on known small-integer operands
// (every product exact in f16 → f32): part of the diagnostic ($LILY_WGPU_COOP_DIAG=1,
// kernels.rs `coop_diag`), after coop_diag.wgsl's single operations. A workgroup of 64 (two
// subgroups of 32, each owning 32 rows: the kernel's `sg = lid / 32`), the kernel's workgroup
// arrays, strides, offsets, loops, barriers and accumulators, with the dequantisation and the
// inputs' staging replaced by copies of known matrices:
//
// S (f16): A (64 rows × 64 columns, row-major) at 0, A2 at 4096 (the second step's rows), B
// (32 items × 64 columns, item-major) at 8192, B2 (the remainder part) at 10240.
// Workgroup `case` writes its 64 × 32 products at O[case · 2048 ..] as the kernel's cs holds
// them (element (row r, item n) at n · 64 + r):
//
// case 0: one step, hi part only: A · Bᵀ
// case 1: one step, hi and remainder parts (the kernel's xh and xl): A · (B + B2)ᵀ
// case 2: two steps (rows A, then A2), barriers around each as in the kernel, the accumulators
//         carried across the steps: (A + A2) · (B + B2)ᵀ
// case 3: case 2 with the subgroups' rows swapped (sg = 1 − lid / 32): the same result; a
//         difference says which subgroup's part depends on the subgroup's position

struct P {
    cases: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> S: array<f16>;
@group(0) @binding(2) var<storage, read_write> O: array<f32>;

const WS: u32 = 72u;

var<workgroup> ws: array<f16, 4608>;
var<workgroup> xh: array<f16, 2304>;
var<workgroup> xl: array<f16, 2304>;
var<workgroup> cs: array<f32, 2048>;

@compute @workgroup_size(64)
fn coop_diag_tile(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let which = wid.x;
    if (which >= p.cases) {
        return;
    }
    var sg = lid / 32u;
    if (which == 3u) {
        sg = 1u - sg;
    }
    let steps = select(1u, 2u, which >= 2u);
    let lo = which >= 1u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    for (var st = 0u; st < steps; st++) {
        // Staging as the kernel's: invocation `lid` writes row `lid` of ws, and half a row of
        // item lid / 2 of xh and xl.
        for (var k = 0u; k < 64u; k++) {
            ws[lid * WS + k] = S[st * 4096u + lid * 64u + k];
        }
        let ti = lid / 2u;
        let half = lid % 2u;
        for (var k = 0u; k < 32u; k++) {
            let col = half * 32u + k;
            xh[ti * WS + col] = S[8192u + ti * 64u + col];
            xl[ti * WS + col] = select(f16(0.0), S[10240u + ti * 64u + col], lo);
        }
        workgroupBarrier();
        for (var k = 0u; k < 4u; k++) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u) * WS + k * 16u], WS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u + 16u) * WS + k * 16u], WS);
            let h0 = coopLoad<coop_mat16x16<f16, B>>(&xh[k * 16u], WS);
            let h1 = coopLoad<coop_mat16x16<f16, B>>(&xh[16u * WS + k * 16u], WS);
            c00 = coopMultiplyAdd(a0, h0, c00);
            c01 = coopMultiplyAdd(a0, h1, c01);
            c10 = coopMultiplyAdd(a1, h0, c10);
            c11 = coopMultiplyAdd(a1, h1, c11);
            let l0 = coopLoad<coop_mat16x16<f16, B>>(&xl[k * 16u], WS);
            let l1 = coopLoad<coop_mat16x16<f16, B>>(&xl[16u * WS + k * 16u], WS);
            c00 = coopMultiplyAdd(a0, l0, c00);
            c01 = coopMultiplyAdd(a0, l1, c01);
            c10 = coopMultiplyAdd(a1, l0, c10);
            c11 = coopMultiplyAdd(a1, l1, c11);
        }
        workgroupBarrier();
    }
    coopStore(c00, &cs[sg * 32u], 64u);
    coopStore(c10, &cs[sg * 32u + 16u], 64u);
    coopStore(c01, &cs[1024u + sg * 32u], 64u);
    coopStore(c11, &cs[1024u + sg * 32u + 16u], 64u);
    workgroupBarrier();
    for (var i = lid; i < 2048u; i += 64u) {
        O[which * 2048u + i] = cs[i];
    }
}
