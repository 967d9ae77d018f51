// linear_q4_mm.wgsl's tiles in f16 (tile_f32.wgsl's aliases): in the same bytes a tile holds
// twice the items (64), which halves the weights' dequantisation and staging per multiply-add;
// every element is converted to f32 as it is read back, the products accumulate in f32.
enable f16;

alias TS = f16;
alias TS4 = vec4<f16>;
