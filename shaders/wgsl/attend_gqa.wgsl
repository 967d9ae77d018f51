// attend.wgsl with the query heads of one KV head together: one workgroup of 256 per (KV head,
// token, split of the keys) computes all G = hq / hkv query heads that read that KV head, so each
// cached K and V row is read once per workgroup instead of once per query head (main's profile on
// the H200, prefill at 4K: attend 5.5 ms a layer per 512-token chunk, reading ≈ 34 GB of K and V).
// Same parameters, bindings, partials and output as attend.wgsl (attend_merge.wgsl combines the
// splits). The host uses it where G is a power of two ≤ 8 and D ≤ 256 (kernels.rs `gqa_group`).
//
// Per block of KB = 256 / G keys: the G invocations of a key each take a slice of its row and
// form partial dot products for all G heads (one K row read by consecutive invocations: the
// first version had each invocation walk a whole 1 KB row alone, 32 rows per read instruction,
// and spent 145 µs a layer at decode and 113 µs per prefill token at 4K on the H200); invocation
// (g, j) = (lid / KB, lid % KB) sums key j's partials for head g; the block's max per head by a
// tree in shared memory; the online-softmax weights p; then invocation c accumulates dimension c of all G
// heads' outputs over the block's keys (each V element read once, used G times).

struct P {
    hq: u32,
    hkv: u32,
    d: u32,
    pos0: u32,
    scale: f32,
    nsplit: u32,
    span: u32,     // keys per split, a multiple of 64 (of 256 / G with `attn_split`)
    qg_stride: u32, // row stride of QG (the joint projection; gate of head h at h·2D + D)
    prep: u32,      // 1 (decode, one token): attn_prep.wgsl's work done here (`prep_queries`)
    rot: u32,       // rotary dims (prep)
    eps: f32,       // the q/k norms' eps (prep)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Q: array<ACT4>;
@group(0) @binding(2) var<storage, read> QG: array<ACT>;
@group(0) @binding(3) var<storage, read_write> Kc: array<KV4>;
@group(0) @binding(4) var<storage, read_write> Vc: array<KV>;
@group(0) @binding(5) var<storage, read_write> O: array<ACT>;
// [(token · hq + head) · nsplit + split] · (d + 2): acc[d], running max, running sum.
@group(0) @binding(6) var<storage, read_write> Part: array<f32>;
@group(0) @binding(7) var<storage, read> norms: array<f32>;  // prep: q_norm[D] then k_norm[D]
@group(0) @binding(8) var<storage, read> rope: array<f32>;   // prep: cos[rot/2] | sin[rot/2]

// The head dim and the query heads per KV head, fixed per model (lily-wgpu/src/plan.rs).
override D: u32 = 256u;
override G: u32 = 8u;
// 1 (`WgpuOptions::attn_flat`): every invocation reads its keys' and values' words 8 at a time
// into registers, with no condition around the reads (keys past the split's end read its last
// key again, their scores unused and their weights 0; dimensions past D read D − 1, times 0),
// then uses them: 8 reads in flight together instead of one round trip each, whether or not the
// compiler unrolls the loops. The same sums in the same order: outputs bit for bit those of
// FLAT = 0.
override FLAT: u32 = 0u;
// 1 (`WgpuOptions::attn_v_early`, with FLAT): a block's first 32 keys' values (all of them where
// G = 8: the full model's blocks of 32 keys) requested as soon as the block's key products are
// formed, held in registers through the scores' barriers and the softmax, so their DRAM trip
// overlaps those instead of following the softmax in rounds of 8 (as written four dependent trips
// a block on the full model; ptxas hoists most of them into one, scripts/attend_gqa_regs.cu).
// Requested beside the keys' words instead, they would hold 32 more registers through the keys'
// products (ptxas: 216 against 127, one workgroup an SM instead of two). The same sums in the
// same order: outputs bit for bit those of VEARLY = 0.
override VEARLY: u32 = 0u;
const VE: u32 = 32u;

const GMAX: u32 = 8u;

// qs[g · D/4 + c]: query head g of the group; kp: the score partials, kp[(g·KB + j)·(G+1) + s]
// for key j of the block, head g and dimension slice s (G + 1: no two keys of a head in one
// bank); sc: the block's scores, then the tree's maxima; pr: the block's weights exp(s − m).
var<workgroup> qs: array<vec4<f32>, 512>;
var<workgroup> kp: array<f32, 2304>;
var<workgroup> sc: array<f32, 256>;
var<workgroup> pr: array<f32, 256>;
// prep: the new key (normalised, rotated; rounded as the cache holds it) and value of this KV
// head, used for position pos0 instead of the cache, and stored into it at the end.
var<workgroup> knew: array<f32, 256>;
var<workgroup> vnew: array<f32, 256>;

// Element c of the head staged in kp[base ..] after attn_prep.wgsl's steps: × r (its RMS norm's
// scale) × the norm's weight norms[nb + c], then NeoX RoPE on the first `rot` dims (the host's
// cos / sin at rope[rb ..]).
fn prepped(base: u32, c: u32, r: f32, nb: u32, rb: u32) -> f32 {
    let half = p.rot / 2u;
    let x = kp[base + c] * r * norms[nb + c];
    if (c < half) {
        let x2 = kp[base + c + half] * r * norms[nb + c + half];
        return x * rope[rb + c] - x2 * rope[rb + half + c];
    } else if (c < p.rot) {
        let i = c - half;
        let x1 = kp[base + i] * r * norms[nb + i];
        return x * rope[rb + i] + x1 * rope[rb + half + i];
    }
    return x;
}

// prep: RMS-norm scales of the `heads` rows of D staged in kp (sums of squares by 32 invocations a
// row, then one), into pr[0 .. heads). Uniform control flow only.
fn stage_scales(lid: u32, heads: u32) {
    if (lid < heads * 32u) {
        let g = lid / 32u;
        var ss = 0.0;
        for (var c = lid % 32u; c < D; c += 32u) {
            let v = kp[g * D + c];
            ss += v * v;
        }
        sc[lid] = ss;
    }
    workgroupBarrier();
    if (lid < heads) {
        var ss = 0.0;
        for (var i = 0u; i < 32u; i++) {
            ss += sc[lid * 32u + i];
        }
        pr[lid] = 1.0 / sqrt(ss / f32(D) + p.eps);
    }
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn attend_gqa(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let kvh = wid.x;
    let t = wid.y;
    let split = wid.z;
    let d4 = D / 4u;
    let kbn = 256u / G;
    let n = p.pos0 + t + 1u;
    let k0 = split * p.span;
    let k1 = min(n, k0 + p.span);
    // The new position (prep): its key and value come from knew / vnew, not the cache.
    var pos_new = 0xffffffffu;
    if (p.prep != 0u) {
        // attn_prep.wgsl for this workgroup's G query heads (every split), and for its KV
        // head's key and value (the split holding the new position), from the joint
        // projection QG: one token, so no attn_prep dispatch at decode.
        let row = t * p.qg_stride;
        let rb = t * p.rot;
        for (var i = lid; i < G * D; i += 256u) {
            kp[i] = f32(QG[row + (kvh * G + i / D) * 2u * D + i % D]);
        }
        workgroupBarrier();
        stage_scales(lid, G);
        for (var e = lid; e < G * d4; e += 256u) {
            let g = e / d4;
            let c = (e % d4) * 4u;
            let r = pr[g];
            qs[e] = vec4<f32>(
                prepped(g * D, c, r, 0u, rb),
                prepped(g * D, c + 1u, r, 0u, rb),
                prepped(g * D, c + 2u, r, 0u, rb),
                prepped(g * D, c + 3u, r, 0u, rb)
            );
        }
        workgroupBarrier();
        let pos = p.pos0 + t;
        if (pos >= k0 && pos < k1) {
            let kq = row + p.hq * 2u * D;
            for (var c = lid; c < D; c += 256u) {
                kp[c] = f32(QG[kq + kvh * D + c]);
                vnew[c] = f32(KV(f32(QG[kq + p.hkv * D + kvh * D + c])));
            }
            workgroupBarrier();
            stage_scales(lid, 1u);
            for (var c = lid; c < D; c += 256u) {
                knew[c] = f32(KV(prepped(0u, c, pr[0], D, rb)));
            }
            workgroupBarrier();
            pos_new = pos;
        }
    } else {
        for (var i = lid; i < G * d4; i += 256u) {
            let g = i / d4;
            let c = i % d4;
            qs[i] = vec4<f32>(Q[(t * p.hq + kvh * G + g) * d4 + c]);
        }
        workgroupBarrier();
    }
    // Scores: invocation (kj, ks) = (lid / G, lid % G) reads slice ks of key kj's row (vec4
    // ks, ks + G, …: the G invocations of a key read consecutive 16-byte words, so a read
    // instruction touches few cache lines) and forms the G heads' partial dot products.
    let kj = lid / G;
    let ks = lid % G;
    // Softmax and values: invocation (sg, sj) = (lid / KB, lid % KB) owns head sg's score of
    // key sj; invocation c accumulates dimension c of every head's output.
    let sg = lid / kbn;
    let sj = lid % kbn;
    var m = array<f32, GMAX>();
    var l = array<f32, GMAX>();
    var acc = array<f32, GMAX>();
    for (var g = 0u; g < G; g++) {
        m[g] = NEG_BIG;
    }
    for (var kb = k0; kb < k1; kb += kbn) {
        {
            var pd = array<vec4<f32>, GMAX>();
            let jk = kb + kj;
            if (FLAT != 0u) {
                // 8 words' reads issued together, then their products (a constant trip count
                // of ⌈D / 4 / G⌉ words: 8 for the full model and tiny).
                let jr = min(jk, k1 - 1u);
                let kbase = (jr * p.hkv + kvh) * d4;
                for (var i0 = 0u; i0 < (d4 + G - 1u) / G; i0 += 8u) {
                    var kw = array<vec4<f32>, 8>();
                    for (var i = 0u; i < 8u; i++) {
                        kw[i] = vec4<f32>(Kc[kbase + min(ks + (i0 + i) * G, d4 - 1u)]);
                    }
                    for (var i = 0u; i < 8u; i++) {
                        let c = ks + (i0 + i) * G;
                        let cc = min(c, d4 - 1u);
                        var kv = kw[i];
                        if (jr == pos_new) {
                            kv = vec4<f32>(knew[4u * cc], knew[4u * cc + 1u], knew[4u * cc + 2u], knew[4u * cc + 3u]);
                        }
                        kv = select(vec4<f32>(0.0), kv, c < d4);
                        for (var g = 0u; g < G; g++) {
                            pd[g] += qs[g * d4 + cc] * kv;
                        }
                    }
                }
            } else if (jk < k1) {
                let kbase = (jk * p.hkv + kvh) * d4;
                for (var c = ks; c < d4; c += G) {
                    var kv = vec4<f32>(Kc[kbase + c]);
                    if (jk == pos_new) {
                        kv = vec4<f32>(knew[4u * c], knew[4u * c + 1u], knew[4u * c + 2u], knew[4u * c + 3u]);
                    }
                    for (var g = 0u; g < G; g++) {
                        pd[g] += qs[g * d4 + c] * kv;
                    }
                }
            }
            for (var g = 0u; g < G; g++) {
                let v = pd[g];
                kp[(g * kbn + kj) * (G + 1u) + ks] = (v.x + v.y) + (v.z + v.w);
            }
        }
        // VEARLY: the block's first VE values of dimension lid (kbn = 256 / G ≥ 32 ≥ VE), as
        // FLAT's value loop below reads them, requested once the keys' products are done (so
        // they do not sit in registers beside the keys' words and the heads' partials) and
        // arriving during the scores' barriers and the softmax.
        var ve = array<f32, VE>();
        if (FLAT != 0u && VEARLY != 0u) {
            let cv = min(lid, D - 1u);
            for (var i = 0u; i < VE; i++) {
                let key = min(kb + i, k1 - 1u);
                ve[i] = f32(Vc[(key * p.hkv + kvh) * D + cv]);
            }
        }
        workgroupBarrier();
        let j = kb + sj;
        var s = NEG_BIG;
        if (j < k1) {
            var tot = 0.0;
            let pb = (sg * kbn + sj) * (G + 1u);
            for (var i = 0u; i < G; i++) {
                tot += kp[pb + i];
            }
            s = tot * p.scale;
        }
        sc[lid] = s;
        workgroupBarrier();
        for (var st = kbn / 2u; st > 0u; st = st >> 1u) {
            if (sj < st) {
                sc[lid] = max(sc[lid], sc[lid + st]);
            }
            workgroupBarrier();
        }
        // Every invocation: each head's new running max and the old sums' correction.
        var corr = array<f32, GMAX>();
        for (var g = 0u; g < G; g++) {
            let mn = max(m[g], sc[g * kbn]);
            corr[g] = exp(m[g] - mn);
            m[g] = mn;
        }
        var pj = 0.0;
        if (j < k1) {
            pj = exp(s - m[sg]);
        }
        pr[lid] = pj;
        workgroupBarrier();
        let c = lid;
        for (var g = 0u; g < G; g++) {
            acc[g] *= corr[g];
            l[g] *= corr[g];
        }
        // Constant bounds (kbn, G: override constants) so the V reads can issue together.
        let cnt = min(kbn, k1 - kb);
        if (FLAT != 0u) {
            // 8 keys' values read together, then summed in key order (kbn = 256 / G ≥ 32, a
            // multiple of 8); with VEARLY the block's first VE taken from `ve` instead.
            let cc = min(c, D - 1u);
            for (var j0 = 0u; j0 < kbn; j0 += 8u) {
                var vv = array<f32, 8>();
                for (var i = 0u; i < 8u; i++) {
                    if (VEARLY != 0u && j0 < VE) {
                        vv[i] = ve[j0 + i];
                    } else {
                        let key = min(kb + j0 + i, k1 - 1u);
                        vv[i] = f32(Vc[(key * p.hkv + kvh) * D + cc]);
                    }
                }
                for (var i = 0u; i < 8u; i++) {
                    let jj = j0 + i;
                    var v = vv[i];
                    if (min(kb + jj, k1 - 1u) == pos_new) {
                        v = vnew[cc];
                    }
                    for (var g = 0u; g < G; g++) {
                        let w = pr[g * kbn + jj];
                        acc[g] += w * v;
                        l[g] += w;
                    }
                }
            }
        } else {
            for (var jj = 0u; jj < kbn; jj++) {
                if (jj < cnt) {
                    var v = 0.0;
                    if (c < D) {
                        v = f32(Vc[((kb + jj) * p.hkv + kvh) * D + c]);
                        if (kb + jj == pos_new) {
                            v = vnew[c];
                        }
                    }
                    for (var g = 0u; g < G; g++) {
                        let w = pr[g * kbn + jj];
                        acc[g] += w * v;
                        l[g] += w;
                    }
                }
            }
        }
        workgroupBarrier();
    }
    let c = lid;
    if (c >= D) {
        return;
    }
    if (pos_new != 0xffffffffu) {
        // The new key and value into the cache (no invocation of this dispatch reads them there).
        Vc[(pos_new * p.hkv + kvh) * D + c] = KV(vnew[c]);
        if (c < d4) {
            Kc[(pos_new * p.hkv + kvh) * d4 + c] = KV4(vec4<f32>(knew[4u * c], knew[4u * c + 1u], knew[4u * c + 2u], knew[4u * c + 3u]));
        }
    }
    for (var g = 0u; g < G; g++) {
        let h = kvh * G + g;
        let row = t * p.hq + h;
        if (p.nsplit == 1u) {
            let gate = f32(QG[t * p.qg_stride + h * 2u * D + D + c]);
            O[row * D + c] = ACT(acc[g] / l[g] * sigmoid(gate));
        } else {
            let pb = (row * p.nsplit + split) * (D + 2u);
            Part[pb + c] = acc[g];
            if (c == 0u) {
                Part[pb + D] = m[g];
                Part[pb + D + 1u] = l[g];
            }
        }
    }
}
