// The KV cache's element types, fp32 (kv_f16.wgsl: f16 where the device has SHADER_F16). The
// loader (lily-wgpu/src/shaders.rs) puts one of the two in front of every kernel; the attention
// kernels read the cache as `KV` / `KV4` and convert to f32 (attn_prep.wgsl writes it).
alias KV = f32;
alias KV4 = vec4<f32>;
