// Prefill attention with the query heads of one KV head AND several tokens together: one
// workgroup of 256 per (KV head, tile of TQ = 64 / G consecutive tokens) computes the 64 rows
// (token, head) of the tile, so each cached K and V row is read once per TQ tokens (attend_gqa.wgsl
// reads it once per token: on the H200 at a 4K prompt it spent 48.9 µs per prefill token, each
// 512-token chunk's call reading ≈ 4 GB of K and V). Written for prefill (chunks of many
// tokens; the plan's `PrefillAttention::Tile`: on the H200 at a 4K prompt 12.3 µs a token).
// Same bindings and outputs as attend_gqa.wgsl without key splits (its O directly, gated).
// Workgroup memory: 17 KiB of queries + 33·KB vec4 of keys, values and scores: 42.75 KiB with
// blocks of KB = 32 keys, 29.5 KiB with 16 (Apple GPUs have 32 KiB; the plan takes 16 there).
//
// Per block of KB keys (an override: 32, or 16):
// - scores S = Q·Kᵀ (64 rows × 32 keys) over the head dim in chunks of 64 dimensions, the
//   tile's queries and the block's keys through shared memory; invocation (rp, kg) =
//   (lid / 8, lid % 8) holds rows 2·rp, 2·rp + 1 × keys kg + 8·i (i < KB / 8) in registers;
// - online softmax per row (invocations 0..63, one row each): the running max and sum, the
//   block's weights p = exp(s − m) in place of the scores, the old sums' correction;
// - O += P·V (64 rows × D) in chunks of 64 dimensions of V: invocation (rg, c4) = (lid / 16,
//   lid % 16) holds rows 4·rg .. 4·rg + 3 × dimensions 4·c4 .. of every chunk (D/64 × 4 vec4).
// Row r = ti·G + g: token t0 + ti, query head kvh·G + g. Causal: key j is used by row r when
// j ≤ pos0 + t0 + ti; the first block (key 0) is open to every row, so a row's running max is
// finite after it.

