"""Inputs and float64 references shared by the CUDA kernel and dispatch tests (not a test module)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hybridgen.attention import partial as tp


def decode_inputs(B: int, Hq: int, Hkv: int, T: int, D: int, dtype: torch.dtype = torch.float32,
                  device: str = "cpu", seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random decode-step q [B, Hq, 1, D] and k, v [B, Hkv, T, D] (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype).to(device)
    return q, k, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 on the CPU."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def logits64(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 logits [B, Hq, 1, T] (the torch primitive computes in float32)."""
    g = q.shape[1] // k.shape[1]
    return (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) * scale


def ref_lse(q: torch.Tensor, k: torch.Tensor, scale: float, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 log-sum-exp [B, Hq, 1] of the (masked) logits."""
    logits = tp._mask_logits(logits64(q, k, scale), mask, k.shape[1])
    return torch.logsumexp(logits, dim=-1)
