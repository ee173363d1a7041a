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


#: bytes :func:`dequantize` reads + writes per output element, counted from its torch passes:
#: the two nibble masks (1 + 1 over the packed half-bytes), their interleave (2) and the codes
#: read once more as they are widened into the output (1): DEQUANT_PASS_BYTES; then the output's
#: own b-byte element is accessed DEQUANT_OUT_ACCESSES times (written by the widening, read and
#: written by the scale, read and written by the offset); and the passes it launches
DEQUANT_PASS_BYTES = 1 + 1 + 2 + 1
DEQUANT_OUT_ACCESSES = 5
DEQUANT_PASSES = 6


def dequant_bytes(elements: float, out_bytes: int) -> float:
    """Bytes :func:`dequantize` moves to decode ``elements`` values into ``out_bytes``-byte
    elements (what its cost prices at the device's memory bandwidth)."""
    return elements * (DEQUANT_PASS_BYTES + DEQUANT_OUT_ACCESSES * out_bytes)


def dequantize(codes: Tensor, meta: Tensor, dim: int, group: int = 64, out: Optional[Tensor] = None) -> Tensor:
    """(codes [..., Dp/2], meta [..., 2*Dp/group]) -> x' [..., dim] in meta.dtype (into ``out`` if given).

    x' = code * scale + min in meta's dtype, as FlexGen's decompression computes it (float32
    for float32 KV; a 16-bit dtype rounds the product, then the sum): the codes are widened
    straight into the output, then scaled and offset in place: :data:`DEQUANT_PASSES` passes
    and no intermediate of the output's size, whenever ``out`` has meta's dtype, no padding
    (dim == Dp) and contiguous rows (a KV segment's ``[:, :, :n]`` capacity view qualifies);
    otherwise through a temporary copied into ``out`` (or returned, contiguous). Measured on the
    2-core CPU (8 KV heads x 7,373 tokens, fp32, codes and meta as capacity views): the previous
    out-of-place float32 version took 55 / 92 ms at batch 1 / 2 (torch's slow broadcast path
    over the views, and output-sized intermediates that were fresh page-faulted mmaps on every
    call at batch 2), this one 7-9 / 14-22 ms.
    """
    dp = codes.shape[-1] * 2
    lead = codes.shape[:-1]
    c = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(*lead, dp // group, group)  # uint8
    m = meta.reshape(*lead, dp // group, 2)
    direct = out is not None and dp == dim and out.dtype == meta.dtype and out.stride(-1) == 1
    x = (out.unflatten(-1, (dp // group, group)) if direct
         else torch.empty(*lead, dp // group, group, dtype=meta.dtype, device=codes.device))
    x.copy_(c)
    x.mul_(m[..., 1:2]).add_(m[..., 0:1])
    if direct:
        return out
    y = x.view(*lead, dp)[..., :dim]
    if out is None:
        return y.contiguous()
    out.copy_(y)
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
