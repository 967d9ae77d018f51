// linear_q4_mm.wgsl on cooperative matrices (wgpu 30's `wgpu_cooperative_matrix`: Vulkan's
// VK_KHR_cooperative_matrix, tensor cores on NVIDIA; Metal's simdgroup matrices on Apple): the
// same parameters, bindings, items and launch geometry (one workgroup per 64 output rows × a
// tile of TT = 16, 32 or 64 items), so the plan swaps one kernel for the other at every launch
// site of linear_q4_mm. Y[item][row] = Σ_k W[row][k] · X[item][k], i.e. C = A · B with A the
// weights (64 rows × K), B the inputs transposed (K × TT items), C (64 × TT) in f32.
// Per step of 32 columns (one 16-byte quad of 4-bit weights a row, two of 8-bit), invocation r
// < 64 dequantises row r's 32 weights to f16 into `ws` (row-major [row][k]) and every invocation
// stages TT / 4 inputs in f16 into `xs` ([item][k]: B column-major); the next step's words are
// read while this one multiplies. Four subgroups of 32 (the workgroup is 128 invocations: the
// plan takes this kernel only where the adapter's subgroups are 32 wide): subgroup s owns
// output rows 16s .. 16s + 15 and all TT items, as (16 / CM) × (TT / CM) accumulators of CM × CM
// (`CM` = 16 on NVIDIA Vulkan, 8 on Metal: the loader, shaders.rs `coop_prelude`, puts the
// aliases CA, CB, CC and the constants CM, ACC_MAX in front). At the end each subgroup stores its accumulators into
// `cs` ([item][row], f32) and the workgroup writes them out (item indirection of expert mode,
// `accumulate`, the output's type YS) as linear_q4_mm does. Products of f16 operands summed in
// f32: the same rounding of the operands as linear_q4_mm's f16 tiles.
// Workgroup memory: ws 64 × 40 f16 (5 KiB) + xs TT × 40 f16 (≤ 5 KiB) + cs TT × 64 f32 (≤ 16
// KiB): ≤ 26.3 KiB at TT = 64, under Apple's 32 KiB. FLOPs 2·rows·cols per item; weights read
// once per tile of items, inputs once per 64 rows.

// (Parameters, bindings, tile_items and the dequantisation: mm_tile.wgsl. The `enable` and
// `diagnostic` directives come from the loader: the cooperative operations run in control flow
// uniform across each subgroup, its own row block, not across the workgroup, which naga's
// uniformity analysis would report.)

override TT: u32 = 64u;   // items per tile, 16, 32 or 64 (MmTile on the host)
const RT: u32 = 64u;      // rows per tile (MM_ROWS on the host)
const KP: u32 = 40u;      // a staged row's stride in f16: 32 columns + 8 (16-byte aligned)
const CP: u32 = 68u;      // cs's stride in f32: 64 rows + 4
override XS_LEN: u32 = KP * TT;
override CS_LEN: u32 = CP * TT;

var<workgroup> ws: array<f16, 2560>;   // RT × KP
var<workgroup> xs: array<f16, XS_LEN>;
var<workgroup> cs: array<f32, CS_LEN>;

@compute @workgroup_size(128)
fn linear_q4_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
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
    // 128 / TT invocations an item, TT / 16 vec4 each).
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
    var xv = array<vec4<f32>, 4>();
    if (xlive) {
        for (var e = 0u; e < nx4; e++) {
            xv[e] = vec4<f32>(X[xb + e]);
        }
    }
    // This subgroup's accumulators: A tiles a = 0 .. 16 / CM of its rows, B tiles b = 0 ..
    // TT / CM of the items; acc[a · (TT / CM) + b].
    let na = 16u / CM;
    let nb = TT / CM;
    var acc: array<CC, ACC_MAX>;   // zero (WGSL's default value)
    let arow = sg * 16u;
    for (var q = 0u; q < quads; q++) {
        if (lid < RT) {
            let cols = deq_step(w, w2, eight, sc, bi);
            for (var j = 0u; j < 8u; j++) {
                let v = cols[j];
                let o = lid * KP + 4u * j;
                ws[o] = f16(v.x);
                ws[o + 1u] = f16(v.y);
                ws[o + 2u] = f16(v.z);
                ws[o + 3u] = f16(v.w);
            }
        }
        let k0 = part * 4u * nx4;
        for (var e = 0u; e < nx4; e++) {
            let v = xv[e];
            let o = ti * KP + k0 + 4u * e;
            xs[o] = f16(v.x);
            xs[o + 1u] = f16(v.y);
            xs[o + 2u] = f16(v.z);
            xs[o + 3u] = f16(v.w);
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
                for (var e = 0u; e < nx4; e++) {
                    xv[e] = vec4<f32>(X[xb + qn * 8u + e]);
                }
            }
        }
        for (var kk = 0u; kk < 32u; kk += CM) {
            for (var a = 0u; a < na; a++) {
                let am = coopLoadT<CA>(&ws[(arow + a * CM) * KP + kk], KP);
                for (var b = 0u; b < nb; b++) {
                    let bm = coopLoad<CB>(&xs[b * CM * KP + kk], KP);
                    acc[a * nb + b] = coopMultiplyAdd(am, bm, acc[a * nb + b]);
                }
            }
        }
        workgroupBarrier();
    }
    // C is [row][item]; cs holds it column-major ([item][row]) so the stores below run along
    // the rows of Y.
    for (var a = 0u; a < na; a++) {
        for (var b = 0u; b < nb; b++) {
            coopStore(acc[a * nb + b], &cs[b * CM * CP + arow + a * CM], CP);
        }
    }
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
