//! NVRTC, loaded at run time from wherever it lives. We keep this finder instead of cudarc's
//! `nvrtc` module for two reasons: cudarc's dynamic loading only tries library names on the
//! dynamic linker's path (a CUDA install under /usr/local/cuda-13.0 or the `nvidia-cuda-nvrtc`
//! pip wheel is often not on it), and it panics when it finds nothing, where `--device auto` must
//! get an error it can report before falling back to the CPU. So we look in the usual places
//! (CUDA_HOME and friends, /usr/local/cuda*, the linker path, the pip wheel) and say where we
//! looked when nothing is found. (`LILY_NVRTC` and cache.rs's `LILY_CACHE_DIR` are read here,
//! not in plan.rs: they say where files are, not which path runs.)

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Result};
use libloading::Library;

type NvrtcProgram = *mut std::ffi::c_void;
type NvrtcResult = c_int;

type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
type CreateFn = unsafe extern "C" fn(
    *mut NvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> NvrtcResult;
type DestroyFn = unsafe extern "C" fn(*mut NvrtcProgram) -> NvrtcResult;
type CompileFn = unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> NvrtcResult;
type SizeFn = unsafe extern "C" fn(NvrtcProgram, *mut usize) -> NvrtcResult;
type GetFn = unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> NvrtcResult;
type ErrorStringFn = unsafe extern "C" fn(NvrtcResult) -> *const c_char;

/// A loaded NVRTC library.
pub struct Nvrtc {
    path: PathBuf,
    version: (i32, i32),
    create: CreateFn,
    destroy: DestroyFn,
    compile: CompileFn,
    log_size: SizeFn,
    log: GetFn,
    cubin_size: SizeFn,
    cubin: GetFn,
    error_string: ErrorStringFn,
    _lib: Library,
    _builtins: Option<Library>,
}

/// What one compilation produced: the cubin and NVRTC's log (ptxas' resource report included).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

const LIB_NAMES: &[&str] = &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];

impl Nvrtc {
    /// Finds and loads NVRTC. Order: `LILY_NVRTC` (a file), `CUDA_HOME`/`CUDA_PATH`/`CUDA_ROOT`,
    /// `/usr/local/cuda`, `/usr/local/cuda-*` (newest first), the dynamic linker's own path,
    /// then the `nvidia-cuda-nvrtc` wheel in python3's site-packages.
    pub fn load() -> Result<Nvrtc> {
        let mut tried: Vec<String> = Vec::new();
        if let Some(nvrtc) = try_each(candidates(), &mut tried) {
            return Ok(nvrtc);
        }
        // Last, the pip wheel: asking python3 for its site-packages costs a process start, so
        // only when nothing else worked.
        let wheel = python_site_dirs().into_iter().flat_map(|site| {
            [
                site.join("nvidia/cu13/lib/libnvrtc.so.13"),
                site.join("nvidia/cuda_nvrtc/lib/libnvrtc.so.12"),
            ]
        });
        if let Some(nvrtc) = try_each(wheel.collect(), &mut tried) {
            return Ok(nvrtc);
        }
        bail!(
            "NVRTC (libnvrtc.so) not found; set LILY_NVRTC to the file or CUDA_HOME to the toolkit, \
             or `pip install nvidia-cuda-nvrtc`. Looked in:\n  {}",
            tried.join("\n  ")
        )
    }

