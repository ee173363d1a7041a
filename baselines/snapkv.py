"""SnapKV: the prompt's last queries vote for the prefix tokens worth keeping.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024.
At the end of prefill, the attention of the last ``window`` queries (the observation window)
over the prefix keys is summed over the window, smoothed by a 1-D pooling along tokens
(kernel 7, max-pool), and the top-(budget - window) prefix tokens per head are kept together
with the window itself. Decoding is dense over the kept tokens plus every generated token.

Choices where the paper is silent:
- GQA: a KV head's vote is the MEAN over its query heads of their window-summed attention,
  taken before pooling (so the cache keeps ``num_kv_heads`` heads);
- the window queries' softmax runs over all prompt keys with the causal mask (as in the
  reference code); only the prefix (non-window) columns are voted on;
- pooling pads with -inf at the ends (max-pool with padding kernel // 2, stride 1), so the
  pooled length equals the prefix length;
- the budget counts the window; a budget below ``window`` keeps the last ``budget`` tokens;
  a budget at or above the prompt keeps everything; the budget applies to the prompt only:
  generated tokens are appended (as in the paper), capacity reserved for them at prefill;
- left padding: padded keys get no probability and a -inf vote (after pooling), padded
  window queries vote nothing;
- kept indices are sorted by position (order does not change attention);
- ``offload='stream'`` / ``'cpu'``: the kept KV on ``host_tier``, streamed per layer a layer
  ahead or attended on the CPU (:mod:`baselines.offload`); the outputs are the resident SnapKV's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgen.methods.tensors import gather_mask, gather_tokens, group_reduce, needs_mask
from hybridgen.methods.tiered import TieredMethod
from baselines.offload import KeptKVOffload, Offload, check_offload
from hybridgen.attention import attention_logits, partial_attention
from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, HostTier, KeptBudget, MethodContext, PositiveInt, Tier


def snapkv_votes(q: Tensor, k: Tensor, scale: float, window: int, kernel: int, valid: Optional[Tensor],
                 pooling: str = "max") -> Tensor:
    """Pooled votes [B, Hkv, T - window] of the last ``window`` queries for the prefix tokens.

    q [B, Hq, T, D]; k [B, Hkv, T, D]; valid [B, T] or None.
    """
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    w = window
    logits = attention_logits(q[:, :, T - w:], k, scale)  # [B, Hq, w, T]
    qpos = torch.arange(T - w, T, device=q.device)[:, None]
    allowed = (torch.arange(T, device=q.device)[None, :] <= qpos)[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :] & valid[:, None, T - w:, None]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    votes = group_reduce(probs[..., : T - w].sum(dim=2), Hkv, "mean")  # [B, Hkv, T - w]
    if kernel > 1:
        flat = votes.reshape(B * Hkv, 1, T - w)
        if pooling == "max":
            flat = F.max_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2)
        else:
            flat = F.avg_pool1d(flat, kernel_size=kernel, stride=1, padding=kernel // 2, count_include_pad=False)
        votes = flat.reshape(B, Hkv, -1)[..., : T - w]
    if valid is not None:
        votes = votes.masked_fill(~valid[:, None, : T - w], float("-inf"))
    return votes


def snapkv_selection(q: Tensor, k: Tensor, scale: float, keep: int, window: int, kernel: int,
                     valid: Optional[Tensor], pooling: str = "max") -> Tensor:
    """Kept token indices [B, Hkv, keep] (sorted): top-(keep - window) voted prefix tokens + window."""
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if keep >= T:
        return torch.arange(T, device=k.device).expand(B, Hkv, T)
    w = min(window, keep)
    win = torch.arange(T - w, T, device=k.device).expand(B, Hkv, w)
    if keep == w:
        return win
    votes = snapkv_votes(q, k, scale, w, kernel, valid, pooling)
    top = torch.topk(votes, keep - w, dim=-1).indices
    return torch.cat([top, win], dim=-1).sort(dim=-1).values


@dataclass
class SnapKV(TieredMethod):
    """Observation-window voting at prefill; dense decoding over the kept + generated tokens.

    budget: prompt tokens kept (window included). window: observation window (32).
    kernel: pooling kernel (7). pooling: 'max' (paper) or 'avg'. tier: where the cache lives.
    offload: 'none' | 'stream' | 'cpu' (kept KV on host_tier, :mod:`baselines.offload`).
    """

    name: ClassVar[str] = "snapkv"
    budget: KeptBudget = Budget(ratio=0.2)
    window: PositiveInt = 32
    kernel: PositiveInt = 7
    pooling: Literal["max", "avg"] = "max"
    tier: Tier = "gpu"
    offload: Offload = "none"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        check_offload(type(self).name, self.tier, self.offload)
        if self.kernel % 2 == 0:
            raise ConfigError(f"method {type(self).name!r}: parameter 'kernel' expects an odd integer >= 1, got {self.kernel}")

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.cache: List[Optional[KVSegment]] = [None] * ctx.num_layers
        self.off = KeptKVOffload(self, self.offload, self.tier, self.host_tier)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        T = k.shape[2]
        keep = self.prompt_keep(layer, T)
        idx = snapkv_selection(q, k, ctx.scale, keep, self.window, self.kernel, valid, self.pooling)
        off = self.off
        seg = self.segment(off.kv_tier, f"layer{layer}/kv", idx.shape[-1] + ctx.max_new_tokens, needs_mask(valid))
        seg.append(*off.put(seg, gather_tokens(k, idx), gather_tokens(v, idx), gather_mask(valid, idx)))
        self.cache[layer] = off.track(layer, "kv", seg)

    def prompt_keep(self, layer: int, prompt_len: int) -> int:
        """Prompt tokens ``layer`` keeps (window included), from :meth:`prompt_keeps`."""
        return self.prompt_keeps(prompt_len, self.ctx.num_layers)[layer]

    def prompt_keeps(self, prompt_len: int, num_layers: int) -> List[int]:
        """Prompt tokens each of ``num_layers`` layers keeps (window included): the budget, the
        same in every layer (subclasses spread it, e.g. PyramidKV)."""
        return [self.budget.resolve(prompt_len)] * num_layers

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.off.on_layer_input(layer)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.offload == "cpu":
            return self.off.on_host(self._decode, layer, q, k, v)
        return self._decode(layer, q, k, v)

    def _decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.off.append(layer, "kv", k, v)
        ck, cv, cm = self.off.view(layer, "kv")
        out, _ = partial_attention(q, ck, cv, self.ctx.scale, cm)
        return out

    def release(self) -> None:
        if getattr(self, "off", None) is not None:
            self.off.release()
        super().release()

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """Resident when every layer's kept prompt + generated KV fits, else streamed (two
        staging slots, each sized for the largest layer, as ``KeptKVOffload`` allocates them),
        else the step on the CPU."""
        from hybridgen.methods.placement import choose_offload

        per_token = shape.batch * (shape.token_bytes + shape.mask_bytes)
        kept = [n + shape.new_tokens for n in self.prompt_keeps(shape.prompt, shape.layers)]
        return choose_offload(type(self).name, gpu_kv_bytes, sum(kept) * per_token, 2 * max(kept) * per_token)

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: attention over the tokens kept at prefill."""
        return self.kept_cost(c, c.fraction(self.budget) * c.S)

    def kept_cost(self, c: "CostContext", kept_tokens: float) -> "LayerCost":
        """PROJECTED cost of one layer keeping ``kept_tokens`` per sequence: GPU attention over
        them, or (offloaded) that attention with the kept set streamed a layer ahead / the step
        on the CPU (``offloaded_kept_cost``)."""
        from hybridgen.perf.costs import offloaded_kept_cost, snapkv_cost

        base = snapkv_cost(c, kept_tokens / c.S)
        if self.offload == "none":
            return base
        return offloaded_kept_cost(c, base, kept_tokens, kept_tokens, self.offload, self.host_tier)
