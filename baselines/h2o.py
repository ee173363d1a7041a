"""H2O: heavy-hitter oracle, keep the tokens with the largest accumulated attention + recent ones.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", NeurIPS 2023. The cache holds a fixed number of heavy hitters (tokens with the
largest attention accumulated over all queries so far) plus the most recent tokens; at each
decode step the new token's attention is added to the accumulated scores and, when the cache
is full, the non-recent token with the lowest score is evicted (greedy, per head). The
paper's default is 10% heavy + 10% recent of the prompt.

Eviction is real: the cache is a KVSegment whose capacity is the budget; the new token
overwrites the evicted slot per head (no masking of a full-size cache).

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
- ``offload='stream'`` ("H2O on FlexGen", as InfiniGen's artifact runs it) / ``'cpu'``: the
  :class:`hybridgen.methods.offloaded.Offloaded` wrapper (scores and positions stay with the compute).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List

import torch
from torch import Tensor

from baselines.kept_costs import h2o_cost
from hybridgen.methods import Fraction, MethodContext, PositiveInt
from hybridgen.methods.evicting import EvictingMethod, Part, keep_recent_and_top, recent_count
from hybridgen.methods.tensors import attend_with_new, causal_attention_colsum, gather_mask, gather_tokens, group_reduce, needs_mask


@dataclass
class H2O(EvictingMethod):
    """Heavy hitters + recent window, greedy per-head eviction each decode step.

    budget: cache size (ratio of the context so far, or tokens). recent_fraction: share of
    the budget for the recent window. chunk: prefill query chunk for the score computation.
    tier, offload, host_tier: :class:`~hybridgen.methods.evicting.EvictingMethod`.
    """

    name: ClassVar[str] = "h2o"
    # no rows in the model's validation on this machine (local_rows.py): its prefill accumulates
    # every prompt token's attention (T x T per head), ~1-2 min per run at the validation's 8K shapes
    recent_fraction: Fraction = 0.5
    chunk: PositiveInt = 256

    def parts(self, layer: int, prompt_len: int, max_len: int, num_layers: int) -> List[Part]:
        cap = self.budget.resolve(max_len)  # the largest budget: the cache never grows
        return [Part("kv", cap), Part("scores", cap, "meta", 4), Part("pos", cap, "meta", 8)]

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.cache, self.scores, self.pos = ([None] * ctx.num_layers for _ in range(3))
        self.T = 0

    def score(self, q: Tensor, k: Tensor, valid) -> Tensor:
        """Accumulated attention [B, Hkv, T] of every prompt query (summed over the group)."""
        acc = group_reduce(causal_attention_colsum(q, k, self.ctx.scale, valid, chunk=self.chunk), k.shape[1], "sum")
        return acc if valid is None else acc.masked_fill(~valid[:, None, :], float("-inf"))

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid) -> None:
        B, H, T, D = k.shape
        self.T, keep = T, self.budget.resolve(T)
        may_evict = self.budget.resolve(self.ctx.max_len) < self.ctx.max_len
        acc = self.score(q, k, valid) if may_evict else torch.zeros(B, H, T, device=k.device)
        idx = keep_recent_and_top(acc, valid, keep, recent_count(keep, self.recent_fraction))
        seg = self.kv_segment(layer, "kv", needs_mask(valid))
        self.store(seg, gather_tokens(k, idx), gather_tokens(v, idx), gather_mask(valid, idx))
        sc, ps = self.meta_buffer(layer, "scores", torch.float32), self.meta_buffer(layer, "pos", torch.int64)
        n = idx.shape[-1]
        sc.t[:, :, :n] = torch.gather(acc, 2, idx)
        ps.t[:, :, :n] = idx
        self.cache[layer], self.scores[layer], self.pos[layer] = seg, sc, ps

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        seg, sc, ps = self.cache[layer], self.scores[layer].t, self.pos[layer].t
        n = seg.length
        out, probs = attend_with_new(q, *self.kept.view(layer, "kv"), k, v, self.ctx.scale, return_probs=True)
        p = group_reduce(probs, self.ctx.num_kv_heads, "sum")  # [B, Hkv, n + 1]
        sc[:, :, :n] += p[..., :n]
        t_new = self.T + int(self.stats["steps"])  # index of the new token
        budget_t = self.budget.resolve(t_new + 1)
        if n + 1 <= budget_t:
            self.store(seg, k, v)
            sc[:, :, n] = p[..., n]
            ps[:, :, n] = t_new
            return out
        if n == 0:
            return out
        pos = ps[:, :, :n]
        cand = pos <= t_new - recent_count(budget_t, self.recent_fraction)  # the window includes the new token
        by_score = sc[:, :, :n].masked_fill(~cand, float("inf")).argmin(dim=-1)
        victim = torch.where(cand.any(dim=-1), by_score, pos.argmin(dim=-1))  # [B, Hkv]
        self.overwrite(seg, victim, k, v)
        sc.scatter_(2, victim[..., None], p[..., n:n + 1])
        ps.scatter_(2, victim[..., None], torch.full_like(victim[..., None], t_new))
        self.count("evicted", victim.numel())
        return out

    def resident_cost(self, c) -> "LayerCost":
        """PROJECTED: attention over the kept tokens plus the score update (baselines.kept_costs)."""
        return h2o_cost(c, c.fraction(self.budget))

    def offload_traffic(self, c, resident):
        """The kept set streamed / read; on the CPU the scores are read and written too."""
        n = resident.breakdown["kept_tokens"]
        return n, n, c.B * c.Hq * n * 8
