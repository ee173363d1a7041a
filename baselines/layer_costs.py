"""One PROJECTED layer cost for a method whose layers differ (PyramidKV's per-layer budgets,
MagicPIG's dense leading layers).

The performance model prices one layer and multiplies it by the layer count
(:func:`hybridgen.perf.predict_step`), so a model whose layers cost a_1 ... a_L is priced exactly
by their mean: times, branch totals and GPU-resident tokens are averaged (their sums are what the
step and the memory check use); model-wide staging buffers are sized for the largest layer, so
``staging_tokens`` is the maximum. Numeric breakdown entries are averaged too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from hybridgen.perf.context import LayerCost

_MEANS = ("attn", "layer", "cpu", "gpu", "transfer", "gpu_tokens")


def mean_layer_cost(costs: Sequence["LayerCost"], label: str) -> "LayerCost":
    """The layer cost whose L-fold sum is the sum of ``costs`` (one per layer; module doc)."""
    from hybridgen.errors import ConfigError
    from hybridgen.perf.context import LayerCost

    if not costs:
        raise ConfigError(f"{label}: no layer costs to combine")
    n = len(costs)
    means = {f: sum(getattr(c, f) for c in costs) / n for f in _MEANS}
    keys = [k for k in costs[0].breakdown if all(isinstance(c.breakdown.get(k), (int, float)) for c in costs)]
    breakdown = {k: sum(c.breakdown[k] for c in costs) / n for k in keys}
    return LayerCost(**means, staging_tokens=max(c.staging_tokens for c in costs), breakdown=breakdown, label=label)
