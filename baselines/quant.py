"""Group-wise asymmetric (min/max) 4-bit quantization, as FlexGen compresses its KV cache.

FlexGen (Sheng et al., ICML 2023, Sec. 5 "Compression") quantizes the KV cache with 4 bits
in groups of 64 contiguous elements along the hidden (here: head) dimension, each group
storing its own min and scale (asymmetric). We pack two 4-bit codes into one uint8.

For a group with minimum ``lo`` and maximum ``hi``: scale = (hi - lo) / 15,
code = round((x - lo) / scale) in [0, 15], x' = code * scale + lo, so
|x - x'| <= scale / 2 = (hi - lo) / 30 (plus the rounding of lo/scale to the meta dtype).

Choices where FlexGen is silent or differs:
- meta (lo, scale) is stored in the data dtype (FlexGen does the same), interleaved as
  [lo_0, scale_0, lo_1, scale_1, ...] in a last dimension of 2 * groups;
- a head dimension that is not a multiple of the group size is padded with the first value
  of the last group (so the padding never widens the range);
- a constant group (hi == lo) gets scale 0 and decodes exactly to lo.

Shapes: x [..., D] -> codes [..., Dp / 2] uint8 and meta [..., 2 * Dp / group] where
Dp = D rounded up to a multiple of ``group``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError

LEVELS = 15  # 4 bits


def check_group(group: int) -> None:
    if group < 2 or group % 2:
        raise ConfigError(f"quantization group size must be an even number >= 2, got {group}")


def padded_dim(dim: int, group: int) -> int:
    return int(math.ceil(dim / group)) * group


def packed_shapes(dim: int, group: int) -> Tuple[int, int]:
    """(code bytes, meta elements) per vector of ``dim`` values."""
    dp = padded_dim(dim, group)
    return dp // 2, 2 * (dp // group)


def quantize(x: Tensor, group: int = 64) -> Tuple[Tensor, Tensor]:
    """x [..., D] -> (codes [..., Dp/2] uint8, meta [..., 2*Dp/group] in x.dtype)."""
    check_group(group)
    D = x.shape[-1]
    dp = padded_dim(D, group)
    xf = x.float()
    if dp != D:
        last_start = (D // group) * group
        pad = xf[..., last_start:last_start + 1].expand(*xf.shape[:-1], dp - D)
        xf = torch.cat([xf, pad], dim=-1)
    g = xf.reshape(*xf.shape[:-1], dp // group, group)
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    # Round meta to the storage dtype first, so codes are computed against what decodes.
    lo_s = lo.to(x.dtype).float()
    scale_s = ((hi - lo_s) / LEVELS).to(x.dtype).float()
    inv = torch.where(scale_s > 0, 1.0 / scale_s, torch.zeros_like(scale_s))
    codes = torch.round((g - lo_s) * inv).clamp_(0, LEVELS).to(torch.uint8)
    codes = codes.reshape(*xf.shape[:-1], dp)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    meta = torch.stack([lo_s.squeeze(-1), scale_s.squeeze(-1)], dim=-1).reshape(*xf.shape[:-1], -1)
    return packed, meta.to(x.dtype)


def dequantize(codes: Tensor, meta: Tensor, dim: int, group: int = 64, out: Optional[Tensor] = None) -> Tensor:
    """(codes [..., Dp/2], meta [..., 2*Dp/group]) -> x' [..., dim] in meta.dtype (into ``out`` if given)."""
    dp = codes.shape[-1] * 2
    lo_nib = codes & 0x0F
    hi_nib = codes >> 4
    c = torch.stack([lo_nib, hi_nib], dim=-1).reshape(*codes.shape[:-1], dp // group, group).float()
    m = meta.float().reshape(*meta.shape[:-1], dp // group, 2)
    x = c * m[..., 1:2] + m[..., 0:1]
    x = x.reshape(*codes.shape[:-1], dp)[..., :dim]
    if out is None:
        return x.to(meta.dtype)
    out.copy_(x)
    return out


def error_bound(x: Tensor, group: int = 64) -> Tensor:
    """Per-element bound on |x - dequantize(quantize(x))|: (group max - group min) / 30, [..., D]."""
    D = x.shape[-1]
    dp = padded_dim(D, group)
    xf = x.float()
    if dp != D:
        last_start = (D // group) * group
        xf = torch.cat([xf, xf[..., last_start:last_start + 1].expand(*xf.shape[:-1], dp - D)], dim=-1)
    g = xf.reshape(*xf.shape[:-1], dp // group, group)
    half = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / (2 * LEVELS)
    return half.expand_as(g).reshape(*xf.shape[:-1], dp)[..., :D]
