"""PROJECTED GPU-resident layer costs of the evicting baselines (symbols in :mod:`hybridgen.perf.context`).

Each is :func:`hybridgen.perf.costs.gpu_resident_cost` over the kept tokens plus the method's
own pass; r = the budget's fraction of the context (``c.fraction``). The offloaded modes price
these with ``offloaded_kept_cost`` (:meth:`hybridgen.methods.evicting.EvictingMethod.mode_cost`);
``gpu_tokens`` / ``staging_tokens`` come from the method's footprint, not from here.

  h2o             attn = gpu_attn(r*S) + score update (B*Hq*r*S*4*2 / hbm)
  snapkv          attn = gpu_attn(r*S)
  streamingllm    attn = gpu_attn(min(S, max(r*S, sinks)))
  quest           attn = page bounds (B*Hkv*(S/page)*2*D*b / attention_gbps)
                         + gather of the selected rows (2*B*r*S*kv_tok / hbm) + gpu_attn(r*S);
                         the first dense_layers layers gpu_attn(S): the mean over the layers
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hybridgen.perf.costs import gpu_resident_cost

if TYPE_CHECKING:
    from hybridgen.perf.context import CostContext, LayerCost


def h2o_cost(c: "CostContext", budget_ratio: float) -> "LayerCost":
    """H2O: attention over the kept heavy hitters + recent tokens and the score update."""
    n = budget_ratio * c.S
    score = c.B * c.Hq * n * 4 * 2 / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    return gpu_resident_cost(c, n, score, label="h2o")


def snapkv_cost(c: "CostContext", budget_ratio: float) -> "LayerCost":
    """SnapKV: attention over the tokens selected at prefill."""
    return gpu_resident_cost(c, budget_ratio * c.S, label="snapkv")


def streamingllm_cost(c: "CostContext", budget_ratio: float, sinks: int) -> "LayerCost":
    """StreamingLLM: attention over the sinks + the recent window."""
    return gpu_resident_cost(c, min(c.S, max(budget_ratio * c.S, sinks)), label="streamingllm")


def quest_cost(c: "CostContext", budget_ratio: float, page_size: int, dense_layers: int = 0) -> "LayerCost":
    """Quest: page-bound scoring over every page, the selected pages' K and V rows gathered
    (``gather_tokens``: read and written once), then attention over them; the first
    ``dense_layers`` of the model's layers attend densely, so the per-layer cost is the mean
    over the layers."""
    pages = math.ceil(c.S / page_size)
    n = budget_ratio * c.S
    bounds = c.B * c.Hkv * pages * 2 * c.D * c.b / (c.hw.gpu.attention_gbps * 1e9) + c.launch
    gather = 2 * c.B * n * c.kv_tok / (c.hw.gpu.hbm_gbps * 1e9) + 2 * c.launch
    layers = c.shape.num_layers
    sparse = (layers - min(dense_layers, layers)) / layers
    return gpu_resident_cost(c, sparse * n + (1 - sparse) * c.S, sparse * (bounds + gather),
                             resident=c.S + 2 * pages, label="quest")
