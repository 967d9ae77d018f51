enable f16;
enable wgpu_cooperative_matrix;

// A diagnostic of cooperative matrices (LILY_WGPU_COOP_DIAG=1, backend.rs): tiny 16 × 16 f16
// products whose result says what each operation did on this device. linear_q4_mm_coop.wgsl
// computed a wrong product on the H200 through Vulkan in every variant tried (4.2e-1 … 3e2
// relative), while the same logic with the operations emulated is right; this kernel separates
// the operations. Workgroup `case` (one subgroup of 32 invocations, the only size the host
// enables cooperative matrices for) writes its 16 × 16 f32 result at O[case · 256 ..]; the host
// reads O row-major (element (i, j) at i · 16 + j) and names which of X, Xᵀ, XY, … it equals.
//
// X[i · 16 + j] = 16 i + j and Y (small random integers; every product is exact in f16 → f32)
// are given row-major in S (f16: X at 0, Y at 256, the identity at 512, zeros at 768) and F
// (f32: X at 0).
//
// case 0: A = coopLoad(X),  B = coopLoad(I), C = zero,            coopStore   (expect X: a
//         column-major load and store cancel)
// case 1: A = coopLoadT(X), B = I,           C = zero,            coopStore   (expect Xᵀ)
// case 2: A = coopLoad(X),  B = I,           C = zero,            coopStoreT  (expect Xᵀ)
// case 3: A = I,            B = coopLoad(X), C = zero,            coopStore   (expect X)
// case 4: A = I,            B = coopLoadT(X), C = zero,           coopStore   (expect Xᵀ)
// case 5: A = zeros,        B = I,           C = coopLoad(F: X),  coopStore   (expect X)
// case 6: A = coopLoadT(X), B = coopLoadT(Y), C = zero,           coopStoreT  (expect XY)
// case 7: case 0 with X copied into workgroup memory first (stride 16)
// case 8: case 6 from workgroup memory (stride 24, rows on 16-byte boundaries, as the kernel)
// case 9: case 6 with C += twice: A = X, B = Y, then again (expect 2XY)
// case 10: case 6 with the zero accumulator from coopLoad of zeroed workgroup f32 (expect XY)
// case 11: case 8 with the result stored to workgroup memory (coopStore, stride 24), then
//          copied out (expect XY)
// Cases 12 … 17 step toward linear_q4_mm_coop.wgsl's own uses (coop_diag_tile.wgsl then runs
// its whole tile):
// case 12: A = I, B = coopLoad(X) from workgroup memory (column-major B, stride 24, as the
//          kernel's xh / xl) (expect X)
// case 13: case 0 stored column-major to workgroup memory (coopStore, stride 24), copied out
//          (expect X)
// case 14: case 6 with A = coopLoadT at the kernel's stride 72 and an offset inside a larger
//          workgroup array (row 16, column 16, as its a1 at k = 1) (expect XY)
// case 15: A = coopLoadT(X) from storage, B = coopLoad(Yᵀ laid out as the kernel's xh: item n's
//          column k at n · 72 + k, from item 16 and column 16) (expect XY)
// case 16: case 6 accumulated over a loop of 4 with workgroup barriers in it, the accumulator
//          a `var` carried across iterations (expect 4XY)
// case 17: case 6 stored column-major to workgroup f32 at the kernel's stride 64 and offset 16
//          (as its c10), read back as the kernel reads cs (expect XY)

struct P {
    cases: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> S: array<f16>;
@group(0) @binding(2) var<storage, read> F: array<f32>;
@group(0) @binding(3) var<storage, read_write> O: array<f32>;

var<workgroup> wa: array<f16, 384>;
var<workgroup> wb: array<f16, 384>;
var<workgroup> wc: array<f32, 384>;
// 32 rows (or items) × 72, as linear_q4_mm_coop.wgsl's ws / xh.
var<workgroup> wt: array<f16, 2304>;
// 16 items × 64 + 16, as its cs.
var<workgroup> wd: array<f32, 1040>;

@compute @workgroup_size(32)
fn coop_diag(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let which = wid.x;
    let ob = which * 256u;
    if (which >= p.cases) {
        return;
    }
    // Workgroup copies (every case, so that barriers stay in uniform control flow).
    for (var i = lid; i < 256u; i += 32u) {
        let r = i / 16u;
        let c = i % 16u;
        wa[r * 24u + c] = S[i];
        wb[r * 24u + c] = S[256u + i];
        wc[r * 24u + c] = 0.0;
        // X at row 16, column 16 of wt (case 14); Yᵀ item-major from item 16 (case 15).
        if (which == 14u) {
            wt[(16u + r) * 72u + 16u + c] = S[i];
        } else {
            wt[(16u + c) * 72u + 16u + r] = S[256u + i];
        }
    }
    workgroupBarrier();
    let zero = coop_mat16x16<f32, C>();
    if (which == 0u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 1u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 2u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 3u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[512], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[0], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 4u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[512], 16u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[0], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 5u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[768], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        let c = coopLoad<coop_mat16x16<f32, C>>(&F[0], 16u);
        coopStore(coopMultiplyAdd(a, b, c), &O[ob], 16u);
    } else if (which == 6u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[256], 16u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 7u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&wa[0], 24u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 8u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&wa[0], 24u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&wb[0], 24u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    } else if (which == 9u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[256], 16u);
        var c = coop_mat16x16<f32, C>();
        c = coopMultiplyAdd(a, b, c);
        c = coopMultiplyAdd(a, b, c);
        coopStoreT(c, &O[ob], 16u);
    } else if (which == 10u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[256], 16u);
        let c = coopLoad<coop_mat16x16<f32, C>>(&wc[0], 24u);
        coopStoreT(coopMultiplyAdd(a, b, c), &O[ob], 16u);
    }
    if (which == 11u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&wa[0], 24u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&wb[0], 24u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &wc[0], 24u);
    }
    if (which == 12u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[512], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&wa[0], 24u);
        coopStore(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    }
    if (which == 13u) {
        let a = coopLoad<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&S[512], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &wc[0], 24u);
    }
    if (which == 14u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&wt[16u * 72u + 16u], 72u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[256], 16u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    }
    if (which == 15u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoad<coop_mat16x16<f16, B>>(&wt[16u * 72u + 16u], 72u);
        coopStoreT(coopMultiplyAdd(a, b, zero), &O[ob], 16u);
    }
    // Every case runs the loop (its barriers in uniform control flow); only case 16 multiplies.
    var acc = coop_mat16x16<f32, C>();
    for (var it = 0u; it < 4u; it++) {
        workgroupBarrier();
        if (which == 16u) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&wa[0], 24u);
            let b = coopLoadT<coop_mat16x16<f16, B>>(&wb[0], 24u);
            acc = coopMultiplyAdd(a, b, acc);
        }
        workgroupBarrier();
    }
    if (which == 16u) {
        coopStoreT(acc, &O[ob], 16u);
    }
    if (which == 17u) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&S[0], 16u);
        let b = coopLoadT<coop_mat16x16<f16, B>>(&S[256], 16u);
        coopStore(coopMultiplyAdd(a, b, zero), &wd[16], 64u);
    }
    workgroupBarrier();
    if (which == 11u || which == 13u) {
        for (var i = lid; i < 256u; i += 32u) {
            O[ob + i] = wc[(i / 16u) * 24u + i % 16u];
        }
    }
    if (which == 17u) {
        // Element (i, j) (row i, item j) at wd[16 + j · 64 + i].
        for (var i = lid; i < 256u; i += 32u) {
            O[ob + i] = wd[16u + (i % 16u) * 64u + i / 16u];
        }
    }
}
