//! The kernel sources, embedded in the binary. Each file under shaders/cuda/ is one op family and
//! one CUDA module; `common.cuh` is prepended to each (NVRTC 13 has no CUDA headers to include).

/// The shared header: bf16/fp32 helpers, warp reductions, the packed-weight reader.
pub const COMMON: &str = include_str!("../../../shaders/cuda/common.cuh");

/// One kernel file: its module name and source.
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
}

pub const FILES: &[KernelFile] = &[
    KernelFile {
        name: "embed",
        source: include_str!("../../../shaders/cuda/embed.cu"),
    },
    KernelFile {
        name: "norm",
        source: include_str!("../../../shaders/cuda/norm.cu"),
    },
    KernelFile {
        name: "linear",
        source: include_str!("../../../shaders/cuda/linear.cu"),
    },
    KernelFile {
        name: "gemm",
        source: include_str!("../../../shaders/cuda/gemm.cu"),
    },
    KernelFile {
        name: "attention",
        source: include_str!("../../../shaders/cuda/attention.cu"),
    },
    KernelFile {
        name: "deltanet",
        source: include_str!("../../../shaders/cuda/deltanet.cu"),
    },
    KernelFile {
        name: "moe",
        source: include_str!("../../../shaders/cuda/moe.cu"),
    },
    KernelFile {
        name: "sample",
        source: include_str!("../../../shaders/cuda/sample.cu"),
    },
];

/// The exact text NVRTC compiles for one file.
pub fn full_source(file: &KernelFile) -> String {
    format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", file.name, file.source)
}

/// Preprocessor defines for an activation mode (see common.cuh).
pub fn defines(bf16_activations: bool) -> Vec<String> {
    if bf16_activations {
        vec!["LILY_BF16_ACT=1".to_string()]
    } else {
        Vec::new()
    }
}
