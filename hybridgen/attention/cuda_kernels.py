"""CUDA decode-attention kernels compiled at run time with CuPy, with a torch fallback.

Two GPU kernels serve the GPU half of the split-attention methods (decode, one query token):

* ``partial_attention(q, k, v, scale, mask)`` -> ``(out, lse)``: attention of q over one
  GPU-resident KV part, normalised within the part, plus its log-sum-exp (``hybrid-exact``
  merges it with the host part by LSE).
* ``hybrid_decode_attention(q, host_logits, host_values, k_gpu, v_gpu, scale, gpu_mask)``:
  the GPU half of ``hybridgen``. It consumes the host's top-k logits and their V rows and
  the GPU-resident K/V, and runs ONE softmax over ``[host top-k logits ; GPU logits]`` with
  one weighted sum over ``[V_topk ; V_gpu]``.
* ``softmax_over_parts(parts, num_kv_heads)``: the same one-softmax merge when every part's
  logits are already computed (the signature of :func:`hybridgen.attention.softmax_over_parts`).

``partial_attention`` and ``softmax_over_parts`` have exactly the signatures of the torch
primitives in :mod:`hybridgen.attention.partial`; they take the CuPy path when every tensor
is on a CUDA device, the shapes are supported (one query token, head dim a power-of-two
number of 16-byte vectors, <= 256) and CuPy works, and the torch primitive otherwise
(no CUDA, CuPy not installed, CuPy installed without a usable driver, unsupported shape).

Kernel design (flash-decoding; all accumulation in fp32; fp16/bf16/fp32 inputs):

* ``hg_partial_*``: grid (splits, B * H). One block takes one (batch, KV head) and a
  contiguous chunk of tokens and keeps, for each of the G query heads of the GQA group, an
  online-softmax state (running max, running sum, weighted V sum). Each key row is read
  ONCE for the whole group. A warp covers 32 / LPR rows at a time, each row read as
  16-byte vectors by LPR lanes (coalesced); each iteration handles two tokens per row group
  so more loads are in flight. The block's row groups merge through shared memory and
  the block writes one unnormalised partial (m, l, acc) per query head to a workspace.
  ``hg_partial_given_*`` are the same kernel with the logits read from memory (host top-k
  logits, or precomputed logits) instead of computed from q·k; ``perhead`` takes one V row
  set per query head (per-head top-k selection), ``grouped`` one per KV head.
* ``hg_combine``: grid (B * Hq). Merges all partials of a query head (of every part: this
  is where the host and GPU parts meet in one softmax) and writes out (and lse).

Choices (the paper gives no kernel details):
- tensors are handed to CuPy through ``__cuda_array_interface__`` (zero copy); bf16 tensors
  travel as an int16 view because CuPy has no bfloat16 dtype;
- kernels run on torch's current CUDA stream;
- the kernel sources include no CUDA headers (half/bf16 conversion by PTX / bit operations),
  so NVRTC needs no include path on the target machine;
- an unsupported case or a kernel that fails to compile falls back to torch with one warning;
  ``HYBRIDGEN_CUPY=0`` turns the CuPy path off, ``HYBRIDGEN_CUPY=strict`` makes failures raise;
- the first CuPy result of each kernel and dtype in a process is checked against the torch
  primitive on the same inputs, and a kernel that disagrees is switched off with one warning
  (the kernel source is tested on the CPU in a C++ emulator of the CUDA thread model and
  compiled by NVRTC in the test suite; this guards GPUs and drivers it has not run on).

Used by ``hybrid-exact`` and FlexGen (``partial_attention``) and ``hybridgen``
(``softmax_over_parts``: it computes the GPU logits before the host top-k arrives, so the
GPU logits overlap the CPU branch; ``hybrid_decode_attention`` fuses both for benchmarks).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import math
import os
import threading
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.attention import partial as _torch_impl

NUM_WARPS = 4
THREADS = NUM_WARPS * 32
MAX_SHARED_BYTES = 48 * 1024  # default dynamic shared-memory limit without opting in
_DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

#: how often each path ran in this process: {"cupy": n, "torch": m} (benchmarks print it).
dispatch_counts: Dict[str, int] = {"cupy": 0, "torch": 0}

KERNEL_SOURCE = r"""
// Compile-time parameters: SCALAR_ID (0 fp32, 1 fp16, 2 bf16), HEAD_DIM, GROUP, NUM_WARPS.
#if SCALAR_ID == 0
typedef float scalar_t;
#define VEC 4
#else
typedef unsigned short scalar_t;
#define VEC 8
#endif

#define NVEC (HEAD_DIM / VEC)             // 16-byte vectors per row
#define LPR (NVEC < 32 ? NVEC : 32)       // lanes per row
#define VPL (NVEC / LPR)                  // vectors per lane
#define RPW (32 / LPR)                    // rows per warp
#define ROW_GROUPS (RPW * NUM_WARPS)      // rows in flight per block
#define EPL (VPL * VEC)                   // elements per lane

