"""Launch planning: which kernels, grids, blocks, splits and arguments one attention call needs.

A :class:`LaunchPlan` is device-agnostic: it lists kernel launches with typed arguments
(``("ptr", tensor)``, ``("i64", n)``, ``("i32", n)``, ``("f32", x)``) in the order of the
kernels' C parameters (:data:`~hybridgen.attention.cuda.source.PARTIAL_ARG_NAMES`,
:data:`~hybridgen.attention.cuda.source.COMBINE_ARG_NAMES`). The CuPy executor
(:mod:`hybridgen.attention.cuda.execution`) runs it on a GPU; the test suite's CPU emulator
(``tests/_cuda_emulator.py``) runs the same plan over the same source compiled as C++, so the
planning code is tested without a GPU.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.attention.cuda.source import DTYPE_IDS, NUM_WARPS, THREADS

MAX_SHARED_BYTES = 48 * 1024  # default dynamic shared-memory limit without opting in


class KernelUnsupported(Exception):
    """Raised for inputs the kernels do not handle (the dispatcher then uses torch)."""


def kernel_config(dtype: torch.dtype, head_dim: int) -> Optional[dict]:
    """Vector layout of a (dtype, head_dim) pair, or None when the kernels do not support it.

    Keys: vec (elements per 16-byte vector), nvec (vectors per row), lpr (lanes per row),
    vpl (vectors per lane), rpw (rows per warp), row_groups (rows in flight per block).
    """
    if dtype not in DTYPE_IDS:
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


def num_splits(blocks_per_split: int, tokens: int, sm_count: int) -> Tuple[int, int]:
    """(splits, tokens per split) for one part: about four waves of blocks over the SMs,
    but at least 256 tokens a split (a split's fixed cost is its block merge and its slot
    in the combine)."""
    want = max(1, math.ceil(4 * sm_count / max(1, blocks_per_split)))
    splits = max(1, min(want, math.ceil(tokens / 256)))
    per = math.ceil(tokens / splits)
    return math.ceil(tokens / per), per


def _ptr(t: Optional[Tensor]) -> tuple:
    return ("ptr", t)


def _i64(x: int) -> tuple:
    return ("i64", int(x))


def _i32(x: int) -> tuple:
    return ("i32", int(x))


def _f32(x: float) -> tuple:
    return ("f32", float(x))


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
        self.parts: List[tuple] = []  # (kernel, grid, shared bytes, args, split offset)
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
        """float32 elements of the workspace: (m, l, acc[D]) per split and row."""
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


def _aligned(t: Tensor) -> Tensor:
    """t itself when its rows can be read as 16-byte vectors, else a contiguous copy."""
    es = t.element_size()
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(
        (s * es) % 16 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)
    return t if ok else t.contiguous()


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
    """[B, Hkv, T]-broadcastable bool mask -> contiguous uint8 [B, H, T] (or None)."""
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
    """Plan of ``partial_attention`` -> (plan, out [B, Hq, 1, D], lse [B, Hq, 1]) (outputs unfilled).

    q: [B, Hq, 1, D]; k, v: [B, Hkv, T, D]; mask: [B, Hkv, T]-broadcastable bool or None.
    """
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
    """Plan of ``softmax_over_parts`` -> (plan, out [B, Hq, 1, D]).

    parts: (logits [B, Hq, 1, Ti] float32, values [B, Hkv or Hq, Ti, D]).
    """
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
    """Plan of ``hybrid_decode_attention`` -> (plan, out [B, Hq, 1, D]).

    q: [B, Hq, 1, D]; host_logits: [B, Hq, K] or [B, Hq, 1, K] float32; host_values:
    [B, Hkv or Hq, K, D]; k_gpu, v_gpu: [B, Hkv, T, D]; gpu_mask: [B, Hkv, T]-broadcastable or None.
    """
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
