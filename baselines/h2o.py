"""H2O: heavy-hitter oracle, keep the tokens with the largest accumulated attention + recent ones.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023. The cache holds a fixed number of heavy hitters (tokens with the
largest attention accumulated over all queries so far) plus the most recent tokens; at each
decode step the new token's attention is added to the accumulated scores and, when the cache
is full, the non-recent token with the lowest score is evicted (greedy, per head). The
paper's default is 10% heavy + 10% recent of the prompt.

Eviction is real: the cache is a gpu-tier KVSegment whose capacity is the budget; the new
token overwrites the evicted slot per head (no masking of a full-size cache).

Choices where the paper is silent:
- GQA: a KV head's score is the SUM over its query heads' attention (one cache per KV head);
- prefill: scores are the column sums of the causal softmax attention over the whole prompt
  (every query contributes), computed in query chunks; the kept set is the recent window
  (last ``recent`` prompt tokens) plus the top-(budget - recent) scores among the others;
- the budget counts heavy + recent; ``recent_fraction`` (default 0.5: 10% + 10% at a 20%
  budget) sets the recent share, rounded to the nearest token;
- a ratio budget tracks the growing context: ceil(ratio x tokens so far); while the cache
  is under that budget new tokens are appended, then each step evicts one (so a 100% budget
  is full attention; a token budget is fixed). Capacity is reserved for the largest budget;
- the recent window at a decode step includes the new token; when every cached token is
  recent the oldest is evicted; padded (left-padding) tokens score -inf and go first;
- per-step attention is one softmax over [cache ; new token], and the new token's own
  probability starts its score;
- ``offload='stream'`` ("H2O on FlexGen", as InfiniGen's artifact runs it) keeps the kept KV on
  ``host_tier`` and streams it per layer a layer ahead; ``offload='cpu'`` runs the step on the
  CPU next to it (:mod:`baselines.offload`); the outputs are the GPU-resident H2O's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch
from torch import Tensor

from hybridgen.methods.tensors import (attend_with_new, causal_attention_colsum, gather_mask,
                                      gather_tokens, group_reduce, needs_mask)
from hybridgen.methods.tiered import TieredMethod, TierBuffer
from baselines.offload import KeptKVOffload, Offload, check_offload
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, Fraction, HostTier, KeptBudget, MethodContext, PositiveInt, Tier


def recent_count(budget_tokens: int, recent_fraction: float) -> int:
    """Tokens of a budget reserved for the recent window."""
    return max(0, min(budget_tokens, int(round(budget_tokens * recent_fraction))))


def h2o_prefill_selection(scores: Tensor, valid: Optional[Tensor], keep: int, recent: int) -> Tensor:
    """Indices [B, Hkv, keep] (sorted) of the recent window + top scores among older tokens.

    scores: [B, Hkv, T] accumulated attention; valid: [B, T] or None.
    """
    B, H, T = scores.shape
    if keep >= T:
        return torch.arange(T, device=scores.device).expand(B, H, T)
    s = scores.float()
    if valid is not None:
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
    heavy = keep - recent
    old = T - recent
    parts = [torch.arange(old, T, device=scores.device).expand(B, H, recent)]
    if heavy > 0:
        parts.insert(0, torch.topk(s[..., :old], heavy, dim=-1).indices)
    return torch.cat(parts, dim=-1).sort(dim=-1).values


@dataclass
class H2O(TieredMethod):
    """Heavy hitters + recent window, greedy per-head eviction each decode step.

    budget: cache size (ratio of the context so far, or tokens). recent_fraction: share of
    the budget for the recent window. tier: where the cache lives. chunk: prefill query
    chunk for the score computation. offload: 'none' | 'stream' | 'cpu' (kept KV on
    host_tier, :mod:`baselines.offload`).
    """

    name: ClassVar[str] = "h2o"
    budget: KeptBudget = Budget(ratio=0.2)
    recent_fraction: Fraction = 0.5
    tier: Tier = "gpu"
    chunk: PositiveInt = 256
    offload: Offload = "none"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        check_offload(self.name, self.tier, self.offload)

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.off = KeptKVOffload(self, self.offload, self.tier, self.host_tier)
        self.cache: List[Optional[KVSegment]] = [None] * L
        self.scores: List[Optional[TierBuffer]] = [None] * L  # [B, Hkv, cap] float32
        self.pos: List[Optional[TierBuffer]] = [None] * L     # [B, Hkv, cap] int64 token index
        self.T = 0

    def _capacity(self) -> int:
        return self.budget.resolve(self.ctx.max_len)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        self.T = T
        keep = self.budget.resolve(T)
        cap = self._capacity()
        may_evict = cap < ctx.max_len
        if may_evict:
            acc = group_reduce(causal_attention_colsum(q, k, ctx.scale, valid, chunk=self.chunk), H, "sum")
            if valid is not None:
                acc = acc.masked_fill(~valid[:, None, :], float("-inf"))
        else:
            acc = torch.zeros(B, H, T, device=k.device)
        idx = h2o_prefill_selection(acc, valid, keep, recent_count(keep, self.recent_fraction))
        off = self.off
        seg = off.track(layer, "kv", self.segment(off.kv_tier, f"layer{layer}/kv", cap, needs_mask(valid)))
        seg.append(*off.put(seg, gather_tokens(k, idx), gather_tokens(v, idx), gather_mask(valid, idx)))
        sc = self.buffer(off.meta_tier, f"layer{layer}/scores", (B, H, cap), torch.float32)
        ps = self.buffer(off.meta_tier, f"layer{layer}/pos", (B, H, cap), torch.int64)
        n = idx.shape[-1]
        sc.t[:, :, :n] = torch.gather(acc, 2, idx)
        ps.t[:, :, :n] = idx
        self.cache[layer], self.scores[layer], self.pos[layer] = seg, sc, ps

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.off.on_layer_input(layer)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.offload == "cpu":
            return self.off.on_host(self._decode, layer, q, k, v)
        return self._decode(layer, q, k, v)

    def _decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.ctx
        seg, sc, ps = self.cache[layer], self.scores[layer].t, self.pos[layer].t
        n = seg.length
        H = ctx.num_kv_heads
        ck, cv, cm = self.off.view(layer, "kv")
        out, probs = attend_with_new(q, ck, cv, cm, k, v, ctx.scale, return_probs=True)
        p = group_reduce(probs, H, "sum")  # [B, Hkv, n + 1]
        sc[:, :, :n] += p[..., :n]
        t_new = self.T + int(self.stats["steps"])  # index of the new token
        budget_t = self.budget.resolve(t_new + 1)
        if n + 1 <= budget_t:
            seg.append(*self.off.put(seg, k, v))
            sc[:, :, n] = p[..., n]
            ps[:, :, n] = t_new
            return out
        if n == 0:
            return out
        recent = recent_count(budget_t, self.recent_fraction)
        pos = ps[:, :, :n]
        cand = pos <= t_new - recent  # not in the recent window (which includes the new token)
        by_score = sc[:, :, :n].masked_fill(~cand, float("inf")).argmin(dim=-1)
        by_age = pos.argmin(dim=-1)
        victim = torch.where(cand.any(dim=-1), by_score, by_age)  # [B, Hkv]
        self._overwrite(seg, *self.off.put(seg, victim, k, v))
        sc.scatter_(2, victim[..., None], p[..., n:n + 1])
        ps.scatter_(2, victim[..., None], torch.full_like(victim[..., None], t_new))
        self.count("evicted", victim.numel())
        return out

    @staticmethod
    def _overwrite(seg: KVSegment, slot: Tensor, k: Tensor, v: Tensor) -> None:
        """Write the new token into per-head slots. slot [B, Hkv]; k, v [B, Hkv, 1, D]."""
        D = k.shape[-1]
        idx = slot[..., None, None].expand(-1, -1, 1, D)
        seg.k.scatter_(2, idx, k.to(seg.k.dtype))
        seg.v.scatter_(2, idx, v.to(seg.v.dtype))
        if seg.mask is not None:
            seg.mask.scatter_(2, slot[..., None], True)

    def release(self) -> None:
        if getattr(self, "off", None) is not None:
            self.off.release()
        super().release()

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """Resident when the kept KV + scores + positions fit, else streamed (scores and positions
        on the GPU, two staging slots), else the step on the CPU."""
        from hybridgen.methods.placement import choose_offload

        kept = shape.batch * shape.kv_heads * self.budget.resolve(shape.context)  # cache slots per layer
        kv, meta = shape.token_bytes // shape.kv_heads + 1, 12  # K+V+mask / score + position per slot
        return choose_offload(self.name, gpu_kv_bytes, shape.layers * kept * (kv + meta),
                              shape.layers * kept * meta + 2 * kept * kv)

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: attention over the kept tokens plus the score update (the kept
        KV streamed from the host, or the step on the CPU, when offloaded)."""
        from hybridgen.perf.costs import h2o_cost, offloaded_kept_cost

        r = c.fraction(self.budget)
        base = h2o_cost(c, r)
        if self.offload == "none":
            return base
        n = r * c.S
        return offloaded_kept_cost(c, base, n, n, self.offload, self.host_tier, host_extra_bytes=c.B * c.Hq * n * 8)
