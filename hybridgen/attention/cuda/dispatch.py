"""The dispatchers the rest of the library calls: torch's flash kernel or CuPy kernels on CUDA, torch otherwise.

``partial_attention`` and ``softmax_over_parts`` have exactly the signatures of the torch
primitives in :mod:`hybridgen.attention.partial`; with ``hybrid_decode_attention`` they take
the CuPy path when every tensor is on a CUDA device, the shapes are supported (one query
token, head dim a power-of-two number of 16-byte vectors, <= 256) and CuPy works, and the
torch primitive otherwise (no CUDA, CuPy not installed, CuPy installed without a usable
driver, unsupported shape). A kernel that fails to compile or launch falls back to torch with
one warning; ``HYBRIDGEN_CUPY=0`` turns the CuPy path off (not torch's flash kernel, which is
torch's own), ``HYBRIDGEN_CUPY=strict`` makes failures of either raise. The first CuPy result
of each kernel and dtype is checked against torch (:mod:`hybridgen.attention.cuda.verification`).

``partial_attention`` first tries torch's own flash kernel, which returns the log-sum-exp
(:mod:`hybridgen.attention.cuda.flash`: unmasked fp16/bf16 decode), verified on first use the
same way; it measured several times the CuPy kernel's bandwidth on the H200 (``results/gpu/``).

Used by ``hybrid-exact`` and FlexGen (``partial_attention``) and ``hybridgen``
(``partial_attention`` over its GPU share before the host top-k arrives, so it overlaps the
CPU branch, then ``softmax_over_parts`` over the shipped part and the share's [lse, out]:
:mod:`hybridgen.hybrid.gpu_share`; ``hybrid_decode_attention`` fuses both for benchmarks).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.attention import partial as _torch_impl
from hybridgen.attention.cuda import flash, state, verification
from hybridgen.attention.cuda.execution import (
    cupy_hybrid_decode_attention,
    cupy_partial_attention,
    cupy_softmax_over_parts,
)
from hybridgen.attention.cuda.planning import KernelUnsupported
from hybridgen.attention.cuda.state import dispatch_counts, kernels_available


def _on_cuda(*tensors: Optional[Tensor]) -> bool:
    return all(t is None or t.is_cuda for t in tensors)


def _try_cupy(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a CuPy entry point; None when it does not apply (the caller then uses torch)."""
    if not state.kernels_available() or fn.__name__ in state.rejected:
        return None
    try:
        return fn(*args)
    except KernelUnsupported:
        return None
    except Exception as err:  # noqa: BLE001 - compile or launch failure: fall back, once loudly
        if state.strict():
            raise
        key = (fn.__name__, type(err).__name__)
        if key not in state.warned:
            state.warned.add(key)
            warnings.warn(f"CuPy kernel {fn.__name__} failed ({type(err).__name__}: {err}); "
                          "using the torch fallback", RuntimeWarning, stacklevel=4)
        return None


def _dispatch(cupy_fn: Callable[..., Any], torch_fn: Callable[..., Any], dtype: torch.dtype,
              tensors: Sequence[Optional[Tensor]], *args: Any) -> Any:
    """``cupy_fn(*args)`` when it applies (first result per (kernel, dtype) verified against
    ``torch_fn(*args)``), else ``torch_fn(*args)``. Counts the path in ``dispatch_counts``."""
    if _on_cuda(*tensors):
        res = _try_cupy(cupy_fn, *args)
        if res is not None:
            value, path = verification.check_result(cupy_fn.__name__, dtype, res, torch_fn, args)
            state.dispatch_counts[path] += 1
            return value
    state.dispatch_counts["torch"] += 1
    return torch_fn(*args)


def partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                      mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """:func:`hybridgen.attention.partial_attention` on the fastest GPU kernel that applies: torch's
    flash kernel with its LSE (:mod:`.flash`: one query token, no mask, fp16/bf16), else the CuPy
    kernel (masks, fp32), else torch.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, T, D]; mask: [B, Hkv, T]-broadcastable bool.
    Returns (out [B, Hq, Tq, D] in q's dtype, lse [B, Hq, Tq] float32).
    """
    if (mask is None and _on_cuda(q, k, v) and flash.applies(q, k, v)
            and "flash_partial_attention" not in state.rejected):
        res = _try_flash(q, k, v, scale)
        if res is not None:
            value, path = verification.check_result("flash_partial_attention", k.dtype, res,
                                                    _torch_impl.partial_attention, (q, k, v, scale, None), path="flash")
            state.dispatch_counts[path] += 1
            return value
    return _dispatch(cupy_partial_attention, _torch_impl.partial_attention, k.dtype, (q, k, v, mask),
                     q, k, v, scale, mask)


def _try_flash(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Optional[Tuple[Tensor, Tensor]]:
    """Torch's flash kernel with its LSE (:mod:`.flash`); None (one warning) when it raises."""
    try:
        return flash.flash_partial_attention(q, k, v, scale)
    except torch.cuda.OutOfMemoryError:
        raise  # a full GPU, not a missing kernel: never a reason to switch the kernel off
    except Exception as err:  # noqa: BLE001 - a torch build without the kernel: fall back, once loudly
        if state.strict():
            raise
        state.rejected.add("flash_partial_attention")
        warnings.warn(f"torch's flash attention with LSE failed ({type(err).__name__}: {err}); "
                      "using the CuPy / torch partial", RuntimeWarning, stacklevel=3)
        return None


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
    """Torch path of :func:`hybrid_decode_attention` (same shapes)."""
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
    return "cupy" if tensors and _on_cuda(*tensors) and state.kernels_available() else "torch"
