"""StreamingLLM: attention sinks + a recent window, with positions re-assigned inside the cache.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024. The cache
keeps the first ``sinks`` (4) tokens and the most recent tokens; everything between is
evicted. The paper assigns rotary positions by place in the cache, not in the text: with
cache length c the query sits at position c - 1, the sinks at 0..3 and the window after them.

Position re-assignment here (``shift_positions=True``): keys reach the method already rotated
at their text positions. RoPE logits depend only on the query-key distance and rotations
compose (R(a) R(b) = R(a + b)), so we put every cached key at its cache position + delta_b and
the query at its cache position + delta_b, where delta_b is the number of real tokens evicted
from sequence b so far. Then the window keys are already in place (they are the latest tokens,
contiguous, so their distances to the query are unchanged) and the query stays where the engine
put it; only the sink keys move: they are rotated by +delta_b with ``ctx.rotary.rotate`` from
their stored originals each step (4 keys per head; no drift from repeated rotations).
``shift_positions=False`` is the naive variant (keys keep their text positions).

Choices where the paper is silent:
- the budget counts the sinks (window = budget - sinks); a budget below ``sinks`` keeps only
  the first ``budget`` sinks; a ratio budget tracks the growing context (ceil(ratio x tokens
  so far): the window grows while under budget, so 100% is full attention); capacity is
  reserved for the largest budget; a token budget is fixed;
- with left padding the sinks are the first ``sinks`` REAL tokens of each row; padded slots in
  the window are evicted first;
- learned absolute positions (OPT, ``ctx.rotary is None``): keys cannot be re-positioned, so
  the cache behaves as the naive variant; ``stats['position_shift']`` records 0 in that case;
- attention is exact over [rotated sinks ; window ; new token], merged by log-sum-exp; the
  new token overwrites the oldest window slot (memory is bounded at the budget);
- offload 'stream' / 'cpu': the Offloaded wrapper (:mod:`hybridgen.methods.offloaded`); positions stay with the compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from baselines.kept_costs import streamingllm_cost
from hybridgen.attention import merge_partials, partial_attention
from hybridgen.methods import MethodContext, NonNegInt
from hybridgen.methods.evicting import EvictingMethod, Part
from hybridgen.methods.tensors import gather_mask, gather_tokens, needs_mask


def streaming_selection(valid: Optional[Tensor], B: int, T: int, keep: int, sinks: int, device) -> tuple:
    """(sink_idx [B, s], window_idx [B, keep - s]) sorted, s = min(sinks, keep, T): the first s
    real tokens of each row, and the last keep - s other tokens."""
    ar = torch.arange(T, device=device).expand(B, T)
    first_real = ar if valid is None else torch.where(valid, ar, ar + T)  # real tokens first, in order
    sink_idx = torch.topk(first_real, min(sinks, keep, T), dim=-1, largest=False).indices.sort(dim=-1).values
    later = ar.scatter(1, sink_idx, -1)  # a sink is never in the window
    return sink_idx, torch.topk(later, min(keep, T) - sink_idx.shape[1], dim=-1).indices.sort(dim=-1).values


@dataclass
class StreamingLLM(EvictingMethod):
    """Attention sinks + recent window with in-cache position re-assignment. budget: cache size
    (sinks included); sinks: leading real tokens always kept; shift_positions: False = naive."""

    name: ClassVar[str] = "streamingllm"
    # rows of the model's validation on this machine (hybridgen_harness/perf/local_rows.py), labelled
    # by the cost that prices them: GPU-resident, and offloaded (streamed one layer ahead)
    validation_rows: ClassVar[Tuple[Tuple[str, Dict[str, Any]], ...]] = (
        ("streamingllm", {}), ("streamingllm-offload-stream", {"offload": "stream"}))
    sinks: NonNegInt = 4
    shift_positions: bool = True

    def parts(self, layer: int, prompt_len: int, max_len: int, num_layers: int) -> List[Part]:
        n_sinks = min(self.sinks, self.budget.resolve(prompt_len), prompt_len)
        cap = max(self.budget.resolve(max_len) - n_sinks, 0)  # the largest window
        return [Part("sinks", n_sinks), Part("window", cap), Part("pos", max(cap, 1), "meta", 8, per_head=False)]

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        # per layer: window positions [B, cap] (text index, -1 = padding), real tokens evicted [B]
        self.window_pos, self.evicted = [None] * ctx.num_layers, [None] * ctx.num_layers
        self.shift = self.shift_positions and ctx.rotary is not None
        self.stats["position_shift"] = int(self.shift)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        (B, H, T, D), self.T = k.shape, k.shape[2]
        sink_idx, win_idx = streaming_selection(valid, B, T, self.budget.resolve(T), self.sinks, k.device)
        self.n_sinks, n = sink_idx.shape[1], win_idx.shape[1]
        for name, idx in (("sinks", sink_idx[:, None, :].expand(B, H, -1)), ("window", win_idx[:, None, :].expand(B, H, -1))):
            self.store(self.kv_segment(layer, name, needs_mask(valid)), *(gather_tokens(x, idx) for x in (k, v)),
                       gather_mask(valid, idx))
        wp = self.window_pos[layer] = self.meta_buffer(layer, "pos", torch.int64)
        wp.t[:, :n] = win_idx if valid is None else torch.where(torch.gather(valid, 1, win_idx), win_idx, -1)
        kept = sum((torch.ones_like(i) if valid is None else torch.gather(valid, 1, i)).sum(1) for i in (sink_idx, win_idx))
        self.evicted[layer] = ((T if valid is None else valid.sum(1)) - kept).long().to(self.kept.meta_device)

    def _sink_keys(self, layer: int, sk: Tensor) -> Tensor:
        """Sink keys sk [B, H, s, D] moved by delta_b positions, where the keys are (as given when not shifting)."""
        if not self.shift or not bool((self.evicted[layer] > 0).any()):
            return sk
        cos, sin = self.ctx.rotary.cos_sin(self.evicted[layer][:, None].expand(sk.shape[0], sk.shape[2]))
        return self.ctx.rotary.apply(sk, cos.to(sk.device), sin.to(sk.device))

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        parts, wk, wp = [partial_attention(q, k, v, self.ctx.scale)], self.kept.parts[layer]["window"], self.window_pos[layer]
        for name in ("sinks", "window"):
            if self.kept.parts[layer][name].length:
                ck, cv, cm = self.kept.view(layer, name)
                parts.append(partial_attention(q, self._sink_keys(layer, ck) if name == "sinks" else ck, cv, self.ctx.scale, cm))
        out, _ = merge_partials(parts)
        t_new, n = self.T + int(self.stats["steps"]), wk.length  # place the new token
        if n + 1 <= self.budget.resolve(t_new + 1) - self.n_sinks:
            self.store(wk, k, v)
            wp.t[:, n] = t_new
        elif n == 0:  # no window at all: the new token is dropped
            self.evicted[layer] += 1
        else:
            victim = wp.t[:, :n].argmin(dim=-1)  # [B] oldest (padding first)
            self.evicted[layer] += (wp.t[:, :n].gather(1, victim[:, None])[:, 0] >= 0).long()
            self.overwrite(wk, victim[:, None].expand(-1, k.shape[1]), k, v)
            wp.t.scatter_(1, victim[:, None], t_new)
            self.count("evicted", k.shape[0] * k.shape[1])
        return out

    def resident_cost(self, c) -> "LayerCost":
        """PROJECTED: attention over the sinks and the recent window (baselines.kept_costs)."""
        return streamingllm_cost(c, c.fraction(self.budget), self.sinks)
