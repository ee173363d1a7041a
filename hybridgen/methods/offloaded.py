"""Offloading as a wrapper: ``Offloaded(inner, mode, host_tier)`` runs any evicting method with
its kept KV on the host ("H2O on FlexGen").

The inner method (a GPU-resident :class:`~hybridgen.methods.evicting.EvictingMethod`) still
decides which tokens it keeps; the wrapper gives it a
:class:`~hybridgen.methods.kept_kv.KeptKVOffload` in ``mode`` when it is bound, and owns what
the mode adds to the step:

- ``'stream'``: the kept KV on ``host_tier``, copied into two gpu staging slots a layer ahead
  (the engine's ``on_layer_input`` hook starts the next layer's copy);
- ``'cpu'``: KV and metadata on ``host_tier``; each layer's whole decode step runs on the CPU
  pool next to it (q, k, v down, the output up).

The outputs are the resident method's, bit for bit (tests/test_offload.py and
:func:`hybridgen.testing.conformance`). From a config, an evicting method's ``offload`` /
``host_tier`` parameters build the wrapper (:meth:`EvictingMethod.composed`, called by
``build_method``), so ``method=h2o method.params.offload=stream`` and the ``*-offload`` presets
keep their names, parameters and run identities. Its footprint, placement and cost are the
inner method's layout in this mode (:func:`~hybridgen.methods.evicting.layout_footprint`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Literal, Optional

from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.methods.evicting import EvictingMethod
from hybridgen.methods.kept_kv import KeptKVOffload
from hybridgen.methods.params import HostTier
from hybridgen.methods.protocol import KVMethod, MethodContext


@dataclass
class Offloaded(KVMethod):
    """An evicting method with its kept KV on the host (module doc).

    inner: a GPU-resident EvictingMethod (offload 'none', tier 'gpu'); mode: 'stream' | 'cpu';
    host_tier: 'dram' | 'cxl'. ``name`` and ``stats`` are the inner method's.
    """

    name: ClassVar[str] = "offloaded"
    inner: Any = None
    mode: Literal["stream", "cpu"] = "stream"
    host_tier: HostTier = "dram"

    def check(self) -> None:
        if not isinstance(self.inner, EvictingMethod):
            raise ConfigError(f"Offloaded wraps an evicting method (an EvictingMethod), got {type(self.inner).__name__}")
        if self.inner.offload != "none" or self.inner.tier != "gpu":
            raise ConfigError(f"Offloaded({self.inner.name!r}): give the GPU-resident method (offload 'none', "
                              f"tier 'gpu'), got offload={self.inner.offload!r}, tier={self.inner.tier!r}")

    def __post_init__(self):
        self.name = self.inner.name  # results, logs and the run identity name the inner method

    def configured(self) -> KVMethod:
        """The inner method with this mode as its parameters (its footprint, cost and config)."""
        return dataclasses.replace(self.inner, offload=self.mode, host_tier=self.host_tier)

    # -- lifecycle -------------------------------------------------------------------
    def bind(self, ctx: MethodContext) -> None:
        self.ctx = ctx
        self.inner.bind(ctx)
        self.inner.kept = KeptKVOffload(self.inner, self.mode, "gpu", self.host_tier)
        self.stats = self.inner.stats

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        self.inner.prefill(layer, q, k, v, valid)

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.inner.kept.on_layer_input(layer)
        self.inner.on_layer_input(layer, hidden)

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.mode == "cpu":
            return self.inner.kept.on_host(self.inner.decode, layer, q, k, v)
        return self.inner.decode(layer, q, k, v)

    def end_step(self) -> None:
        self.inner.end_step()

    def release(self) -> None:
        self.inner.release()

    def held_bytes(self) -> Dict[str, int]:
        return self.inner.held_bytes()

    # -- what it holds, where it goes, what it costs: the inner layout in this mode ---------
    def footprint(self, shape: Any) -> Any:
        return self.configured().footprint(shape)

    def placement_for(self, gpu_kv_bytes: int, shape: Any) -> Optional[Dict[str, Any]]:
        return self.configured().placement_for(gpu_kv_bytes, shape)

    def layer_cost(self, c: Any) -> Any:
        return self.configured().layer_cost(c)

    def config(self) -> Dict[str, Any]:
        return self.configured().config()

    def output_config(self) -> Dict[str, Any]:
        return self.configured().output_config()

    def __getattr__(self, attr: str) -> Any:
        """The inner method's state (its caches, counters) for inspection."""
        if attr.startswith("__") or attr == "inner":
            raise AttributeError(attr)
        return getattr(self.__dict__.get("inner"), attr)