__device__ __forceinline__ float hg_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float hg_to_float(scalar_t x) {
#if SCALAR_ID == 0
  return x;
#elif SCALAR_ID == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#else
  return __uint_as_float(((unsigned int)x) << 16);
#endif
}

__device__ __forceinline__ scalar_t hg_from_float(float f) {
#if SCALAR_ID == 0
  return f;
#elif SCALAR_ID == 1
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                     // round to nearest even
  return (unsigned short)(u >> 16);
#endif
}

// One 16-byte vector (VEC elements) widened to fp32.
__device__ __forceinline__ void hg_load_vec(const scalar_t* __restrict__ p, float* out) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
#if SCALAR_ID == 0
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
#else
  const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = hg_to_float((unsigned short)(w[i] & 0xffffu));
    out[2 * i + 1] = hg_to_float((unsigned short)(w[i] >> 16));
  }
#endif
}

// A row of HEAD_DIM elements: lane j of its row group loads vectors j, j + LPR, ...
__device__ __forceinline__ void hg_load_row(const scalar_t* __restrict__ row, int j, float* out) {
#pragma unroll
  for (int u = 0; u < VPL; ++u) hg_load_vec(row + (j + u * LPR) * VEC, out + u * VEC);
}

// Sum over the LPR lanes of one row group (butterfly: every lane ends with the same value).
__device__ __forceinline__ float hg_row_sum(float s) {
#pragma unroll
  for (int off = LPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// One block: (split, b * H + h). G query heads share KV head h (G = 1 and H = Hq for per-head
// value sets). GIVEN: logits read from `logits` [B, H*G, T] (last stride 1) instead of q.k.
// Writes unnormalised partials to workspace slot (split_offset + split) * rows_total + row.
template <int G, bool GIVEN>
__device__ __forceinline__ void hg_partial_body(
    const scalar_t* __restrict__ q, long long q_sb, long long q_sh,
    const scalar_t* __restrict__ k, long long k_sb, long long k_sh, long long k_st,
    const float* __restrict__ logits, long long l_sb, long long l_sh,
    const scalar_t* __restrict__ v, long long v_sb, long long v_sh, long long v_st,
    const unsigned char* __restrict__ mask, long long m_sb, long long m_sh,
    int H, int T, int tokens_per_split, float scale,
    float* __restrict__ ws_m, float* __restrict__ ws_l, float* __restrict__ ws_acc,
    int split_offset, int rows_total) {
  extern __shared__ float hg_smem[];
  const int split = blockIdx.x;
  const int b = blockIdx.y / H;
  const int h = blockIdx.y - b * H;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int rg_local = lane / LPR;
  const int rg = warp * RPW + rg_local;
  const int j = lane - rg_local * LPR;
  const int t0 = split * tokens_per_split;
  const int t1 = min(T, t0 + tokens_per_split);
  const float NEG_INF = hg_neg_inf();

  float qf[G][EPL];
  if (!GIVEN) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      hg_load_row(q + (long long)b * q_sb + (long long)(h * G + g) * q_sh, j, qf[g]);
#pragma unroll
      for (int e = 0; e < EPL; ++e) qf[g][e] *= scale;
    }
  }
  float m_run[G], l_run[G], acc[G][EPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = NEG_INF;
    l_run[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  }

  const scalar_t* kh = GIVEN ? k : k + (long long)b * k_sb + (long long)h * k_sh;
  const scalar_t* vh = v + (long long)b * v_sb + (long long)h * v_sh;
  const unsigned char* mh = mask ? mask + (long long)b * m_sb + (long long)h * m_sh : mask;
  const float* lh = GIVEN ? logits + (long long)b * l_sb + (long long)(h * G) * l_sh : logits;

  // Uniform loop for the whole block (the shuffles need every lane of a warp).
  for (int base = t0; base < t1; base += 2 * ROW_GROUPS) {
    const int ta = base + rg;
    const int tb = ta + ROW_GROUPS;
    bool va_ok = ta < t1;
    bool vb_ok = tb < t1;
    if (mh) {
      va_ok = va_ok && mh[ta] != 0;
      vb_ok = vb_ok && mh[tb] != 0;
    }
    float sa[G], sb[G];
    if (GIVEN) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        sa[g] = va_ok ? lh[(long long)g * l_sh + ta] : NEG_INF;
        sb[g] = vb_ok ? lh[(long long)g * l_sh + tb] : NEG_INF;
      }
    }
    float ka[EPL], kb[EPL], xa[EPL], xb[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) { ka[e] = 0.f; kb[e] = 0.f; xa[e] = 0.f; xb[e] = 0.f; }
    if (!GIVEN) {
      if (va_ok) hg_load_row(kh + (long long)ta * k_st, j, ka);
      if (vb_ok) hg_load_row(kh + (long long)tb * k_st, j, kb);
    }
    if (va_ok) hg_load_row(vh + (long long)ta * v_st, j, xa);
    if (vb_ok) hg_load_row(vh + (long long)tb * v_st, j, xb);
    if (!GIVEN) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float pa = 0.f, pb = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          pa = fmaf(qf[g][e], ka[e], pa);
          pb = fmaf(qf[g][e], kb[e], pb);
        }
        pa = hg_row_sum(pa);
        pb = hg_row_sum(pb);
        sa[g] = va_ok ? pa : NEG_INF;
        sb[g] = vb_ok ? pb : NEG_INF;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mn = fmaxf(m_run[g], fmaxf(sa[g], sb[g]));
      if (mn == NEG_INF) continue;  // nothing seen yet
      const float c = expf(m_run[g] - mn);
      const float pa = expf(sa[g] - mn);
      const float pb = expf(sb[g] - mn);
      l_run[g] = l_run[g] * c + pa + pb;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * c + pa * xa[e] + pb * xb[e];
      m_run[g] = mn;
    }
  }

  // Merge the block's row groups through shared memory.
  float* s_acc = hg_smem;                              // [ROW_GROUPS][G][HEAD_DIM]
  float* s_m = hg_smem + ROW_GROUPS * G * HEAD_DIM;    // [ROW_GROUPS][G]
  float* s_l = s_m + ROW_GROUPS * G;                   // [ROW_GROUPS][G]
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        s_acc[(rg * G + g) * HEAD_DIM + (j + u * LPR) * VEC + e] = acc[g][u * VEC + e];
    }
    if (j == 0) {
      s_m[rg * G + g] = m_run[g];
      s_l[rg * G + g] = l_run[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx - g * HEAD_DIM;
    float M = NEG_INF;
    for (int r = 0; r < ROW_GROUPS; ++r) M = fmaxf(M, s_m[r * G + g]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF) {
      for (int r = 0; r < ROW_GROUPS; ++r) {
        const float w = expf(s_m[r * G + g] - M);
        L += s_l[r * G + g] * w;
        A += s_acc[(r * G + g) * HEAD_DIM + d] * w;
      }
    }
    const long long row = (long long)b * H * G + h * G + g;
    const long long slot = (long long)(split_offset + split) * rows_total + row;
    ws_acc[slot * HEAD_DIM + d] = A;
    if (d == 0) {
      ws_m[slot] = M;
      ws_l[slot] = L;
    }
  }
}

