#!/usr/bin/env python3
"""Registers a thread of each kernel in a CUDA file, as NVRTC and ptxas give them for sm_90
(`cuobjdump -res-usage` of the cubin). Session 24 (branch s24win) used it on
scripts/rows_persist_regs.cu, a CUDA transcription of linear_q4_rows.wgsl's persistent loop, to
estimate what the Vulkan driver's compiler (the same back end) allocates for each form.

    python3 scripts/nvrtc_regs.py scripts/rows_persist_regs.cu

NVRTC: /work/main/.venv-test (libnvrtc.so.13) or NVRTC_LIB; cuobjdump: CUOBJDUMP or on PATH
(pip `nvidia-cuda-cuobjdump`)."""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

LIB = os.environ.get(
    "NVRTC_LIB",
    "/work/main/.venv-test/lib/python3.11/site-packages/nvidia/cu13/lib/libnvrtc.so.13",
)


def cubin(src: bytes, opts: list) -> bytes:
    # libnvrtc-builtins sits beside libnvrtc: preload it so that NVRTC finds it.
    d = os.path.dirname(LIB)
    for f in sorted(os.listdir(d)):
        if f.startswith("libnvrtc-builtins.so"):
            ctypes.CDLL(os.path.join(d, f), mode=ctypes.RTLD_GLOBAL)
    nv = ctypes.CDLL(LIB)
    prog = ctypes.c_void_p()
    if nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    args = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nv.nvrtcCompileProgram(prog, len(opts), args)
    n = ctypes.c_size_t()
    nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(log.value.decode())
    nv.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    nv.nvrtcGetCUBIN(prog, buf)
    return buf.raw


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    src = open(sys.argv[1], "rb").read()
    data = cubin(src, ["-arch=sm_90", "--use_fast_math"] + sys.argv[2:])
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not tool:
        sys.exit("no cuobjdump (set CUOBJDUMP)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(data)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    name = None
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("Function "):
            name = line.split()[1].rstrip(":")
        elif line.startswith("REG:") and name:
            print(name, line.split()[0], line.split()[3])


if __name__ == "__main__":
    main()
