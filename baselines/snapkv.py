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
- ``offload='stream'`` / ``'cpu'``: the :class:`hybridgen.methods.offloaded.Offloaded` wrapper.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from baselines.kept_costs import snapkv_cost
from hybridgen.attention import attention_logits, partial_attention
from hybridgen.errors import ConfigError
from hybridgen.methods import PositiveInt
from hybridgen.methods.evicting import EvictingMethod, Part, keep_recent_and_top
from hybridgen.methods.tensors import gather_mask, gather_tokens, group_reduce, needs_mask


def snapkv_votes(q: Tensor, k: Tensor, scale: float, window: int, kernel: int, valid: Optional[Tensor],
                 pooling: str = "max") -> Tensor:
    """Pooled votes [B, Hkv, T - window] of the last ``window`` queries for the prefix tokens.

    q [B, Hq, T, D]; k [B, Hkv, T, D]; valid [B, T] or None.
    """
    B, Hq, T, D = q.shape
    Hkv, w = k.shape[1], window
    logits = attention_logits(q[:, :, T - w:], k, scale)  # [B, Hq, w, T]
    allowed = (torch.arange(T, device=q.device)[None, :] <= torch.arange(T - w, T, device=q.device)[:, None])[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :] & valid[:, None, T - w:, None]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    votes = group_reduce(probs[..., : T - w].sum(dim=2), Hkv, "mean")  # [B, Hkv, T - w]
    if kernel > 1:
        flat = votes.reshape(B * Hkv, 1, T - w)
        pool = dict(kernel_size=kernel, stride=1, padding=kernel // 2)
        flat = F.max_pool1d(flat, **pool) if pooling == "max" else F.avg_pool1d(flat, **pool, count_include_pad=False)
        votes = flat.reshape(B, Hkv, -1)[..., : T - w]
    return votes if valid is None else votes.masked_fill(~valid[:, None, : T - w], float("-inf"))


def snapkv_selection(q: Tensor, k: Tensor, scale: float, keep: int, window: int, kernel: int,
                     valid: Optional[Tensor], pooling: str = "max") -> Tensor:
    """Kept token indices [B, Hkv, keep] (sorted): top-(keep - window) voted prefix tokens + window."""
    T, w = k.shape[2], min(window, keep)
    votes = snapkv_votes(q, k, scale, w, kernel, valid, pooling) if w < keep < T else k.new_zeros(*k.shape[:2], T - w)
    return keep_recent_and_top(torch.cat([votes, votes.new_zeros(*votes.shape[:2], w)], -1), None, keep, w)


@dataclass
class SnapKV(EvictingMethod):
    """Observation-window voting at prefill; dense decoding over the kept + generated tokens.

    budget: prompt tokens kept (window included). window: observation window (32).
    kernel: pooling kernel (7). pooling: 'max' (paper) or 'avg'. tier, offload, host_tier:
    :class:`~hybridgen.methods.evicting.EvictingMethod`.
    """

    name: ClassVar[str] = "snapkv"
    # rows of the model's validation on this machine (hybridgen_harness/perf/local_rows.py), labelled
    # by the cost that prices them: GPU-resident, and offloaded (streamed one layer ahead)
    validation_rows: ClassVar[Tuple[Tuple[str, Dict[str, Any]], ...]] = (
        ("snapkv", {}), ("snapkv-offload-stream", {"offload": "stream"}))
    window: PositiveInt = 32
    kernel: PositiveInt = 7
    pooling: Literal["max", "avg"] = "max"

    def check(self) -> None:
        super().check()
        if self.kernel % 2 == 0:
            raise ConfigError(f"method {type(self).name!r}: parameter 'kernel' expects an odd integer >= 1, got {self.kernel}")

    def prompt_keeps(self, prompt_len: int, num_layers: int) -> List[int]:
        """Prompt tokens each of ``num_layers`` layers keeps (window included): the budget, the
        same in every layer (subclasses spread it, e.g. PyramidKV)."""
        return [self.budget.resolve(prompt_len)] * num_layers

    def parts(self, layer: int, prompt_len: int, max_len: int, num_layers: int) -> List[Part]:
        keep = min(self.prompt_keeps(prompt_len, num_layers)[layer], prompt_len)
        return [Part("kv", keep + max_len - prompt_len)]  # the kept prompt + every generated token

    cache = property(lambda self: self.segments("kv"), doc="the kept segment per layer")

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        keep = self.prompt_keeps(k.shape[2], self.ctx.num_layers)[layer]
        idx = snapkv_selection(q, k, self.ctx.scale, keep, self.window, self.kernel, valid, self.pooling)
        seg = self.kv_segment(layer, "kv", needs_mask(valid))
        self.store(seg, gather_tokens(k, idx), gather_tokens(v, idx), gather_mask(valid, idx))

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.kept.append(layer, "kv", k, v)
        ck, cv, cm = self.kept.view(layer, "kv")
        return partial_attention(q, ck, cv, self.ctx.scale, cm)[0]

    def resident_cost(self, c) -> "LayerCost":
        """PROJECTED: attention over the tokens kept at prefill (baselines.kept_costs)."""
        return self.kept_cost(c, c.fraction(self.budget) * c.S)

    def kept_cost(self, c, kept_tokens: float) -> "LayerCost":
        """PROJECTED GPU-resident cost of one layer keeping ``kept_tokens`` per sequence."""
        return snapkv_cost(c, kept_tokens / c.S)