#define HG_PARTIAL_ARGS                                                                   \
    const scalar_t* __restrict__ q, long long q_sb, long long q_sh,                       \
    const scalar_t* __restrict__ k, long long k_sb, long long k_sh, long long k_st,       \
    const float* __restrict__ logits, long long l_sb, long long l_sh,                     \
    const scalar_t* __restrict__ v, long long v_sb, long long v_sh, long long v_st,       \
    const unsigned char* __restrict__ mask, long long m_sb, long long m_sh,               \
    int H, int T, int tokens_per_split, float scale,                                      \
    float* __restrict__ ws_m, float* __restrict__ ws_l, float* __restrict__ ws_acc,      \
    int split_offset, int rows_total
#define HG_PARTIAL_PASS q, q_sb, q_sh, k, k_sb, k_sh, k_st, logits, l_sb, l_sh, v, v_sb, v_sh, \
    v_st, mask, m_sb, m_sh, H, T, tokens_per_split, scale, ws_m, ws_l, ws_acc, split_offset, rows_total

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_qk(HG_PARTIAL_ARGS) {
  hg_partial_body<GROUP, false>(HG_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_given_grouped(HG_PARTIAL_ARGS) {
  hg_partial_body<GROUP, true>(HG_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_given_perhead(HG_PARTIAL_ARGS) {
  hg_partial_body<1, true>(HG_PARTIAL_PASS);
}

// One block per query-head row (b * Hq + hq): merge every partial of every part.
extern "C" __global__ void hg_combine(const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                                      const float* __restrict__ ws_acc, int num_splits, int rows_total,
                                      scalar_t* __restrict__ out, float* __restrict__ lse) {
  const int row = blockIdx.x;
  const float NEG_INF = hg_neg_inf();
  float M = NEG_INF;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, ws_m[(long long)s * rows_total + row]);
  float L = 0.f;
  if (M != NEG_INF) {
    for (int s = 0; s < num_splits; ++s) {
      const long long slot = (long long)s * rows_total + row;
      L += ws_l[slot] * expf(ws_m[slot] - M);
    }
  }
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float A = 0.f;
    if (L > 0.f) {
      for (int s = 0; s < num_splits; ++s) {
        const long long slot = (long long)s * rows_total + row;
        A += ws_acc[slot * HEAD_DIM + d] * expf(ws_m[slot] - M);
      }
    }
    out[(long long)row * HEAD_DIM + d] = hg_from_float(L > 0.f ? A / L : 0.f);
  }
  if (threadIdx.x == 0 && lse) lse[row] = L > 0.f ? M + logf(L) : NEG_INF;
}
"""

KERNEL_NAMES = ("hg_partial_qk", "hg_partial_given_grouped", "hg_partial_given_perhead", "hg_combine")


class KernelUnsupported(Exception):
    """Raised by the raw CuPy entry points for inputs they do not handle (callers fall back)."""


# ------------------------------------------------------------------ availability
def _mode() -> str:
    return os.environ.get("HYBRIDGEN_CUPY", "1").strip().lower()


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """True when the CuPy kernels can run: torch sees CUDA, CuPy imports and sees a device.

    False (never an exception) without CUDA, without CuPy, with CuPy but no usable driver,
    or with ``HYBRIDGEN_CUPY=0``. Cached; ``kernels_available.cache_clear()`` re-probes.
    """
    if _mode() in ("0", "off", "false", "no"):
        return False
    try:
        if not torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - a broken CUDA install means "not available"
        return False
    cp = _import_cupy()
    if cp is None:
        return False
    try:
        return bool(cp.cuda.is_available()) and cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CUDARuntimeError, missing driver, ...
        return False


def _import_cupy():
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except Exception:  # noqa: BLE001 - ImportError, or a broken CuPy wheel
        return None
    return cupy


def kernel_config(dtype: torch.dtype, head_dim: int) -> Optional[dict]:
    """Vector layout of a (dtype, head_dim) pair, or None when the kernels do not support it."""
    if dtype not in _DTYPE_IDS:
        return None
    vec = 4 if dtype == torch.float32 else 8
    if head_dim <= 0 or head_dim % vec or head_dim > 256:
        return None
    nvec = head_dim // vec
    if nvec & (nvec - 1):  # lanes per row must divide the warp
        return None
    lpr = min(nvec, 32)
    rpw = 32 // lpr
    return {"vec": vec, "nvec": nvec, "lpr": lpr, "vpl": nvec // lpr, "rpw": rpw, "row_groups": rpw * NUM_WARPS}


def shared_bytes(dtype: torch.dtype, head_dim: int, group: int) -> int:
    """Dynamic shared memory of one partial block (row groups x group x (head_dim + 2) floats)."""
    cfg = kernel_config(dtype, head_dim)
    if cfg is None:
        return 0
    return cfg["row_groups"] * group * (head_dim + 2) * 4


def compile_options(dtype: torch.dtype, head_dim: int, group: int) -> Tuple[str, ...]:
    """NVRTC options that specialise :data:`KERNEL_SOURCE`."""
    return ("-std=c++17", f"-DSCALAR_ID={_DTYPE_IDS[dtype]}", f"-DHEAD_DIM={head_dim}",
            f"-DGROUP={group}", f"-DNUM_WARPS={NUM_WARPS}")


# ------------------------------------------------------------------ NVRTC-only compile check
def _find_nvrtc() -> Optional[str]:
    """Path of a libnvrtc shared library (system CUDA or an nvidia-cuda-nvrtc wheel), or None."""
    import ctypes.util
    import site
    import sys

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
    name = ctypes.util.find_library("nvrtc")
    return name


def nvrtc_compile(dtype: torch.dtype, head_dim: int, group: int, arch: str = "compute_90",
                  extra_options: Sequence[str] = ()) -> Tuple[str, str]:
    """Compile :data:`KERNEL_SOURCE` with NVRTC alone (no GPU or driver needed).

    Returns (ptx, log). Raises RuntimeError with NVRTC's log when compilation fails and
    OSError when no NVRTC library is found. Used by tests and by developers on GPU-less
    machines: it checks the source, not the kernels' results.
    """
    path = _find_nvrtc()
    if path is None:
        raise OSError("no libnvrtc found; pip install nvidia-cuda-nvrtc (or a CUDA toolkit)")
    libdir = os.path.dirname(path)
    for builtins in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so*"))):
        if ".alt." not in builtins:
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by soname
    lib = ctypes.CDLL(path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), KERNEL_SOURCE.encode(), b"hybridgen_attn.cu", 0, None, None)
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


# ------------------------------------------------------------------ launch plans
# A plan is device-agnostic: it lists kernel launches with typed arguments. The CuPy executor
# runs it on a GPU; the test-suite's CPU emulator runs the same plan over the same kernel
# source compiled as C++ (tests/test_cuda_kernels.py), so the planning code is tested here.
PARTIAL_ARG_NAMES = ("q", "q_sb", "q_sh", "k", "k_sb", "k_sh", "k_st", "logits", "l_sb", "l_sh",
                     "v", "v_sb", "v_sh", "v_st", "mask", "m_sb", "m_sh", "H", "T", "tokens_per_split",
                     "scale", "ws_m", "ws_l", "ws_acc", "split_offset", "rows_total")
COMBINE_ARG_NAMES = ("ws_m", "ws_l", "ws_acc", "num_splits", "rows_total", "out", "lse")


def _ptr(t: Optional[Tensor]) -> tuple:
    return ("ptr", t)


def _i64(x: int) -> tuple:
    return ("i64", int(x))


def _i32(x: int) -> tuple:
    return ("i32", int(x))


def _f32(x: float) -> tuple:
    return ("f32", float(x))


def _aligned(t: Tensor) -> Tensor:
    """t itself when its rows can be read as 16-byte vectors, else a contiguous copy."""
    es = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        (s * es) % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if ok else t.contiguous()


def num_splits(blocks_per_split: int, tokens: int, sm_count: int) -> Tuple[int, int]:
    """(splits, tokens per split) for one part: about four waves of blocks over the SMs,
    but at least 256 tokens a split (a split's fixed cost is its block merge and its slot
    in the combine)."""
    want = max(1, math.ceil(4 * sm_count / max(1, blocks_per_split)))
    splits = max(1, min(want, math.ceil(tokens / 256)))
    per = math.ceil(tokens / splits)
    return math.ceil(tokens / per), per


class LaunchPlan:
    """The partial launches of one attention call (sharing one workspace), then one combine.

    dtype/head_dim/group select the compiled specialisation; rows = B * Hq query-head rows;
    sm_count sizes the split of each part over the tokens.
    """

    def __init__(self, dtype: torch.dtype, head_dim: int, group: int, rows: int, sm_count: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.group = group
        self.rows = rows
        self.sm_count = sm_count
        self.parts: List[tuple] = []  # (kernel, grid, shared bytes, args[:20], split offset)
        self.total_splits = 0

    def add(self, kernel: str, heads: int, batch: int, tokens: int, group: int, args: tuple) -> None:
        """Queue one part. args: the 17 tensor/stride arguments then the scale (see _qk_args)."""
        if batch * heads > 65535:
            raise KernelUnsupported("batch x heads exceeds the grid's y limit (65535)")
        smem = shared_bytes(self.dtype, self.head_dim, group)
        if smem > MAX_SHARED_BYTES:
            raise KernelUnsupported(f"needs {smem} B of shared memory per block")
        splits, per = num_splits(batch * heads, tokens, self.sm_count)
        full = (*args[:-1], _i32(heads), _i32(tokens), _i32(per), args[-1])
        self.parts.append((kernel, (splits, batch * heads), smem, full, self.total_splits))
        self.total_splits += splits

    def workspace_numel(self) -> int:
        return self.total_splits * self.rows * (self.head_dim + 2)

    def launches(self, workspace: Tensor, out: Tensor, lse: Optional[Tensor]) -> List[tuple]:
        """[(kernel, grid, block, shared bytes, args)] in launch order.

        workspace: float32 [workspace_numel()]; out: [B, Hq, 1, D] contiguous; lse: [B, Hq, 1] or None.
        """
        S, R, D = self.total_splits, self.rows, self.head_dim
        ws_m, ws_l, ws_acc = workspace[: S * R], workspace[S * R: 2 * S * R], workspace[2 * S * R:]
        ws = (_ptr(ws_m), _ptr(ws_l), _ptr(ws_acc))
        out_list = [(kernel, grid, (THREADS,), smem, (*args, *ws, _i32(offset), _i32(R)))
                    for kernel, grid, smem, args, offset in self.parts]
        out_list.append(("hg_combine", (R,), (min(THREADS, max(32, D)),), 0,
                         (*ws, _i32(S), _i32(R), _ptr(out), _ptr(lse))))
        return out_list


def _qk_args(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float) -> tuple:
    """A q·k part: q [B, Hq, D]; k, v [B, Hkv, T, D]; mask uint8 [B, Hkv, T] (last stride 1) or None."""
    m = (_ptr(mask), _i64(mask.stride(0)), _i64(mask.stride(1))) if mask is not None else \
        (_ptr(None), _i64(0), _i64(0))
    return (_ptr(q), _i64(q.stride(0)), _i64(q.stride(1)),
            _ptr(k), _i64(k.stride(0)), _i64(k.stride(1)), _i64(k.stride(2)),
            _ptr(None), _i64(0), _i64(0),
            _ptr(v), _i64(v.stride(0)), _i64(v.stride(1)), _i64(v.stride(2)),
            *m, _f32(scale))


def _given_args(logits: Tensor, v: Tensor) -> tuple:
    """A given-logits part: logits [B, Hq, T] fp32 (last stride 1); v [B, Hv, T, D]."""
    return (_ptr(None), _i64(0), _i64(0),
            _ptr(None), _i64(0), _i64(0), _i64(0),
            _ptr(logits), _i64(logits.stride(0)), _i64(logits.stride(1)),
            _ptr(v), _i64(v.stride(0)), _i64(v.stride(1)), _i64(v.stride(2)),
            _ptr(None), _i64(0), _i64(0), _f32(1.0))


def _mask_u8(mask: Optional[Tensor], B: int, H: int, T: int) -> Optional[Tensor]:
    if mask is None:
        return None
    return mask.expand(B, H, T).to(torch.uint8).contiguous()


def _add_given_part(plan: LaunchPlan, logits: Tensor, values: Tensor, Hq: int, Hkv: int) -> None:
    """Queue one given-logits part. logits [B, Hq, 1, Ti] fp32; values [B, Hkv or Hq, Ti, D]."""
    B, _, _, Ti = logits.shape
    if Ti == 0:
        return
    lg = logits.reshape(B, Hq, Ti).float()
    if lg.stride(-1) != 1:
        lg = lg.contiguous()
    vals = _aligned(values)
    if vals.shape[1] == Hq:
        plan.add("hg_partial_given_perhead", Hq, B, Ti, 1, _given_args(lg, vals))
    elif vals.shape[1] == Hkv:
        plan.add("hg_partial_given_grouped", Hkv, B, Ti, plan.group, _given_args(lg, vals))
    else:
        raise KernelUnsupported(f"values have {vals.shape[1]} heads; expected {Hkv} or {Hq}")


def _check_shapes(tensors: Sequence[Tensor], dtype: torch.dtype, head_dim: int) -> None:
    if kernel_config(dtype, head_dim) is None:
        raise KernelUnsupported(f"unsupported dtype/head_dim {dtype}/{head_dim}")
    dev = tensors[0].device
    if any(t.device != dev for t in tensors):
        raise KernelUnsupported("tensors on different devices")


def plan_partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, mask: Optional[Tensor],
                           sm_count: int) -> Tuple[LaunchPlan, Tensor, Tensor]:
    """Plan of :func:`partial_attention` -> (plan, out [B, Hq, 1, D], lse [B, Hq, 1]) (outputs unfilled)."""
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    _check_shapes((q, k, v) + ((mask,) if mask is not None else ()), q.dtype, D)
    if Tq != 1 or T == 0 or Hq % Hkv or k.dtype != q.dtype or v.dtype != q.dtype or v.shape[-1] != D:
        raise KernelUnsupported("needs one query token, T > 0, matching dtypes and Hq % Hkv == 0")
    G = Hq // Hkv
    plan = LaunchPlan(q.dtype, D, G, B * Hq, sm_count)
    plan.add("hg_partial_qk", Hkv, B, T, G, _qk_args(_aligned(q.reshape(B, Hq, D)), _aligned(k), _aligned(v),
                                                     _mask_u8(mask, B, Hkv, T), scale))
    out = torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, 1, dtype=torch.float32, device=q.device)
    return plan, out, lse


def plan_softmax_over_parts(parts: Sequence[Tuple[Tensor, Tensor]], num_kv_heads: int,
                            sm_count: int) -> Tuple[LaunchPlan, Tensor]:
    """Plan of :func:`softmax_over_parts` -> (plan, out [B, Hq, 1, D])."""
    logits0, values0 = parts[0]
    B, Hq, Tq, _ = logits0.shape
    D = values0.shape[-1]
    _check_shapes([t for part in parts for t in part], values0.dtype, D)
    if Tq != 1 or Hq % num_kv_heads:
        raise KernelUnsupported("needs one query token and Hq % Hkv == 0")
    for lg, vals in parts:
        if vals.dtype != values0.dtype or lg.dtype != torch.float32 or vals.shape[-1] != D:
            raise KernelUnsupported("parts must share the values dtype; logits must be float32")
    plan = LaunchPlan(values0.dtype, D, Hq // num_kv_heads, B * Hq, sm_count)
    for lg, vals in parts:
        _add_given_part(plan, lg, vals, Hq, num_kv_heads)
    return plan, torch.empty(B, Hq, 1, D, dtype=values0.dtype, device=values0.device)


def plan_hybrid_decode_attention(q: Tensor, host_logits: Tensor, host_values: Tensor, k_gpu: Tensor,
                                 v_gpu: Tensor, scale: float, gpu_mask: Optional[Tensor],
                                 sm_count: int) -> Tuple[LaunchPlan, Tensor]:
    """Plan of :func:`hybrid_decode_attention` -> (plan, out [B, Hq, 1, D])."""
    B, Hq, Tq, D = q.shape
    Hkv, T = k_gpu.shape[1], k_gpu.shape[2]
    hl = host_logits if host_logits.dim() == 4 else host_logits[:, :, None, :]
    _check_shapes((q, hl, host_values, k_gpu, v_gpu) + ((gpu_mask,) if gpu_mask is not None else ()), q.dtype, D)
    if Tq != 1 or Hq % Hkv or any(t.dtype != q.dtype for t in (host_values, k_gpu, v_gpu)):
        raise KernelUnsupported("needs one query token, matching dtypes and Hq % Hkv == 0")
    if hl.dtype != torch.float32:
        raise KernelUnsupported("host logits must be float32")
    G = Hq // Hkv
    plan = LaunchPlan(q.dtype, D, G, B * Hq, sm_count)
    _add_given_part(plan, hl, host_values, Hq, Hkv)
    if T:
        plan.add("hg_partial_qk", Hkv, B, T, G,
                 _qk_args(_aligned(q.reshape(B, Hq, D)), _aligned(k_gpu), _aligned(v_gpu),
                          _mask_u8(gpu_mask, B, Hkv, T), scale))
    return plan, torch.empty(B, Hq, 1, D, dtype=q.dtype, device=q.device)


# ------------------------------------------------------------------ CuPy executor
_modules: Dict[tuple, dict] = {}
_modules_lock = threading.Lock()
_warned: set = set()


def _kernels(dtype: torch.dtype, head_dim: int, group: int, device_index: int) -> dict:
    """Compiled kernels of one specialisation (compiled once per process and device)."""
    key = (dtype, head_dim, group, device_index)
    with _modules_lock:
        funcs = _modules.get(key)
        if funcs is None:
            cp = _import_cupy()
            with cp.cuda.Device(device_index):
                module = cp.RawModule(code=KERNEL_SOURCE, options=compile_options(dtype, head_dim, group))
                funcs = {name: module.get_function(name) for name in KERNEL_NAMES}
            _modules[key] = funcs
    return funcs


def _cupy_view(t: Tensor):
    """Zero-copy CuPy view of a CUDA tensor (through __cuda_array_interface__)."""
    cp = _import_cupy()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return cp.asarray(t)


def _cupy_arg(arg: tuple):
    import numpy as np

    kind, value = arg
    if kind == "ptr":
        return np.uint64(0) if value is None else _cupy_view(value)
    return {"i64": np.int64, "i32": np.int32, "f32": np.float32}[kind](value)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def run_plan_cupy(plan: LaunchPlan, out: Tensor, lse: Optional[Tensor] = None) -> None:
    """Run a plan on out's CUDA device, on torch's current stream."""
    cp = _import_cupy()
    index = _device_index(out)
    funcs = _kernels(plan.dtype, plan.head_dim, plan.group, index)
    workspace = torch.empty(plan.workspace_numel(), dtype=torch.float32, device=out.device)
    with cp.cuda.Device(index):
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(out.device).cuda_stream)
        with stream:
            for kernel, grid, block, smem, args in plan.launches(workspace, out, lse):
                funcs[kernel](grid, block, tuple(_cupy_arg(a) for a in args), shared_mem=smem)


def _require_cuda(*tensors: Optional[Tensor]) -> int:
    if not kernels_available():
        raise KernelUnsupported("CuPy kernels unavailable")
    if not all(t is None or t.is_cuda for t in tensors):
        raise KernelUnsupported("tensors not on CUDA")
    return _sm_count(_device_index(tensors[0]))


# ------------------------------------------------------------------ raw CuPy entry points
def cupy_partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                           mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """CuPy path of :func:`partial_attention`; raises KernelUnsupported for unsupported inputs."""
    sms = _require_cuda(q, k, v, mask)
    plan, out, lse = plan_partial_attention(q, k, v, scale, mask, sms)
    run_plan_cupy(plan, out, lse)
    return out, lse


def cupy_softmax_over_parts(parts: Sequence[Tuple[Tensor, Tensor]], num_kv_heads: int) -> Tensor:
    """CuPy path of :func:`softmax_over_parts` (every part's logits given)."""
    sms = _require_cuda(*[t for part in parts for t in part])
    plan, out = plan_softmax_over_parts(parts, num_kv_heads, sms)
    if not plan.parts:
        return out.zero_()
    run_plan_cupy(plan, out)
    return out


def cupy_hybrid_decode_attention(q: Tensor, host_logits: Tensor, host_values: Tensor, k_gpu: Tensor,
                                 v_gpu: Tensor, scale: float, gpu_mask: Optional[Tensor] = None) -> Tensor:
    """CuPy path of :func:`hybrid_decode_attention`."""
    sms = _require_cuda(q, host_logits, host_values, k_gpu, v_gpu, gpu_mask)
    plan, out = plan_hybrid_decode_attention(q, host_logits, host_values, k_gpu, v_gpu, scale, gpu_mask, sms)
    if not plan.parts:
        return out.zero_()
    run_plan_cupy(plan, out)
    return out


# ------------------------------------------------------------------ dispatch (public)
def _on_cuda(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or t.is_cuda for t in tensors)


def _try_cupy(fn, *args):
    """Run a CuPy entry point; None when it does not apply (the caller then uses torch)."""
    if not kernels_available() or fn.__name__ in _rejected:
        return None
    try:
        result = fn(*args)
    except KernelUnsupported:
        return None
    except Exception as err:  # noqa: BLE001 - compile or launch failure: fall back, once loudly
        if _mode() == "strict":
            raise
        key = (fn.__name__, type(err).__name__)
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"CuPy kernel {fn.__name__} failed ({type(err).__name__}: {err}); "
                          "using the torch fallback", RuntimeWarning, stacklevel=3)
        return None
    return result


#: (kernel, dtype) pairs whose first CuPy result matched torch; kernels whose first result did not
_verified: set = set()
_rejected: set = set()
VERIFY_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def _max_rel_err(got, ref) -> float:
    pairs = zip(got, ref) if isinstance(ref, tuple) else [(got, ref)]
    err = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        if not bool((torch.isfinite(a) == finite).all()):
            return math.inf
        diff = (a[finite] - b[finite]).abs().max() if bool(finite.any()) else a.new_zeros(())
        err = max(err, float(diff) / max(float(b[finite].abs().max()) if bool(finite.any()) else 0.0, 1e-6))
    return err


def _dispatch(cupy_fn, torch_fn, dtype: torch.dtype, tensors: Sequence[Optional[Tensor]], *args):
    """CuPy when it applies, else torch. The first CuPy result per (kernel, dtype) in a process is
    checked against the torch primitive on the same inputs: a kernel that disagrees (beyond
    ``VERIFY_TOL``) is switched off for the process with one warning (an error under
    ``HYBRIDGEN_CUPY=strict``), so an untested GPU/driver combination cannot change results."""
    if _on_cuda(*tensors):
        res = _try_cupy(cupy_fn, *args)
        if res is not None:
            key = (cupy_fn.__name__, dtype)
            if key in _verified:
                dispatch_counts["cupy"] += 1
                return res
            ref = torch_fn(*args)
            err = _max_rel_err(res, ref)
            if err <= VERIFY_TOL.get(dtype, 3e-2):
                _verified.add(key)
                dispatch_counts["cupy"] += 1
                return res
            msg = (f"CuPy kernel {cupy_fn.__name__} disagrees with torch on its first call ({dtype}, max relative "
                   f"error {err:.2e}); using the torch fallback for the rest of this process")
            if _mode() == "strict":
                raise RuntimeError(msg)
            _rejected.add(cupy_fn.__name__)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            dispatch_counts["torch"] += 1
            return ref
    dispatch_counts["torch"] += 1
    return torch_fn(*args)


def partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                      mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`hybridgen.attention.partial_attention` on the CuPy kernel when it applies.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, T, D]; mask: [B, Hkv, T]-broadcastable bool.
    Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] float32).
    """
    return _dispatch(cupy_partial_attention, _torch_impl.partial_attention, k.dtype, (q, k, v, mask),
                     q, k, v, scale, mask)


def softmax_over_parts(parts: Sequence[Tuple[Tensor, Tensor]], num_kv_heads: int) -> Tensor:
    """:func:`hybridgen.attention.softmax_over_parts` on the CuPy kernel when it applies.

    parts: (logits [B, Hq, Tq, Ti] float32, values [B, Hkv or Hq, Ti, D]). Returns
    [B, Hq, Tq, D] in the first values' dtype.
    """
    if not parts:
        return _torch_impl.softmax_over_parts(parts, num_kv_heads)
    return _dispatch(cupy_softmax_over_parts, _torch_impl.softmax_over_parts, parts[0][1].dtype,
                     [t for part in parts for t in part], parts, num_kv_heads)


def _torch_hybrid_decode_attention(q: Tensor, host_logits: Tensor, host_values: Tensor, k_gpu: Tensor,
                                   v_gpu: Tensor, scale: float, gpu_mask: Optional[Tensor] = None) -> Tensor:
    hl = host_logits if host_logits.dim() == 4 else host_logits[:, :, None, :]
    Hkv = k_gpu.shape[1]
    gpu_logits = _torch_impl._mask_logits(_torch_impl.attention_logits(q, k_gpu, scale), gpu_mask, Hkv)
    return _torch_impl.softmax_over_parts([(hl.float(), host_values), (gpu_logits, v_gpu)], Hkv)


def hybrid_decode_attention(q: Tensor, host_logits: Tensor, host_values: Tensor, k_gpu: Tensor,
                            v_gpu: Tensor, scale: float, gpu_mask: Optional[Tensor] = None) -> Tensor:
    """GPU half of ``hybridgen``: one softmax over [host top-k logits ; GPU logits].

    q: [B, Hq, 1, D]; host_logits: [B, Hq, K] or [B, Hq, 1, K] float32 (already scaled;
    -inf for padding); host_values: [B, Hkv, K, D] (shared selection) or [B, Hq, K, D]
    (per-head selection); k_gpu, v_gpu: [B, Hkv, T, D]; gpu_mask: [B, Hkv, T]-broadcastable
    bool (True = attend). Returns [B, Hq, 1, D] in host_values' dtype.
    """
    return _dispatch(cupy_hybrid_decode_attention, _torch_hybrid_decode_attention, k_gpu.dtype,
                     (q, host_logits, host_values, k_gpu, v_gpu, gpu_mask),
                     q, host_logits, host_values, k_gpu, v_gpu, scale, gpu_mask)


def backend(*tensors: Tensor) -> str:
    """'cupy' when these tensors would take the CuPy path (device and availability), else 'torch'."""
    return "cupy" if tensors and _on_cuda(*tensors) and kernels_available() else "torch"
