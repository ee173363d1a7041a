"""Preallocated append-only K/V storage for one layer on one (or two) tiers.

A segment owns buffers k, v: [B, Hkv, capacity, D] (and optionally a validity mask
[B, Hkv, capacity] for left-padded batches). Appends write into free slots; when full the
capacity grows geometrically (amortised O(1) per token; never a torch.cat of the whole cache
per step). Keys and values may live on different tiers (semantic-aware mapping).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from hybridgen.kv.tiers import Tier

GROWTH = 1.5
MIN_CAPACITY = 16


class KVSegment:
    """K/V of one layer on a tier: the views ``k``/``v`` are [B, Hkv, length, D].

    key_tier holds keys (and the mask), value_tier values (defaults to key_tier).
    owner names the allocations in the tier ledger, e.g. 'layer3/host'.
    """

    def __init__(self, key_tier: Tier, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 owner: str, capacity: int = 0, value_tier: Optional[Tier] = None, with_mask: bool = False):
        self.key_tier = key_tier
        self.value_tier = value_tier or key_tier
        self.shape = (batch, kv_heads, head_dim)
        self.dtype = dtype
        self.owner = owner
        self.with_mask = with_mask
        self.length = 0
        self.capacity = 0
        self._k = self._v = self._mask = None
        self._alloc(max(capacity, 0))

    # ----------------------------------------------------------------- storage
    def _alloc(self, capacity: int) -> None:
        B, H, D = self.shape
        k = self.key_tier.allocate((B, H, capacity, D), self.dtype, f"{self.owner}/k")
        v = None
        try:
            v = self.value_tier.allocate((B, H, capacity, D), self.dtype, f"{self.owner}/v")
            m = self.key_tier.allocate((B, H, capacity), torch.bool, f"{self.owner}/mask") if self.with_mask else None
        except BaseException:  # e.g. CapacityError on V: return K (and V) to the ledger
            self.key_tier.release(k)
            if v is not None:
                self.value_tier.release(v)
            raise
        n = self.length
        if n:
            k[:, :, :n].copy_(self._k[:, :, :n])
            v[:, :, :n].copy_(self._v[:, :, :n])
            if m is not None:
                m[:, :, :n].copy_(self._mask[:, :, :n])
        self._free()
        self._k, self._v, self._mask, self.capacity = k, v, m, capacity

    def _free(self) -> None:
        if self._k is not None:
            self.key_tier.release(self._k)
            self.value_tier.release(self._v)
            if self._mask is not None:
                self.key_tier.release(self._mask)
        self._k = self._v = self._mask = None

    def reserve(self, total: int) -> None:
        """Make room for ``total`` tokens, growing geometrically."""
        if total > self.capacity:
            self._alloc(max(total, int(self.capacity * GROWTH), MIN_CAPACITY))

    def release(self) -> None:
        """Free all memory of this segment."""
        self._free()
        self.length = self.capacity = 0

    # ----------------------------------------------------------------- views
    @property
    def device(self) -> torch.device:
        return self.key_tier.device

    @property
    def k(self) -> Tensor:
        return self._k[:, :, : self.length]

    @property
    def v(self) -> Tensor:
        return self._v[:, :, : self.length]

    @property
    def mask(self) -> Optional[Tensor]:
        """[B, Hkv, length] bool (True = real token) or None when every token is real."""
        return None if self._mask is None else self._mask[:, :, : self.length]

    @property
    def nbytes(self) -> int:
        """Bytes allocated (capacity, not length) across K, V and mask."""
        total = 0
        for t in (self._k, self._v, self._mask):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    # ----------------------------------------------------------------- updates
    def append(self, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        """Append tokens. k, v: [B, Hkv, n, D]; mask: [B, Hkv, n] or [B, n] bool, or None (all real)."""
        n = k.shape[2]
        if n == 0:
            return
        self.reserve(self.length + n)
        s = slice(self.length, self.length + n)
        self._k[:, :, s].copy_(k, non_blocking=True)
        self._v[:, :, s].copy_(v, non_blocking=True)
        if self._mask is not None:
            if mask is None:
                self._mask[:, :, s] = True
            else:
                self._mask[:, :, s].copy_(mask if mask.dim() == 3 else mask[:, None, :].expand(-1, self.shape[1], -1))
        self.length += n

    def write(self, slot: int, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        """Overwrite the tokens at [slot, slot + n) (ring-buffer use). k, v: [B, Hkv, n, D]."""
        n = k.shape[2]
        s = slice(slot, slot + n)
        self._k[:, :, s].copy_(k, non_blocking=True)
        self._v[:, :, s].copy_(v, non_blocking=True)
        if self._mask is not None:
            self._mask[:, :, s] = True if mask is None else (mask if mask.dim() == 3 else mask[:, None, :])

    def keep(self, index: Tensor, capacity: int = 0) -> None:
        """Keep only the tokens at ``index`` [B, Hkv, n] (per head), compacted to the front.

        The surplus capacity is returned: eviction frees memory for real (capacity: keep room
        for that many tokens instead, when more than n).
        """
        n = index.shape[-1]
        D = self.shape[2]
        idx = index.to(self._k.device)
        idx_v = index.to(self._v.device)
        k = torch.gather(self.k, 2, idx[..., None].expand(-1, -1, -1, D))
        v = torch.gather(self.v, 2, idx_v[..., None].expand(-1, -1, -1, D))  # on the value tier
        m = torch.gather(self.mask, 2, idx) if self._mask is not None else None
        self._free()
        self.length = 0
        self._alloc(max(n, capacity))
        self.append(k, v, m)

    def pop_front(self, n: int) -> tuple:
        """Remove the n oldest tokens and return them as (k, v, mask) copies."""
        n = min(n, self.length)
        k = self._k[:, :, :n].clone()
        v = self._v[:, :, :n].clone()
        m = self._mask[:, :, :n].clone() if self._mask is not None else None
        rest = self.length - n
        if rest:
            self._k[:, :, :rest].copy_(self._k[:, :, n:self.length].clone())
            self._v[:, :, :rest].copy_(self._v[:, :, n:self.length].clone())
            if self._mask is not None:
                self._mask[:, :, :rest].copy_(self._mask[:, :, n:self.length].clone())
        self.length = rest
        return k, v, m


def split_prompt(gpu: KVSegment, host: KVSegment, k: Tensor, v: Tensor, valid: Optional[Tensor], sinks: int,
                 host_end: int) -> int:
    """Place a prompt's KV (k, v: [B, Hkv, T, D]; valid: [B, T] bool or None) across two segments:
    tokens [0, sinks) and [host_end, T) to ``gpu`` (sinks, then the recent window), tokens
    [sinks, host_end) to ``host``. Returns the bytes written to ``host`` (K and V)."""
    T = k.shape[2]

    def m(a: int, b: int) -> Optional[Tensor]:
        return None if valid is None else valid[:, a:b]

    gpu.append(k[:, :, :sinks], v[:, :, :sinks], m(0, sinks))
    gpu.append(k[:, :, host_end:], v[:, :, host_end:], m(host_end, T))
    host.append(k[:, :, sinks:host_end], v[:, :, sinks:host_end], m(sinks, host_end))
    B, H, _, D = k.shape
    return 2 * (host_end - sinks) * B * H * D * k.element_size()