struct P {
    hq: u32,
    hkv: u32,
    d: u32,
    pos0: u32,
    scale: f32,
    nsplit: u32,    // unused (1)
    span: u32,      // unused
    qg_stride: u32, // row stride of QG (the joint projection; gate of head h at h·2D + D)
    tokens: u32,    // tokens in the chunk
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Q: array<ACT4>;
@group(0) @binding(2) var<storage, read> QG: array<ACT>;
@group(0) @binding(3) var<storage, read> Kc: array<KV4>;
@group(0) @binding(4) var<storage, read> Vc: array<KV4>;
@group(0) @binding(5) var<storage, read_write> O: array<ACT>;

// Head dim (a multiple of 64, ≤ 256) and query heads per KV head (a power of two ≤ 8).
override D: u32 = 256u;
override G: u32 = 8u;

override KB: u32 = 32u;
override KS_LEN: u32 = KB * 17u;
override VS_LEN: u32 = KB * 16u;
// Row stride (vec4) of qs and ks: 16 vec4 of a chunk + 1 (rows on different banks).
const CS: u32 = 17u;

// qs[r · CS + c]: row r's query, dimensions 4c.. of the chunk; ks[j · CS + c]: key j's;
// vs[j · 16 + c]: key j's value, dimensions 4c.. of the chunk; ss[j · 16 + r / 4][r % 4]:
// score, then weight, of row r and key j (four rows a vec4: one read for an invocation's four
// rows); corr[r]: the row's correction of this block.
var<workgroup> qs: array<vec4<f32>, 1088>;
var<workgroup> ks: array<vec4<f32>, KS_LEN>;
var<workgroup> vs: array<vec4<f32>, VS_LEN>;
var<workgroup> ss: array<vec4<f32>, VS_LEN>;
var<workgroup> corr: array<f32, 64>;

const DCMAX: u32 = 4u;   // chunks of 64 dimensions in D at most

@compute @workgroup_size(256)
fn attend_tile(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kvh = wid.x;
    let tq = 64u / G;
    let t0 = wid.y * tq;
    let d4 = D / 4u;
    let nc = D / 64u;
    // Keys of the tile's last token.
    let nt = min(tq, p.tokens - t0);
    let k1 = p.pos0 + t0 + nt;
    // Scores: rows 2·rp, 2·rp + 1; keys kg, kg + 8, .. (KB / 8 of them).
    let kpi = KB / 8u;
    let rp = lid / 8u;
    let kg = lid % 8u;
    // Values: rows 4·rg .. 4·rg + 3, dimension vec4 c4 of each chunk.
    let rg = lid / 16u;
    let c4 = lid % 16u;
    var acc = array<vec4<f32>, 16>();   // [chunk · 4 + row]
    var m = NEG_BIG;     // invocations < 64: row lid's running max and sum
    var l = 0.0;
    for (var kb = 0u; kb < k1; kb += KB) {
        var s = array<f32, 8>();        // [row · 4 + i]
        for (var ch = 0u; ch < nc; ch++) {
            // The tile's queries and the block's keys, dimensions 64·ch .. 64·ch + 63.
            for (var i = lid; i < 1024u; i += 256u) {
                let r = i / 16u;
                let c = i % 16u;
                let ti = r / G;
                var v = vec4<f32>(0.0);
                if (ti < nt) {
                    v = vec4<f32>(Q[((t0 + ti) * p.hq + kvh * G + r % G) * d4 + ch * 16u + c]);
                }
                qs[r * CS + c] = v;
            }
            for (var i = lid; i < KB * 16u; i += 256u) {
                let j = i / 16u;
                let c = i % 16u;
                var v = vec4<f32>(0.0);
                if (kb + j < k1) {
                    v = vec4<f32>(Kc[((kb + j) * p.hkv + kvh) * d4 + ch * 16u + c]);
                }
                ks[j * CS + c] = v;
            }
            workgroupBarrier();
            for (var c = 0u; c < 16u; c++) {
                let q0 = qs[(2u * rp) * CS + c];
                let q1 = qs[(2u * rp + 1u) * CS + c];
                for (var i = 0u; i < kpi; i++) {
                    let k = ks[(kg + 8u * i) * CS + c];
                    s[i] += dot(q0, k);
                    s[4u + i] += dot(q1, k);
                }
            }
            workgroupBarrier();
        }
        for (var h = 0u; h < 2u; h++) {
            let r = 2u * rp + h;
            let last = p.pos0 + t0 + r / G;   // the row's last key
            for (var i = 0u; i < kpi; i++) {
                let j = kg + 8u * i;
                var v = NEG_BIG;
                if (kb + j <= last) {
                    v = s[h * 4u + i] * p.scale;
                }
                ss[j * 16u + r / 4u][r % 4u] = v;
            }
        }
        workgroupBarrier();
        if (lid < 64u) {
            var mx = m;
            for (var j = 0u; j < KB; j++) {
                mx = max(mx, ss[j * 16u + lid / 4u][lid % 4u]);
            }
            let cr = exp(m - mx);
            var sum = 0.0;
            for (var j = 0u; j < KB; j++) {
                let w = exp(ss[j * 16u + lid / 4u][lid % 4u] - mx);
                ss[j * 16u + lid / 4u][lid % 4u] = w;
                sum += w;
            }
            l = l * cr + sum;
            m = mx;
            corr[lid] = cr;
        }
        workgroupBarrier();
        let cr = vec4<f32>(corr[4u * rg], corr[4u * rg + 1u], corr[4u * rg + 2u], corr[4u * rg + 3u]);
        for (var ch = 0u; ch < nc; ch++) {
            for (var i = lid; i < KB * 16u; i += 256u) {
                let j = i / 16u;
                let c = i % 16u;
                var v = vec4<f32>(0.0);
                if (kb + j < k1) {
                    v = vec4<f32>(Vc[((kb + j) * p.hkv + kvh) * d4 + ch * 16u + c]);
                }
                vs[i] = v;
            }
            workgroupBarrier();
            var a0 = acc[ch * 4u] * cr.x;
            var a1 = acc[ch * 4u + 1u] * cr.y;
            var a2 = acc[ch * 4u + 2u] * cr.z;
            var a3 = acc[ch * 4u + 3u] * cr.w;
            for (var j = 0u; j < KB; j++) {
                let v = vs[j * 16u + c4];
                let w = ss[j * 16u + rg];
                a0 += w.x * v;
                a1 += w.y * v;
                a2 += w.z * v;
                a3 += w.w * v;
            }
            acc[ch * 4u] = a0;
            acc[ch * 4u + 1u] = a1;
            acc[ch * 4u + 2u] = a2;
            acc[ch * 4u + 3u] = a3;
            workgroupBarrier();
        }
    }
    // The rows' sums to every invocation (corr is free now).
    if (lid < 64u) {
        corr[lid] = l;
    }
    workgroupBarrier();
    for (var h = 0u; h < 4u; h++) {
        let r = 4u * rg + h;
        let ti = r / G;
        if (ti < nt) {
            let head = kvh * G + r % G;
            let tok = t0 + ti;
            let inv = 1.0 / corr[r];
            for (var ch = 0u; ch < nc; ch++) {
                let o = acc[ch * 4u + h] * inv;
                let c = ch * 64u + 4u * c4;
                let gb = tok * p.qg_stride + head * 2u * D + D + c;
                let ob = (tok * p.hq + head) * D + c;
                O[ob] = ACT(o.x * sigmoid(f32(QG[gb])));
                O[ob + 1u] = ACT(o.y * sigmoid(f32(QG[gb + 1u])));
                O[ob + 2u] = ACT(o.z * sigmoid(f32(QG[gb + 2u])));
                O[ob + 3u] = ACT(o.w * sigmoid(f32(QG[gb + 3u])));
            }
        }
    }
}
