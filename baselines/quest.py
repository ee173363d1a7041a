"""Quest: query-aware page selection by per-channel key bounds.

Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024.
The KV cache is split into pages of ``page_size`` (16) tokens; each page keeps the per-channel
minimum and maximum of its keys. At a decode step the upper bound of q·k over a page is
Σ_d max(q_d · min_d, q_d · max_d); the top-K pages by this bound (K = token budget / page
size) are attended exactly. The whole KV stays resident (Quest saves memory *reads*, not
memory), on the GPU as in the paper.

Choices where the paper is silent:
- GQA: pages are chosen per KV head from the SUM of its query heads' bounds, so one gather
  of K/V rows serves the whole group;
- the page holding the newest token (the last, possibly partial page) is always selected and
  counts toward K; K = max(1, budget // page_size); when the budget covers the context the
  step is dense;
- a ratio budget is a ratio of the tokens so far (prompt + generated, including the new one);
- the first ``dense_layers`` (2) layers run dense, as in Quest's evaluation (they are not
  sparse enough); set 0 to apply Quest everywhere;
- left padding: padded keys are left out of the page bounds; all-padding pages are never
  chosen unless K exceeds the real pages;
- page metadata (min in the ``k`` slot, max in the ``v`` slot of a KVSegment of pages) lives
  on the same tier as the KV and is updated in place as the last page fills;
- offload 'stream' (the Offloaded wrapper): the whole layer's KV streamed a layer ahead (the
  selection needs the step's query, so pages cannot be fetched ahead), the page bounds on the
  gpu; 'cpu': KV and bounds on the host, the whole step (bounds, top-K, gather, attention) there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from baselines.kept_costs import quest_cost
from baselines.quest_pages import page_bounds, upper_bound
from hybridgen.attention import partial_attention
from hybridgen.methods import NonNegInt, PositiveInt
from hybridgen.methods.evicting import EvictingMethod, Part
from hybridgen.methods.tensors import gather_mask, gather_tokens, group_reduce, needs_mask

__all__ = ["Quest", "page_bounds", "upper_bound"]


@dataclass
class Quest(EvictingMethod):
    """Top-K pages by key-bound upper bound, exact attention over them; full KV resident.

    budget: tokens attended per step (ratio of the context so far, or tokens). page_size:
    tokens per page (16). dense_layers: leading layers left dense (2). tier, offload, host_tier:
    :class:`~hybridgen.methods.evicting.EvictingMethod`.
    """

    name: ClassVar[str] = "quest"
    # rows of the model's validation on this machine (hybridgen_harness/perf/local_rows.py), labelled
    # by the cost that prices them: GPU-resident, and offloaded (streamed one layer ahead); with no
    # dense layer, since the validation runs two layers (the default's two would both be dense)
    validation_rows: ClassVar[Tuple[Tuple[str, Dict[str, Any]], ...]] = (
        ("quest", {"dense_layers": 0}), ("quest-offload-stream", {"offload": "stream", "dense_layers": 0}))
    page_size: PositiveInt = 16
    dense_layers: NonNegInt = 2

    def parts(self, layer: int, prompt_len: int, max_len: int, num_layers: int) -> List[Part]:
        pages = [Part("pages", math.ceil(max_len / self.page_size), "meta", kv_shaped=True)]
        return [Part("kv", max_len)] + (pages if layer >= self.dense_layers else [])

    kv = property(lambda self: self.segments("kv"), doc="the KV segment per layer")

    def bind(self, ctx) -> None:
        super().bind(ctx)
        self.pages: List = [None] * ctx.num_layers
        self.last_selected: List[Optional[Tensor]] = [None] * ctx.num_layers  # page ids [B, Hkv, K] (None = dense)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        self.store(self.kv_segment(layer, "kv", needs_mask(valid)), k, v, valid)
        if layer >= self.dense_layers:
            pages = self.pages[layer] = self.meta_segment(layer, "pages", needs_mask(valid))
            kmin, kmax, pv = page_bounds(k, None if valid is None else valid[:, None, :], self.page_size)
            pages.append(*self.kept.put(pages, kmin, kmax, pv if needs_mask(valid) else None))

    def _update_pages(self, layer: int, k: Tensor, index: int) -> None:
        """Fold the new key (token ``index``) into its page's bounds."""
        pages, p = self.pages[layer], index // self.page_size
        if p == pages.length:
            return pages.append(k, k)
        # the last prompt token is real in every row (left padding), so page p has real bounds
        pages.write(p, torch.minimum(pages.k[:, :, p:p + 1], k), torch.maximum(pages.v[:, :, p:p + 1], k))

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = self.kv[layer]
        index = kv.length
        self.kept.append(layer, "kv", k, v)
        ck, cv, cm = self.kept.view(layer, "kv")
        scale, total = self.ctx.scale, kv.length
        if layer < self.dense_layers:
            return partial_attention(q, ck, cv, scale, cm)[0]
        self._update_pages(layer, k, index)
        pages = self.pages[layer]
        P, n_pages = pages.length, max(1, self.budget.resolve(total) // self.page_size)
        if self.budget.resolve(total) >= total or n_pages >= P:
            self.last_selected[layer] = None
            return partial_attention(q, ck, cv, scale, cm)[0]
        ub = group_reduce(upper_bound(q, pages.k, pages.v), self.ctx.num_kv_heads, "sum")  # [B, Hkv, P]
        if pages.mask is not None:
            ub = ub.masked_fill(~pages.mask, float("-inf"))
        ub[..., P - 1] = float("inf")  # the current page is always attended
        sel = self.last_selected[layer] = torch.topk(ub, n_pages, dim=-1).indices.sort(dim=-1).values  # [B, Hkv, K]
        tok = (sel[..., None] * self.page_size + torch.arange(self.page_size, device=sel.device)).flatten(2)
        in_range, tok = tok < total, tok.clamp(max=total - 1)
        mask = in_range if cm is None else in_range & gather_mask(cm, tok)
        return partial_attention(q, gather_tokens(ck, tok), gather_tokens(cv, tok), scale, mask)[0]

    def resident_cost(self, c) -> "LayerCost":
        """PROJECTED: page bounds over every page, the selected pages gathered and attended, the
        dense layers dense (baselines.kept_costs)."""
        return quest_cost(c, c.fraction(self.budget), self.page_size, self.dense_layers)

    def offload_traffic(self, c, resident):
        """'stream' copies the whole layer (the pages are chosen by the step's query); the host
        reads the selected tokens and every page bound."""
        return c.S, c.fraction(self.budget) * c.S, c.B * c.Hkv * math.ceil(c.S / self.page_size) * 2 * c.D * c.b
