"""PROJECTED time of one decode step of a method: ``predict_step``.

The method prices one layer itself (``method.layer_cost(c)`` with ``c`` a
:class:`~hybridgen.perf.context.CostContext`); this module scales the layer to the model:

  step total = L * layer + lm_head (vocab*hidden*b / hbm);  cpu/gpu/transfer totals = L * per layer
  GPU memory = weights + (L * gpu_tokens + staging_tokens) * B * kv_tok   (``fits_gpu``)

``attention_layer_s`` is the attention of one layer run alone (what a single-layer decode
benchmark times); ``layer_s`` is the steady-state per-layer time inside the model, with the
method's cross-layer overlap.

Host memory: the method's footprint's host bytes placed on the profile's DRAM, then CXL
(:mod:`hybridgen.perf.host_tiers`): ``host_bytes`` {'dram', 'cxl'}, ``fits_host`` (False
beyond DRAM + CXL); the CXL share of the method's DRAM reads is priced at the CXL rate
(``CostContext.spill``), and every breakdown states the bytes, the fraction and the rates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

from hybridgen.errors import ConfigError
from hybridgen.methods.registry import build_method
from hybridgen.perf.context import CostContext, LayerCost
from hybridgen.perf.host_tiers import host_tiers_of
from hybridgen.perf.profiles import HardwareProfile, load_profile
from hybridgen.shapes import ModelShape, Workload, as_model_shape


class NotModelled(ConfigError):
    """The method has no performance-model cost (its ``layer_cost`` returns None)."""


@dataclass(frozen=True)
class StepPrediction:
    """A PROJECTED decode step (seconds). cpu/gpu/transfer are totals over the layers;
    attention_layer_s and layer_s are per layer; breakdown holds per-layer components and
    bytes; cost names the cost function that priced the layer; host_bytes: the bytes of the
    method's host state (KV, codes, sketches) assumed on each host tier, keys 'dram' and 'cxl'
    (empty: unknown, read as zeros); fits_host: the host's DRAM + CXL hold them. ``projected``
    is always True: this is a model, not a measurement."""

    method: str
    profile: str
    total_s: float
    cpu_branch_s: float
    gpu_branch_s: float
    transfer_s: float
    attention_layer_s: float
    layer_s: float
    breakdown: Dict[str, float]
    fits_gpu: bool
    cost: str = ""
    projected: bool = True
    fits_host: bool = True
    host_bytes: Dict[str, float] = field(default_factory=dict)

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.total_s if self.total_s > 0 else float("inf")

    def __str__(self) -> str:
        return (f"[projected] {self.method} on {self.profile}: step {self.total_s * 1e3:.2f} ms, "
                f"attention/layer {self.attention_layer_s * 1e3:.3f} ms (cpu {self.cpu_branch_s * 1e3:.2f} ms, "
                f"gpu {self.gpu_branch_s * 1e3:.2f} ms, transfer {self.transfer_s * 1e3:.2f} ms)"
                + ("" if self.fits_gpu else " [does not fit in GPU memory]")
                + ("" if self.fits_host else " [does not fit host memory]"))


def _as_method(method: Any) -> Any:
    if isinstance(method, str):
        return build_method(method)
    return method


def predict_step(method: Any, model: Union[str, ModelShape, Any], workload: Workload,
                 profile: Union[str, Path, HardwareProfile],
                 measured: Optional[Mapping[str, float]] = None) -> StepPrediction:
    """PROJECTED time of one decode step of ``method`` (see the module docstring).

    method: a KVMethod instance (its own parameters are priced) or a registered method name
    (built with its defaults); model: a ModelShape, an engine ModelSpec or a shipped model
    name; profile: a profile name, a profile JSON path, or a HardwareProfile; measured: what an
    emulated run of the method measured, priced instead of its assumption where its cost reads
    it (``CostContext.measured``, e.g. InfiniGen's 'fetch_fraction'). Raises
    :class:`NotModelled` when the method has no cost (``layer_cost`` missing or None).
    """
    m = _as_method(method)
    name = getattr(m, "name", type(m).__name__)
    shape = as_model_shape(model)
    hw = load_profile(profile)
    c = CostContext(shape, workload, hw)
    host = host_tiers_of(m, c.kv_shape(), hw)
    c.spill = host.spill_fraction if host is not None else 0.0
    c.measured = dict(measured or {})
    layer_cost = getattr(m, "layer_cost", None)
    lay = layer_cost(c) if callable(layer_cost) else None
    if lay is None:
        raise NotModelled(f"{name} has no performance-model cost (not modelled); "
                          f"give its class a layer_cost(c) method (see hybridgen.perf.costs)")
    if not isinstance(lay, LayerCost):
        raise ConfigError(f"{name}.layer_cost returned {type(lay).__name__}; return a hybridgen.perf.LayerCost or None")
    L = shape.num_layers
    gpu_bytes = c.weights_bytes + (L * lay.gpu_tokens + lay.staging_tokens) * c.B * c.kv_tok
    breakdown = dict(lay.breakdown)
    breakdown.update({"lm_head_s": c.head, "gpu_resident_bytes": gpu_bytes, "layers": L}, **c.host_rates())
    if host is not None:
        breakdown.update(host_dram_bytes=host.dram_bytes, host_cxl_bytes=host.cxl_bytes)
    return StepPrediction(method=name, profile=hw.name, total_s=L * lay.layer + c.head,
                          cpu_branch_s=L * lay.cpu, gpu_branch_s=L * lay.gpu + c.head, transfer_s=L * lay.transfer,
                          attention_layer_s=lay.attn, layer_s=lay.layer, breakdown=breakdown,
                          fits_gpu=gpu_bytes <= hw.gpu.memory_gb * 1e9, cost=lay.label,
                          fits_host=host is None or host.fits, host_bytes=host.as_dict() if host is not None else {})


def fastest_setting(method: Any, parameter: str, choices: Any, model: Union[str, ModelShape, Any],
                    workload: Workload, profile: Union[str, Path, HardwareProfile]) -> Any:
    """The value of ``method``'s ``parameter`` among ``choices`` whose PROJECTED step is shortest
    (the method's other settings kept), e.g. HybridGen's ``ship`` on 'h200-host'."""
    import dataclasses

    steps = {c: predict_step(dataclasses.replace(method, **{parameter: c}), model, workload, profile).total_s
             for c in choices}
    return min(steps, key=steps.get)
