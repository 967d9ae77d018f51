// The KV cache in f16 (half the bytes attention reads at decode): kv_f32.wgsl's aliases. Scores,
// softmax and sums stay f32: the kernels convert each element as they read it.
enable f16;

alias KV = f16;
alias KV4 = vec4<f16>;
