// The activations between kernels in f16 (act_f32.wgsl's aliases): half the bytes each buffer
// moves between dispatches. Every element is converted to f32 as it is read; sums, norms,
// softmax, the residual stream and the recurrent state stay f32.
enable f16;

alias ACT = f16;
alias ACT4 = vec4<f16>;
