"""Shared pieces of the baselines: tier-accounted buffers, token gathers, attention helpers.

Every buffer a baseline holds (KV, per-token metadata, staging buffers) is allocated through
a store tier, either as a :class:`hybridgen.kv.KVSegment` or as a :class:`TierBuffer`, and
registered with :meth:`BaselineMethod.own` so :meth:`BaselineMethod.release` frees it and
:func:`held_bytes_by_tier` can check the store's ledger against what is really held.

Shapes: q [B, Hq, Tq, D]; k, v [B, Hkv, T, D]; token indices [B, Hkv, n]; valid [B, T].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.attention import attention_logits
from hybridgen.kv import KVSegment
from hybridgen.kv.tiers import Tier
from hybridgen.methods import KVMethod, MethodContext

NEG_INF = float("-inf")


class TierBuffer:
    """One tensor allocated on a store tier (metadata, staging buffers, partial keys).

    ``t`` is the tensor (zero-filled); ``release()`` returns it to the tier ledger.
    """

    def __init__(self, tier: Tier, shape: Sequence[int], dtype: torch.dtype, owner: str):
        self.tier = tier
        self.owner = owner
        self.t: Optional[Tensor] = tier.allocate(tuple(shape), dtype, owner)

    @property
    def nbytes(self) -> int:
        return 0 if self.t is None else self.t.numel() * self.t.element_size()

    def release(self) -> None:
        if self.t is not None:
            self.tier.release(self.t)
            self.t = None


def held_bytes_by_tier(objs: Sequence[object]) -> Dict[str, int]:
    """Bytes held per tier name by KVSegments / TierBuffers (for checking the store ledger)."""
    out: Dict[str, int] = {}
    for o in objs:
        if isinstance(o, KVSegment):
            if o._k is None:  # released
                continue
            kb = o._k.numel() * o._k.element_size()
            vb = o._v.numel() * o._v.element_size()
            mb = 0 if o._mask is None else o._mask.numel()
            out[o.key_tier.name] = out.get(o.key_tier.name, 0) + kb + mb
            out[o.value_tier.name] = out.get(o.value_tier.name, 0) + vb
        elif isinstance(o, TierBuffer):
            out[o.tier.name] = out.get(o.tier.name, 0) + o.nbytes
    return out


@dataclass
class BaselineMethod(KVMethod):
    """KVMethod with ownership tracking of tier allocations and a decode-step counter.

    stats: 'bytes_h2d', 'bytes_d2h' (totals), 'steps' (decode steps run); per-step averages
    are totals / steps.
    """

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.stats["steps"] = 0
        self._owned: List[object] = []

    def own(self, obj):
        """Register a KVSegment/TierBuffer so release() frees it. Returns obj."""
        self._owned.append(obj)
        return obj

    def segment(self, tier: str, owner: str, capacity: int, with_mask: bool,
                head_dim: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                value_tier: Optional[str] = None) -> KVSegment:
        """A new owned KVSegment [B, Hkv, capacity, head_dim] on ``tier``.

        owner: 'layer<i>/<part>' for per-layer state, 'shared/<part>' otherwise, so the
        store's bytes_by_layer() groups by layer."""
        ctx = self.ctx
        seg = KVSegment(ctx.store[tier], ctx.batch_size, ctx.num_kv_heads, head_dim or ctx.head_dim,
                        dtype or ctx.dtype, owner, capacity=capacity,
                        value_tier=ctx.store[value_tier] if value_tier else None, with_mask=with_mask)
        return self.own(seg)

    def buffer(self, tier: str, owner: str, shape: Sequence[int], dtype: torch.dtype) -> TierBuffer:
        """A new owned TierBuffer on ``tier``."""
        return self.own(TierBuffer(self.ctx.store[tier], shape, dtype, owner))

    def end_step(self) -> None:
        self.stats["steps"] = self.stats.get("steps", 0) + 1

    def release(self) -> None:
        for o in getattr(self, "_owned", []):
            o.release()
        self._owned = []

    def held_bytes(self) -> Dict[str, int]:
        """Bytes this method holds per tier (computed from its buffers, not the ledger)."""
        return held_bytes_by_tier(getattr(self, "_owned", []))

    @staticmethod
    def kv_bytes(t: Tensor) -> int:
        return t.numel() * t.element_size()


