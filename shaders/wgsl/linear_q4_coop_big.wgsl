// linear_q4_coop.wgsl in steps of 64 columns, every invocation staging (`coop_big`): the same
// parameters, bindings, items and launch geometry (one workgroup of 128 invocations per 64
// output rows × a tile of TT = 16, 32 or 64 items; C = A · B, A the weights 64 rows × K, B the
// inputs transposed K × TT, C in f32), so the plan swaps it for linear_q4_coop at every launch
// site. What differs:
// - a step is 64 columns (two 16-byte quads of a 4-bit row, four words of an 8-bit one): two
//   barriers per 64 columns instead of per 32;
// - every invocation stages: invocation i dequantises quad i / 64 of the step of row i % 64 (32
//   weights) into `ws` and reads TT / 8 vec4 of inputs (item i / (128 / TT)) into `xs`; in
//   linear_q4_coop invocations 64..127 stage only inputs while 0..63 dequantise;
// - the four subgroups as SR × SI blocks of RS rows × IS items (`// <coop: layout>`, written by
//   the loader, shaders.rs `coop_big_code`): 2 × 2 blocks of 32 rows × TT / 2 items where TT / 2 ≥
//   CM (each A fragment loaded feeds TT / 2 / CM products, each B fragment 32 / CM), else 4 × 1
//   of 16 rows × TT items (linear_q4_coop's);
// - the accumulators go out in PASSES passes of CR rows (each subgroup's first then second half
//   of its rows), so `cs` holds TT × CR f32 and the deeper staging fits 32 KiB.
// A quad past the matrix's columns (cols an odd multiple of 32) stages zeros: weights and
// inputs. The weights' q becomes f32 by its bits (`deq_exact`), not an integer conversion; f16
// activations stay f16 from their read to their store (linear_q4_coop takes them through f32).
// The next step's words are read while this one multiplies (registers, as linear_q4_coop). The cooperative operations are the loader's as in linear_q4_coop.wgsl (one
// named variable per accumulator, every index and stride a `let`, control flow uniform across
// the workgroup: loops on constants and `p`, subgroups enter only as pointer offsets).
// With `coop_rows` 128 (RT = 128, WG = 256, `BigLayout::new`'s `rows`): one workgroup of 256
// invocations, eight subgroups, per 128 output rows × the tile, each staged input tile feeding
// twice the rows (staged elements a multiply-add 128 → 96 at TT = 64); invocation i still
// dequantises quad i / RT of row i % RT, an item's inputs are read by WG / TT invocations of
// TT · 16 / WG vec4 (1 at TT = 16); 45,328 bytes of workgroup memory at TT = 64 on 16 × 16
// (ws 18,432 + xs 9,216 + cs 17,408 + the items): NVIDIA's 48 KiB, not Apple's 32 KiB, where
// the plan keeps 64 rows.
// Workgroup memory (64 rows): ws 64 × 72 f16 (9,216 B) + xs TT × 72 f16 (≤ 9,216) + cs TT × (CR + 4) f32
// (≤ 9,216: 64 × 36 at TT = 64, both sizes; 16 × 68 at TT = 16 on 16 × 16) + the tile's items
// (272): 27,920 bytes at TT = 64, under Apple's 32 KiB. Loads and barriers per multiply-add:
// docs/perf-notes.md, session 21 (wprefill).

override TT: u32 = 64u;   // items per tile, 16, 32 or 64 (MmTile on the host)
const KP: u32 = 72u;      // a staged row's stride in f16: 64 columns + 8 (16-byte aligned)
// <coop: layout>
const CSP: u32 = CR + 4u; // cs's stride in f32
override XS_LEN: u32 = KP * TT;
override CS_LEN: u32 = CSP * TT;

var<workgroup> ws: array<f16, RT * KP>;
var<workgroup> xs: array<f16, XS_LEN>;
var<workgroup> cs: array<f32, CS_LEN>;

