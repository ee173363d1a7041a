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
- ``offload='stream'`` / ``'cpu'``: sinks and window on ``host_tier``, streamed per layer a
  layer ahead or attended on the CPU (:mod:`baselines.offload`); window positions stay with
  the compute; the outputs are the resident StreamingLLM's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch
from torch import Tensor

from hybridgen.methods.tensors import gather_mask, gather_tokens, needs_mask
from hybridgen.methods.tiered import TieredMethod, TierBuffer
from baselines.offload import KeptKVOffload, Offload, check_offload
from hybridgen.attention import merge_partials, partial_attention
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, HostTier, KeptBudget, MethodContext, NonNegInt, Tier


def streaming_selection(valid: Optional[Tensor], B: int, T: int, keep: int, sinks: int, device) -> tuple:
    """(sink_idx [B, s], window_idx [B, keep - s]) sorted, s = min(sinks, keep).

    Sinks: the first s real tokens of each row; window: the last keep - s other tokens.
    """
    s = min(sinks, keep, T)
    ar = torch.arange(T, device=device).expand(B, T)
    if valid is None:
        sink_idx = ar[:, :s]
    else:
        key = torch.where(valid, ar, ar + T)  # real tokens first, in order
        sink_idx = torch.topk(key, s, dim=-1, largest=False).indices.sort(dim=-1).values
    w = min(keep, T) - s
    is_sink = torch.zeros(B, T, dtype=torch.bool, device=device)
    is_sink.scatter_(1, sink_idx, True)
    later = torch.where(is_sink, torch.full_like(ar, -1), ar)
    win_idx = torch.topk(later, w, dim=-1).indices.sort(dim=-1).values
    return sink_idx, win_idx


