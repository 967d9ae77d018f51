// linear_q4.wgsl for plain 4-bit matrices of 2,048 or 4,096 columns (decode's input and output
// projections, lm_head) and 8-bit ones of 2,048 (the router with the shared expert's gate): the
// inputs read once per workgroup into registers, then rows streamed. Invocation `lane` of the 64
// owns 16-byte words lane and lane + 64 (32 columns each at 4 bits, 16 at 8) of every row: it
// holds those inputs (and their sums, the bias terms' factor) and reads its 16 bytes of each of
// the workgroup's RB = 16 rows, 8 rows' reads in flight at a time; consecutive invocations read
// consecutive 16 bytes of a row (1 KB per row per read). Per row the 64 partial sums meet through
// `row_put` / `row_total` (common.wgsl). main's profile on the H200 (c7ee898): linear_q4 reached 350–490 GB/s (in_proj
// 35.8 µs a call, lm_head 520 µs), re-reading its inputs for every row with ≈ 300 values live
// per invocation. Same parameters and bindings as linear_q4.wgsl; plain mode, 4-bit only (the
// host checks: plan.rs `rows_ok`). Decode's DeltaNet in_proj also runs the causal conv of its
// conv channels here (`conv_ch`, one item: `conv_step`).
// Bytes a workgroup: RB rows × (cols / 2 + cols / 16) (4-bit g64) from DRAM, the input (and the
// norm's weight) from L2: 16 rows of 2,048 columns 18 KB + 16 KB; FLOPs 2 × RB × cols.
// `PERSIST` (`rows_persist`): the next round's words in flight while this round's are summed;
// where the plan's `rows_grid` launches fewer workgroups than row blocks (lm_head), each streams
// blocks wid, wid + workgroups, ... (CUDA's dec_gemv4 geometry): the input and the folded norm
// once per workgroup, not once per block of 16 rows.

