"""The scorer base of evicting methods: a method is a ``score`` (or its own selection) + a budget.

What H2O, SnapKV, StreamingLLM, Quest and their kin share lives here, once:

- the layout: a method lists, per layer, the buffers it keeps (:class:`Part`: KV segments
  and per-token metadata with their capacities, :meth:`EvictingMethod.parts`); the SAME list
  sizes the allocations at prefill (:meth:`~EvictingMethod.kv_segment`,
  :meth:`~EvictingMethod.meta_buffer`), states the footprint (:meth:`~EvictingMethod.footprint`,
  exact bytes per tier), places the method under a GPU budget (``placement_for`` =
  :func:`hybridgen.methods.footprint.fit_first` over resident, streamed, on the CPU) and gives
  the projected cost its ``gpu_tokens`` / ``staging_tokens``;
- the kept set at prefill: the recent window + the top scores among the older tokens
  (:func:`keep_recent_and_top`), padded tokens scoring -inf;
- decode-time eviction in place (:meth:`EvictingMethod.overwrite`: the new token takes a
  victim's slot per head), ratio budgets growing with the context (``budget.resolve(tokens so
  far)``), capacity reserved for the largest budget;
- the one-softmax attention over [cache ; new token] (:func:`attend_with_new`);
- where the kept KV lives: every access goes through ``self.kept`` (a
  :class:`~hybridgen.methods.kept_kv.KeptKVOffload`), resident on ``tier``; the
  :class:`~hybridgen.methods.offloaded.Offloaded` wrapper moves it to the host. The
  ``offload`` / ``host_tier`` parameters select the wrapper from a config
  (``build_method('h2o', offload='stream')`` returns ``Offloaded(H2O(...), 'stream', 'dram')``).

Footprint units: ``gpu_tokens`` / ``host_tokens`` are token-equivalents per row and layer
(bytes / (layers x batch x (K+V + mask bytes of a token))), metadata included, so the
performance model's memory is the footprint's; ``staging_tokens`` are the staging slots'
tokens per row. Masks are counted (a left-padded batch allocates them).

Shapes: scores [B, Hkv, T]; valid [B, T] bool; kept indices [B, Hkv, n]; q [B, Hq, 1, D].
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, FrozenSet, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment
from hybridgen.methods.budget import Budget
from hybridgen.methods.footprint import Footprint, KVShape, add_bytes, fit_first
from hybridgen.methods.kept_kv import KeptKVOffload, Offload, check_offload
from hybridgen.methods.params import HostTier, KeptBudget, Tier
from hybridgen.methods.protocol import MethodContext
from hybridgen.methods.tensors import NEG_INF
from hybridgen.methods.tiered import TierBuffer, TieredMethod


def recent_count(budget_tokens: int, recent_fraction: float) -> int:
    """Tokens of a budget reserved for the recent window (rounded to the nearest token)."""
    return max(0, min(budget_tokens, int(round(budget_tokens * recent_fraction))))


def keep_recent_and_top(scores: Tensor, valid: Optional[Tensor], keep: int, recent: int) -> Tensor:
    """Indices [B, Hkv, keep] (sorted) of the last ``recent`` tokens + the top-(keep - recent)
    ``scores`` [B, Hkv, T] among the older ones (padded tokens, valid [B, T] False, score -inf);
    everything when keep >= T."""
    B, H, T = scores.shape
    if keep >= T:
        return torch.arange(T, device=scores.device).expand(B, H, T)
    s = scores.float()
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :], NEG_INF)
    old = T - recent
    parts = [torch.arange(old, T, device=scores.device).expand(B, H, recent)]
    if keep > recent:
        parts.insert(0, torch.topk(s[..., :old], keep - recent, dim=-1).indices)
    return torch.cat(parts, dim=-1).sort(dim=-1).values


@dataclass(frozen=True)
class Part:
    """One per-layer buffer of an evicting method, ``slots`` slots per row.

    kind 'kv': a KV segment [B, Hkv, slots, D] + mask (the kept KV; moved to the host by
    :class:`~hybridgen.methods.offloaded.Offloaded`, staged when streamed); kind 'meta': per-slot
    metadata staying with the compute, ``elem_bytes`` per slot (per KV head when ``per_head``),
    or KV-shaped (``kv_shaped``: a segment of the KV's shape, e.g. page bounds)."""

    name: str
    slots: int
    kind: Literal["kv", "meta"] = "kv"
    elem_bytes: int = 0
    per_head: bool = True
    kv_shaped: bool = False

    def nbytes(self, shape: KVShape) -> int:
        """Bytes of this part in one layer of ``shape`` (masks included)."""
        if self.kind == "kv" or self.kv_shaped:
            return shape.batch * self.slots * (shape.token_bytes + shape.mask_bytes)
        return shape.batch * self.slots * self.elem_bytes * (shape.kv_heads if self.per_head else 1)


def layout_footprint(layers: Sequence[Sequence[Part]], shape: KVShape, mode: str, tier: str,
                     host_tier: str) -> Footprint:
    """The footprint of a per-layer layout placed in ``mode`` ('none': everything on ``tier``;
    'stream': KV on ``host_tier``, metadata + two staging slots (each part's largest capacity,
    at least 1) on the gpu; 'cpu': everything on ``host_tier``)."""
    kv = sum(p.nbytes(shape) for ps in layers for p in ps if p.kind == "kv")
    meta = sum(p.nbytes(shape) for ps in layers for p in ps if p.kind == "meta")
    staging = 0
    if mode == "stream":
        caps: Dict[str, int] = {}
        for ps in layers:
            for p in ps:
                if p.kind == "kv":
                    caps[p.name] = max(caps.get(p.name, 1), p.slots)
        staging = 2 * sum(caps.values())
    per_token = shape.layers * shape.batch * (shape.token_bytes + shape.mask_bytes)
    stage_bytes = staging * shape.batch * (shape.token_bytes + shape.mask_bytes)
    if mode == "none":
        by_tier = {tier: kv + meta}
    elif mode == "stream":
        by_tier = add_bytes({host_tier: kv}, {"gpu": meta + stage_bytes})
    else:
        by_tier = {host_tier: kv + meta}
    by_tier = add_bytes(by_tier)
    gpu = by_tier.get("gpu", 0) - stage_bytes
    return Footprint(gpu_tokens=gpu / per_token, host_tokens=sum(n for t, n in by_tier.items() if t != "gpu") / per_token,
                     staging_tokens=float(staging), tier_bytes=by_tier)


@dataclass
class EvictingMethod(TieredMethod):
    """Base of the evicting methods (module doc). A subclass states :meth:`parts`, allocates
    through :meth:`kv_segment` / :meth:`meta_buffer`, reaches its KV through ``self.kept`` and
    prices its GPU-resident step in :meth:`resident_cost`.

    budget: kept tokens (ratio of the context, or tokens). tier: where the cache lives.
    offload: 'none' | 'stream' | 'cpu' builds the Offloaded wrapper; host_tier: its host tier.
    """

    name: ClassVar[str] = "evicting"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"tier", "offload", "host_tier"})
    budget: KeptBudget = Budget(ratio=0.2)
    tier: Tier = "gpu"
    offload: Offload = "none"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        check_offload(self.name, self.tier, self.offload)

    def composed(self):
        """The method to run: itself, or wrapped in Offloaded when ``offload`` is set."""
        if self.offload == "none":
            return self
        from hybridgen.methods.offloaded import Offloaded

        return Offloaded(dataclasses.replace(self, offload="none"), self.offload, self.host_tier)

    # -- the layout: stated once --------------------------------------------------------
    def parts(self, layer: int, prompt_len: int, max_len: int, num_layers: int) -> List[Part]:
        """The buffers ``layer`` keeps for a prompt of ``prompt_len`` and ``max_len`` tokens in all."""
        raise NotImplementedError

    def layout(self, shape: KVShape) -> List[List[Part]]:
        """:meth:`parts` of every layer of ``shape``."""
        return [self.parts(l, shape.prompt, shape.context, shape.layers) for l in range(shape.layers)]

    def footprint(self, shape: KVShape) -> Footprint:
        """Exact bytes per tier of the layout in this method's ``offload`` mode."""
        return layout_footprint(self.layout(shape), shape, self.offload, self.tier, self.host_tier)

    def placement_for(self, gpu_kv_bytes: int, shape: KVShape) -> Dict[str, Any]:
        """Resident when the footprint fits, else streamed, else the step on the CPU."""
        modes = ("none", "stream", "cpu") if self.tier == "gpu" else ("none",)
        return fit_first(self, gpu_kv_bytes, shape, [{"offload": m} for m in modes], "its kept KV")

    # -- lifecycle helpers -----------------------------------------------------------------
    def bind(self, ctx: MethodContext) -> None:
        if self.offload != "none":
            raise ConfigError(f"method {self.name!r}: offload={self.offload!r} runs in the Offloaded wrapper; "
                              f"build it with build_method({self.name!r}, offload={self.offload!r})")
        super().bind(ctx)
        self.kept = KeptKVOffload(self, "none", self.tier, "dram")
        self._layout = [{p.name: p for p in self.parts(l, ctx.prompt_len, ctx.max_len, ctx.num_layers)}
                        for l in range(ctx.num_layers)]

    def kv_segment(self, layer: int, name: str, with_mask: bool) -> KVSegment:
        """The kept-KV segment ``name`` of ``layer`` (capacity from :meth:`parts`), tracked."""
        seg = self.segment(self.kept.kv_tier, f"layer{layer}/{name}", self._layout[layer][name].slots, with_mask)
        return self.kept.track(layer, name, seg)

    def segments(self, name: str) -> List[Optional[KVSegment]]:
        """The kept-KV segment ``name`` of every layer (None where not allocated)."""
        return [parts.get(name) for parts in self.kept.parts]

    def meta_segment(self, layer: int, name: str, with_mask: bool) -> KVSegment:
        """A KV-shaped metadata segment (e.g. page bounds) on the metadata tier."""
        return self.segment(self.kept.meta_tier, f"layer{layer}/{name}", self._layout[layer][name].slots, with_mask)

    def meta_buffer(self, layer: int, name: str, dtype: torch.dtype) -> TierBuffer:
        """Metadata [B, Hkv, slots] (or [B, slots]) of ``dtype`` on the metadata tier."""
        p, ctx = self._layout[layer][name], self.ctx
        shape = (ctx.batch_size, ctx.num_kv_heads, p.slots) if p.per_head else (ctx.batch_size, p.slots)
        return self.buffer(self.kept.meta_tier, f"layer{layer}/{name}", shape, dtype)

    def store(self, seg: KVSegment, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> None:
        """Append k, v [B, Hkv, n, D] (mask [B, Hkv, n]) to a kept segment, where it lives."""
        seg.append(*self.kept.put(seg, k, v, mask))

    def overwrite(self, seg: KVSegment, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Evict in place: the new token k, v [B, Hkv, 1, D] takes slot [B, Hkv] of ``seg``."""
        slot, k, v = self.kept.put(seg, slot, k, v)
        idx = slot[..., None, None].expand(-1, -1, 1, k.shape[-1])
        seg.k.scatter_(2, idx, k.to(seg.k.dtype))
        seg.v.scatter_(2, idx, v.to(seg.v.dtype))
        if seg.mask is not None:
            seg.mask.scatter_(2, slot[..., None], True)

    def release(self) -> None:
        if getattr(self, "kept", None) is not None:
            self.kept.release()
        super().release()

    # -- performance model -----------------------------------------------------------------
    def resident_cost(self, c: Any) -> Any:
        """PROJECTED GPU-resident layer cost (a ``LayerCost``; times only)."""
        raise NotImplementedError

    def offload_traffic(self, c: Any, resident: Any) -> Tuple[float, float, float]:
        """(tokens streamed per row, tokens the host reads per row, other host bytes) of one
        offloaded layer-step: by default the kept tokens, twice, nothing else."""
        n = resident.breakdown["kept_tokens"]
        return n, n, 0.0

    def mode_cost(self, c: Any, resident: Any) -> Any:
        """``resident`` priced in this method's ``offload`` mode (``offloaded_kept_cost``)."""
        if self.offload == "none":
            return resident
        from hybridgen.perf.costs import offloaded_kept_cost

        streamed, read, extra = self.offload_traffic(c, resident)
        return offloaded_kept_cost(c, resident, streamed, read, self.offload, self.host_tier, host_extra_bytes=extra)

    def step_cost(self, c: Any) -> Any:
        """The layer's times in this method's mode (PyramidKV averages its layers here)."""
        return self.mode_cost(c, self.resident_cost(c))

    def layer_cost(self, c: Any) -> Any:
        """PROJECTED layer cost: :meth:`step_cost`'s times, gpu/staging tokens from the footprint."""
        fp = self.footprint(c.kv_shape())
        return dataclasses.replace(self.step_cost(c), gpu_tokens=fp.gpu_tokens, staging_tokens=fp.staging_tokens)