# ----------------------------------------------------------------------------- tensors
def needs_mask(valid: Optional[Tensor]) -> bool:
    """True when a [B, T] validity mask has padding (False entries)."""
    return valid is not None and not bool(valid.all())


def gather_tokens(x: Tensor, idx: Tensor) -> Tensor:
    """x [B, H, T, D], idx [B, H, n] -> [B, H, n, D]."""
    return torch.gather(x, 2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


def gather_mask(valid: Optional[Tensor], idx: Tensor) -> Optional[Tensor]:
    """valid [B, T] (or [B, H, T]) or None, idx [B, H, n] -> [B, H, n] bool or None."""
    if valid is None:
        return None
    if valid.dim() == 2:
        valid = valid[:, None, :].expand(-1, idx.shape[1], -1)
    return torch.gather(valid, 2, idx)


def group_reduce(x: Tensor, num_kv_heads: int, how: str = "sum") -> Tensor:
    """[B, Hq, ...] -> [B, Hkv, ...] by summing / averaging / max over each KV group's query heads."""
    B, Hq = x.shape[:2]
    xg = x.reshape(B, num_kv_heads, Hq // num_kv_heads, *x.shape[2:])
    if how == "sum":
        return xg.sum(dim=2)
    if how == "mean":
        return xg.mean(dim=2)
    if how == "max":
        return xg.amax(dim=2)
    raise ValueError(how)


def attend_with_new(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], k_new: Tensor, v_new: Tensor,
                    scale: float, return_probs: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """One-query attention over a cache plus the new token, with ONE softmax.

    q [B, Hq, 1, D]; k, v [B, Hkv, n, D]; mask [B, Hkv, n] or None; k_new, v_new [B, Hkv, 1, D].
    Returns (out [B, Hq, 1, D], probs [B, Hq, n + 1] float32 or None), probs ordered
    [cache tokens ; new token].
    """
    B, Hq, Tq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    lc = attention_logits(q, k, scale)  # [B, Hq, 1, n]
    if mask is not None:
        lc = lc.view(B, Hkv, g, Tq, -1).masked_fill(~mask[:, :, None, None, :], NEG_INF).view_as(lc)
    ln = attention_logits(q, k_new, scale)  # [B, Hq, 1, 1]
    logits = torch.cat([lc, ln], dim=-1)
    probs = torch.softmax(logits, dim=-1)  # the new token is always visible: no all -inf row
    n = k.shape[2]
    pg = probs.reshape(B, Hkv, g * Tq, n + 1)
    out = torch.matmul(pg[..., :n].to(v.dtype), v) + torch.matmul(pg[..., n:].to(v.dtype), v_new)
    out = out.reshape(B, Hq, Tq, D).to(q.dtype)
    return out, (probs[:, :, 0, :] if return_probs else None)


def causal_attention_colsum(q: Tensor, k: Tensor, scale: float, valid: Optional[Tensor],
                            query_start: int = 0, chunk: int = 256) -> Tensor:
    """Σ over queries of causal softmax attention probabilities, per query head and key.

    q [B, Hq, T, D] (queries at positions 0..T-1), k [B, Hkv, T, D]; valid [B, T] or None.
    Only queries i >= query_start contribute; padded queries contribute nothing and padded
    keys get no probability. Computed in query chunks so memory stays O(chunk * T).
    Returns [B, Hq, T] float32.
    """
    B, Hq, T, D = q.shape
    out = torch.zeros(B, Hq, T, dtype=torch.float32, device=q.device)
    kpos = torch.arange(T, device=q.device)
    for s in range(query_start, T, chunk):
        e = min(T, s + chunk)
        logits = attention_logits(q[:, :, s:e], k, scale)  # [B, Hq, c, T]
        allowed = kpos[None, :] <= torch.arange(s, e, device=q.device)[:, None]  # [c, T]
        allowed = allowed[None, None]
        if valid is not None:
            allowed = allowed & valid[:, None, None, :] & valid[:, None, s:e, None]
        logits = logits.masked_fill(~allowed, NEG_INF)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        out += probs.sum(dim=2)
    return out