struct P {
    @size(80) m: Mat,   // words 0..19 (Mat and two unused)
    norm: u32,        // 1: X is the residual stream; normalise it first (RMSNorm with Wn, eps)
    eps: f32,
    conv_ch: u32,     // rows (global) below this are DeltaNet conv channels (`conv_step`); 0: none
    conv_k: u32,      // the conv's taps
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> X: array<XS4>;
@group(0) @binding(3) var<storage, read_write> Y: array<YS>;
@group(0) @binding(4) var<storage, read> Wn: array<vec4<f32>>;  // the norm's weight (norm = 1)
@group(0) @binding(5) var<storage, read> taps: array<f32>;          // conv taps [conv_ch, conv_k]
@group(0) @binding(6) var<storage, read_write> cstate: array<f32>;  // conv state [conv_k − 1, conv_ch]

// A decode step's DeltaNet causal conv of channel `ch` (dn_conv_step.wgsl's, fused into the
// in_proj product that computes the channel's input x: no conv dispatch): the state's K − 1
// earlier inputs and x through the taps, the state shifted, silu.
fn conv_step(ch: u32, x: f32) -> f32 {
    let cd = p.conv_ch;
    let km1 = p.conv_k - 1u;
    var s = 0.0;
    for (var j = 0u; j < km1; j++) {
        s += taps[ch * p.conv_k + j] * cstate[j * cd + ch];
    }
    s += taps[ch * p.conv_k + km1] * x;
    for (var j = 0u; j + 1u < km1; j++) {
        cstate[j * cd + ch] = cstate[(j + 1u) * cd + ch];
    }
    if (km1 > 0u) {
        cstate[(km1 - 1u) * cd + ch] = x;
    }
    return silu(s);
}

// Rows per workgroup (a power of two ≤ 16: the plan's `rows_rb`) and rows whose reads are in
// flight together (min(RB, 8)). Few rows a workgroup for matrices of few rows, so that they still
// spread over the GPU: on the H200 the router (257 rows: 17 workgroups of 16) took 21 µs a call
// and the 2,048-row output projections (128 workgroups) 24 µs, as long as the 12,352-row in_proj.
override RB: u32 = 16u;
override RI: u32 = 8u;
// 1 (`WgpuOptions::rows_early`): both 16-byte words of a two-word row (8-bit, or 4,096
// columns) of the first RI rows and their scales, the input and the folded norm's weights all
// read before any arithmetic or barrier (their reads in flight together: one DRAM round trip
// where 0 has two and an L2 one after the norm's barrier), and the norm applied as
// y = r · W (x ⊙ w) with r = 1 / RMS(x) on each row's total (the product is linear in x after
// the scale), its reduction after the rows' arithmetic.
override EARLY: u32 = 0u;
// 1 (`WgpuOptions::rows_persist`, the 16-row kernel: plan.rs `rows_spec`, RI 4): blocks
// `block`, `block` + the launch's workgroups, ... (one where the grid has a workgroup a block)
// in rounds of RI rows, round n + 1's words and
// scales requested before round n's arithmetic, and a block's first round's before the
// previous block's totals (the row_total barriers): a workgroup's loads stay in flight from
// its first round to its last, two rounds of 4 rows held (the 8-row round's registers; a
// two-word row's, 4,096 columns, both words of both rounds: twice that). The same sums in the
// same order as 0: outputs bit for bit. Also the 8-row kernel (`WgpuOptions::out_rows` 8:
// plan.rs `Plan::rows_rb`), one workgroup a block of two rounds.
override PERSIST: u32 = 0u;
// The 16-byte words a lane reads of a row: 2 (rows of one or two words, chosen at run time by
// the matrix's columns and bits), or 1 (`WgpuOptions::rows_one_word`: plan.rs `rows_spec`; the
// plan gives this kernel one-word rows only, 4-bit 2,048 columns): the second words' code and
// registers compiled out (their inputs `xc`, the persistent form's `cur2` / `nxt2` carried
// between rounds), the same sums in the same order: outputs bit for bit.
override WORDS: u32 = 2u;
// 1 (`WgpuOptions::router_lean`: plan.rs `rows_spec` compiles it with RB 1 only, the router's
// kernel): the row's 64 partials and, with EARLY and a folded norm, the input's Σx² summed
// together in one two-value workgroup sum (`wg_sum2`: one subgroupAdd of the pair and one
// barrier), instead of the norm's `rms_scale` (two barriers) then `row_total` (three barriers
// and 64 serial adds at one row). The same products; the partials meet in another order: within
// rounding of RB 1 without it, not bit for bit.
override LEAN: u32 = 0u;

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

const SH_8 = vec4<u32>(0u, 8u, 16u, 24u);
const BYTE = vec4<u32>(255u);

// Σ q x over one 16-byte word of a row against its inputs x (8 vec4 at 4 bits, the first 4 at 8).
fn qd(w: vec4<u32>, x: array<vec4<f32>, 8>) -> f32 {
    if (p.m.bits == 8u) {
        return (dot(vec4<f32>((vec4<u32>(w.x) >> SH_8) & BYTE), x[0])
            + dot(vec4<f32>((vec4<u32>(w.y) >> SH_8) & BYTE), x[1]))
            + (dot(vec4<f32>((vec4<u32>(w.z) >> SH_8) & BYTE), x[2])
            + dot(vec4<f32>((vec4<u32>(w.w) >> SH_8) & BYTE), x[3]));
    }
    return qdot32(w, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]);
}

// Word `q` (lid, or lid + 64 for the second of a two-word row) of rows rr .. rr + RI − 1 of the
// block at r0 (`nr` rows; those past them read row r0 again and are not stored), with the
// scale and bias of its group `g`.
struct Words {
    w: array<vec4<u32>, 8>,
    s: array<f32, 8>,
    b: array<f32, 8>,
}

fn read_words(r0: u32, rr: u32, nr: u32, q: u32, g: u32, quads: u32, groups: u32) -> Words {
    var o: Words;
    for (var j = 0u; j < RI; j++) {
        let row = select(r0, r0 + rr + j, rr + j < nr);
        o.w[j] = W[row * quads + q];
        o.s[j] = w_half4(p.m.scale_off + row * groups + g);
        o.b[j] = w_half4(p.m.bias_off + row * groups + g);
    }
    return o;
}

