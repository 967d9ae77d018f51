// Groups a prefill chunk's routed (token, expert) items by expert for linear_q4_mm.wgsl, on the
// GPU (no read back): G = [indirect args A (blocks_a, 1, tiles, 0) | indirect args B (blocks_b,
// 1, tiles, 0) | tile list at tiles_at: (expert, first, count, 0) per tile of at most TT items |
// the items sorted by expert at order_at (within an expert in no set order: each item's product
// is computed on its own, wherever it sits in a tile)]. One workgroup of 256: the items counted
// and placed with workgroup atomics (invocation lid takes items lid, lid + 256, ...), the
// offsets by one invocation, the tiles by expert (lid, lid + 256: E ≤ 512).

struct P {
    items: u32,
    e: u32,
    tt: u32,
    blocks_a: u32,
    blocks_b: u32,
    tiles_at: u32,
    order_at: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> G: array<u32>;

var<workgroup> cnt: array<atomic<u32>, 512>;
var<workgroup> cursor: array<atomic<u32>, 512>;
var<workgroup> first: array<u32, 512>;
var<workgroup> tile0: array<u32, 512>;
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
        var tl = 0u;
        for (var e = 0u; e < p.e; e++) {
            let c = atomicLoad(&cnt[e]);
            first[e] = o;
            atomicStore(&cursor[e], o);
            tile0[e] = tl;
            o += c;
            tl += (c + p.tt - 1u) / p.tt;
        }
        total_tiles = tl;
        G[0] = p.blocks_a;
        G[1] = 1u;
        G[2] = tl;
        G[3] = 0u;
        G[4] = p.blocks_b;
        G[5] = 1u;
        G[6] = tl;
        G[7] = 0u;
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
        let nt = (c + p.tt - 1u) / p.tt;
        for (var j = 0u; j < nt; j++) {
            let tb = p.tiles_at + (tile0[e] + j) * 4u;
            G[tb] = e;
            G[tb + 1u] = first[e] + j * p.tt;
            G[tb + 2u] = min(p.tt, c - j * p.tt);
            G[tb + 3u] = 0u;
        }
    }
}
