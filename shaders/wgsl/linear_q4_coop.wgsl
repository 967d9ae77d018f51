// linear_q4_mm.wgsl on cooperative matrices (wgpu 30's `wgpu_cooperative_matrix`: Vulkan's
// VK_KHR_cooperative_matrix, tensor cores on NVIDIA; Metal's simdgroup matrices on Apple): the
// same parameters, bindings, items and launch geometry (one workgroup per 64 output rows × a
// tile of TT = 16, 32 or 64 items), so the plan swaps one kernel for the other at every launch
// site of linear_q4_mm. Y[item][row] = Σ_k W[row][k] · X[item][k], i.e. C = A · B with A the
// weights (64 rows × K), B the inputs transposed (K × TT items), C (64 × TT) in f32.
// Per step of 32 columns (one 16-byte quad of 4-bit weights a row, two of 8-bit), invocation r
// < 64 dequantises row r's 32 weights to f16 into `ws` (row-major [row][k]) and every invocation
// stages TT / 4 inputs in f16 into `xs` ([item][k]: B column-major); the next step's words are
// read while this one multiplies. Four subgroups of 32 (the workgroup is 128 invocations, and
// the plan takes this kernel only where the adapter's subgroups are 32 wide, so subgroup s is
// invocations 32s .. 32s + 31): subgroup s owns output rows 16s .. 16s + 15 and all TT items, as
// (16 / CM) × (TT / CM) accumulators of CM × CM (CM = 16 on NVIDIA Vulkan, 8 on Metal). At the
// end each subgroup stores its accumulators into `cs` ([item][row], f32) and the workgroup
// writes them out (item indirection of expert mode, `accumulate`, the output's type YS) as
// linear_q4_mm does. Products of f16 operands summed in f32: the same rounding of the operands
// as linear_q4_mm's f16 tiles.
// The lines `// <coop: …>` are the cooperative operations, written by the loader (shaders.rs
// `coop_code`) for this CM and TT: one named variable per accumulator, every pointer index and
// stride a `let` of its own, no array of matrices and no private array live across them (the
// forms known to work through naga's SPIR-V on NVIDIA). naga wants them in control flow uniform
// across the workgroup: every loop around them runs on constants and `p`; a subgroup's rows
// enter only as pointer offsets. (Parameters, bindings, tile_items and the dequantisation:
// mm_tile.wgsl.)
// Workgroup memory: ws 64 × 40 f16 (5 KiB) + xs TT × 40 f16 (≤ 5 KiB) + cs TT × 68 f32 (≤ 17
// KiB): 27,920 bytes at TT = 64, under Apple's 32 KiB. FLOPs 2·rows·cols per item; weights read
// once per tile of items, inputs once per 64 rows.

override TT: u32 = 64u;   // items per tile, 16, 32 or 64 (MmTile on the host)
const RT: u32 = 64u;      // rows per tile (MM_ROWS on the host)
const KP: u32 = 40u;      // a staged row's stride in f16: 32 columns + 8 (16-byte aligned)
const CP: u32 = 68u;      // cs's stride in f32: 64 rows + 4
override XS_LEN: u32 = KP * TT;
override CS_LEN: u32 = CP * TT;

var<workgroup> ws: array<f16, 2560>;   // RT × KP
var<workgroup> xs: array<f16, XS_LEN>;
var<workgroup> cs: array<f32, CS_LEN>;

// Four values into ws (row-major weights) or xs (an item's inputs) at `at`.
fn put_ws(at: u32, v: vec4<f32>) {
    ws[at] = f16(v.x);
    ws[at + 1u] = f16(v.y);
    ws[at + 2u] = f16(v.z);
    ws[at + 3u] = f16(v.w);
}

fn put_xs(at: u32, v: vec4<f32>) {
    xs[at] = f16(v.x);
    xs[at + 1u] = f16(v.y);
    xs[at + 2u] = f16(v.z);
    xs[at + 3u] = f16(v.w);
}

