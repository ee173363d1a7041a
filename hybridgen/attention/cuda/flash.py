"""Torch's fused flash-attention forward with its log-sum-exp: the fast GPU partial of a decode step.

A decode query of a GQA layer is G = Hq / Hkv query rows per KV head attending, without a causal
mask, over the same T keys. Viewing q [B, Hq, 1, D] as [B, Hkv, G, D], ONE call of the flash
kernel SDPA itself runs (``aten._scaled_dot_product_flash_attention``, split over the keys for
small batches) returns out [B, Hkv, G, D] and lse [B, Hkv, G]: the partial attention of
:func:`hybridgen.attention.partial_attention` (out normalised within the part, lse of the scaled
logits, natural log) without materialising logits or repeating KV heads.

It applies to one query token, no mask, fp16/bf16, head dim a multiple of 8 up to 256, and keys
and values whose last dimension is contiguous (the KV segments' capacity views are). On the
H200 (``results/gpu/``) it reads the KV several times faster than the CuPy partial kernel, which
keeps the masked case. On the CPU the same view runs torch's CPU flash kernel (tests check the
view and the LSE there); the dispatcher calls this on CUDA only.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """True when :func:`flash_partial_attention` takes these inputs (see the module docstring)."""
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    return (Tq == 1 and T > 0 and Hq % Hkv == 0 and q.dtype in FLASH_DTYPES and k.dtype == q.dtype
            and v.dtype == q.dtype and D % 8 == 0 and D <= 256 and q.stride(-1) == 1 and k.stride(-1) == 1
            and v.stride(-1) == 1)


def flash_partial_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tuple[Tensor, Tensor]:
    """q [B, Hq, 1, D]; k, v [B, Hkv, T, D] (T > 0). Returns (out [B, Hq, 1, D] in q's dtype,
    lse [B, Hq, 1] float32), as :func:`hybridgen.attention.partial_attention` without a mask."""
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, D)  # the G query heads of a KV head as G query rows
    if q.is_cuda:
        res = torch.ops.aten._scaled_dot_product_flash_attention(qg, k, v, 0.0, False, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, scale=scale)
    out, lse = res[0], res[1]  # lse [B, Hkv, G]; sliced in case a torch build pads the query rows
    return out.reshape(B, Hq, 1, D), lse[..., :G].reshape(B, Hq, 1).float()
