"""FlexGen's PROJECTED layer cost, beside the method (:mod:`baselines.flexgen`).

The host part is streamed over PCIe (4-bit codes + their dequantisation on the GPU when
``compress_kv``) or attended on the CPU (``attention_on='cpu'``); ``compress_gpu_kv`` adds the
dequantisation of the GPU part's codes. A dequantisation is priced as :func:`baselines.quant.dequantize`
runs it: its torch passes' bytes (:func:`baselines.quant.dequant_bytes`) at gpu.hbm_gbps, plus a
launch per pass of each of its two calls (K, V). The cost prices time only; the memory a row
reports is the method's footprint (set by ``FlexGen.layer_cost``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from baselines import quant

if TYPE_CHECKING:
    from hybridgen.perf.context import CostContext, LayerCost


def dequant_time(c: "CostContext", tokens: float) -> float:
    """Seconds of :func:`baselines.quant.dequantize` over ``tokens`` K rows and V rows per sequence."""
    elements = c.B * tokens * 2 * c.Hkv * c.D
    return quant.dequant_bytes(elements, c.b) / (c.hw.gpu.hbm_gbps * 1e9) + 2 * quant.DEQUANT_PASSES * c.launch


def flexgen_cost(c: "CostContext", share: float, group_size: int, compress_kv: bool, compress_gpu_kv: bool,
                 attention_on: str, host_tier: str) -> "LayerCost":
    """One layer of FlexGen at a GPU ``share`` of the context (module docstring); the breakdown
    adds ``dequant_s`` (every dequantisation of the layer) and ``gpu_dequant_s`` (the GPU part's)."""
    from hybridgen.perf.costs import cpu_attention_split_cost, stream_cost

    S_g, S_h = c.split(share)
    packed = 2 * c.Hkv * c.D * (0.5 + 4.0 / group_size)  # 4-bit codes + fp16 (min, scale) per group
    gpu_dequant = dequant_time(c, S_g) if compress_gpu_kv and S_g else 0.0
    if compress_kv:
        dequant = dequant_time(c, S_h) + gpu_dequant
        lay = stream_cost(c, share, packed, dequant, host_tier, "flexgen-int4")
    elif attention_on == "cpu":
        lay = cpu_attention_split_cost(c, share, merge=True, mapping=host_tier)
        if gpu_dequant:  # before the GPU partial, priced serially with the layer (an upper bound)
            lay = replace(lay, attn=lay.attn + gpu_dequant, layer=lay.layer + gpu_dequant, gpu=lay.gpu + gpu_dequant,
                          breakdown=dict(lay.breakdown))
        dequant = gpu_dequant
    else:
        lay, dequant = stream_cost(c, share, gpu_extra=gpu_dequant, mapping=host_tier, label="flexgen-stream"), gpu_dequant
    lay.breakdown.update(dequant_s=dequant, gpu_dequant_s=gpu_dequant)
    return lay