@compute @workgroup_size(128)
fn linear_q4_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let block = wid.x + wid.y * p.m.nwx;
    if (block * RT >= p.m.rows) {
        return;
    }
    if (lid == 0u) {
        tile_info = mm_tile(wid.z);
    }
    let info = workgroupUniformLoad(&tile_info);
    let nt = info.x;
    if (info.y == 0u) {
        return;
    }
    let slot = info.y - 1u;
    let quads = p.m.cols / 32u;
    let groups = p.m.cols / p.m.group;
    // Row `lid`'s quad (invocations 0..63), and columns 32 / ipi · part .. of item `ti` (ipi =
    // 128 / TT invocations an item, nx4 = TT / 16 vec4 each: x0 .. x3).
    let wrow = block * RT + lid;
    let wlive = lid < RT && wrow < p.m.rows;
    let eight = p.m.bits == 8u;
    let wps = select(1u, 2u, eight);
    let qbase = (slot * p.m.mat_words + select(0u, wrow, wlive) * (p.m.cols * p.m.bits / 32u)) / 4u;
    let hbase = (slot * p.m.rows + select(0u, wrow, wlive)) * groups;
    let ipi = 128u / TT;
    let nx4 = TT / 16u;
    let ti = lid / ipi;
    let part = lid % ipi;
    let xlive = ti < nt;
    var xr = 0u;
    if (xlive) {
        xr = tile_items[ti];
        if (p.m.expert_mode != 0u) {
            xr = xr / p.m.x_div;
        }
    }
    let xb = (p.m.x_off + xr * p.m.x_stride) / 4u + part * nx4;
    let xo = ti * KP + part * 4u * nx4;
    // Step 0's reads.
    var w = vec4<u32>(0u);
    var w2 = vec4<u32>(0u);
    var sc = 0.0;
    var bi = 0.0;
    if (wlive) {
        w = W[qbase];
        if (eight) {
            w2 = W[qbase + 1u];
        }
        sc = w_half4(p.m.scale_off + hbase);
        bi = w_half4(p.m.bias_off + hbase);
    }
    var x0 = vec4<f32>(0.0);
    var x1 = vec4<f32>(0.0);
    var x2 = vec4<f32>(0.0);
    var x3 = vec4<f32>(0.0);
    if (xlive) {
        x0 = vec4<f32>(X[xb]);
        if (nx4 > 1u) {
            x1 = vec4<f32>(X[xb + 1u]);
        }
        if (nx4 > 2u) {
            x2 = vec4<f32>(X[xb + 2u]);
            x3 = vec4<f32>(X[xb + 3u]);
        }
    }
    // This subgroup's rows.
    let arow = (lid / 32u) * 16u;
    // <coop: declare>
    for (var q = 0u; q < quads; q++) {
        if (lid < RT) {
            let o = lid * KP;
            if (eight) {
                put_ws(o, deq8(w.x, sc, bi));
                put_ws(o + 4u, deq8(w.y, sc, bi));
                put_ws(o + 8u, deq8(w.z, sc, bi));
                put_ws(o + 12u, deq8(w.w, sc, bi));
                put_ws(o + 16u, deq8(w2.x, sc, bi));
                put_ws(o + 20u, deq8(w2.y, sc, bi));
                put_ws(o + 24u, deq8(w2.z, sc, bi));
                put_ws(o + 28u, deq8(w2.w, sc, bi));
            } else {
                put_ws(o, deq(w.x, SH_LO, sc, bi));
                put_ws(o + 4u, deq(w.x, SH_HI, sc, bi));
                put_ws(o + 8u, deq(w.y, SH_LO, sc, bi));
                put_ws(o + 12u, deq(w.y, SH_HI, sc, bi));
                put_ws(o + 16u, deq(w.z, SH_LO, sc, bi));
                put_ws(o + 20u, deq(w.z, SH_HI, sc, bi));
                put_ws(o + 24u, deq(w.w, SH_LO, sc, bi));
                put_ws(o + 28u, deq(w.w, SH_HI, sc, bi));
            }
        }
        put_xs(xo, x0);
        if (nx4 > 1u) {
            put_xs(xo + 4u, x1);
        }
        if (nx4 > 2u) {
            put_xs(xo + 8u, x2);
            put_xs(xo + 12u, x3);
        }
        workgroupBarrier();
        // The next step's reads, in flight while this one multiplies.
        let qn = q + 1u;
        if (qn < quads) {
            if (wlive) {
                w = W[qbase + qn * wps];
                if (eight) {
                    w2 = W[qbase + qn * wps + 1u];
                }
                let g = hbase + (qn * 32u) / p.m.group;
                sc = w_half4(p.m.scale_off + g);
                bi = w_half4(p.m.bias_off + g);
            }
            if (xlive) {
                let xn = xb + qn * 8u;
                x0 = vec4<f32>(X[xn]);
                if (nx4 > 1u) {
                    x1 = vec4<f32>(X[xn + 1u]);
                }
                if (nx4 > 2u) {
                    x2 = vec4<f32>(X[xn + 2u]);
                    x3 = vec4<f32>(X[xn + 3u]);
                }
            }
        }
        for (var kk = 0u; kk < 32u; kk += CM) {
            // <coop: multiply>
        }
        workgroupBarrier();
    }
    // C is [row][item]; cs holds it column-major ([item][row]) so the stores below run along
    // the rows of Y.
    // <coop: store>
    workgroupBarrier();
    let r = lid % RT;
    let row = block * RT + r;
    if (row < p.m.rows) {
        for (var t = lid / RT; t < nt; t += 2u) {
            let v = cs[t * CP + r];
            let o = p.m.y_off + tile_items[t] * p.m.y_stride + p.m.row0 + row;
            if (p.m.accumulate != 0u) {
                Y[o] = YS(f32(Y[o]) + v);
            } else {
                Y[o] = YS(v);
            }
        }
    }
}
