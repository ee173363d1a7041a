"""Numba kernels of the CPU key scan and top-k, and the code generation of the per-group scan.

Shapes (as :mod:`hybridgen.attention.cpu_scan` hands them over): q [BH, G, D] float32 (the G
query heads of each of the BH = B * Hkv (batch, KV head) pairs); keys as rows [rows, D]
(token t of pair bh at row ``bh * cap + t``: a KVSegment view read in place), bf16 keys as
their uint16 bit patterns; out [BH, G, T] float32. Every kernel takes a work range
``[j0, j1)`` last, so :meth:`hybridgen.attention.cpu_pool.CPUAttentionPool.run_split` can
hand disjoint slices to its threads: a scan work item is one (bh, ``TOKEN_BLOCK``-token
block), a top-k item one row.

- bf16 keys are widened to fp32 in registers (zero-extend + shift of the uint16 bit pattern,
  an LLVM bit-cast: exact) and accumulated in fp32.
- :func:`scan_kernel` returns, for a GQA group of G <= ``MAX_SPECIALISED_GROUP`` heads, a
  kernel generated for that G (G scalar accumulators: each key element is widened once and
  feeds all G dot products), else a generic loop over g.
- every kernel is compiled ``nogil`` and runs serially per slice; never use numba's parallel
  threading layer, whose OpenMP clashes with torch's (keep ``NUMBA_THREADING_LAYER=workqueue``;
  docs/design.md, thread-runtime pitfalls). fp16 keys are not handled (numba's CPU float16
  support is partial): the scan API falls back to torch for them.

Numba is optional: without it ``HAVE_NUMBA`` is False and every caller takes its torch path.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import torch
from torch import Tensor

TOKEN_BLOCK = 512  # token rows per scan work item
MAX_SPECIALISED_GROUP = 8  # GQA group sizes with a generated kernel (larger ones use the generic loop)
_GROUP_KERNELS: Dict[Tuple[int, bool], Callable] = {}

try:  # numba is optional; every path has a torch fallback
    import numpy as np
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    HAVE_NUMBA = True
except Exception:  # pragma: no cover - exercised only without numba
    HAVE_NUMBA = False


# ------------------------------------------------------------------------------ kernels
if HAVE_NUMBA:

    @intrinsic
    def _bf16_bits_to_f32(typingctx, bits):  # pragma: no cover - compiled
        """uint16 bf16 bit pattern -> float32 (zero-extend, shift left 16, bit-cast): exact."""
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return sig, codegen

    @njit(nogil=True, fastmath=True, cache=True)
    def _scan_bf16_kernel(q, k, cap, out, scale, T, block, j0, j1):  # pragma: no cover - compiled
        """q [BH, G, D] f32; k [rows, D] uint16 (bf16 bits; token t of bh at row bh*cap + t); out [BH, G, T] f32.

        Work item j covers (bh, token block). Each key element is widened in registers
        (no scratch tile: a tile through a uint32 view measured 2x slower) and dotted with
        the G heads of its group while the row is in L1.
        """
        G = q.shape[1]
        D = k.shape[1]
        nblk = (T + block - 1) // block
        for job in range(j0, j1):
            bh = job // nblk
            t0 = (job - bh * nblk) * block
            t1 = min(T, t0 + block)
            for t in range(t0, t1):
                row = bh * cap + t
                for g in range(G):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[bh, g, d] * _bf16_bits_to_f32(k[row, d])
                    out[bh, g, t] = acc * scale

    @njit(nogil=True, fastmath=True, cache=True)
    def _scan_f32_kernel(q, k, cap, out, scale, T, block, j0, j1):  # pragma: no cover - compiled
        """q [BH, G, D] f32; k [rows, D] f32 (token t of bh at row bh*cap + t); out [BH, G, T] f32."""
        G = q.shape[1]
        D = k.shape[1]
        nblk = (T + block - 1) // block
        for job in range(j0, j1):
            bh = job // nblk
            t0 = (job - bh * nblk) * block
            t1 = min(T, t0 + block)
            for t in range(t0, t1):
                row = bh * cap + t
                for g in range(G):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[bh, g, d] * k[row, d]
                    out[bh, g, t] = acc * scale

    _GROUP_KERNEL_SRC = """
def kernel(q, k, cap, out, scale, T, block, j0, j1):
    D = k.shape[1]
    nblk = (T + block - 1) // block
    for job in range(j0, j1):
        bh = job // nblk
        t0 = (job - bh * nblk) * block
        t1 = min(T, t0 + block)
{qrows}
        for t in range(t0, t1):
            row = k[bh * cap + t]
{zero}
            for d in range(D):
                kv = {widen}
{fma}
{store}
"""

    def _group_kernel(G: int, bf16: bool) -> Callable:
        """A scan kernel specialised to G query heads per KV head (G scalar accumulators).

        Each key element is widened once and feeds all G dot products, so LLVM keeps G vector
        accumulators along D; this measured ~1.4x faster than the generic kernel below, which
        loops over g and re-reads (and re-widens) the key row for every head.
        """
        key = (G, bf16)
        if key not in _GROUP_KERNELS:
            ind = " " * 16
            src = _GROUP_KERNEL_SRC.format(
                qrows="\n".join(f"        q{g} = q[bh, {g}]" for g in range(G)),
                zero="\n".join(f"            a{g} = np.float32(0.0)" for g in range(G)),
                widen="_bf16_bits_to_f32(row[d])" if bf16 else "row[d]",
                fma="\n".join(f"{ind}a{g} += q{g}[d] * kv" for g in range(G)),
                store="\n".join(f"            out[bh, {g}, t] = a{g} * scale" for g in range(G)))
            ns = {"np": np, "_bf16_bits_to_f32": _bf16_bits_to_f32}
            exec(compile(src, f"<hybridgen scan kernel G={G} bf16={bf16}>", "exec"), ns)  # noqa: S102
            _GROUP_KERNELS[key] = njit(nogil=True, fastmath=True)(ns["kernel"])
        return _GROUP_KERNELS[key]

    @njit(nogil=True, cache=True)
    def _topk_kernel(scores, kk, out, r0, r1):  # pragma: no cover - compiled
        """scores [R, T] f32 -> out [R, kk] int64 (unsorted top-kk per row)."""
        T = scores.shape[1]
        for r in range(r0, r1):
            part = np.argpartition(-scores[r], kk - 1) if kk < T else np.arange(T)
            for i in range(kk):
                out[r, i] = part[i]


def scan_kernel(G: int, bf16: bool) -> Callable:
    """The scan kernel for G query heads per KV head over bf16 (uint16 bits) or fp32 key rows.

    Signature: kernel(q, k, cap, out, scale, T, block, j0, j1) with the shapes of the module
    docstring; needs numba (``HAVE_NUMBA``).
    """
    if G <= MAX_SPECIALISED_GROUP:
        return _group_kernel(G, bf16)
    return _scan_bf16_kernel if bf16 else _scan_f32_kernel


def key_array(rows: Tensor, bf16: bool) -> Any:
    """Key rows [rows, D] (bf16 or fp32, contiguous rows) as the numpy array a kernel reads
    (bf16 as its uint16 bit patterns; no copy)."""
    return rows.view(torch.int16).numpy().view(np.uint16) if bf16 else rows.numpy()


def topk_kernel() -> Callable:
    """kernel(scores [R, T] f32, kk, out [R, kk] int64, r0, r1): unsorted top-kk of rows
    [r0, r1) by ``np.argpartition`` (introselect); needs numba (``HAVE_NUMBA``)."""
    return _topk_kernel
