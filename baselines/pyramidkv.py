"""PyramidKV: SnapKV's selection with per-layer budgets that shrink with depth.

Cai et al., "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", 2024. Attention is broad in the lower layers and concentrated in the upper ones,
so the lower layers keep more prompt tokens: the budgets form an arithmetic sequence from
layer 0 (largest) to layer L - 1 (smallest, 1/``beta`` of the average) whose mean is the
method's budget. Which tokens a layer keeps is SnapKV's rule (observation window votes,
pooled, top-k per KV head; :func:`baselines.snapkv.snapkv_selection`); decoding is SnapKV's.

Choices where the paper is silent (or follows its reference code):
- the window is kept in every layer and is outside the pyramid: with w = min(window, budget)
  the prefix budgets (budget - w) form the pyramid, smallest = (budget - w) / beta, largest
  = 2 (budget - w) - smallest (beta 20 as in the reference code);
- when the largest exceeds the prefix (T - w) it is capped there and the smallest raised so
  the mean still holds; at a budget >= the prompt every layer keeps everything (= ``full``);
- the real-valued ramp is made integer by largest remainders (ties to the lower layer), so
  the budgets never increase with depth and sum to exactly L x budget;
- window, kernel and pooling default to SnapKV's (32, 7, max);
- under one GPU memory budget (``placement_for``, from the footprint of these budgets) the kept
  KV is resident when the sum over layers fits, else streamed through two staging slots sized
  for the LARGEST layer (layer 0 keeps up to ~2x the mean), else attended on the CPU;
- the projected cost prices every layer at its own budget, in its ``offload`` mode, and takes
  the mean layer (the step is their sum; ``baselines.layer_costs``).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar, List

from baselines.snapkv import SnapKV
from hybridgen.methods import PositiveInt


def pyramid_budgets(keep: int, window: int, prompt_len: int, num_layers: int, beta: int) -> List[int]:
    """Prompt tokens kept per layer [num_layers], non-increasing, summing to num_layers x keep."""
    T, L = prompt_len, num_layers
    if keep >= T:
        return [T] * L
    w = min(window, keep)
    pref, avail = keep - w, T - w
    if pref == 0 or L == 1:
        return [keep] * L
    lo = Fraction(pref, beta)
    hi = 2 * pref - lo
    if hi > avail:
        hi, lo = Fraction(avail), 2 * pref - Fraction(avail)
    x = [hi - (hi - lo) * Fraction(l, L - 1) for l in range(L)]
    n = [int(v) for v in x]  # floors (x >= 0)
    order = sorted(range(L), key=lambda l: (-(x[l] - n[l]), l))
    for l in order[: L * pref - sum(n)]:
        n[l] += 1
    return [w + c for c in n]


@dataclass
class PyramidKV(SnapKV):
    """SnapKV with pyramid budgets: layer budgets fall linearly with depth, mean = ``budget``.

    budget: mean prompt tokens kept per layer (window included). beta: the deepest layer keeps
    1/beta of the mean prefix budget (20). window, kernel, pooling, tier: as SnapKV.
    """

    name: ClassVar[str] = "pyramidkv"
    beta: PositiveInt = 20

    def prompt_keeps(self, prompt_len: int, num_layers: int) -> List[int]:
        """Prompt tokens kept per layer: the pyramid (:func:`pyramid_budgets`) around the budget."""
        return pyramid_budgets(self.budget.resolve(prompt_len), self.window, prompt_len, num_layers, self.beta)

    def step_cost(self, c: "CostContext") -> "LayerCost":
        """PROJECTED layer times: each layer priced as SnapKV at its own kept tokens (GPU-resident,
        or in its ``offload`` mode: the layer's kept set streamed a layer ahead, or its step on
        the CPU; ``offloaded_kept_cost``), the pyramid taken over the context S; the mean layer
        (:func:`baselines.layer_costs.mean_layer_cost`). Its gpu and staging tokens come from the
        footprint (staging sized for the largest layer)."""
        from baselines.layer_costs import mean_layer_cost

        layers = [self.mode_cost(c, self.kept_cost(c, n)) for n in self.prompt_keeps(int(c.S), c.shape.num_layers)]
        return mean_layer_cost(layers, label=layers[0].label.replace("snapkv", "pyramidkv"))
