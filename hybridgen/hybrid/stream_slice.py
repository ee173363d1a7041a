"""HybridGen's three-way split: the oldest host tokens of a layer streamed to the GPU, a layer ahead.

In three-way mode the host tokens [0, n) of a layer (its oldest, n chosen by the scheduler,
:mod:`hybridgen.hybrid.scheduler`) are copied to the GPU and attended densely there with exact
logits, while the CPU scans only the rest. The copy of layer l + 1 starts at
``on_layer_input(l)`` (:meth:`StreamSlices.start`), so it runs on the copy stream under layer
l's compute; ``decode(l + 1)`` only waits for it (:meth:`StreamSlices.get`).

- Source: host segments are append-only, so a prefix of one never changes. When the host tier
  is page-locked the copy reads it in place; otherwise the prefix is mirrored into a per-layer
  pinned buffer, grown incrementally (only tokens new to the prefix are copied), so every copy
  to the GPU is from pinned memory (a pageable source would make the copy synchronous).
- Destination: two device slots (k, v [B, Hkv, cap, D], mask [B, Hkv, cap]) shared by all
  layers (layer l uses slot l % 2, FlexGen's double buffer); the copy stream waits on the
  compute stream before writing (:class:`hybridgen.kv.transfer.HostToDevice`), so layer l + 2
  never overwrites a slot layer l still reads. Slots are allocated on the store's gpu tier
  (counted in its ledger): reserved at their largest size up front (:meth:`StreamSlices.reserve`),
  else grown geometrically; :meth:`release` returns them.
- Timing: the copy's seconds per layer (CUDA timing events on the copy stream, read at the
  step's end; ``perf_counter`` around the plain copy without CUDA) feed the scheduler's
  stream-fraction rule.

Without CUDA the copy is a plain ``copy_`` into the slots: identical results, no overlap.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.kv import KVSegment
from hybridgen.kv.tiers import Tier
from hybridgen.kv.transfer import HostToDevice

GROWTH = 1.5


class StreamSlices:
    """Double-buffered device slots and pinned mirrors for the streamed host prefixes.

    stager: the method's host -> device copier (its copy stream); gpu_tier: where the slots
    are allocated; owner: ledger name prefix.
    """

    def __init__(self, stager: HostToDevice, gpu_tier: Tier, owner: str = "shared/stream"):
        self.stager = stager
        self.gpu_tier = gpu_tier
        self.owner = owner
        self._slots: List[Dict[str, Tensor]] = [{}, {}]
        self._mirror: Dict[int, Dict[str, Any]] = {}
        self._started: Dict[int, Tuple[int, Any, Any, float]] = {}  # layer -> (n, start mark, end mark, sync s)
        self.copy_marks: List[Tuple[int, Any, Any]] = []   # (layer, start event, end event), CUDA only
        self.copy_s: Dict[int, float] = {}                 # layer -> seconds (sync path)

    # ------------------------------------------------------------------ storage
    def reserve(self, slots: int, batch: int, heads: int, head_dim: int, dtype: torch.dtype, tokens: int,
                with_mask: bool) -> None:
        """Allocate ``slots`` (1 or 2: layers use slot l % 2) device slots of ``tokens`` tokens
        up front, so a run's peak is known before it starts (:mod:`hybridgen.hybrid.memory`)."""
        for i in range(slots):
            self._allocate(i, batch, heads, head_dim, dtype, tokens, with_mask)

    def _allocate(self, i: int, B: int, H: int, D: int, dtype: torch.dtype, cap: int, with_mask: bool) -> None:
        slot = self._slots[i]
        self._free_slot(slot)
        name = f"{self.owner}{i}"
        slot["k"] = self.gpu_tier.allocate((B, H, cap, D), dtype, f"{name}/k")
        slot["v"] = self.gpu_tier.allocate((B, H, cap, D), dtype, f"{name}/v")
        if with_mask:
            slot["mask"] = self.gpu_tier.allocate((B, H, cap), torch.bool, f"{name}/mask")
        slot["cap"] = cap

    def _slot(self, layer: int, host: KVSegment, n: int) -> Dict[str, Tensor]:
        slot = self._slots[layer % 2]
        if "k" not in slot or slot["k"].shape[2] < n or slot["k"].shape[:2] != host.k.shape[:2]:
            B, H, _, D = host.k.shape  # not reserved, or too small: grow geometrically
            cap = max(n, int(GROWTH * (slot.get("cap", 0) or n)))
            self._allocate(layer % 2, B, H, D, host.k.dtype, cap, host.mask is not None)
        return slot

    def _free_slot(self, slot: Dict[str, Tensor]) -> None:
        for key in ("k", "v", "mask"):
            t = slot.pop(key, None)
            if t is not None:
                self.gpu_tier.release(t)

    def _source(self, layer: int, host: KVSegment, n: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """Pinned (k, v, mask) views of the host prefix [0, n) (the host buffers when pinned)."""
        mask = host.mask
        if not self.stager.async_mode or host.k.is_pinned():
            return host.k[:, :, :n], host.v[:, :, :n], None if mask is None else mask[:, :, :n]
        m = self._mirror.get(layer)
        if m is None or m["k"].shape[2] < n:
            B, H, _, D = host.k.shape
            cap = max(n, int(GROWTH * (m["k"].shape[2] if m else n)))
            new = {"k": torch.empty((B, H, cap, D), dtype=host.k.dtype, pin_memory=True),
                   "v": torch.empty((B, H, cap, D), dtype=host.v.dtype, pin_memory=True),
                   "mask": torch.empty((B, H, cap), dtype=torch.bool, pin_memory=True) if mask is not None else None,
                   "len": 0}
            if m is not None and m["len"]:
                self.stager.reuse(("stream_src", layer))  # the old mirror's last copy has finished
                old = m["len"]
                for part in ("k", "v", "mask"):
                    if new[part] is not None:
                        new[part][:, :, :old].copy_(m[part][:, :, :old])
                new["len"] = old
            m = self._mirror[layer] = new
        have = m["len"]
        if n > have:
            self.stager.reuse(("stream_src", layer))
            m["k"][:, :, have:n].copy_(host.k[:, :, have:n])
            m["v"][:, :, have:n].copy_(host.v[:, :, have:n])
            if m["mask"] is not None:
                m["mask"][:, :, have:n].copy_(mask[:, :, have:n])
            m["len"] = n
        return m["k"][:, :, :n], m["v"][:, :, :n], None if m["mask"] is None else m["mask"][:, :, :n]

    # ------------------------------------------------------------------ copies
    def pending(self, layer: int) -> bool:
        return layer in self._started

    def start(self, layer: int, host: KVSegment, n: int) -> int:
        """Enqueue the copy of ``layer``'s host prefix [0, n) into its slot. Returns the bytes."""
        if n <= 0 or layer in self._started:
            return 0
        slot = self._slot(layer, host, n)
        k, v, mask = self._source(layer, host, n)
        pairs = [(slot["k"][:, :, :n], k), (slot["v"][:, :, :n], v)]
        if mask is not None:
            pairs.append((slot["mask"][:, :, :n], mask))
        if self.stager.async_mode:
            # wait for the compute stream first, so the timed interval is the copy alone
            self.stager.stream.wait_stream(torch.cuda.current_stream(self.stager.device))
            s0 = torch.cuda.Event(enable_timing=True)
            s0.record(self.stager.stream)
            nbytes = self.stager.start(("stream", layer), pairs, buffer=("stream_src", layer))
            s1 = torch.cuda.Event(enable_timing=True)
            s1.record(self.stager.stream)
            self._started[layer] = (n, s0, s1, 0.0)
        else:
            t0 = time.perf_counter()
            nbytes = self.stager.start(("stream", layer), pairs)
            self._started[layer] = (n, None, None, time.perf_counter() - t0)
        return nbytes

    def get(self, layer: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
        """(k, v, mask) of ``layer``'s streamed prefix on the device, after its copy landed."""
        n, s0, s1, sync_s = self._started.pop(layer)
        self.stager.wait(("stream", layer))
        if s0 is not None:
            self.copy_marks.append((layer, s0, s1))
        else:
            self.copy_s[layer] = self.copy_s.get(layer, 0.0) + sync_s
        slot = self._slots[layer % 2]
        return slot["k"][:, :, :n], slot["v"][:, :, :n], slot["mask"][:, :, :n] if "mask" in slot else None

    def drop_pending(self) -> None:
        """Consume copies started for layers that were not decoded (e.g. an aborted step)."""
        for layer in list(self._started):
            self.get(layer)

    def take_copy_seconds(self, num_layers: int) -> List[float]:
        """Copy seconds per layer since the last call (reads the CUDA timing events back)."""
        out = [0.0] * num_layers
        for layer, s0, s1 in self.copy_marks:
            s1.synchronize()
            out[layer] += s0.elapsed_time(s1) / 1e3
        for layer, s in self.copy_s.items():
            out[layer] += s
        self.copy_marks, self.copy_s = [], {}
        return out

    def release(self) -> None:
        """Wait for every copy, free the slots and the mirrors."""
        self.drop_pending()
        self.stager.drain()
        for slot in self._slots:
            self._free_slot(slot)
            slot.pop("cap", None)
        self._mirror = {}