// A word's four 4-bit (`sh`: SH_LO / SH_HI) or 8-bit (SH_8, BYTE) weights `q · s + b`, as
// mm_tile.wgsl's deq / deq8 but with q made f32 without an integer conversion (NVIDIA's I2F
// runs on the conversion unit at a fraction of the FP32 rate, one per weight staged): the bits 2^23 + q, less 2^23,
// exact for q < 2^23, so the same values.
const TWO23 = vec4<u32>(0x4B000000u);

fn deq_exact(w: u32, sh: vec4<u32>, mask: vec4<u32>, s: f32, b: f32) -> vec4<f32> {
    let q = bitcast<vec4<f32>>(((vec4<u32>(w) >> sh) & mask) | TWO23) - vec4<f32>(8388608.0);
    return q * s + vec4<f32>(b);
}

// mm_tile.wgsl's deq_step on deq_exact: a row's 32 weights of one quad in column order.
fn deq_step_exact(s: StepWords, eight: bool) -> array<vec4<f32>, 8> {
    let w = s.w;
    let w2 = s.w2;
    let sc = s.sc;
    let bi = s.bi;
    if (eight) {
        return array<vec4<f32>, 8>(
            deq_exact(w.x, SH_8, BYTE, sc, bi), deq_exact(w.y, SH_8, BYTE, sc, bi),
            deq_exact(w.z, SH_8, BYTE, sc, bi), deq_exact(w.w, SH_8, BYTE, sc, bi),
            deq_exact(w2.x, SH_8, BYTE, sc, bi), deq_exact(w2.y, SH_8, BYTE, sc, bi),
            deq_exact(w2.z, SH_8, BYTE, sc, bi), deq_exact(w2.w, SH_8, BYTE, sc, bi));
    }
    return array<vec4<f32>, 8>(
        deq_exact(w.x, SH_LO, NIB, sc, bi), deq_exact(w.x, SH_HI, NIB, sc, bi),
        deq_exact(w.y, SH_LO, NIB, sc, bi), deq_exact(w.y, SH_HI, NIB, sc, bi),
        deq_exact(w.z, SH_LO, NIB, sc, bi), deq_exact(w.z, SH_HI, NIB, sc, bi),
        deq_exact(w.w, SH_LO, NIB, sc, bi), deq_exact(w.w, SH_HI, NIB, sc, bi));
}

// Four values into ws (row-major weights) or xs (an item's inputs) at `at` (a multiple of 4:
// 8-byte aligned), converted as one vector (pairs the conversions where the GPU packs two f16 in
// one instruction; the same values as four scalar ones).
fn put_ws(at: u32, v: vec4<f32>) {
    let h = vec4<f16>(v);
    ws[at] = h.x;
    ws[at + 1u] = h.y;
    ws[at + 2u] = h.z;
    ws[at + 3u] = h.w;
}

fn put_xs(at: u32, v: XS4) {
    let h = vec4<f16>(v);
    xs[at] = h.x;
    xs[at + 1u] = h.y;
    xs[at + 2u] = h.z;
    xs[at + 3u] = h.w;
}

// An invocation's inputs of one step as read (XS4: f16 activations stay f16 in registers): nx4
// = TT · 16 / WG of them (1, 2, 4 or 8), zero where `live` is false (an item past the tile's, or a quad
// past the matrix's columns).
struct Inputs {
    x0: XS4,
    x1: XS4,
    x2: XS4,
    x3: XS4,
    x4: XS4,
    x5: XS4,
    x6: XS4,
    x7: XS4,
}

fn read_inputs(live: bool, at: u32, nx4: u32) -> Inputs {
    let z = XS4(0.0);
    var x = Inputs(z, z, z, z, z, z, z, z);
    if (live) {
        x.x0 = X[at];
        if (nx4 > 1u) {
            x.x1 = X[at + 1u];
        }
        if (nx4 > 2u) {
            x.x2 = X[at + 2u];
            x.x3 = X[at + 3u];
        }
        if (nx4 > 4u) {
            x.x4 = X[at + 4u];
            x.x5 = X[at + 5u];
            x.x6 = X[at + 6u];
            x.x7 = X[at + 7u];
        }
    }
    return x;
}

