// The element type of the activations between kernels (forward.rs `Scratch`: the normed inputs,
// the products' outputs, attention's and DeltaNet's intermediates, the GLU's, the experts'
// outputs; the table in crates/lily-wgpu/README.md), f32 (act_f16.wgsl: f16 where the device has
// SHADER_F16 and the plan's `act_f16` is on). The residual stream, the logits, the router's
// logits, the recurrent and conv state and every sum stay f32 either way: kernels convert each
// element to f32 as they read it and round once as they store it. The loader
// (lily-wgpu/src/shaders.rs) puts one of the two in front of every kernel, followed by the
// products' `XS` / `YS` (what a product reads and writes: `ACT`, or f32 where that is the
// residual stream or logits).
alias ACT = f32;
alias ACT4 = vec4<f32>;
