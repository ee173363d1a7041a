"""Rotary position embedding (RoPE) with the 'default', 'linear' and 'llama3' frequency rules.

Layout is the Hugging Face one ("rotate half": the first and second halves of the head
dimension form the pairs), which is what HF checkpoints and transformers' GGUF loader use.
cos/sin are computed in float32 from the positions at every call (no table), then cast to
the input's dtype, as transformers does.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor


def rope_inv_freq(head_dim: int, theta: float, rope_type: str = "default",
                  params: Optional[Dict[str, float]] = None) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for the given rule.

    llama3: frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor
    are divided by ``factor``; those shorter than original / high_freq_factor are kept; the band
    between is interpolated smoothly (Llama 3.1 reference rule).
    """
    params = params or {}
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        return inv / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """RoPE for one model: ``rotate(x [B, H, T, D], positions [B, T]) -> x`` rotated.

    ``positions`` are absolute token positions (left padding excluded), LongTensor.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, rope_type: str = "default",
                 params: Optional[Dict[str, float]] = None, device: Optional[torch.device] = None):
        self.head_dim = head_dim
        self.theta = theta
        self.rope_type = rope_type
        self.inv_freq = rope_inv_freq(head_dim, theta, rope_type, params).to(device or "cpu")

    def cos_sin(self, positions: Tensor) -> Tuple[Tensor, Tensor]:
        """positions [B, T] -> (cos, sin) each [B, 1, T, D] float32."""
        freqs = positions.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos(), emb.sin()

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, H, T, D] with cos/sin [B, 1, T, D]."""
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos, sin)
