"""Dense float64 attention: the ground truth every other attention path is tested against."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def dense_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    mask: Optional[Tensor] = None,
    causal: bool = False,
) -> Tensor:
    """Plain softmax attention in float64 with K/V repeated for GQA.

    q: [B, Hq, Tq, D]; k, v: [B, Hkv, T, D] with Hq % Hkv == 0.
    mask: bool, True = attend, broadcastable to [B, Hkv, T] (per KV head) or None.
    causal: query i (of the last Tq positions) sees keys 0 .. T - Tq + i.
    Returns [B, Hq, Tq, D] in float64. A query that sees no key gets a zero output.
    """
    B, Hq, Tq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), kk) * scale
    allowed = torch.ones(B, Hq, Tq, T, dtype=torch.bool, device=q.device)
    if mask is not None:
        m = mask.expand(B, Hkv, T).repeat_interleave(group, dim=1)
        allowed &= m[:, :, None, :]
    if causal:
        qpos = torch.arange(T - Tq, T, device=q.device)[:, None]
        allowed &= torch.arange(T, device=q.device)[None, :] <= qpos
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bhkd->bhqd", probs, vv)
