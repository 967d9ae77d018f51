// act = silu(gate) ⊙ up, elementwise over n values (the experts' and shared expert's middle).

struct P {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> G: array<ACT>;
@group(0) @binding(2) var<storage, read> U: array<ACT>;
@group(0) @binding(3) var<storage, read_write> A: array<ACT>;

@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 64u;
    if (i < p.n) {
        A[i] = ACT(silu(f32(G[i])) * f32(U[i]));
    }
}
