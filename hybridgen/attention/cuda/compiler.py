"""Compiling :data:`~hybridgen.attention.cuda.source.KERNEL_SOURCE`.

* :func:`cupy_kernels`: the CuPy ``RawModule`` build used at run time (NVRTC through CuPy),
  compiled once per specialisation and device and cached in
  :data:`hybridgen.attention.cuda.state.compiled_kernels`;
* :func:`nvrtc_compile`: NVRTC alone through ctypes, to PTX, with no GPU or driver (the test
  suite and developers on GPU-less machines check the source with it; the
  ``nvidia-cuda-nvrtc-cu12`` wheel is enough).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import site
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import torch

from hybridgen.attention.cuda import state
from hybridgen.attention.cuda.source import KERNEL_NAMES, KERNEL_SOURCE, SOURCE_FILE, compile_options


def cupy_kernels(dtype: torch.dtype, head_dim: int, group: int, device_index: int) -> Dict[str, Any]:
    """{kernel name: CuPy RawKernel} of one specialisation on one device (compiled on first use).

    Raises whatever CuPy raises when the source does not compile (the dispatcher falls back).
    """
    key = (dtype, head_dim, group, device_index)
    with state.compiled_kernels_lock:
        funcs = state.compiled_kernels.get(key)
        if funcs is None:
            cp = state.import_cupy()
            if cp is None:
                raise RuntimeError("CuPy is not importable; pip install cupy-cuda12x")
            with cp.cuda.Device(device_index):
                module = cp.RawModule(code=KERNEL_SOURCE, options=compile_options(dtype, head_dim, group))
                funcs = {name: module.get_function(name) for name in KERNEL_NAMES}
            state.compiled_kernels[key] = funcs
    return funcs


def find_nvrtc() -> Optional[str]:
    """Path of a libnvrtc shared library (an nvidia-cuda-nvrtc wheel or a system CUDA), or None."""
    roots = list(dict.fromkeys([*sys.path, *site.getsitepackages(), site.getusersitepackages()]))
    patterns = ["nvidia/cu*/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*"]
    for root in roots:
        for pat in patterns:
            for path in sorted(glob.glob(os.path.join(root, pat))):
                if "builtins" not in path and ".alt." not in path:
                    return path
    for cand in ("/usr/local/cuda/lib64/libnvrtc.so",):
        if os.path.exists(cand):
            return cand
    return ctypes.util.find_library("nvrtc")


def nvrtc_compile(dtype: torch.dtype, head_dim: int, group: int, arch: str = "compute_90",
                  extra_options: Sequence[str] = ()) -> Tuple[str, str]:
    """Compile :data:`KERNEL_SOURCE` with NVRTC alone (no GPU or driver needed).

    Returns (ptx, log); ptx is empty unless arch is a virtual ``compute_*`` architecture.
    Raises RuntimeError with NVRTC's log when compilation fails and OSError when no NVRTC
    library is found. It checks the source, not the kernels' results.
    """
    path = find_nvrtc()
    if path is None:
        raise OSError("no libnvrtc found; pip install nvidia-cuda-nvrtc (or a CUDA toolkit)")
    libdir = os.path.dirname(path)
    for builtins in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by soname
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), KERNEL_SOURCE.encode(), SOURCE_FILE.encode(), 0, None, None)
    if rc != 0:
        raise RuntimeError(f"nvrtcCreateProgram failed ({rc})")
    opts = [o.encode() for o in (f"--gpu-architecture={arch}", *compile_options(dtype, head_dim, group),
                                 *extra_options)]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise RuntimeError(f"NVRTC failed ({rc}): {log}")
        ptx = ""
        if arch.startswith("compute_"):
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, buf)
            ptx = buf.value.decode(errors="replace")
        return ptx, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
