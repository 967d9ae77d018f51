//! Writes kernel files' cubins for one arch, as the backend compiles them (each file with its
//! launcher's defines, both activation modes), with ptxas' report beside each: the SASS
//! (instructions per kernel and per loop) can then be read without a GPU.
//!
//!     cargo run --release -p lily-cuda --example cubins -- DIR [ARCH] [FILE] [DEFINE...]
//!     cuobjdump -sass DIR/decode-bf16.cubin
//!
//! ARCH defaults to sm_90a; FILE (a name of kernels::FILES, e.g. `decode`; `all` for every
//! file) to all; each DEFINE (`NAME=VALUE`) is added to every file's. cuobjdump needs `nvdisasm`
//! on the PATH (the `nvidia-cuda-nvdisasm` wheel ships one under nvidia/cu13/bin).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use lily_cuda::kernels::FILES;
use lily_cuda::nvrtc::Nvrtc;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first().map(PathBuf::from) else {
        bail!("usage: cubins DIR [ARCH] [FILE|all] [NAME=VALUE...]");
    };
    let arch = args.get(1).map_or("sm_90a", String::as_str);
    let only = args.get(2).map(String::as_str).filter(|f| *f != "all");
    let extra = args.get(3..).unwrap_or(&[]);
    if let Some(f) = only {
        if !FILES.iter().any(|k| k.name == f) {
            let names: Vec<&str> = FILES.iter().map(|k| k.name).collect();
            bail!("no kernel file {f}: one of {}", names.join(", "));
        }
    }
    let nvrtc = Nvrtc::load().context("NVRTC (pip install nvidia-cuda-nvrtc)")?;
    std::fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
    for file in FILES.iter().filter(|f| only.is_none_or(|o| o == f.name)) {
        for bf16 in [false, true] {
            let mut defines = file.defines(bf16);
            defines.extend(extra.iter().cloned());
            let c = nvrtc
                .compile(file.name, &file.full_source(), arch, &defines)
                .with_context(|| format!("{}.cu for {arch}", file.name))?;
            let mode = if bf16 { "bf16" } else { "f32" };
            let path = dir.join(format!("{}-{mode}.cubin", file.name));
            std::fs::write(&path, &c.cubin).with_context(|| path.display().to_string())?;
            let log = path.with_extension("ptxas.txt");
            std::fs::write(&log, &c.log).with_context(|| log.display().to_string())?;
            println!(
                "{} ({} bytes), {}",
                path.display(),
                c.cubin.len(),
                log.display()
            );
        }
    }
    Ok(())
}
