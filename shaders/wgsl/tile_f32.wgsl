// The element type of linear_q4_mm.wgsl's workgroup tiles (its dequantised weights and staged
// inputs), f32 (tile_f16.wgsl: f16 where the device has SHADER_F16 and the plan's `f16_tiles` is
// on; the products accumulate in f32 either way). The loader (lily-wgpu/src/shaders.rs) puts one
// of the two in front of every kernel, followed by `const TMAX`: the most items a tile of this
// kernel holds (the size of its register arrays: 32, or 64 for tiles of 64).
alias TS = f32;
alias TS4 = vec4<f32>;