// Pass `h`'s rows out of `cs` ([item][CR rows]): cs row rr is row rr % HR of the pass's half of
// subgroup block rr / HR (HR = RS / PASSES rows), i.e. the tile's row (rr / HR) · RS + h · HR +
// rr % HR; `put_y` as linear_q4_mm's. Barriers on both sides: after the stores into cs, before
// the next pass's.
fn write_out(h: u32, block: u32, lid: u32, nt: u32) {
    workgroupBarrier();
    let hr = RS / PASSES;
    let rr = lid % CR;
    let row = block * RT + (rr / hr) * RS + h * hr + rr % hr;
    if (row < p.m.rows) {
        for (var t = lid / CR; t < nt; t += WG / CR) {
            put_y(t, row, cs[t * CSP + rr]);
        }
    }
    workgroupBarrier();
}

@compute @workgroup_size(WG)
fn linear_q4_coop_big(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // linear_q4_coop's prologue, inline for the same reason (naga's uniformity analysis).
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
    let steps = (quads + 1u) / 2u;
    // Quad `wq` (0 or 1) of each step of row `lid % RT` (WG = 2 · RT).
    let wr = lid % RT;
    let wq = lid / RT;
    let wrow = block * RT + wr;
    let wlive = wrow < p.m.rows;
    let eight = p.m.bits == 8u;
    let bases = row_bases(slot, wrow, wlive);
    let wo = wr * KP + wq * 32u;
    // Columns 64 / ipi · part .. of item `ti` (ipi = WG / TT invocations an item, nx4 = 16 /
    // ipi vec4 each), inside quad `xq` of the step.
    let ipi = WG / TT;
    let nx4 = 16u / ipi;
    let ti = lid / ipi;
    let part = lid % ipi;
    let xlive = ti < nt;
    let xq = (part * nx4) / 8u;
    let xb = (p.m.x_off + item_input(ti, xlive) * p.m.x_stride) / 4u + part * nx4;
    let xo = ti * KP + part * 4u * nx4;
    // Step 0's reads.
    var sw = step_words(wlive && wq < quads, bases, wq, eight);
    var xin = read_inputs(xlive && xq < quads, xb, nx4);
    // This subgroup's block: rows arow .. arow + RS − 1, items aitem .. aitem + IS − 1; its
    // rows of one pass at crow .. in cs.
    let sg = lid / 32u;
    let arow = (sg / SI) * RS;
    let aitem = (sg % SI) * IS;
    let crow = (sg / SI) * (RS / PASSES);
    // <coop: declare>
    for (var q = 0u; q < steps; q++) {
        {
            // (The array is gone before the cooperative operations.)
            let cols = deq_step_exact(sw, eight);
            for (var j = 0u; j < 8u; j++) {
                put_ws(wo + 4u * j, cols[j]);
            }
        }
        put_xs(xo, xin.x0);
        if (nx4 > 1u) {
            put_xs(xo + 4u, xin.x1);
        }
        if (nx4 > 2u) {
            put_xs(xo + 8u, xin.x2);
            put_xs(xo + 12u, xin.x3);
        }
        if (nx4 > 4u) {
            put_xs(xo + 16u, xin.x4);
            put_xs(xo + 20u, xin.x5);
            put_xs(xo + 24u, xin.x6);
            put_xs(xo + 28u, xin.x7);
        }
        workgroupBarrier();
        // The next step's reads, in flight while this one multiplies.
        let qn = q + 1u;
        if (qn < steps) {
            sw = step_words(wlive && 2u * qn + wq < quads, bases, 2u * qn + wq, eight);
            xin = read_inputs(xlive && 2u * qn + xq < quads, xb + qn * 16u, nx4);
        }
        for (var kk = 0u; kk < 64u; kk += CM) {
            // <coop: multiply>
        }
        workgroupBarrier();
    }
    // C is [row][item]; cs holds a pass's rows column-major ([item][row]) so the stores run
    // along the rows of Y.
    // <coop: store>
}
