"""Quest's page metadata: per-channel key bounds of each page and the query's upper bound on them.

Shapes: k [B, Hkv, T, D]; pages P = ceil(T / page_size); bounds [B, Hkv, P, D]; q [B, Hq, 1, D].
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor


def page_bounds(k: Tensor, valid: Optional[Tensor], page_size: int):
    """Per-page channel min/max of keys. k [B, H, T, D], valid [B, H, T] or None.

    Returns (kmin, kmax [B, H, P, D], page_valid [B, H, P]); all-padding pages get zeros.
    """
    B, H, T, D = k.shape
    P = math.ceil(T / page_size)
    pad = P * page_size - T
    kf = k.float()
    m = torch.ones(B, H, T, dtype=torch.bool, device=k.device) if valid is None else valid.expand(B, H, T)
    if pad:
        kf = torch.cat([kf, kf.new_zeros(B, H, pad, D)], dim=2)
        m = torch.cat([m, m.new_zeros(B, H, pad)], dim=2)
    kf = kf.view(B, H, P, page_size, D)
    mm = m.view(B, H, P, page_size)[..., None]
    kmin = kf.masked_fill(~mm, float("inf")).amin(dim=3)
    kmax = kf.masked_fill(~mm, float("-inf")).amax(dim=3)
    pv = mm[..., 0].any(dim=3)
    kmin = torch.where(pv[..., None], kmin, torch.zeros_like(kmin))
    kmax = torch.where(pv[..., None], kmax, torch.zeros_like(kmax))
    return kmin.to(k.dtype), kmax.to(k.dtype), pv


def upper_bound(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Σ_d max(q_d min_d, q_d max_d) per query head and page.

    q [B, Hq, 1, D]; kmin, kmax [B, Hkv, P, D] -> [B, Hq, P] float32.
    """
    B, Hq, _, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    ub = torch.matmul(qg.clamp(min=0), kmax.float().transpose(-1, -2)) + \
        torch.matmul(qg.clamp(max=0), kmin.float().transpose(-1, -2))
    return ub.reshape(B, Hq, P)
