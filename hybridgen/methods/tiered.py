"""Tier-accounted state for a method: owned buffers and segments, released together.

Every buffer a method holds (KV, per-token metadata, staging buffers) is allocated through
a store tier, either as a :class:`hybridgen.kv.KVSegment` or as a :class:`TierBuffer`, and
registered with :meth:`TieredMethod.own` so :meth:`TieredMethod.release` frees it and
:func:`held_bytes_by_tier` can check the store's ledger against what is really held.

The tensor helpers methods share (gathers, group reductions, one-softmax attention) are in
:mod:`hybridgen.methods.tensors`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from hybridgen.kv import KVSegment
from hybridgen.kv.tiers import Tier
from hybridgen.methods.protocol import KVMethod, MethodContext


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
class TieredMethod(KVMethod):
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
