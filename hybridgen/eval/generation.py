"""Measured generation and teacher-forced scoring on the engine, for any KV method.

- :func:`make_store` builds the run's TieredStore from a hardware config (capacities, NUMA).
- :func:`teacher_forced_logits` prefills a prompt through the method and then feeds GIVEN
  tokens by decode steps: the logits at every step are the method's next-token distribution
  over the same context as the reference's. This is how fidelity (top-1 agreement, KL) is
  measured, and how lm-eval continuations are scored so that a KV method acts on them.
- :func:`scheduler_trace` finds a method's scheduler decisions, if it has any.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.kv import TieredStore, parse_bytes


def weight_bytes(engine) -> int:
    w = getattr(engine, "weights", None)
    if w is not None and hasattr(w, "nbytes"):
        n = w.nbytes() if callable(w.nbytes) else w.nbytes
        return int(n)
    return int(engine.spec.param_count() * torch.empty((), dtype=engine.dtype).element_size())


def resolve_capacities(hw: Mapping[str, Any], engine=None) -> Dict[str, Optional[int]]:
    """Bytes per tier from a hardware config; 'auto' gpu = gpu_memory x gpu_kv_fraction - weights
    (:func:`hybridgen.methods.placement.auto_gpu_kv`, the engine's real weight bytes)."""
    from hybridgen.methods.placement import auto_gpu_kv, is_auto, store_capacities

    gpu = hw.get("gpu_capacity")
    if is_auto(gpu):
        gpu_bytes = auto_gpu_kv(hw, weight_bytes(engine) if engine is not None else 0, "hardware.gpu_capacity")
    else:
        gpu_bytes = parse_bytes(gpu)
    return store_capacities(hw, gpu_bytes)


def make_store(hw: Mapping[str, Any], engine=None, capacities: Optional[Mapping[str, Optional[int]]] = None
               ) -> TieredStore:
    """A fresh TieredStore for one generation from a hardware config (NUMA nodes) and its tier
    ``capacities`` (default: :func:`resolve_capacities` of the config; a run point under
    memory.gpu_kv passes its Placement's). DRAM spills to the cxl tier (``TieredStore(spill=True)``):
    host KV past hardware.dram_capacity lives on CXL, as the projection places it."""
    caps = resolve_capacities(hw, engine) if capacities is None else capacities
    cxl_node = hw.get("cxl_node", "auto")
    return TieredStore(gpu=caps["gpu"], dram=caps["dram"], cxl=caps["cxl"], cxl_node=cxl_node,
                       dram_node=hw.get("dram_node"), spill=True,
                       gpu_device=None if engine is None else engine.device)


@torch.no_grad()
def teacher_forced_logits(engine, method, input_ids: Tensor, attention_mask: Optional[Tensor],
                          tokens: Tensor, store=None, pool=None, progress: bool = False,
                          shared_prefill: Any = None) -> Tensor:
    """Logits [B, n, V] (float32) of ``method`` when the n given ``tokens`` [B, n] are fed back.

    logits[:, 0] come from the prefill; logits[:, t] (t >= 1) from the decode step fed tokens[:, t-1].
    shared_prefill: the recorded dense prefill of these inputs (hybridgen.model.shared_prefill).
    The method is released before returning.
    """
    n = int(tokens.shape[1])
    if n < 1:
        raise ConfigError("teacher forcing needs at least one token")
    try:
        out = [engine.prefill(input_ids, attention_mask, method, store=store, max_new_tokens=n, pool=pool,
                              shared_prefill=shared_prefill)]
        steps = range(n - 1)
        if progress:
            from tqdm.auto import tqdm
            steps = tqdm(steps, desc=f"teacher-forced [{method.name}]", unit="tok", leave=False)
        for t in steps:
            out.append(engine.decode_step(tokens[:, t], method))
    finally:
        engine.release()
    return torch.stack(out, 1)


def scheduler_trace(method) -> Optional[Dict[str, Any]]:
    """The method's trace as ``{"scheduler": [decision dicts], ...}`` if it keeps one, else None.

    Accepts a ``trace`` attribute that is a list of decisions or a dict holding a 'scheduler'
    list (plus anything else, e.g. HybridGen's stand-in cosine per layer), on the method or on
    its ``scheduler``.
    """
    for holder in (method, getattr(method, "scheduler", None)):
        tr = getattr(holder, "trace", None) if holder is not None else None
        if isinstance(tr, list):
            return {"scheduler": list(tr)}
        if isinstance(tr, dict) and isinstance(tr.get("scheduler"), list):
            return dict(tr)
    return None


def step_stats(step_s: List[float]) -> Dict[str, Optional[float]]:
    """Mean / median / p90 / max of decode step times, in milliseconds."""
    if not step_s:
        return {"mean_ms": None, "p50_ms": None, "p90_ms": None, "max_ms": None}
    xs = sorted(step_s)

    def q(p: float) -> float:
        i = min(len(xs) - 1, max(0, int(math.ceil(p * len(xs))) - 1))
        return xs[i] * 1e3

    return {"mean_ms": 1e3 * sum(xs) / len(xs), "p50_ms": q(0.5), "p90_ms": q(0.9), "max_ms": xs[-1] * 1e3}


def fidelity_metrics(ref_logits: Tensor, logits: Tensor) -> Dict[str, float]:
    """top-1 agreement and mean KL(ref || method) via hybridgen.eval.fidelity (shapes [B, n, V])."""
    from hybridgen.eval.fidelity import fidelity

    out = fidelity(ref_logits, logits)
    return {k: float(v) for k, v in dict(out).items()}
