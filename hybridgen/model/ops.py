"""Plain tensor ops of the decoder: norms, MLPs, and the dense causal prefill attention.

Numerics follow transformers so logits match in fp32: RMSNorm normalises in float32 and
casts back before the weight multiply; LayerNorm is torch's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

_ACT = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., h] -> weight * x / rms(x) (statistics in float32)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def norm(kind: str, x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> Tensor:
    return rms_norm(x, weight, eps) if kind == "rms" else layer_norm(x, weight, bias, eps)


def mlp(x: Tensor, w_in: Tensor, b_in: Optional[Tensor], w_out: Tensor, b_out: Optional[Tensor],
        activation: str, gated: bool) -> Tensor:
    """x [..., h]. gated: down(act(gate x) * (up x)) with w_in = [gate; up]; else fc2(act(fc1 x))."""
    y = F.linear(x, w_in, b_in)
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = _ACT[activation](gate) * up
    else:
        y = _ACT[activation](y)
    return F.linear(y, w_out, b_out)


def prefill_mask(valid: Optional[Tensor], T: int, start: int, stop: int, device) -> Optional[Tensor]:
    """Bool mask [B or 1, 1, stop-start, T] (True = attend) for queries start..stop-1 over keys 0..T-1.

    Causal, excludes left padding (valid [B, T] False), and always lets a query see itself so a
    padding query never has an empty row (its output is ignored downstream).
    """
    qi = torch.arange(start, stop, device=device)[:, None]
    kj = torch.arange(T, device=device)[None, :]
    causal = kj <= qi  # [Tq, T]
    if valid is None:
        return causal[None, None]
    allowed = causal[None] & valid[:, None, :]  # [B, Tq, T]
    allowed = allowed | (kj == qi)[None]
    return allowed[:, None]


def causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, valid: Optional[Tensor],
                     chunk: int = 4096) -> Tensor:
    """Dense causal attention for prefill.

    q [B, Hq, T, D]; k, v [B, Hkv, T, D]; valid [B, T] bool or None. Returns [B, Hq, T, D].
    K/V are repeated to Hq heads (as HF's eager path does) so every SDPA backend accepts them;
    queries are processed in chunks of ``chunk`` to bound the mask's memory for long prompts.
    """
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    if G > 1:
        k = k.repeat_interleave(G, dim=1)
        v = v.repeat_interleave(G, dim=1)
    if valid is None and T <= chunk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    out = torch.empty_like(q)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        mask = prefill_mask(None if valid is None else valid[:, :e], e, s, e, q.device)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, :e], v[:, :, :e],
                                                        attn_mask=mask, scale=scale)
    return out
