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
- ``offload='stream'``: the KV on ``host_tier``, the whole layer streamed a layer ahead (the
  selection needs the step's query, so pages cannot be fetched ahead); the page bounds stay on
  the gpu tier. ``offload='cpu'``: KV and bounds on the host, the step (bounds, top-K, gather,
  attention over the selected pages) on the CPU (:mod:`baselines.offload`). Outputs equal the
  resident Quest's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, List, Optional

import torch
from torch import Tensor

from hybridgen.methods.tensors import gather_mask, gather_tokens, group_reduce, needs_mask
from hybridgen.methods.tiered import TieredMethod
from baselines.offload import KeptKVOffload, Offload, check_offload
from hybridgen.attention import partial_attention
from hybridgen.kv import KVSegment
from hybridgen.methods import Budget, HostTier, KeptBudget, MethodContext, NonNegInt, PositiveInt, Tier


def page_bounds(k: Tensor, valid: Optional[Tensor], page_size: int):
    """Per-page channel min/max of keys. k [B, H, T, D], valid [B, H, T] or None.

    Returns (kmin, kmax [B, H, P, D], page_valid [B, H, P]); all-padding pages get zeros.
    """
    B, H, T, D = k.shape
    P = math.ceil(T / page_size)
    pad = P * page_size - T
    kf = k.float()
    m = torch.ones(B, H, T, dtype=torch.bool, device=k.device) if valid is None else valid.expand(B, H, T)
    if pad:
        kf = torch.cat([kf, kf.new_zeros(B, H, pad, D)], dim=2)
        m = torch.cat([m, m.new_zeros(B, H, pad)], dim=2)
    kf = kf.view(B, H, P, page_size, D)
    mm = m.view(B, H, P, page_size)[..., None]
    kmin = kf.masked_fill(~mm, float("inf")).amin(dim=3)
    kmax = kf.masked_fill(~mm, float("-inf")).amax(dim=3)
    pv = mm[..., 0].any(dim=3)
    kmin = torch.where(pv[..., None], kmin, torch.zeros_like(kmin))
    kmax = torch.where(pv[..., None], kmax, torch.zeros_like(kmax))
    return kmin.to(k.dtype), kmax.to(k.dtype), pv


def upper_bound(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Σ_d max(q_d min_d, q_d max_d) per query head and page.

    q [B, Hq, 1, D]; kmin, kmax [B, Hkv, P, D] -> [B, Hq, P] float32.
    """
    B, Hq, _, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    ub = torch.matmul(qg.clamp(min=0), kmax.float().transpose(-1, -2)) + \
        torch.matmul(qg.clamp(max=0), kmin.float().transpose(-1, -2))
    return ub.reshape(B, Hq, P)


@dataclass
class Quest(TieredMethod):
    """Top-K pages by key-bound upper bound, exact attention over them; full KV resident.

    budget: tokens attended per step (ratio of the context so far, or tokens).
    page_size: tokens per page (16). dense_layers: leading layers left dense (2).
    tier: where KV and page metadata live ('gpu' as in Quest). offload: 'none' | 'stream' |
    'cpu' (KV on host_tier, :mod:`baselines.offload`).
    """

    name: ClassVar[str] = "quest"
    budget: KeptBudget = Budget(ratio=0.2)
    page_size: PositiveInt = 16
    dense_layers: NonNegInt = 2
    tier: Tier = "gpu"
    offload: Offload = "none"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        check_offload(self.name, self.tier, self.offload)

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        L = ctx.num_layers
        self.off = KeptKVOffload(self, self.offload, self.tier, self.host_tier)
        self.kv: List[Optional[KVSegment]] = [None] * L
        self.pages: List[Optional[KVSegment]] = [None] * L
        self.last_selected: List[Optional[Tensor]] = [None] * L  # page ids [B, Hkv, K] (None = dense)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        with_mask = needs_mask(valid)
        off = self.off
        kv = self.segment(off.kv_tier, f"layer{layer}/kv", ctx.max_len, with_mask)
        kv.append(*off.put(kv, k, v, valid))
        self.kv[layer] = off.track(layer, "kv", kv)
        if layer < self.dense_layers:
            return
        pages = self.segment(off.meta_tier, f"layer{layer}/pages", math.ceil(ctx.max_len / self.page_size), with_mask)
        kmin, kmax, pv = page_bounds(k, None if valid is None else valid[:, None, :], self.page_size)
        pages.append(*off.put(pages, kmin, kmax, pv if with_mask else None))
        self.pages[layer] = pages

    def _update_pages(self, layer: int, k: Tensor, index: int) -> None:
        """Fold the new key (token ``index``) into its page's bounds."""
        pages = self.pages[layer]
        p = index // self.page_size
        if p == pages.length:
            pages.append(k, k)
            return
        # the last prompt token is real in every row (left padding), so page p has real bounds
        kmin = torch.minimum(pages.k[:, :, p:p + 1], k)
        kmax = torch.maximum(pages.v[:, :, p:p + 1], k)
        pages.write(p, kmin, kmax)

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.off.on_layer_input(layer)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.offload == "cpu":
            return self.off.on_host(self._decode, layer, q, k, v)
        return self._decode(layer, q, k, v)

    def _decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        kv = self.kv[layer]
        index = kv.length
        self.off.append(layer, "kv", k, v)
        ck, cv, cm = self.off.view(layer, "kv")
        scale = self.ctx.scale
        if layer < self.dense_layers:
            return partial_attention(q, ck, cv, scale, cm)[0]
        self._update_pages(layer, k, index)
        total = kv.length
        pages = self.pages[layer]
        P = pages.length
        n_pages = max(1, self.budget.resolve(total) // self.page_size)
        if self.budget.resolve(total) >= total or n_pages >= P:
            self.last_selected[layer] = None
            return partial_attention(q, ck, cv, scale, cm)[0]
        H = self.ctx.num_kv_heads
        ub = group_reduce(upper_bound(q, pages.k, pages.v), H, "sum")  # [B, Hkv, P]
        if pages.mask is not None:
            ub = ub.masked_fill(~pages.mask, float("-inf"))
        ub[..., P - 1] = float("inf")  # the current page is always attended
        sel = torch.topk(ub, n_pages, dim=-1).indices.sort(dim=-1).values  # [B, Hkv, K]
        self.last_selected[layer] = sel
        tok = (sel[..., None] * self.page_size + torch.arange(self.page_size, device=sel.device)).flatten(2)
        in_range = tok < total
        tok = tok.clamp(max=total - 1)
        mask = in_range if cm is None else in_range & gather_mask(cm, tok)
        return partial_attention(q, gather_tokens(ck, tok), gather_tokens(cv, tok), scale, mask)[0]

    def release(self) -> None:
        if getattr(self, "off", None) is not None:
            self.off.release()
        super().release()

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """Resident when the whole KV + page bounds fit, else streamed (bounds on the GPU, two
        staging slots of a whole layer), else the step on the CPU."""
        from hybridgen.methods.placement import choose_offload

        B, L, T = shape.batch, shape.layers, shape.context
        kv = B * T * (shape.token_bytes + shape.mask_bytes)
        pages = max(0, L - self.dense_layers) * B * math.ceil(T / self.page_size) * (shape.token_bytes + shape.mask_bytes)
        return choose_offload(self.name, gpu_kv_bytes, L * kv + pages, pages + 2 * kv)

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost: page bounds over every page, attention over the selected pages."""
        from hybridgen.perf.costs import offloaded_kept_cost, quest_cost

        r = c.fraction(self.budget)
        base = quest_cost(c, r, self.page_size)
        if self.offload == "none":
            return base
        bounds = c.B * c.Hkv * math.ceil(c.S / self.page_size) * 2 * c.D * c.b
        # 'stream' copies the whole layer (the pages are chosen by the step's query)
        return offloaded_kept_cost(c, base, c.S, r * c.S, self.offload, self.host_tier, host_extra_bytes=bounds)
