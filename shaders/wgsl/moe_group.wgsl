// Groups a prefill chunk's routed (token, expert) items by expert for linear_q4_mm.wgsl, on the
// GPU (no read back), in tiles sized by each expert's load (the seed's tile-by-expert-load
// choice): `nsizes` tile sizes tt0, tt0 / 2, ... (largest first: 64/32/16 with f16 tiles, 16 alone
// with f32), an expert taking the largest size of at most half its items (else the smallest), so
// that its last tile is not mostly empty. G = [for each size k: indirect args A (blocks_a, 1,
// tiles_k, 0) at 8k, B (blocks_b, 1, tiles_k, 0) at 8k + 4 | size k's tile list at tiles_at +
// 4·cap·k: (expert, first, count, 0) per tile | the items sorted by expert at order_at (within an
// expert in no set order: each item's product is computed on its own, wherever it sits in a
// tile, so the sizes change no sum)]. One workgroup of 256: the items counted and placed with
// workgroup atomics (invocation lid takes items lid, lid + 256, ...), the offsets and sizes by
// one invocation, the tiles by expert (lid, lid + 256: E ≤ 512).

struct P {
    items: u32,
    e: u32,
    nsizes: u32,    // tile sizes, 1..3
    blocks_a: u32,
    blocks_b: u32,
    tiles_at: u32,
    order_at: u32,
    cap: u32,       // tiles each size's list has room for
    tt0: u32,       // the largest tile size (size k: tt0 >> k)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> G: array<u32>;

var<workgroup> cnt: array<atomic<u32>, 512>;
var<workgroup> cursor: array<atomic<u32>, 512>;
var<workgroup> first: array<u32, 512>;
var<workgroup> tile0: array<u32, 512>;
var<workgroup> size_of: array<u32, 512>;   // each expert's size index k
var<workgroup> total_tiles: u32;

@compute @workgroup_size(256)
fn moe_group(@builtin(local_invocation_index) lid: u32) {
    for (var e = lid; e < p.e; e += 256u) {
        atomicStore(&cnt[e], 0u);
    }
    workgroupBarrier();
    for (var i = lid; i < p.items; i += 256u) {
        let e = ids[i];
        if (e < p.e) {
            atomicAdd(&cnt[e], 1u);
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var o = 0u;
        var tl = array<u32, 3>(0u, 0u, 0u);
        for (var e = 0u; e < p.e; e++) {
            let c = atomicLoad(&cnt[e]);
            first[e] = o;
            atomicStore(&cursor[e], o);
            var k = 0u;
            while (k + 1u < p.nsizes && 2u * (p.tt0 >> k) > c) {
                k++;
            }
            size_of[e] = k;
            tile0[e] = tl[k];
            o += c;
            tl[k] += (c + (p.tt0 >> k) - 1u) / (p.tt0 >> k);
        }
        total_tiles = tl[0] + tl[1] + tl[2];
        for (var k = 0u; k < 3u; k++) {
            G[8u * k] = p.blocks_a;
            G[8u * k + 1u] = 1u;
            G[8u * k + 2u] = tl[k];
            G[8u * k + 3u] = 0u;
            G[8u * k + 4u] = p.blocks_b;
            G[8u * k + 5u] = 1u;
            G[8u * k + 6u] = tl[k];
            G[8u * k + 7u] = 0u;
        }
    }
    workgroupBarrier();
    for (var i = lid; i < p.items; i += 256u) {
        let e = ids[i];
        if (e < p.e) {
            G[p.order_at + atomicAdd(&cursor[e], 1u)] = i;
        }
    }
    for (var e = lid; e < p.e; e += 256u) {
        let c = atomicLoad(&cnt[e]);
        if (c == 0u) {
            continue;
        }
        let k = size_of[e];
        let tt = p.tt0 >> k;
        let nt = (c + tt - 1u) / tt;
        for (var j = 0u; j < nt; j++) {
            let tb = p.tiles_at + (k * p.cap + tile0[e] + j) * 4u;
            G[tb] = e;
            G[tb + 1u] = first[e] + j * tt;
            G[tb + 2u] = min(tt, c - j * tt);
            G[tb + 3u] = 0u;
        }
    }
}
