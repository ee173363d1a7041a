"""A CPU emulator of the CUDA thread model for the kernel source (a test helper, not a test module).

``kernels.cu`` is compiled as C++ with a small prelude: every GPU thread is an OS thread, warp
shuffles and ``__syncthreads`` are barriers, shared memory is a per-block buffer poisoned with
NaN. :func:`run_plan_emulated` executes the same :class:`LaunchPlan` the CuPy executor runs, so
indexing, splitting and the one-softmax merge are checked without a GPU. Needs g++ with C++20
``<barrier>``; otherwise :class:`EmulatorUnavailable` is raised (the tests skip).
"""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from hybridgen.attention.cuda.planning import LaunchPlan
from hybridgen.attention.cuda.source import DTYPE_IDS, KERNEL_SOURCE, PARTIAL_ARG_NAMES, compile_options

EMU_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 0, y = 0, z = 0; };
struct uint4 { unsigned x, y, z, w; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;
struct EmuBlock { std::barrier<>* bar; std::vector<std::barrier<>*> warp_bars; std::vector<float> warp_buf; float* smem; };
static thread_local EmuBlock* emu_block;
static thread_local int emu_warp, emu_lane;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
static inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline uint4 __ldg(const uint4* p) { return *p; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline void __syncthreads() { emu_block->bar->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  float* buf = &emu_block->warp_buf[emu_warp * 32];
  buf[emu_lane] = v;
  emu_block->warp_bars[emu_warp]->arrive_and_wait();
  float r = buf[emu_lane ^ off];
  emu_block->warp_bars[emu_warp]->arrive_and_wait();
  return r;
}
"""

EMU_LAUNCH = r"""
template <typename F>
static void emu_run(int gx, int gy, int bx, int smem_bytes, F body) {
  blockDim = {(unsigned)bx, 1, 1};
  gridDim = {(unsigned)gx, (unsigned)gy, 1};
  for (int y = 0; y < gy; ++y)
    for (int x = 0; x < gx; ++x) {
      std::barrier<> bar(bx);
      const int warps = (bx + 31) / 32;
      std::vector<std::barrier<>*> wb;
      for (int w = 0; w < warps; ++w) wb.push_back(new std::barrier<>(32));
      std::vector<float> smem(smem_bytes / 4 + 1, __int_as_float(0x7fc00000));  // poisoned
      EmuBlock blk{&bar, wb, std::vector<float>(warps * 32), smem.data()};
      std::vector<std::thread> threads;
      for (int t = 0; t < bx; ++t)
        threads.emplace_back([&, t] {
          threadIdx = {(unsigned)t, 0, 0};
          blockIdx = {(unsigned)x, (unsigned)y, 0};
          emu_block = &blk;
          emu_warp = t / 32;
          emu_lane = t % 32;
          body();
        });
      for (auto& th : threads) th.join();
      for (auto* p : wb) delete p;
    }
}
extern "C" void emu_partial(int which, int gx, int gy, int bx, int smem, void** p, long long* s, int H, int T,
                            int per, float scale, float* ws_m, float* ws_l, float* ws_acc, int off, int rows) {
  auto q = (const scalar_t*)p[0]; auto k = (const scalar_t*)p[1]; auto lg = (const float*)p[2];
  auto v = (const scalar_t*)p[3]; auto m = (const unsigned char*)p[4];
  emu_run(gx, gy, bx, smem, [&] {
    if (which == 0) hg_partial_qk(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
    else if (which == 1) hg_partial_given_grouped(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
    else hg_partial_given_perhead(q, s[0], s[1], k, s[2], s[3], s[4], lg, s[5], s[6], v, s[7], s[8], s[9], m, s[10], s[11], H, T, per, scale, ws_m, ws_l, ws_acc, off, rows);
  });
}
extern "C" void emu_combine(int gx, int bx, const float* ws_m, const float* ws_l, const float* ws_acc, int S, int R,
                            void* out, float* lse) {
  emu_run(gx, 1, bx, 0, [&] { hg_combine(ws_m, ws_l, ws_acc, S, R, (scalar_t*)out, lse); });
}
"""

_KERNEL_IDS = {"hg_partial_qk": 0, "hg_partial_given_grouped": 1, "hg_partial_given_perhead": 2}
_STRIDE_NAMES = ("q_sb", "q_sh", "k_sb", "k_sh", "k_st", "l_sb", "l_sh", "v_sb", "v_sh", "v_st", "m_sb", "m_sh")
_SHARED_DECL = "extern __shared__ float hg_smem[];"


class EmulatorUnavailable(Exception):
    """No C++ compiler able to build the emulator (no g++, or no C++20 <barrier>)."""


class KernelEmulator:
    """Builds (and caches) one ctypes library per (dtype, head_dim, group) specialisation in workdir."""

    def __init__(self, workdir: Path):
        if shutil.which("g++") is None:
            raise EmulatorUnavailable("g++ not available for the kernel emulator")
        self.workdir = Path(workdir)
        self._libs: Dict[Tuple[torch.dtype, int, int], ctypes.CDLL] = {}

    def library(self, dtype: torch.dtype, head_dim: int, group: int) -> ctypes.CDLL:
        """The kernel source of this specialisation compiled as C++ (with emu_partial / emu_combine)."""
        key = (dtype, head_dim, group)
        if key not in self._libs:
            src = KERNEL_SOURCE.replace(_SHARED_DECL, "float* hg_smem = emu_block->smem;")
            assert src != KERNEL_SOURCE
            path = self.workdir / f"emu_{DTYPE_IDS[dtype]}_{head_dim}_{group}"
            path.with_suffix(".cpp").write_text(EMU_PRELUDE + src + EMU_LAUNCH)
            defs = [o for o in compile_options(dtype, head_dim, group) if o.startswith("-D")]
            res = subprocess.run(["g++", "-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                                  *defs, str(path.with_suffix(".cpp")), "-o", str(path.with_suffix(".so"))],
                                 capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                if "barrier" in res.stderr and "No such file" in res.stderr:
                    raise EmulatorUnavailable("g++ without C++20 <barrier>")
                raise AssertionError(res.stderr[-4000:])
            lib = ctypes.CDLL(str(path.with_suffix(".so")))
            P, I, F, LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
            lib.emu_partial.argtypes = [I, I, I, I, I, ctypes.POINTER(P), ctypes.POINTER(LL), I, I, I, F, P, P, P, I, I]
            lib.emu_combine.argtypes = [I, I, P, P, P, I, I, P, P]
            self._libs[key] = lib
        return self._libs[key]


def run_plan_emulated(lib: ctypes.CDLL, plan: LaunchPlan, out: torch.Tensor,
                      lse: Optional[torch.Tensor] = None) -> None:
    """Execute a LaunchPlan on the emulator; workspace and outputs start poisoned with NaN.

    out: CPU [B, Hq, 1, D] contiguous; lse: CPU float32 [B, Hq, 1] or None.
    """
    ws = torch.full((plan.workspace_numel(),), float("nan"))
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))

    def val(arg):
        kind, value = arg
        if kind == "ptr":
            return value.data_ptr() if value is not None else None
        return value

    for kernel, grid, block, smem, args in plan.launches(ws, out, lse):
        vals = [val(a) for a in args]
        if kernel == "hg_combine":
            lib.emu_combine(grid[0], block[0], *vals)
            continue
        named = dict(zip(PARTIAL_ARG_NAMES, vals))
        ptrs = (ctypes.c_void_p * 5)(*[named[n] for n in ("q", "k", "logits", "v", "mask")])
        strides = (ctypes.c_longlong * 12)(*[named[n] for n in _STRIDE_NAMES])
        lib.emu_partial(_KERNEL_IDS[kernel], grid[0], grid[1], block[0], smem, ptrs, strides, named["H"], named["T"],
                        named["tokens_per_split"], named["scale"], named["ws_m"], named["ws_l"], named["ws_acc"],
                        named["split_offset"], named["rows_total"])
    assert not torch.isnan(ws).any(), "a workspace slot was never written"
