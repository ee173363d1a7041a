"""`hybrid-exact`: lossless CPU-GPU split attention merged by log-sum-exp.

The gpu tier holds the first ``sinks`` tokens plus a recent window, up to ``gpu_budget``
tokens per layer; every older token lives in a host tier. At each decode step the host
partial attention runs on the CPU attention pool while the GPU partial runs, and the two
are merged exactly by LSE (see ``hybridgen.attention.merge_partials``).

Choices where the paper is silent (it has no lossless mode; this is our extension):
- the GPU budget is re-resolved against the current context length n at every step
  (``gpu_budget.resolve(n)``): a ratio keeps the host share constant while decoding
  (ratio 1.0 = everything stays on the gpu tier, ratio 0 = everything on the host); a token
  count caps the GPU part (a short prompt leaves room that new tokens fill first);
- sinks count inside the GPU budget; when the budget is smaller than ``sinks`` only the
  first ``gpu_budget`` tokens are kept as sinks. With left padding the first positions may
  be padding: they are still the "sinks" (exactness does not depend on the choice);
- the recent window is a ring of GPU slots kept in age order (a deque of slot indices):
  once the GPU part is full, the oldest window token moves to the host tier and the new
  token takes its slot (one token's K/V crosses GPU->host per layer per step, counted in
  ``bytes_d2h``). Attention is order-invariant, so slots need not be in position order;
- GPU and host segments are preallocated for the whole generation at prefill (GPU:
  ``gpu_budget.resolve(max_len)`` tokens; host: ``max_len - that``), so decoding never
  reallocates unless the engine runs more steps than ``max_new_tokens``;
- the query reaches the CPU worker through :class:`hybridgen.kv.transfer.DeviceToHost` (a
  per-layer pinned buffer + CUDA event); the worker waits on the event before reading it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Deque, FrozenSet, List, Optional

from torch import Tensor

from hybridgen.attention import merge_partials
from hybridgen.attention.cuda import partial_attention  # flash / CuPy on CUDA, torch otherwise
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.hybrid.memory import hybrid_exact_footprint
from hybridgen.kv import KVSegment
from hybridgen.kv.segment import split_prompt
from hybridgen.kv.transfer import DeviceToHost, after_copy
from hybridgen.methods import Budget, HostTier, KVMethod, MethodContext, NonNegInt
from hybridgen.methods.footprint import Footprint, KVShape, fit_share
from hybridgen.methods.placement import as_budget


@dataclass
class HybridExact(KVMethod):
    """GPU partial over sinks + recent window, CPU partial over host KV, exact LSE merge.

    gpu_budget: tokens per layer on the gpu tier (ratio of the current context or absolute count).
    sinks: leading tokens pinned on the gpu tier.
    key_tier / value_tier: host tiers for host keys and values ('dram' or 'cxl').
    """

    name: ClassVar[str] = "hybrid-exact"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"gpu_budget", "key_tier", "value_tier"})  # lossless
    gpu_budget: Budget = Budget(ratio=0.1)
    sinks: NonNegInt = 4
    key_tier: HostTier = "dram"
    value_tier: HostTier = "dram"

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.pool = ctx.pool or default_pool()
        self.q_down = DeviceToHost(ctx.compute_device)  # q -> pinned host buffer + event, per layer
        L = ctx.num_layers
        self.gpu: List[Optional[KVSegment]] = [None] * L
        self.host: List[Optional[KVSegment]] = [None] * L
        # GPU slots of window tokens, oldest first; slots not in it hold sinks.
        self.window: List[Deque[int]] = [deque() for _ in range(L)]
        self.n_sinks: List[int] = [0] * L

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        """k, v: [B, Hkv, T, D]; valid: [B, T] bool (False = left padding) or None."""
        ctx = self.ctx
        B, H, T, D = k.shape
        gpu_tokens = self.gpu_budget.resolve(T)
        s = min(self.sinks, gpu_tokens)
        w = gpu_tokens - s
        host_end = T - w
        max_len = max(ctx.max_len, T)
        gpu_cap = self.gpu_budget.resolve(max_len)
        with_mask = valid is not None and not bool(valid.all())
        gpu = KVSegment(ctx.store["gpu"], B, H, D, k.dtype, f"layer{layer}/gpu", capacity=gpu_cap,
                        with_mask=with_mask)
        host = KVSegment(ctx.store[self.key_tier], B, H, D, k.dtype, f"layer{layer}/host",
                         capacity=max_len - gpu_cap, value_tier=ctx.store[self.value_tier],
                         with_mask=with_mask)
        self.count("bytes_d2h", split_prompt(gpu, host, k, v, valid, s, host_end))
        self.gpu[layer], self.host[layer] = gpu, host
        self.n_sinks[layer] = s
        self.window[layer] = deque(range(s, s + w))

    def _place_new_token(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Put the new token (k, v: [B, Hkv, 1, D]) on the gpu tier or the host tier."""
        gpu, host, window = self.gpu[layer], self.host[layer], self.window[layer]
        n = gpu.length + host.length + 1  # context length including the new token
        if gpu.length < self.gpu_budget.resolve(n):  # the GPU part may grow
            if host.length == 0 and not window and self.n_sinks[layer] < self.sinks:
                self.n_sinks[layer] += 1  # still inside the leading sink tokens
            else:
                window.append(gpu.length)
            gpu.append(k, v)
        elif window:  # roll the window: the oldest window token moves to the host
            slot = window.popleft()
            old_mask = gpu.mask[:, :, slot:slot + 1] if gpu.mask is not None else None
            host.append(gpu.k[:, :, slot:slot + 1], gpu.v[:, :, slot:slot + 1], old_mask)
            self.count("bytes_d2h", k.numel() * k.element_size() * 2)
            gpu.write(slot, k, v)
            window.append(slot)
        else:  # no window on the GPU (budget spent on sinks or zero): straight to the host
            host.append(k, v)
            self.count("bytes_d2h", k.numel() * k.element_size() * 2)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q: [B, Hq, 1, D]; k, v: [B, Hkv, 1, D]. Returns [B, Hq, 1, D] in q's dtype."""
        self._place_new_token(layer, k, v)
        gpu, host = self.gpu[layer], self.host[layer]
        scale = self.ctx.scale
        if host.length == 0:
            out, _ = partial_attention(q, gpu.k, gpu.v, scale, gpu.mask)
            return out
        q_host, q_ready = self.q_down.send(layer, q)  # the worker waits on q_ready before reading q_host
        host_future = self.pool.submit(after_copy, q_ready, partial_attention, q_host, host.k, host.v, scale,
                                       host.mask)
        gpu_part = partial_attention(q, gpu.k, gpu.v, scale, gpu.mask)
        h_out, h_lse = host_future.result()
        self.count("bytes_h2d", h_out.numel() * h_out.element_size() + h_lse.numel() * 4)
        out, _ = merge_partials([gpu_part, (h_out.to(q.device), h_lse.to(q.device))])
        return out

    def release(self) -> None:
        for seg in [*getattr(self, "gpu", []), *getattr(self, "host", [])]:
            if seg is not None:
                seg.release()
        self.gpu, self.host = [], []

    def footprint(self, shape: "KVShape") -> "Footprint":
        """What this method allocates per tier (:func:`hybridgen.hybrid.memory.hybrid_exact_footprint`)."""
        return hybrid_exact_footprint(self, shape)

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """The largest gpu share (tokens per layer) whose footprint fits; the rest on the host tiers."""
        return fit_share(self, gpu_kv_bytes, shape, lambda n: {"gpu_budget": as_budget(n)})

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: CPU attention over the host KV || GPU over its part, LSE merge;
        its gpu_tokens are the footprint's."""
        from hybridgen.methods.footprint import with_memory
        from hybridgen.perf.costs import cpu_attention_split_cost

        cost = cpu_attention_split_cost(c, self.gpu_budget, merge=True, mapping=(self.key_tier, self.value_tier))
        shape = c.kv_shape()
        return with_memory(cost, self.footprint(shape), shape)
