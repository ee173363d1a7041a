"""Execution: running launch plans with CuPy, and the raw CuPy entry points.

Tensors are handed to CuPy through ``__cuda_array_interface__`` (zero copy); bf16 tensors
travel as an int16 view (CuPy has no bfloat16) and bool masks as uint8. Kernels run on
torch's current CUDA stream. The ``cupy_*`` functions raise
:class:`~hybridgen.attention.cuda.planning.KernelUnsupported` for inputs they do not handle
and are not verified against torch (the dispatcher in :mod:`hybridgen.attention.cuda.dispatch`
adds the fallback and the first-use check).
"""
from __future__ import annotations

import functools
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.attention.cuda import state
from hybridgen.attention.cuda.compiler import cupy_kernels
from hybridgen.attention.cuda.planning import (
    KernelUnsupported,
    LaunchPlan,
    plan_hybrid_decode_attention,
    plan_partial_attention,
    plan_softmax_over_parts,
)


def _cupy_view(t: Tensor) -> Any:
    """Zero-copy CuPy view of a CUDA tensor (through __cuda_array_interface__)."""
    cp = state.import_cupy()
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return cp.asarray(t)


def _cupy_arg(arg: tuple) -> Any:
    """One typed plan argument -> the value CuPy passes to the kernel."""
    import numpy as np

    kind, value = arg
    if kind == "ptr":
        return np.uint64(0) if value is None else _cupy_view(value)
    return {"i64": np.int64, "i32": np.int32, "f32": np.float32}[kind](value)


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (sizes the token splits)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(t: Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def run_plan_cupy(plan: LaunchPlan, out: Tensor, lse: Optional[Tensor] = None) -> None:
    """Run a plan on out's CUDA device, on torch's current stream (fills out and lse)."""
    cp = state.import_cupy()
    index = _device_index(out)
    funcs = cupy_kernels(plan.dtype, plan.head_dim, plan.group, index)
    workspace = torch.empty(plan.workspace_numel(), dtype=torch.float32, device=out.device)
    with cp.cuda.Device(index):
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream(out.device).cuda_stream)
        with stream:
            for kernel, grid, block, smem, args in plan.launches(workspace, out, lse):
                funcs[kernel](grid, block, tuple(_cupy_arg(a) for a in args), shared_mem=smem)


def _require_cuda(*tensors: Optional[Tensor]) -> int:
    """SM count of the first tensor's device; KernelUnsupported without CuPy or off CUDA."""
    if not state.kernels_available():
        raise KernelUnsupported("CuPy kernels unavailable")
    if not all(t is None or t.is_cuda for t in tensors):
        raise KernelUnsupported("tensors not on CUDA")
    return sm_count(_device_index(tensors[0]))


def cupy_partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                           mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """CuPy path of ``partial_attention``: q [B, Hq, 1, D]; k, v [B, Hkv, T, D] ->
    (out [B, Hq, 1, D], lse [B, Hq, 1] float32)."""
    sms = _require_cuda(q, k, v, mask)
    plan, out, lse = plan_partial_attention(q, k, v, scale, mask, sms)
    run_plan_cupy(plan, out, lse)
    return out, lse


def cupy_softmax_over_parts(parts: Sequence[Tuple[Tensor, Tensor]], num_kv_heads: int) -> Tensor:
    """CuPy path of ``softmax_over_parts`` (every part's logits given) -> [B, Hq, 1, D]."""
    sms = _require_cuda(*[t for part in parts for t in part])
    plan, out = plan_softmax_over_parts(parts, num_kv_heads, sms)
    if not plan.parts:
        return out.zero_()
    run_plan_cupy(plan, out)
    return out


def cupy_hybrid_decode_attention(q: Tensor, host_logits: Tensor, host_values: Tensor, k_gpu: Tensor,
                                 v_gpu: Tensor, scale: float, gpu_mask: Optional[Tensor] = None) -> Tensor:
    """CuPy path of ``hybrid_decode_attention`` -> [B, Hq, 1, D]."""
    sms = _require_cuda(q, host_logits, host_values, k_gpu, v_gpu, gpu_mask)
    plan, out = plan_hybrid_decode_attention(q, host_logits, host_values, k_gpu, v_gpu, scale, gpu_mask, sms)
    if not plan.parts:
        return out.zero_()
    run_plan_cupy(plan, out)
    return out
