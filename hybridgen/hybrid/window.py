"""HybridGen's GPU-resident part of one layer: attention sinks + a recent window kept as a ring.

The gpu segment holds ``sinks`` leading tokens (slots [0, sinks)) and up to ``window`` recent
tokens (slots [sinks, sinks + window)). While the window has room a new token is appended;
once full, the new token overwrites the window's oldest slot (``sinks + ring``) and the token
it evicts moves to the host segment, so the window always holds the newest ``window`` tokens
and the host every older one. With ``window == 0`` every new token goes straight to the host.
K/V are [B, Hkv, 1, D] per new token, as :class:`hybridgen.kv.KVSegment` takes them.

Decode uses two halves (fewer small ops per layer than attending the new token as a part of
its own): :meth:`place_new` appends the new token to the gpu segment BEFORE attention (one
spare slot past the window, so the segment is sized ``sinks + window + 1``), attention reads
the gpu segment with the new token in it, and :meth:`settle` then moves the window's oldest
token to the host and the new token into its slot. The host is untouched until
:meth:`settle`, so a CPU scan started before the layer sees a consistent host segment.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor

from hybridgen.kv import KVSegment


class RingWindow:
    """The ring of one layer's recent window on the gpu segment.

    sinks: tokens pinned at the front of the gpu segment; window: recent tokens after them.
    ring: the window slot (relative to ``sinks``) holding the oldest token once it is full.
    """

    def __init__(self, sinks: int, window: int):
        self.sinks = sinks
        self.window = window
        self.ring = 0

    def place(self, gpu: KVSegment, host: KVSegment, k: Tensor, v: Tensor) -> int:
        """Put the new token (k, v [B, Hkv, 1, D] on the gpu) in the window; the token it
        evicts (or the new one itself when ``window == 0``) moves to the host.

        Returns the bytes moved to the host (K + V of one token, or 0).
        """
        w = self.window
        if w == 0:
            host.append(k.to(host.device), v.to(host.device))
            return k.numel() * k.element_size() * 2
        if gpu.length < self.sinks + w:
            gpu.append(k, v)
            return 0
        slot = self.sinks + self.ring
        old_mask = gpu.mask[:, :, slot:slot + 1] if gpu.mask is not None else None
        host.append(gpu.k[:, :, slot:slot + 1], gpu.v[:, :, slot:slot + 1], old_mask)
        gpu.write(slot, k, v)
        self.ring = (self.ring + 1) % w
        return k.numel() * k.element_size() * 2

    def place_new(self, gpu: KVSegment, k: Tensor, v: Tensor) -> bool:
        """Before attention: append the new token (k, v [B, Hkv, 1, D]) to the gpu segment.
        False when ``window == 0`` (nothing placed: attend it separately, then :meth:`place`)."""
        if self.window == 0:
            return False
        gpu.append(k, v)
        return True

    def settle(self, gpu: KVSegment, host: KVSegment) -> int:
        """After attention (following :meth:`place_new`): when the window holds ``window + 1``
        tokens, its oldest moves to the host and the new token (last slot) takes its slot.

        Returns the bytes moved to the host (K + V of one token, or 0).
        """
        w, s = self.window, self.sinks
        if gpu.length - s <= w:
            return 0
        slot = s + self.ring
        old_mask = gpu.mask[:, :, slot:slot + 1] if gpu.mask is not None else None
        host.append(gpu.k[:, :, slot:slot + 1], gpu.v[:, :, slot:slot + 1], old_mask)
        last = gpu.length - 1
        gpu.write(slot, gpu.k[:, :, last:], gpu.v[:, :, last:])
        gpu.length = last
        self.ring = (self.ring + 1) % w
        return gpu.k[:, :, slot:slot + 1].numel() * gpu.k.element_size() * 2

    def order(self, gpu: KVSegment) -> List[int]:
        """The gpu slots of the window's tokens, oldest first."""
        s, w = self.sinks, self.window
        if gpu.length - s == w and w > 0:  # full ring: oldest token sits at slot s + ring
            return [s + (self.ring + j) % w for j in range(w)]
        return list(range(s, gpu.length))

    def resize(self, gpu: KVSegment, host: KVSegment, new_window: int) -> int:
        """Move the GPU/host split: the window becomes ``new_window`` tokens. Shrinking moves
        the oldest window tokens to the host; growing takes the next new tokens (no copy).

        Returns the bytes moved to the host.
        """
        s = self.sinks
        held = gpu.length - s
        order = self.order(gpu)
        drop = max(0, held - new_window)
        moved = 0
        if drop:
            old = torch.tensor(order[:drop], device=gpu.device)
            m = gpu.mask[:, :, old] if gpu.mask is not None else None
            host.append(gpu.k[:, :, old], gpu.v[:, :, old], m)
            moved = 2 * gpu.k[:, :, old].numel() * gpu.k.element_size()
        keep = list(range(s)) + order[drop:]
        B, H = gpu.shape[0], gpu.shape[1]
        # the segment keeps its capacity (sized for the largest window), at least the new
        # window + the spare slot of place_new
        gpu.keep(torch.tensor(keep, device=gpu.device).expand(B, H, len(keep)),
                 capacity=max(gpu.capacity, s + new_window + 1))
        self.window = new_window
        self.ring = 0
        return moved