    /// Loads NVRTC from one path (or a bare library name for the dynamic linker).
    pub fn open(path: &Path) -> Result<Nvrtc> {
        let builtins = preload_builtins(path);
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        let lib = unsafe { Library::new(path) }.map_err(|e| anyhow!("{e}"))?;
        // SAFETY: the symbol types match the NVRTC C API (nvrtc.h, CUDA 12 and 13).
        unsafe {
            let version: VersionFn = *lib.get(b"nvrtcVersion\0")?;
            let mut major = 0;
            let mut minor = 0;
            if version(&mut major, &mut minor) != 0 {
                bail!("nvrtcVersion failed");
            }
            Ok(Nvrtc {
                path: path.to_path_buf(),
                version: (major, minor),
                create: *lib.get(b"nvrtcCreateProgram\0")?,
                destroy: *lib.get(b"nvrtcDestroyProgram\0")?,
                compile: *lib.get(b"nvrtcCompileProgram\0")?,
                log_size: *lib.get(b"nvrtcGetProgramLogSize\0")?,
                log: *lib.get(b"nvrtcGetProgramLog\0")?,
                cubin_size: *lib.get(b"nvrtcGetCUBINSize\0")?,
                cubin: *lib.get(b"nvrtcGetCUBIN\0")?,
                error_string: *lib.get(b"nvrtcGetErrorString\0")?,
                _lib: lib,
                _builtins: builtins,
            })
        }
    }

    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, what: &str, rc: NvrtcResult) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: nvrtcGetErrorString returns a static C string for any code.
        let msg = unsafe { CStr::from_ptr((self.error_string)(rc)) }.to_string_lossy();
        bail!("{what}: {msg} (nvrtc error {rc})")
    }

    /// Compiles one source for a real architecture (`sm_90a`, `sm_80`, …) straight to a cubin.
    pub fn compile(
        &self,
        name: &str,
        source: &str,
        arch: &str,
        defines: &[String],
    ) -> Result<Compiled> {
        let c_src = CString::new(source)
            .map_err(|_| anyhow!("kernel source {name} contains a NUL byte"))?;
        let c_name =
            CString::new(name).map_err(|_| anyhow!("kernel name {name} contains a NUL byte"))?;
        let mut opts: Vec<String> = vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            "--device-as-default-execution-space".into(),
            "--ptxas-options=-v".into(),
            "-lineinfo".into(),
        ];
        opts.extend(defines.iter().map(|d| format!("-D{d}")));
        let c_opts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).expect("no NUL in options"))
            .collect();
        let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();

        let mut prog: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: all pointers are valid C strings for the duration of the calls; the program is
        // destroyed on every path below.
        unsafe {
            self.check(
                "nvrtcCreateProgram",
                (self.create)(
                    &mut prog,
                    c_src.as_ptr(),
                    c_name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                ),
            )?;
            let rc = (self.compile)(prog, opt_ptrs.len() as c_int, opt_ptrs.as_ptr());
            let log = self.read(prog, self.log_size, self.log).unwrap_or_default();
            let log = String::from_utf8_lossy(&log)
                .trim_end_matches('\0')
                .to_string();
            let result = if rc != 0 {
                Err(anyhow!(
                    "NVRTC failed to compile {name} for {arch} (error {rc}):\n{log}"
                ))
            } else {
                self.read(prog, self.cubin_size, self.cubin)
                    .map(|cubin| Compiled { cubin, log })
            };
            (self.destroy)(&mut prog);
            result
        }
    }

    unsafe fn read(&self, prog: NvrtcProgram, size: SizeFn, get: GetFn) -> Result<Vec<u8>> {
        let mut n = 0usize;
        self.check("nvrtc size query", size(prog, &mut n))?;
        let mut buf = vec![0u8; n];
        self.check("nvrtc read", get(prog, buf.as_mut_ptr() as *mut c_char))?;
        Ok(buf)
    }
}

/// NVRTC dlopens `libnvrtc-builtins.so.X.Y` by bare name at compile time, which fails when its
/// folder is not on the linker's path (the pip wheel, a versioned toolkit). Loading it first from
/// NVRTC's own folder makes that later lookup find the already-loaded library by its soname.
fn preload_builtins(nvrtc: &Path) -> Option<Library> {
    let dir = nvrtc.parent().filter(|d| !d.as_os_str().is_empty())?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc-builtins.so.") && !n.contains(".alt."))
        })
        .collect();
    found.sort();
    // SAFETY: the builtins library has no initialisers with preconditions.
    found
        .iter()
        .rev()
        .find_map(|p| unsafe { Library::new(p) }.ok())
}

fn try_each(candidates: Vec<PathBuf>, tried: &mut Vec<String>) -> Option<Nvrtc> {
    for candidate in candidates {
        let shown = candidate.display().to_string();
        // A bare name goes to the dynamic linker; a path must exist first.
        if candidate.components().count() > 1 && !candidate.exists() {
            tried.push(format!("{shown} (absent)"));
            continue;
        }
        match Nvrtc::open(&candidate) {
            Ok(nvrtc) => return Some(nvrtc),
            Err(e) => tried.push(format!("{shown} ({e})")),
        }
    }
    None
}

/// Every place NVRTC may be apart from the pip wheel, in the order we try them.
fn candidates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("LILY_NVRTC") {
        out.push(PathBuf::from(p));
    }
    let mut roots: Vec<PathBuf> = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Some(p) = std::env::var_os(var) {
            roots.push(PathBuf::from(p));
        }
    }
    roots.push(PathBuf::from("/usr/local/cuda"));
    if let Ok(dir) = std::fs::read_dir("/usr/local") {
        let mut versioned: Vec<PathBuf> = dir
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("cuda-"))
            })
            .collect();
        versioned.sort();
        versioned.reverse();
        roots.extend(versioned);
    }
    for root in roots {
        for sub in [
            "lib64",
            "lib",
            "targets/x86_64-linux/lib",
            "targets/sbsa-linux/lib",
        ] {
            for name in LIB_NAMES {
                out.push(root.join(sub).join(name));
            }
        }
    }
    // Bare names: LD_LIBRARY_PATH, ldconfig's cache.
    out.extend(LIB_NAMES.iter().map(PathBuf::from));
    out
}

/// site-packages of the python3 on PATH (the pip wheel's home), asked once; empty without python.
fn python_site_dirs() -> Vec<PathBuf> {
    let script = "import site,sys\nfor p in site.getsitepackages()+[site.getusersitepackages()]+sys.path: print(p)";
    let mut dirs: Vec<PathBuf> = Vec::new();
    for python in ["python3", "python"] {
        if let Ok(out) = Command::new(python).args(["-c", script]).output() {
            if out.status.success() {
                for line in String::from_utf8_lossy(&out.stdout).lines() {
                    let p = PathBuf::from(line.trim());
                    if !line.trim().is_empty() && p.is_dir() && !dirs.contains(&p) {
                        dirs.push(p);
                    }
                }
                break;
            }
        }
    }
    dirs
}
