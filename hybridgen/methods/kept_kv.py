"""Where an evicting method's kept KV lives and how a decode step reaches it (one helper).

An evicting method (:class:`hybridgen.methods.evicting.EvictingMethod`) decides WHICH tokens it
keeps and goes through a :class:`KeptKVOffload` for every KV part it keeps (``track``, ``put``,
``append``, ``view``); the :class:`hybridgen.methods.offloaded.Offloaded` wrapper decides WHERE
they live by giving the method a helper in another mode:

- ``'none'``: the kept KV on the method's ``tier`` (the gpu tier by default), as in the papers;
- ``'stream'``: the kept KV segments on ``host_tier``; at each decode step a layer's segments
  are copied into a double-buffered gpu-tier staging slot through
  :class:`hybridgen.kv.transfer.HostToDevice`, started at ``on_layer_input(l - 1)`` so the copy
  overlaps layer l - 1 (FlexGen's schedule, as InfiniGen's artifact runs H2O on FlexGen). The
  method attends over the staged copy with its own code; its cache updates (appends, eviction
  overwrites) go to the host segments. Small per-token metadata (scores, positions, page
  bounds) stays on the gpu tier;
- ``'cpu'``: the kept KV and the metadata on ``host_tier``; the layer's whole decode step runs
  on the CPU attention pool next to the host KV (q, k, v go down, the output comes up), as
  FlexGen's ``cpu_cache_compute``.

The staged copy is bit-for-bit the host KV, and 'cpu' runs the same code on the same values,
so every mode returns the GPU-resident method's outputs (tested in tests/test_offload.py).

Choices: the new token is written to the host with a blocking ``.to(host)`` (the compute stream
is synchronised, so no staged copy of that layer is still in flight); without the engine's
hooks (method-level use) each copy happens in ``decode`` (correct, not overlapped); the two
staging slots hold, per part, its largest capacity over the layers (at least one slot).
stats: 'bytes_h2d' staged bytes (+ the output in 'cpu' mode), 'bytes_d2h' KV written to the
host (+ q, k, v in 'cpu' mode), 'prefetched_ahead' copies started one layer ahead.

Shapes: staged k, v [B, Hkv, n, D]; mask [B, Hkv, n] bool or None.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Literal, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention.cpu_pool import default_pool
from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment
from hybridgen.kv.transfer import HostToDevice

Offload = Literal["none", "stream", "cpu"]
View = Tuple[Tensor, Tensor, Optional[Tensor]]


def check_offload(method: str, tier: str, offload: str) -> None:
    """One-line refusal of a ``tier`` other than 'gpu' together with an offloaded mode."""
    if offload != "none" and tier != "gpu":
        raise ConfigError(f"method {method!r}: offload={offload!r} keeps the KV on 'host_tier'; "
                          f"leave 'tier' at 'gpu' (got {tier!r})")


class KeptKVOffload:
    """Where an evicting method's kept KV lives and how a decode step reaches it (module doc).

    method: the bound TieredMethod (its stats, buffers and context are used); mode: 'none' |
    'stream' | 'cpu'; tier: the method's own tier ('none' mode); host_tier: 'dram' | 'cxl'.
    """

    def __init__(self, method: Any, mode: str, tier: str, host_tier: str):
        self.m, self.mode = method, mode
        ctx = method.ctx
        self.kv_tier = tier if mode == "none" else host_tier
        self.meta_tier = host_tier if mode == "cpu" else tier
        L = ctx.num_layers
        self.parts: List[Dict[str, KVSegment]] = [dict() for _ in range(L)]
        self.staged_len: List[Dict[str, int]] = [dict() for _ in range(L)]
        self.new: List[Dict[str, Tuple[Tensor, Tensor]]] = [dict() for _ in range(L)]
        self._on_host = False  # inside a 'cpu' step: q, k, v already came down (counted)
        self.fetched_at = [-1] * L  # decode step whose copy of the layer was started
        self.slots: Optional[List[Dict[str, Dict[str, Tensor]]]] = None
        self.xfer = HostToDevice(ctx.compute_device) if mode == "stream" else None
        self.pool = (ctx.pool or default_pool()) if mode == "cpu" else None
        self.device = ctx.compute_device

    @property
    def meta_device(self) -> torch.device:
        return self.m.ctx.store[self.meta_tier].device

    # ------------------------------------------------------------------ registration
    def track(self, layer: int, name: str, seg: KVSegment) -> KVSegment:
        """Declare ``seg`` (on kv_tier) as part ``name`` of ``layer``'s kept KV. Returns seg."""
        self.parts[layer][name] = seg
        return seg

    def put(self, seg: KVSegment, *ts: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        """``ts`` moved to ``seg``'s device (blocking); in an offloaded mode their bytes count
        as written to the host ('bytes_d2h'), also where the gpu tier is emulated on the CPU."""
        out = []
        for t in ts:
            if t is not None:
                if self.mode != "none" and not self._on_host and seg.key_tier.name != "gpu":
                    self.m.count("bytes_d2h", t.numel() * t.element_size())
                t = t.to(seg.device)
            out.append(t)
        return tuple(out)

    def append(self, layer: int, name: str, k: Tensor, v: Tensor) -> None:
        """Append the new token (k, v [B, Hkv, 1, D]) to part ``name``; in 'stream' mode the
        layer's staged copy (started before the append) gets it too, on the compute device."""
        seg = self.parts[layer][name]
        if self.mode == "stream":
            self._start(layer)
            self.new[layer][name] = (k, v)
        seg.append(*self.put(seg, k, v))

    # ------------------------------------------------------------------ streaming
    def _alloc_slots(self) -> None:
        """Two gpu-tier slots, each holding one layer's parts at their largest capacity."""
        ctx = self.m.ctx
        caps: Dict[str, Tuple[int, bool]] = {}
        for parts in self.parts:
            for name, seg in parts.items():
                cap, mask = caps.get(name, (0, False))
                caps[name] = (max(cap, seg.capacity), mask or seg.mask is not None)
        B, H, D = ctx.batch_size, ctx.num_kv_heads, ctx.head_dim
        self.slots = []
        for i in range(2):
            slot = {}
            for name, (cap, mask) in caps.items():
                cap = max(cap, 1)
                bufs = {p: self.m.buffer("gpu", f"shared/stage{i}/{name}_{p}", (B, H, cap, D), ctx.dtype).t
                        for p in ("k", "v")}
                if mask:
                    bufs["mask"] = self.m.buffer("gpu", f"shared/stage{i}/{name}_mask", (B, H, cap), torch.bool).t
                slot[name] = bufs
            self.slots.append(slot)

    def _start(self, layer: int) -> None:
        """Enqueue the copy of ``layer``'s parts into slot layer % 2 (no-op when in flight)."""
        step = int(self.m.stats.get("steps", 0))
        if self.mode != "stream" or layer >= len(self.parts) or self.fetched_at[layer] == step:
            return
        self.fetched_at[layer] = step
        if self.slots is None:
            self._alloc_slots()
        slot, pairs = self.slots[layer % 2], []
        for name, seg in self.parts[layer].items():
            n = seg.length
            self.staged_len[layer][name] = n
            if n == 0:
                continue
            bufs = slot[name]
            pairs += [(bufs["k"][:, :, :n], seg.k), (bufs["v"][:, :, :n], seg.v)]
            if seg.mask is not None:
                pairs.append((bufs["mask"][:, :, :n], seg.mask))
        self.m.count("bytes_h2d", self.xfer.start(layer, pairs))

    def on_layer_input(self, layer: int) -> None:
        """Engine hook: make sure ``layer``'s copy runs and start ``layer + 1``'s (prefetch)."""
        if self.mode != "stream":
            return
        self._start(layer)
        step = int(self.m.stats.get("steps", 0))
        if layer + 1 < len(self.parts) and self.fetched_at[layer + 1] != step:
            self._start(layer + 1)
            self.m.count("prefetched_ahead", 1)

    def view(self, layer: int, name: str) -> View:
        """(k, v, mask) of part ``name`` on the compute device: the segment itself ('none',
        'cpu') or its staged copy ('stream', with a token added by :meth:`append`)."""
        seg = self.parts[layer][name]
        if self.mode != "stream":
            return seg.k, seg.v, seg.mask
        self._start(layer)
        self.xfer.wait(layer)
        n = self.staged_len[layer][name]
        bufs = self.slots[layer % 2][name]
        new = self.new[layer].pop(name, None)
        if new is not None:
            bufs["k"][:, :, n:n + 1] = new[0]
            bufs["v"][:, :, n:n + 1] = new[1]
            if "mask" in bufs:
                bufs["mask"][:, :, n] = True
            n += 1
            self.staged_len[layer][name] = n
        mask = bufs["mask"][:, :, :n] if "mask" in bufs and seg.mask is not None else None
        return bufs["k"][:, :, :n], bufs["v"][:, :, :n], mask

    # ------------------------------------------------------------------ CPU attention
    def on_host(self, fn: Callable[..., Tensor], layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """'cpu' mode: ``fn(layer, q, k, v)`` on the CPU pool over host copies; out on q's device."""
        host = self.m.ctx.store[self.kv_tier].device
        for t in (q, k, v):
            self.m.count("bytes_d2h", t.numel() * t.element_size())
        moved = [t.to(host) for t in (q, k, v)]
        self._on_host = True
        try:
            out = self.pool.submit(fn, layer, *moved).result()
        finally:
            self._on_host = False
        self.m.count("bytes_h2d", out.numel() * out.element_size())
        return out.to(q.device)

    def release(self) -> None:
        if self.xfer is not None:
            self.xfer.drain()
        self.parts = [dict() for _ in self.parts]
        self.slots = None
