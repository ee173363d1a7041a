"""UVM and UVM + H2O: PROJECTED-only rows of the paper's comparison (never run here).

InfiniGen's artifact compares against CUDA unified memory: the KV cache is allocated as
managed memory larger than the GPU, and the driver migrates pages on demand (UVM + H2O: the
same with H2O's kept set). We do not run them: oversubscribed managed memory thrashes the
GPU's page tables and can stall or hang a GPU that other jobs share, and its speed depends on
the driver's eviction policy. They are methods of the registry so projections can list them
(``build_method('uvm')``, :func:`hybridgen.perf.predict_step`); ``bind`` refuses in one line.
Their footprint: the kept KV (``budget`` of the context) up to ``gpu_kv`` bytes resident on the
GPU, the rest in host memory (managed pages). Their cost is :func:`uvm_cost`: the KV that does
not fit (the footprint's host part, S_h of the kept tokens) migrates by page faults each step,
B*S_h*kv_tok at UVM_MIGRATION_SHARE of the pinned link rate + one fault-batch latency per
UVM_FAULT_BATCH_BYTES; the kernel stalls on its faults (no overlap):
layer = rest + gpu_attn(kept) + migrate.

Parameters: budget (UVM + H2O's kept share; 1.0 = plain UVM); gpu_kv (GPU bytes left to the
KV, e.g. '20GiB'; None = the profile's GPU memory minus the weights), set by the placement
from ``memory.gpu_kv``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from hybridgen.errors import ConfigError
from hybridgen.methods.budget import Budget
from hybridgen.methods.params import KeptBudget
from hybridgen.methods.protocol import KVMethod, MethodContext

# UVM demand paging (model assumptions, not measured here: UVM is never run): fault-driven
# migration reaches a fraction of the pinned copy rate, and each batch of faults (about 2 MiB of
# pages) pays a fault-handling latency on top
UVM_MIGRATION_SHARE = 0.5
UVM_FAULT_BATCH_BYTES = 2 << 20
UVM_FAULT_US = 30.0
PROJECTED_ONLY_REASON = ("projected only, never run: oversubscribed CUDA managed memory (UVM) migrates "
                         "pages on demand and can stall or hang a shared GPU")


@dataclass
class UVM(KVMethod):
    """All KV in managed memory larger than the GPU (projected only, see the module doc)."""

    name: ClassVar[str] = "uvm"
    projected_only: ClassVar[str] = PROJECTED_ONLY_REASON
    budget: KeptBudget = Budget(ratio=1.0)
    gpu_kv: Optional[str] = None

    def check(self) -> None:
        from hybridgen.kv.tiers import parse_bytes

        if self.gpu_kv is not None:
            parse_bytes(self.gpu_kv)

    def bind(self, ctx: MethodContext) -> None:
        raise ConfigError(f"method {self.name!r} is {PROJECTED_ONLY_REASON}; use it with exp.kind=project")

    def footprint(self, shape: "KVShape", room: Optional[float] = None) -> "Footprint":
        """The kept KV (``budget`` of the context, no masks: never run) resident on the GPU up to
        ``room`` bytes (default ``gpu_kv``; None: all of it), the rest in host memory."""
        from hybridgen.kv.tiers import parse_bytes
        from hybridgen.methods.footprint import Footprint

        kept = self.budget.share(shape.context) * shape.context
        total = kept * shape.layers * shape.batch * shape.token_bytes
        room = parse_bytes(self.gpu_kv) if room is None and self.gpu_kv is not None else room
        resident = total if room is None else min(total, max(0.0, float(room)))
        per = shape.layers * shape.batch * shape.token_bytes
        return Footprint(gpu_tokens=resident / per, host_tokens=(total - resident) / per,
                         tier_bytes={t: int(n) for t, n in (("gpu", resident), ("dram", total - resident)) if n})

    def placement_for(self, gpu_kv_bytes: int, shape) -> Optional[dict]:
        """Managed memory holds everything; the budget sets what stays resident."""
        return {"gpu_kv": str(int(gpu_kv_bytes))}

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED (:func:`uvm_cost`); GPU room: ``gpu_kv``, or the profile's GPU memory minus the weights."""
        from hybridgen.methods.footprint import with_memory

        shape = c.kv_shape()
        room = None if self.gpu_kv is not None else c.hw.gpu.memory_gb * 1e9 - c.weights_bytes
        fp = self.footprint(shape, room)
        return with_memory(uvm_cost(c, self.budget.share(c.S), fp.host_bytes / shape.layers), fp, shape)


def uvm_cost(c: "CostContext", kept_ratio: float, spill_bytes: float) -> "LayerCost":
    """UVM (managed memory, oversubscribed) over the kept ``kept_ratio`` of the context (1.0:
    plain UVM; an H2O budget: UVM + H2O); spill_bytes: KV bytes per layer that do not stay
    resident (the footprint's host part), migrated by page faults every step (module docstring).
    PROJECTED only: never run (oversubscription can hang a shared GPU)."""
    from hybridgen.perf.context import LayerCost

    kept = kept_ratio * c.S
    rate = UVM_MIGRATION_SHARE * c.hw.link.h2d_pinned_gbps * 1e9
    spill = spill_bytes
    migrate = spill / rate + math.ceil(spill / UVM_FAULT_BATCH_BYTES) * UVM_FAULT_US * 1e-6 if spill else 0.0
    gpu = c.gpu_attn(kept)
    if kept_ratio < 1.0:  # H2O's score update
        gpu += c.B * c.Hq * kept * 4 * 2 / (c.hw.gpu.hbm_gbps * 1e9) + c.launch
    attn = gpu + migrate
    return LayerCost(attn=attn, layer=c.rest + attn, gpu=c.rest + gpu, transfer=migrate,
                     breakdown={"migrated_bytes": spill, "migrate_s": migrate, "gpu_attn_s": gpu, "rest_s": c.rest,
                                "kept_tokens": kept},
                     label="uvm" if kept_ratio >= 1.0 else "uvm-h2o")


@dataclass
class UVMH2O(UVM):
    """UVM with H2O's kept set (heavy hitters + recent, 20% by default); projected only."""

    name: ClassVar[str] = "uvm-h2o"
    budget: KeptBudget = Budget(ratio=0.2)