@dataclass
class StreamingLLM(TieredMethod):
    """Attention sinks + recent window with in-cache position re-assignment.

    budget: cache size (sinks included; ratio of the context so far, or tokens).
    sinks: leading real tokens always kept. shift_positions: re-assign rotary positions inside
    the cache (False: naive variant). tier: where the cache lives. offload: 'none' | 'stream'
    | 'cpu' (kept KV on host_tier, :mod:`baselines.offload`).
    """

    name: ClassVar[str] = "streamingllm"
    budget: KeptBudget = Budget(ratio=0.2)
    sinks: NonNegInt = 4
    shift_positions: bool = True
    tier: Tier = "gpu"
    offload: Offload = "none"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        check_offload(self.name, self.tier, self.offload)

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.off = KeptKVOffload(self, self.offload, self.tier, self.host_tier)
        self.sink_kv: List[Optional[KVSegment]] = [None] * L
        self.window_kv: List[Optional[KVSegment]] = [None] * L
        self.window_pos: List[Optional[TierBuffer]] = [None] * L  # [B, cap] text index, -1 = padding
        self.evicted: List[Optional[Tensor]] = [None] * L  # per layer [B]: real tokens evicted
        self.shift = self.shift_positions and ctx.rotary is not None
        self.stats["position_shift"] = int(self.shift)
        self.T = 0

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        self.T = T
        keep = self.budget.resolve(T)
        sink_idx, win_idx = streaming_selection(valid, B, T, keep, self.sinks, k.device)
        self.n_sinks = sink_idx.shape[1]
        with_mask = needs_mask(valid)
        cap = max(self.budget.resolve(ctx.max_len) - self.n_sinks, 0)
        sidx = sink_idx[:, None, :].expand(B, H, -1)
        widx = win_idx[:, None, :].expand(B, H, -1)
        off = self.off
        sk = off.track(layer, "sinks", self.segment(off.kv_tier, f"layer{layer}/sinks", self.n_sinks, with_mask))
        sk.append(*off.put(sk, gather_tokens(k, sidx), gather_tokens(v, sidx), gather_mask(valid, sidx)))
        wk = off.track(layer, "window", self.segment(off.kv_tier, f"layer{layer}/window", cap, with_mask))
        wk.append(*off.put(wk, gather_tokens(k, widx), gather_tokens(v, widx), gather_mask(valid, widx)))
        wp = self.buffer(off.meta_tier, f"layer{layer}/pos", (B, max(cap, 1)), torch.int64)
        n = win_idx.shape[1]
        wp.t[:, :n] = win_idx if valid is None else torch.where(torch.gather(valid, 1, win_idx), win_idx, -1)
        self.sink_kv[layer], self.window_kv[layer], self.window_pos[layer] = sk, wk, wp
        if valid is None:
            self.evicted[layer] = torch.full((B,), T - sink_idx.shape[1] - n, dtype=torch.long, device=k.device)
        else:
            kept = torch.gather(valid, 1, sink_idx).sum(1) + torch.gather(valid, 1, win_idx).sum(1)
            self.evicted[layer] = (valid.sum(1) - kept).long()
        self.evicted[layer] = self.evicted[layer].to(off.meta_device)

    def _sink_keys(self, layer: int, sk: Tensor) -> Tensor:
        """Sink keys sk [B, H, s, D] moved by delta_b positions (or as given when not shifting /
        nothing evicted); the rotation is applied where the keys are."""
        evicted = self.evicted[layer]
        if not self.shift or not bool((evicted > 0).any()):
            return sk
        B, H, s, D = sk.shape
        cos, sin = self.ctx.rotary.cos_sin(evicted[:, None].expand(B, s))
        return self.ctx.rotary.apply(sk, cos.to(sk.device), sin.to(sk.device))

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.off.on_layer_input(layer)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.offload == "cpu":
            return self.off.on_host(self._decode, layer, q, k, v)
        return self._decode(layer, q, k, v)

    def _decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.ctx
        sk, wk, wp = self.sink_kv[layer], self.window_kv[layer], self.window_pos[layer]
        scale = ctx.scale
        parts = [partial_attention(q, k, v, scale)]
        if sk.length:
            sk_k, sk_v, sk_m = self.off.view(layer, "sinks")
            parts.append(partial_attention(q, self._sink_keys(layer, sk_k), sk_v, scale, sk_m))
        if wk.length:
            wk_k, wk_v, wk_m = self.off.view(layer, "window")
            parts.append(partial_attention(q, wk_k, wk_v, scale, wk_m))
        out, _ = merge_partials(parts)
        # place the new token
        t_new = self.T + int(self.stats["steps"])
        window_budget = self.budget.resolve(t_new + 1) - self.n_sinks
        n = wk.length
        if n + 1 <= window_budget:
            wk.append(*self.off.put(wk, k, v))
            wp.t[:, n] = t_new
            return out
        if n == 0:  # no window at all: the new token is dropped
            self.evicted[layer] += 1
            return out
        victim = wp.t[:, :n].argmin(dim=-1)  # [B] oldest (padding first)
        real = wp.t[:, :n].gather(1, victim[:, None])[:, 0] >= 0
        self.evicted[layer] += real.long()
        B, H, _, D = k.shape
        vh, kh, vvh = self.off.put(wk, victim, k, v)
        idx = vh[:, None, None, None].expand(B, H, 1, D)
        wk.k.scatter_(2, idx, kh.to(wk.k.dtype))
        wk.v.scatter_(2, idx, vvh.to(wk.v.dtype))
        if wk.mask is not None:
            wk.mask.scatter_(2, vh[:, None, None].expand(B, H, 1), True)
        wp.t.scatter_(1, victim[:, None], t_new)
        self.count("evicted", B * H)
        return out

    def release(self) -> None:
        if getattr(self, "off", None) is not None:
            self.off.release()
        super().release()

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """Resident when sinks + window (+ window positions) fit, else streamed (positions on the
        GPU, two staging slots), else the step on the CPU."""
        from hybridgen.methods.placement import choose_offload

        slots = shape.batch * self.budget.resolve(shape.context)
        kv, meta = shape.token_bytes + shape.mask_bytes, 8
        return choose_offload(self.name, gpu_kv_bytes, shape.layers * slots * (kv + meta),
                              shape.layers * slots * meta + 2 * slots * kv)

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: attention over the sinks and the recent window."""
        from hybridgen.perf.costs import offloaded_kept_cost, streamingllm_cost

        base = streamingllm_cost(c, c.fraction(self.budget), self.sinks)
        if self.offload == "none":
            return base
        n = base.breakdown["kept_tokens"]
        return offloaded_kept_cost(c, base, n, n, self.offload, self.host_tier)
