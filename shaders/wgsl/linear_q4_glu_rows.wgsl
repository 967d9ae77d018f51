// act = silu(Wg x) ⊙ (Wu x) for 2,048 input columns (decode's experts and shared expert), as
// linear_q4_rows.wgsl streams rows: the input read once per workgroup (invocation `lane` of 64
// holds quad `lane`, 32 columns, and its sum), then RB = 16 rows of both matrices of the item's
// expert, 8 rows' 16-byte reads of each in flight at a time, consecutive invocations reading
// consecutive 16 bytes of a row. Same parameters, bindings and grid (with RB rows a workgroup)
// as linear_q4_glu.wgsl: plain matrices or routed experts (item z: token z / x_div, expert
// ids[z], or routed here from the router's logits: `route`, decode). main's profile on the H200 (c7ee898): linear_q4_glu 24.8 µs a call for 9 experts'
// 9.4 MB (≈ 380 GB/s). The host checks the shapes (plan.rs `glu_rows_ok`).

struct P {
    @size(80) m: Mat,   // words 0..19 (Mat and two unused)
    norm: u32,        // 1: X is the residual stream; normalise it first (RMSNorm with Wn, eps)
    eps: f32,
    route: u32,       // 1 (expert mode): each workgroup routes its token itself (`route`)
    e: u32,           // routed experts
    k: u32,           // experts picked a token
    l_stride: u32,    // row stride of L (E logits, then the shared gate's)
    ks: u32,          // items a token: k, or k + 1 with the shared expert stacked as expert E
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;   // gate
@group(0) @binding(2) var<storage, read> X: array<XS4>;
@group(0) @binding(3) var<storage, read_write> Y: array<ACT>;
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;
@group(0) @binding(5) var<storage, read> Wu: array<vec4<u32>>;  // up
@group(0) @binding(6) var<storage, read> Wn: array<vec4<f32>>;  // the norm's weight (norm = 1)
@group(0) @binding(7) var<storage, read> L: array<f32>;          // router logits (route = 1)
@group(0) @binding(8) var<storage, read_write> wts: array<f32>;  // routing weights (route = 1)

// Rows per workgroup (GLU_RB on the host, or the `glu_rows` knob: 4, 8 or 16): 8, so that a
// decode step's 9 items × 512 rows run on 576 workgroups (with 16: 288, 25 µs a call on the
// H200); with 4, 1,152 workgroups of one round of 4 rows.
override RB: u32 = 8u;

// 1 (`WgpuOptions::glu_early`): the routing by `route_early` (order keys, one barrier a round,
// only the rounds the item needs) and the folded norm's weights read with the input, the norm
// applied as silu(r · G(x ⊙ w)) ⊙ (r · U(x ⊙ w)) with r = 1 / RMS(x) on the row totals (the
// products are linear in x after the scale), its reduction while the weights' reads are in
// flight.
override EARLY: u32 = 0u;

// 1 (`WgpuOptions::moe_rounds`, routed experts with `route` only: plan.rs `glu_items_spec`):
// a workgroup takes one row of every item of its token (grid: rows × tokens) in rounds of one
// item, the item's gate and up words and scales requested as soon as its expert is known — the
// stacked shared expert's before any routing, rank r's right after routing round r — and the
// previous item's sums done while they are in flight; the routing's rounds (order keys, as
// `route_early`, all k in every workgroup) thus overlap the weights' reads instead of preceding
// them. The norm as EARLY's (x ⊙ w, 1 / RMS on the totals). Each item's 64 partials meet in one
// `rows2_total` over 16 slots (item ranks), so the sums' last additions are ordered differently
// from 0's: within rounding, not bit for bit.
override ITEMS: u32 = 0u;

var<workgroup> wg_expert: u32;

// One item's reads (`ITEMS`): its gate and up words of this invocation's quad, their scales and
// biases.
struct GluWords {
    wg: vec4<u32>,
    wu: vec4<u32>,
    sg: f32,
    bg: f32,
    su: f32,
    bu: f32,
}

fn glu_read(e: u32, row: u32, lid: u32, g: u32) -> GluWords {
    let groups = p.m.cols / p.m.group;
    // Experts outside this launch's slice read expert e0's row (not stored).
    let inside = e >= p.m.e0 && e < p.m.e0 + p.m.e_count;
    let slot = select(0u, e - p.m.e0, inside);
    let q = slot * p.m.mat_words / 4u + row * (p.m.cols / 32u) + lid;
    let h = slot * p.m.rows * groups + row * groups + g;
    var o: GluWords;
    o.wg = W[q];
    o.wu = Wu[q];
    o.sg = w_half4(p.m.scale_off + h);
    o.bg = w_half4(p.m.bias_off + h);
    o.su = u_half4(p.m.scale_off + h);
    o.bu = u_half4(p.m.bias_off + h);
    return o;
}

// A u32 whose unsigned order is the order of the f32 values (−0 as +0): sign set, all bits
// flipped; else the sign bit set. The largest logit gets the largest key.
fn order_key(v: f32) -> u32 {
    var b = bitcast<u32>(v);
    if (b == 0x80000000u) {
        b = 0u;
    }
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

// The value of an `order_key`.
fn key_value(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// `route`'s rule and result with EARLY: the shared expert (rank k) without ranking; a routed
// rank r after r + 1 rounds, all k where `write` (row block 0: the weight's sum needs them);
// each round one `wg_argmax_key` (integer keys, one barrier). Key 0 marks an expert taken or
// past E (the logits' keys are above 0 but for NaNs). Uniform control flow only.
fn route_early(lid: u32, item: u32, write: bool) -> u32 {
    let tt = item / p.ks;
    let rk = item % p.ks;
    let lb = tt * p.l_stride;
    if (rk >= p.k) {
        if (write && lid == 0u) {
            ids[item] = p.e;
            wts[item] = sigmoid(L[lb + p.e]);
        }
        return p.e;
    }
    var kv = array<u32, 8>();
    for (var m = 0u; m < 8u; m++) {
        let i = lid + 64u * m;
        if (i < p.e) {
            kv[m] = order_key(L[lb + i]);
        }
    }
    let rounds = select(rk + 1u, p.k, write);
    var top = 0.0;
    var den = 0.0;
    var ve = 0.0;
    var e = p.e;
    for (var r = 0u; r < rounds; r++) {
        var bk = 0u;
        var bi = 0xffffffffu;
        for (var m = 0u; m < 8u; m++) {
            if (kv[m] > bk) {
                bk = kv[m];
                bi = lid + 64u * m;
            }
        }
        let b = wg_argmax_key(lid, bk, bi, r);
        for (var m = 0u; m < 8u; m++) {
            if (lid + 64u * m == b.i) {
                kv[m] = 0u;
            }
        }
        let v = key_value(b.k);
        if (r == 0u) {
            top = v;
        }
        let ev = exp(v - top);
        den += ev;
        if (r == rk) {
            e = b.i;
            ve = ev;
        }
    }
    if (write && lid == 0u) {
        ids[item] = e;
        wts[item] = ve / den;
    }
    return e;
}

// The expert of `item` (token item / ks, rank item % ks) by moe_route.wgsl's rule, computed by
// the workgroup from the router's logits, so that a decode step needs no moe_route dispatch:
// softmax over the E experts, the k largest (ties to the lower id) in k rounds of a workgroup
// argmax (invocation lid holds experts lid + 64 m, E ≤ 512), weights renormalised over the k
// (exp(l − top) / Σ over the k: moe_route's ev / sum / kept); rank k is the shared expert (id E,
// weight sigmoid of its gate logit, column E of L) where it rides in the stacks. `write`: this
// workgroup (row block 0 of the item) stores the item's id and weight for moe_down_rows. Every
// invocation returns the same id. Uniform control flow only.
fn route(lid: u32, item: u32, write: bool) -> u32 {
    let tt = item / p.ks;
    let rk = item % p.ks;
    let lb = tt * p.l_stride;
    var lv = array<f32, 8>();
    var taken = 0u; // bit m: expert lid + 64 m picked already, or past E
    for (var m = 0u; m < 8u; m++) {
        let i = lid + 64u * m;
        if (i < p.e) {
            lv[m] = L[lb + i];
        } else {
            taken |= 1u << m;
        }
    }
    var top = 0.0;
    var den = 0.0;
    var ve = 0.0;
    var e = p.e;
    for (var r = 0u; r < p.k; r++) {
        var bv = -3.4028235e38;
        var bi = 0xffffffffu;
        for (var m = 0u; m < 8u; m++) {
            if ((taken & (1u << m)) == 0u && (bi == 0xffffffffu || lv[m] > bv)) {
                bv = lv[m];
                bi = lid + 64u * m;
            }
        }
        let b = wg_argmax(lid, bv, bi);
        if (b.i % 64u == lid) {
            taken |= 1u << (b.i / 64u);
        }
        if (r == 0u) {
            top = b.v;
        }
        let ev = exp(b.v - top);
        den += ev;
        if (r == rk) {
            e = b.i;
            ve = ev;
        }
    }
    var w = 0.0;
    if (rk < p.k) {
        w = ve / den;
    } else {
        w = sigmoid(L[lb + p.e]);
    }
    if (write && lid == 0u) {
        ids[item] = e;
        wts[item] = w;
    }
    return e;
}

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

fn u_half4(i: u32) -> f32 {
    return bf16_at(Wu[i >> 3u][(i >> 1u) & 3u], i);
}

@compute @workgroup_size(64)
fn linear_q4_glu_rows(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let block = wid.x + wid.y * p.m.nwx;
    if (ITEMS != 0u && p.route != 0u) {
        glu_items(lid, block, wid.z);
        return;
    }
    let item = wid.z;
    let r0 = block * RB;
    if (r0 >= p.m.rows) {
        return;
    }
    var slot = 0u;
    let xrow = select(item, item / p.m.x_div, p.m.expert_mode != 0u);
    // The inputs first: their reads overlap the routing below.
    let quads = p.m.cols / 32u;            // 64
    let groups = p.m.cols / p.m.group;
    let xb = (p.m.x_off + xrow * p.m.x_stride) / 4u + lid * 8u;
    var x0 = vec4<f32>(X[xb]);
    var x1 = vec4<f32>(X[xb + 1u]);
    var x2 = vec4<f32>(X[xb + 2u]);
    var x3 = vec4<f32>(X[xb + 3u]);
    var x4 = vec4<f32>(X[xb + 4u]);
    var x5 = vec4<f32>(X[xb + 5u]);
    var x6 = vec4<f32>(X[xb + 6u]);
    var x7 = vec4<f32>(X[xb + 7u]);
    // EARLY: the norm's weights with the input (before the routing's barriers).
    var ss = 0.0;
    if (EARLY != 0u && p.norm != 0u) {
        let wb = lid * 8u;
        ss = ((dot(x0, x0) + dot(x1, x1)) + (dot(x2, x2) + dot(x3, x3)))
            + ((dot(x4, x4) + dot(x5, x5)) + (dot(x6, x6) + dot(x7, x7)));
        x0 = x0 * Wn[wb];
        x1 = x1 * Wn[wb + 1u];
        x2 = x2 * Wn[wb + 2u];
        x3 = x3 * Wn[wb + 3u];
        x4 = x4 * Wn[wb + 4u];
        x5 = x5 * Wn[wb + 5u];
        x6 = x6 * Wn[wb + 6u];
        x7 = x7 * Wn[wb + 7u];
    }
    if (p.m.expert_mode != 0u) {
        if (p.route != 0u && EARLY != 0u) {
            let routed = route_early(lid, item, block == 0u);
            if (lid == 0u) {
                wg_expert = routed;
            }
        } else if (p.route != 0u) {
            let routed = route(lid, item, block == 0u);
            if (lid == 0u) {
                wg_expert = routed;
            }
        } else if (lid == 0u) {
            wg_expert = ids[item];
        }
        let e = workgroupUniformLoad(&wg_expert);
        if (e < p.m.e0 || e >= p.m.e0 + p.m.e_count) {
            return;
        }
        slot = e - p.m.e0;
    }
    if (EARLY == 0u && p.norm != 0u) {
        // rms_norm.wgsl's y = x · rsqrt(mean(x²) + eps) · w over the row (2,048 columns: the
        // 64 invocations hold it all).
        let ss = ((dot(x0, x0) + dot(x1, x1)) + (dot(x2, x2) + dot(x3, x3)))
            + ((dot(x4, x4) + dot(x5, x5)) + (dot(x6, x6) + dot(x7, x7)));
        let r = rms_scale(lid, ss, p.m.cols, p.eps);
        let wb = lid * 8u;
        x0 = x0 * r * Wn[wb];
        x1 = x1 * r * Wn[wb + 1u];
        x2 = x2 * r * Wn[wb + 2u];
        x3 = x3 * r * Wn[wb + 3u];
        x4 = x4 * r * Wn[wb + 4u];
        x5 = x5 * r * Wn[wb + 5u];
        x6 = x6 * r * Wn[wb + 6u];
        x7 = x7 * r * Wn[wb + 7u];
    }
    let xs = xsum32(x0, x1, x2, x3, x4, x5, x6, x7);
    let g = (lid * 32u) / p.m.group;
    let nr = min(RB, p.m.rows - r0);
    var rn = 1.0;
    let qslot = slot * p.m.mat_words / 4u;
    let hslot = slot * p.m.rows * groups;
    // Rows a round: 8, or RB where fewer (4: `glu_rows`).
    let ri = min(RB, 8u);
    for (var r8 = 0u; r8 < RB; r8 += 8u) {
        // Eight rows' reads of both matrices together (rows past the end read row r0 again;
        // not stored).
        var wg = array<vec4<u32>, 8>();
        var wu = array<vec4<u32>, 8>();
        var sg = array<f32, 8>();
        var bg = array<f32, 8>();
        var su = array<f32, 8>();
        var bu = array<f32, 8>();
        for (var j = 0u; j < ri; j++) {
            var row = r0 + r8 + j;
            if (r8 + j >= nr) {
                row = r0;
            }
            let q = qslot + row * quads + lid;
            let h = hslot + row * groups + g;
            wg[j] = W[q];
            wu[j] = Wu[q];
            sg[j] = w_half4(p.m.scale_off + h);
            bg[j] = w_half4(p.m.bias_off + h);
            su[j] = u_half4(p.m.scale_off + h);
            bu[j] = u_half4(p.m.bias_off + h);
        }
        if (EARLY != 0u && p.norm != 0u && r8 == 0u) {
            // The norm's scale while the first rows' reads are in flight.
            rn = rms_scale(lid, ss, p.m.cols, p.eps);
        }
        for (var j = 0u; j < ri; j++) {
            let gate = sg[j] * qdot32(wg[j], x0, x1, x2, x3, x4, x5, x6, x7) + bg[j] * xs;
            let up = su[j] * qdot32(wu[j], x0, x1, x2, x3, x4, x5, x6, x7) + bu[j] * xs;
            rows2_put(lid, r8 + j, vec2<f32>(gate, up));
        }
    }
    let total = rows2_total(lid, RB);
    let r = lid / (64u / RB);
    if (lid % (64u / RB) == 0u && r < nr) {
        let gate = total.x * rn;
        let up = total.y * rn;
        Y[p.m.y_off + item * p.m.y_stride + p.m.row0 + r0 + r] = ACT(silu(gate) * up);
    }
}

// `ITEMS`: row `row` of every item of token `tt` (see ITEMS). Uniform control flow only.
fn glu_items(lid: u32, row: u32, tt: u32) {
    if (row >= p.m.rows) {
        return;
    }
    let g = (lid * 32u) / p.m.group;
    let lb = tt * p.l_stride;
    // The stacked shared expert's reads first: its id needs no routing.
    let stacked = p.ks > p.k;
    var cur = GluWords();
    if (stacked) {
        cur = glu_read(p.e, row, lid, g);
    }
    var cur_rank = p.k;
    var have = stacked;
    // The input and the norm's weights (x ⊙ w; Σx² for the scale on the totals), the logits'
    // keys (invocation lid holds experts lid + 64 m).
    let xb = (p.m.x_off + tt * p.m.x_stride) / 4u + lid * 8u;
    var x = array<vec4<f32>, 8>();
    for (var i = 0u; i < 8u; i++) {
        x[i] = vec4<f32>(X[xb + i]);
    }
    var ss = 0.0;
    if (p.norm != 0u) {
        ss = ((dot(x[0], x[0]) + dot(x[1], x[1])) + (dot(x[2], x[2]) + dot(x[3], x[3])))
            + ((dot(x[4], x[4]) + dot(x[5], x[5])) + (dot(x[6], x[6]) + dot(x[7], x[7])));
        for (var i = 0u; i < 8u; i++) {
            x[i] = x[i] * Wn[lid * 8u + i];
        }
    }
    let xs = xsum32(x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]);
    var kv = array<u32, 8>();
    for (var m = 0u; m < 8u; m++) {
        let i = lid + 64u * m;
        if (i < p.e) {
            kv[m] = order_key(L[lb + i]);
        }
    }
    var top = 0.0;
    var den = 0.0;
    // Item slots: rank r at r, the shared expert at k; their experts and exp(l − top).
    var ids_k = array<u32, 16>();
    var evs = array<f32, 16>();
    for (var r = 0u; r <= p.k; r++) {
        // Routing round r (r < k): rank r's expert, its reads issued at once.
        var nxt = GluWords();
        if (r < p.k) {
            var bk = 0u;
            var bi = 0xffffffffu;
            for (var m = 0u; m < 8u; m++) {
                if (kv[m] > bk) {
                    bk = kv[m];
                    bi = lid + 64u * m;
                }
            }
            let b = wg_argmax_key(lid, bk, bi, r);
            for (var m = 0u; m < 8u; m++) {
                if (lid + 64u * m == b.i) {
                    kv[m] = 0u;
                }
            }
            let v = key_value(b.k);
            if (r == 0u) {
                top = v;
            }
            let ev = exp(v - top);
            den += ev;
            ids_k[r] = b.i;
            evs[r] = ev;
            nxt = glu_read(b.i, row, lid, g);
        }
        // The previous item's sums while those reads are in flight.
        if (have) {
            let gate = cur.sg * qdot32(cur.wg, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7])
                + cur.bg * xs;
            let up = cur.su * qdot32(cur.wu, x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7])
                + cur.bu * xs;
            rows2_put(lid, cur_rank, vec2<f32>(gate, up));
        }
        cur = nxt;
        cur_rank = r;
        have = r < p.k;
    }
    var rn = 1.0;
    if (p.norm != 0u) {
        rn = rms_scale(lid, ss, p.m.cols, p.eps);
    }
    let total = rows2_total(lid, 16u);
    let sr = lid / 4u;
    if (lid % 4u == 0u && sr < p.ks) {
        let item = tt * p.ks + sr;
        var e = p.e;
        var w = 0.0;
        if (sr < p.k) {
            e = ids_k[sr];
            w = evs[sr] / den;
        } else {
            w = sigmoid(L[lb + p.e]);
        }
        if (row == 0u) {
            ids[item] = e;
            wts[item] = w;
        }
        if (e >= p.m.e0 && e < p.m.e0 + p.m.e_count) {
            Y[p.m.y_off + item * p.m.y_stride + p.m.row0 + row] =
                ACT(silu(total.x * rn) * (total.y * rn));
        }
    }
}
