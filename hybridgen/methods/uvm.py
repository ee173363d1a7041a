"""UVM and UVM + H2O: PROJECTED-only rows of the paper's comparison (never run here).

InfiniGen's artifact compares against CUDA unified memory: the KV cache is allocated as
managed memory larger than the GPU, and the driver migrates pages on demand (UVM + H2O: the
same with H2O's kept set). We do not run them: oversubscribed managed memory thrashes the
GPU's page tables and can stall or hang a GPU that other jobs share, and its speed depends on
the driver's eviction policy. They are methods of the registry so projections can list them
(``build_method('uvm')``, :func:`hybridgen.perf.predict_step`); ``bind`` refuses in one line.
Their cost is :func:`hybridgen.perf.costs.uvm_cost` (page migration of the KV that does not
fit, every step, stalling the kernels).

Parameters: budget (UVM + H2O's kept share; 1.0 = plain UVM); gpu_kv (GPU bytes left to the
KV, e.g. '20GiB'; None = the profile's GPU memory minus the weights), set by the placement
from ``memory.gpu_kv``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from hybridgen.errors import ConfigError
from hybridgen.methods.budget import Budget
from hybridgen.methods.params import KeptBudget
from hybridgen.methods.protocol import KVMethod, MethodContext

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

    def placement_for(self, gpu_kv_bytes: int, shape) -> Optional[dict]:
        """Managed memory holds everything; the budget sets what stays resident."""
        return {"gpu_kv": str(int(gpu_kv_bytes))}

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED: attention over the kept KV plus the page migration of what does not fit."""
        from hybridgen.kv.tiers import parse_bytes
        from hybridgen.perf.costs import uvm_cost

        return uvm_cost(c, c.fraction(self.budget), parse_bytes(self.gpu_kv))


@dataclass
class UVMH2O(UVM):
    """UVM with H2O's kept set (heavy hitters + recent, 20% by default); projected only."""

    name: ClassVar[str] = "uvm-h2o"
    budget: KeptBudget = Budget(ratio=0.2)