// Row r of the block at r0 (`nr` rows) gets its total: stored (a DeltaNet conv channel through
// `conv_step`), or added into Y (`accumulate`). One invocation a row stores.
fn store_rows(lid: u32, item: u32, r0: u32, nr: u32, total: f32) {
    let r = lid / (64u / RB);
    if (lid % (64u / RB) == 0u && r < nr) {
        let row = p.m.row0 + r0 + r;
        let o = p.m.y_off + item * p.m.y_stride + row;
        if (row < p.conv_ch) {
            Y[o] = YS(conv_step(row, total));
        } else if (p.m.accumulate != 0u) {
            Y[o] = YS(f32(Y[o]) + total);
        } else {
            Y[o] = YS(total);
        }
    }
}

@compute @workgroup_size(64)
fn linear_q4_rows(@builtin(workgroup_id) wid: vec3<u32>,
                  @builtin(num_workgroups) nwg: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let block = wid.x + wid.y * p.m.nwx;
    let item = wid.z;
    let r0 = block * RB;
    if (r0 >= p.m.rows) {
        return;
    }
    let span = 128u / p.m.bits;            // columns per 16-byte word: 32 or 16
    let nv = span / 4u;                   // input vec4 per word
    let quads = p.m.cols / span;           // words per row: 64 or 128
    let two = WORDS > 1u && quads > 64u;
    let groups = p.m.cols / p.m.group;
    let ga = (lid * span) / p.m.group;
    let gc = ((lid + 64u) * span) / p.m.group;
    let nr = min(RB, p.m.rows - r0);
    // The first RI rows' words (word lid of each) first: they do not depend on the inputs, so
    // their reads are in flight during the inputs' reads and the norm's reduction (one DRAM
    // round trip fewer on the kernel's path; rows past the end read row r0 again, not stored).
    var cur = read_words(r0, 0u, nr, lid, ga, quads, groups);
    // EARLY: the second words of those rows too.
    // PERSIST: the second words of the first round too (each round's with its first words).
    var cur2 = Words();
    if ((EARLY != 0u || PERSIST != 0u) && two) {
        cur2 = read_words(r0, 0u, nr, lid + 64u, gc, quads, groups);
    }
    let xb = (p.m.x_off + item * p.m.x_stride) / 4u;
    // This invocation's inputs: word lid (and lid + 64); zeros past nv.
    var xa = array<vec4<f32>, 8>();
    var xc = array<vec4<f32>, 8>();
    for (var i = 0u; i < 8u; i++) {
        if (i < nv) {
            xa[i] = vec4<f32>(X[xb + lid * nv + i]);
        }
    }
    if (two) {
        for (var i = 0u; i < 8u; i++) {
            if (i < nv) {
                xc[i] = vec4<f32>(X[xb + (lid + 64u) * nv + i]);
            }
        }
    }
    // EARLY: x ⊙ w here (the norm's weights read unconditionally, clamped, with the input), Σx²
    // of the raw input kept for the scale taken after the rows' arithmetic.
    var ss_early = 0.0;
    if (EARLY != 0u && p.norm != 0u) {
        var wa = array<vec4<f32>, 8>();
        var wc = array<vec4<f32>, 8>();
        for (var i = 0u; i < 8u; i++) {
            wa[i] = Wn[lid * nv + min(i, nv - 1u)];
        }
        if (two) {
            for (var i = 0u; i < 8u; i++) {
                wc[i] = Wn[(lid + 64u) * nv + min(i, nv - 1u)];
            }
        }
        for (var i = 0u; i < 8u; i++) {
            ss_early += dot(xa[i], xa[i]) + dot(xc[i], xc[i]);
            xa[i] = select(xa[i], xa[i] * wa[i], i < nv);
            xc[i] = select(xc[i], xc[i] * wc[i], i < nv);
        }
    }
    if (EARLY == 0u && p.norm != 0u) {
        // rms_norm.wgsl's y = x · rsqrt(mean(x²) + eps) · w, on this invocation's inputs (the
        // workgroup holds the whole row between its invocations).
        var ss = 0.0;
        for (var i = 0u; i < 8u; i++) {
            ss += dot(xa[i], xa[i]) + dot(xc[i], xc[i]);
        }
        let r = rms_scale(lid, ss, p.m.cols, p.eps);
        for (var i = 0u; i < 8u; i++) {
            if (i < nv) {
                xa[i] = xa[i] * r * Wn[lid * nv + i];
                if (two) {
                    xc[i] = xc[i] * r * Wn[(lid + 64u) * nv + i];
                }
            }
        }
    }
    let sa = xsum32(xa[0], xa[1], xa[2], xa[3], xa[4], xa[5], xa[6], xa[7]);
    let sc = xsum32(xc[0], xc[1], xc[2], xc[3], xc[4], xc[5], xc[6], xc[7]);
    if (PERSIST != 0u) {
        // Rounds (block b, rows rr .. rr + RI − 1); `cur` holds the first block's first round.
        let nblocks = (p.m.rows + RB - 1u) / RB;
        let stride = nwg.x * nwg.y;
        var b = block;
        var rr = 0u;
        var c0 = r0;
        var cn = nr;
        var rn = 1.0;
        var first = true;
        loop {
            // The next round: this block's next RI rows, else block b + stride's first.
            var nb = b;
            var nrr = rr + RI;
            if (nrr >= RB) {
                nb = b + stride;
                nrr = 0u;
            }
            let more = nb < nblocks;
            var nxt = Words();
            var nxt2 = Words();
            if (more) {
                let n0 = nb * RB;
                let nn = min(RB, p.m.rows - n0);
                nxt = read_words(n0, nrr, nn, lid, ga, quads, groups);
                if (two) {
                    nxt2 = read_words(n0, nrr, nn, lid + 64u, gc, quads, groups);
                }
            }
            var pa = array<f32, 8>();
            for (var j = 0u; j < RI; j++) {
                pa[j] = cur.s[j] * qd(cur.w[j], xa) + cur.b[j] * sa;
            }
            if (two) {
                for (var j = 0u; j < RI; j++) {
                    pa[j] += cur2.s[j] * qd(cur2.w[j], xc) + cur2.b[j] * sc;
                }
            }
            for (var j = 0u; j < RI; j++) {
                row_put(lid, rr + j, pa[j]);
            }
            if (rr + RI >= RB) {
                if (first && EARLY != 0u && p.norm != 0u) {
                    rn = rms_scale(lid, ss_early, p.m.cols, p.eps);
                }
                first = false;
                store_rows(lid, item, c0, cn, row_total(lid, RB) * rn);
                // row_total's last reads before the next block's row_put.
                workgroupBarrier();
            }
            if (!more) {
                break;
            }
            b = nb;
            rr = nrr;
            c0 = nb * RB;
            cn = min(RB, p.m.rows - c0);
            cur = nxt;
            cur2 = nxt2;
        }
        return;
    }
    var lean = 0.0;
    for (var r8 = 0u; r8 < RB; r8 += RI) {
        // RI rows' reads together (rows past the end read row r0 again; not stored); the first
        // RI were read above.
        if (r8 > 0u) {
            cur = read_words(r0, r8, nr, lid, ga, quads, groups);
        }
        var pa = array<f32, 8>();
        for (var j = 0u; j < RI; j++) {
            pa[j] = cur.s[j] * qd(cur.w[j], xa) + cur.b[j] * sa;
        }
        if (two && EARLY != 0u && r8 == 0u) {
            // Read with the first words.
            for (var j = 0u; j < RI; j++) {
                pa[j] += cur2.s[j] * qd(cur2.w[j], xc) + cur2.b[j] * sc;
            }
        } else if (two) {
            let c2 = read_words(r0, r8, nr, lid + 64u, gc, quads, groups);
            for (var j = 0u; j < RI; j++) {
                pa[j] += c2.s[j] * qd(c2.w[j], xc) + c2.b[j] * sc;
            }
        }
        if (LEAN != 0u) {
            // RB 1: pa[0] is this invocation's partial of the one row.
            lean = pa[0];
        } else {
            for (var j = 0u; j < RI; j++) {
                row_put(lid, r8 + j, pa[j]);
            }
        }
    }
    if (LEAN != 0u) {
        let t = wg_sum2(lid, vec2<f32>(lean, ss_early));
        var rl = 1.0;
        if (EARLY != 0u && p.norm != 0u) {
            // rms_scale's formula on the same Σx².
            rl = 1.0 / sqrt(t.y / f32(p.m.cols) + p.eps);
        }
        store_rows(lid, item, r0, nr, t.x * rl);
        return;
    }
    var rn = 1.0;
    if (EARLY != 0u && p.norm != 0u) {
        rn = rms_scale(lid, ss_early, p.m.cols, p.eps);
    }
    store_rows(lid, item, r0, nr, row_total(lid, RB) * rn);
}
