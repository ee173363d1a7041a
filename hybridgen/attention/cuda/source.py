"""The kernel source (``kernels.cu``, package data) and the parameters that specialise it.

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

The source includes no CUDA headers (half/bf16 conversion by PTX / bit operations), so NVRTC
needs no include path on the target machine. Compile-time macros: ``SCALAR_ID`` (0 fp32,
1 fp16, 2 bf16), ``HEAD_DIM``, ``GROUP`` (query heads per KV head), ``NUM_WARPS``.
"""
from __future__ import annotations

from importlib import resources
from typing import Dict, Tuple

import torch

#: file name of the kernel source inside this package
SOURCE_FILE = "kernels.cu"

NUM_WARPS = 4
THREADS = NUM_WARPS * 32
#: ``SCALAR_ID`` of each supported dtype (bf16 travels as 16-bit integers)
DTYPE_IDS: Dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

KERNEL_NAMES = ("hg_partial_qk", "hg_partial_given_grouped", "hg_partial_given_perhead", "hg_combine")

#: positional parameters of every ``hg_partial_*`` kernel (``HG_PARTIAL_ARGS`` in the source)
PARTIAL_ARG_NAMES = ("q", "q_sb", "q_sh", "k", "k_sb", "k_sh", "k_st", "logits", "l_sb", "l_sh",
                     "v", "v_sb", "v_sh", "v_st", "mask", "m_sb", "m_sh", "H", "T", "tokens_per_split",
                     "scale", "ws_m", "ws_l", "ws_acc", "split_offset", "rows_total")
#: positional parameters of ``hg_combine``
COMBINE_ARG_NAMES = ("ws_m", "ws_l", "ws_acc", "num_splits", "rows_total", "out", "lse")


def read_kernel_source() -> str:
    """Text of ``kernels.cu`` from the installed package (works from a wheel or an editable install)."""
    return resources.files(__package__).joinpath(SOURCE_FILE).read_text(encoding="utf-8")


#: the CUDA C++ source of every kernel (one translation unit, specialised by compile_options)
KERNEL_SOURCE: str = read_kernel_source()


def compile_options(dtype: torch.dtype, head_dim: int, group: int) -> Tuple[str, ...]:
    """NVRTC options that specialise :data:`KERNEL_SOURCE` for (dtype, head_dim, group)."""
    return ("-std=c++17", f"-DSCALAR_ID={DTYPE_IDS[dtype]}", f"-DHEAD_DIM={head_dim}",
            f"-DGROUP={group}", f"-DNUM_WARPS={NUM_WARPS}")
