//! Every kernel compiles through NVRTC for every architecture Lily supports, in both activation
//! modes, without register spills. No GPU needed, but NVRTC is, and cargo has no run-time skip:
//! the test is ignored by default, so a machine without NVRTC reports it as ignored rather than
//! passed. scripts/test.sh runs it in CI (CI=true; NVRTC from the `nvidia-cuda-nvrtc` wheel that
//! test.sh installs there), as does scripts/gpu_check.sh; elsewhere
//! `cargo test --release --workspace --test kernels_compile -- --ignored`. Once asked for, a
//! missing NVRTC fails.
//! Each file is compiled with the defines its launcher module passes (kernels::FILES), exactly as
//! the backend loads it.

use lily_cuda::kernels::FILES;
use lily_cuda::nvrtc::Nvrtc;

const ARCHES: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90a", "sm_120"];

/// "N bytes spill stores, M bytes spill loads" lines of ptxas' report that are not zero.
fn spills(log: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().unwrap_or("").to_string();
        }
        if line.contains("spill stores")
            && !line.contains(" 0 bytes spill stores, 0 bytes spill loads")
        {
            out.push(format!("{current}: {}", line.trim()));
        }
    }
    out
}

#[test]
#[ignore = "needs NVRTC: run with --ignored (scripts/test.sh does in CI)"]
fn every_kernel_compiles_for_every_supported_arch() {
    let nvrtc =
        Nvrtc::load().unwrap_or_else(|e| panic!("no NVRTC (pip install nvidia-cuda-nvrtc): {e:#}"));
    eprintln!(
        "NVRTC {:?} from {}",
        nvrtc.version(),
        nvrtc.path().display()
    );
    let mut failures = Vec::new();
    for arch in ARCHES {
        for bf16 in [false, true] {
            // decode.cu also in its early-trigger variant (the plan's `early_trigger`), sample.cu
            // in its warp-scan one (`warp_scan_sampling`), attention.cu with bf16 activations on
            // compute capability 9 and later in its int8-cache one (`kv_cache int8`, which the
            // plan resolves there only).
            let int8_cache = matches!(*arch, "sm_90a" | "sm_120");
            let variants = FILES.iter().flat_map(move |f| {
                let extra: &[&str] = match (f.name, bf16) {
                    ("decode", _) => &["", "DEC_EARLY_TRIGGER=1"],
                    ("sample", _) => &["", "SAMPLE_WARP_SCAN=1"],
                    ("attention", true) if int8_cache => &["", "LILY_KV_INT8=1"],
                    _ => &[""],
                };
                extra.iter().map(move |e| (*f, *e))
            });
            for (file, extra) in variants {
                let mut defines = file.defines(bf16);
                if !extra.is_empty() {
                    defines.push(extra.to_string());
                }
                match nvrtc.compile(file.name, &file.full_source(), arch, &defines) {
                    Ok(c) => {
                        assert!(!c.cubin.is_empty(), "{} {arch}: empty cubin", file.name);
                        // LILY_PTXAS_REPORT=sm_90a (an arch): ptxas' registers and shared memory
                        // of every kernel for it, to reason about occupancy without a GPU.
                        if std::env::var("LILY_PTXAS_REPORT").is_ok_and(|a| a == *arch) {
                            eprintln!("== {}.cu {extra} {arch} bf16={bf16}\n{}", file.name, c.log);
                        }
                        for s in spills(&c.log) {
                            failures.push(format!(
                                "{}.cu {extra} {arch} bf16={bf16}: register spill: {s}",
                                file.name
                            ));
                        }
                    }
                    Err(e) => failures.push(format!(
                        "{}.cu {extra} {arch} bf16={bf16}: {e:#}",
                        file.name
                    )),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A kernel file compiled without its launcher's defines stops with a message naming the module.
#[test]
#[ignore = "needs NVRTC: run with --ignored (scripts/test.sh does in CI)"]
fn a_file_without_its_launcher_defines_names_the_launcher_module() {
    let nvrtc =
        Nvrtc::load().unwrap_or_else(|e| panic!("no NVRTC (pip install nvidia-cuda-nvrtc): {e:#}"));
    let file = FILES
        .iter()
        .find(|f| f.name == "linear")
        .expect("linear.cu is a kernel file");
    let Err(err) = nvrtc.compile(file.name, &file.full_source(), "sm_80", &[]) else {
        panic!("linear.cu compiled without LINEAR_WARPS");
    };
    assert!(format!("{err:#}").contains("kernels/linear.rs"), "{err:#}");
}
