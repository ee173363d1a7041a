"""`hybrid-exact`: lossless CPU-GPU split attention merged by log-sum-exp.

The gpu tier holds the first ``sinks`` tokens plus a recent window, up to ``gpu_budget``
tokens per layer; every older token lives in a host tier. At each decode step the host
partial attention runs on the CPU attention pool while the GPU partial runs, and the two
are merged exactly by LSE (see ``hybridgen.attention.merge_partials``).

Choices where the paper is silent (it has no lossless mode; this is our extension):
- the GPU budget is resolved against the prompt length and stays fixed while decoding;
- sinks count inside the GPU budget; when the budget is smaller than ``sinks`` only the
  first ``gpu_budget`` tokens are kept as sinks;
- the recent window is a ring buffer: the token it pushes out moves to the host tier
  (one token's K/V crosses GPU->host per layer per step, counted in ``bytes_d2h``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from hybridgen.attention import merge_partials, partial_attention
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, KVMethod, MethodContext, register


@register("hybrid-exact")
@dataclass
class HybridExact(KVMethod):
    """GPU partial over sinks + recent window, CPU partial over host KV, exact LSE merge.

    gpu_budget: tokens per layer on the gpu tier (ratio of the prompt or absolute count).
    sinks: leading tokens pinned on the gpu tier.
    key_tier / value_tier: host tiers for host keys and values ('dram' or 'cxl').
    """

    gpu_budget: Budget = Budget(ratio=0.5)
    sinks: int = 4
    key_tier: str = "dram"
    value_tier: str = "dram"

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        if self.sinks < 0:
            from hybridgen.errors import ConfigError
            raise ConfigError(f"hybrid-exact: sinks must be >= 0, got {self.sinks}")
        self.pool = ctx.pool or default_pool()
        L = ctx.num_layers
        self.gpu: List[Optional[KVSegment]] = [None] * L
        self.host: List[Optional[KVSegment]] = [None] * L
        self.n_sinks = 0
        self.window = 0
        self.ring: List[int] = [0] * L

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        gpu_tokens = self.gpu_budget.resolve(T)
        self.n_sinks = min(self.sinks, gpu_tokens)
        self.window = gpu_tokens - self.n_sinks
        with_mask = valid is not None and not bool(valid.all())
        s, w = self.n_sinks, self.window
        host_end = T - w
        gpu = KVSegment(ctx.store["gpu"], B, H, D, k.dtype, f"layer{layer}/gpu", capacity=gpu_tokens,
                        with_mask=with_mask)
        host = KVSegment(ctx.store[self.key_tier], B, H, D, k.dtype, f"layer{layer}/host",
                         capacity=ctx.max_len - gpu_tokens, value_tier=ctx.store[self.value_tier],
                         with_mask=with_mask)
        m = (lambda a, b: None if valid is None else valid[:, a:b])
        gpu.append(k[:, :, :s], v[:, :, :s], m(0, s))
        gpu.append(k[:, :, host_end:], v[:, :, host_end:], m(host_end, T))
        host.append(k[:, :, s:host_end], v[:, :, s:host_end], m(s, host_end))
        self.count("bytes_d2h", (host_end - s) * B * H * D * k.element_size() * 2)
        self.gpu[layer], self.host[layer] = gpu, host

    def _place_new_token(self, layer: int, k: Tensor, v: Tensor) -> None:
        gpu, host = self.gpu[layer], self.host[layer]
        if self.window == 0:
            host.append(k, v)
            self.count("bytes_d2h", k.numel() * k.element_size() * 2)
            return
        if gpu.length < self.n_sinks + self.window:
            gpu.append(k, v)
            return
        slot = self.n_sinks + self.ring[layer]
        old_mask = gpu.mask[:, :, slot:slot + 1] if gpu.mask is not None else None
        host.append(gpu.k[:, :, slot:slot + 1], gpu.v[:, :, slot:slot + 1], old_mask)
        self.count("bytes_d2h", k.numel() * k.element_size() * 2)
        gpu.write(slot, k, v)
        self.ring[layer] = (self.ring[layer] + 1) % self.window

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._place_new_token(layer, k, v)
        gpu, host = self.gpu[layer], self.host[layer]
        scale = self.ctx.scale
        q_host = q.to(host.device, non_blocking=True)
        host_future = self.pool.submit(partial_attention, q_host, host.k, host.v, scale, host.mask)
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
