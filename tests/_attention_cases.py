"""Random attention cases shared by the attention / hybrid-exact tests (not a test module)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

import torch

GQA_RATIOS = (1, 2, 3, 4, 8)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error ||out - ref|| / ||ref|| in float64 (0 when both are 0)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num if den == 0 else num / den


@dataclass
class Case:
    """One random attention problem. q [B, Hq, Tq, D]; k, v [B, Hkv, T, D]; mask [B, Hkv, T] or None."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Optional[torch.Tensor]
    scale: float

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]


def random_mask(gen: random.Random, B: int, Hkv: int, T: int, kind: str) -> Optional[torch.Tensor]:
    """kind: 'none' | 'left' (left padding, shared by heads, [B, 1, T]) | 'head' (random per head)."""
    if kind == "none" or T == 0:
        return None
    if kind == "left":
        pads = [gen.randint(0, T) for _ in range(B)]  # a row may be all padding
        pads[0] = 0  # keep at least one full row
        m = torch.ones(B, 1, T, dtype=torch.bool)
        for b, p in enumerate(pads):
            m[b, :, :p] = False
        return m
    if kind == "head":
        return torch.rand(B, Hkv, T) < 0.7
    raise ValueError(kind)


def random_case(seed: int, dtype: torch.dtype = torch.float32, T: Optional[int] = None, Tq: int = 1,
                mask_kind: Optional[str] = None) -> Case:
    """A random GQA problem; shapes, GQA ratio and mask kind are drawn from ``seed``."""
    gen = random.Random(seed)
    torch.manual_seed(seed)
    B = gen.randint(1, 3)
    Hkv = gen.randint(1, 3)
    G = gen.choice(GQA_RATIOS)
    D = gen.choice((8, 16, 24, 64))
    if T is None:
        T = gen.choice((1, 2, 3, 7, 13, 31, 64, 129))
    kind = mask_kind or gen.choice(("none", "left", "head"))
    q = torch.randn(B, Hkv * G, Tq, D)
    k = torch.randn(B, Hkv, T, D)
    v = torch.randn(B, Hkv, T, D)
    mask = random_mask(gen, B, Hkv, T, kind)
    return Case(q.to(dtype), k.to(dtype), v.to(dtype), mask, D ** -0.5)
