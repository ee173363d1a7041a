"""The KV-method protocol every method implements (``KVMethod``) and what it is bound to (``MethodContext``).

A method decides, per layer, what happens to the prompt's KV after prefill (store, place,
compress, evict) and how one decode step attends over what it kept. The engine calls:

    method.bind(ctx)                         once per generation
    method.prefill(layer, q, k, v, valid)    after each layer's dense causal prefill attention
    method.on_layer_input(layer, hidden)     before each layer at a decode step (speculation hooks)
    method.decode(layer, q, k, v) -> out     each layer at each decode step
    method.end_step()                        after each decode step
    method.release()                         frees every tier allocation

Shapes: q [B, Hq, T, D], k and v [B, Hkv, T, D] with rotary already applied; at decode T = 1.
Methods keep per-layer state in their own lists and allocate all KV memory through
``ctx.store`` so bytes per tier are accounted exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict, FrozenSet, Mapping, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.kv.tiers import TieredStore
from hybridgen.methods.budget import Budget
from hybridgen.methods.params import coerce_fields

if TYPE_CHECKING:  # the performance model's types (hybridgen.perf); only for annotations
    from hybridgen.perf.costs import CostContext, LayerCost


@dataclass
class MethodContext:
    """What a method knows about the model and the run when it is bound.

    num_heads/num_kv_heads/head_dim: attention shape; scale: softmax scale (1/sqrt(D)).
    prompt_len: padded prompt length T; max_new_tokens: decode steps to come.
    compute_device: device of q/k/v handed to the method (the 'gpu' tier's device).
    rotary: the engine's rotary embedding (None for learned positions, e.g. OPT); it offers
    ``rotate(x, positions)`` so methods may re-assign positions inside the cache.
    engine: the decoder engine (speculative methods read next-layer weights through it).
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    batch_size: int
    prompt_len: int
    max_new_tokens: int
    dtype: torch.dtype
    compute_device: torch.device
    store: TieredStore
    pool: Any = None
    rotary: Any = None
    engine: Any = None

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_new_tokens


@dataclass
class KVMethod:
    """Base class of every KV method. Subclasses are dataclasses of their hyper-parameters.

    ``name`` (a class attribute) is the registry name. Fields are converted and checked from
    their declared types when the method is built (:mod:`hybridgen.methods.params`), then
    :meth:`check` runs the method's own cross-field checks; both raise one-line ConfigErrors
    before any model loads. A subclass puts its checks in ``check`` (a ``__post_init__`` of its
    own still runs after the conversion).

    Counters every method keeps (``stats``): 'bytes_h2d' (host->GPU bytes moved),
    'bytes_d2h', plus method-specific ones. The engine reads ``stats`` and the store.
    """

    name: ClassVar[str] = "abstract"
    #: parameters that only decide where bytes live or how they move, never what the method attends
    #: to: its tokens and logits do not depend on them (tests/test_placement_params.py checks each)
    placement_params: ClassVar[FrozenSet[str]] = frozenset()
    ctx: Optional[MethodContext] = field(default=None, init=False, repr=False, compare=False)
    stats: Dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "_converts_fields", False):
            def __post_init__(self, _own=own):
                KVMethod.__post_init__(self)
                _own(self)
            __post_init__._converts_fields = True
            cls.__post_init__ = __post_init__

    def __post_init__(self):
        coerce_fields(self, type(self).name)
        self.check()

    def check(self) -> None:
        """Cross-field checks of the hyper-parameters (raise ConfigError); called when built."""

    def composed(self) -> "KVMethod":
        """The method to run for these parameters: itself, or a composition built from them
        (an evicting method's ``offload`` wraps it in ``Offloaded``); ``build_method`` calls it."""
        return self

    # -- lifecycle -------------------------------------------------------------------
    def bind(self, ctx: MethodContext) -> None:
        """Attach to a run. Subclasses call super().bind(ctx) then set up per-layer state."""
        self.ctx = ctx
        self.stats = {"bytes_h2d": 0, "bytes_d2h": 0}

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        """Take the prompt's KV of ``layer``. valid: [B, T] bool (False = left padding) or None."""
        raise NotImplementedError

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        """Decode-step hook before ``layer`` runs. hidden: [B, 1, hidden_size] (the layer input)."""

    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """One decode step of ``layer``: store the new token's k/v, return attention [B, Hq, 1, D]."""
        raise NotImplementedError

    def end_step(self) -> None:
        """Called after every layer of one decode step ran."""

    def release(self) -> None:
        """Free all KV memory this method holds."""

    # -- performance model -----------------------------------------------------------
    def layer_cost(self, c: "CostContext") -> Optional["LayerCost"]:
        """PROJECTED cost of one decode-step layer on ``c``'s hardware, or None (not modelled).

        A method that wants projected numbers returns a ``hybridgen.perf.LayerCost`` built
        from the primitives of ``c`` (see ``hybridgen/perf/costs.py``); without it, projected
        columns say "not modelled" and every measured column still works.
        """
        return None

    # -- memory: stated once --------------------------------------------------------
    def footprint(self, shape: Any) -> Optional[Any]:
        """What this method holds where on the workload ``shape`` (a
        :class:`hybridgen.methods.footprint.KVShape`): a :class:`~hybridgen.methods.footprint.Footprint`
        with its KV tokens per tier and the exact bytes it allocates per tier, or None (not
        stated). Its placement (:meth:`placement_for`), the cost's ``gpu_tokens`` and the
        conformance check of the store ledger all derive from this one statement."""
        return None

    # -- placement under one GPU memory budget ---------------------------------------
    def placement_for(self, gpu_kv_bytes: int, shape: Any) -> Optional[Dict[str, Any]]:
        """Parameter overrides that place this method's KV within ``gpu_kv_bytes`` of GPU memory
        for the workload ``shape`` (a :class:`hybridgen.methods.placement.KVShape`), counting
        everything it allocates on the gpu tier; None = this method cannot derive its placement.
        Raise a one-line ConfigError when it cannot fit at all (see ``placement.refuse``)."""
        return None

    # -- reporting -------------------------------------------------------------------
    def count(self, key: str, amount: float) -> None:
        self.stats[key] = self.stats.get(key, 0) + amount

    def config(self) -> Dict[str, Any]:
        """Hyper-parameters as plain values (for result files)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.init:
                val = getattr(self, f.name)
                out[f.name] = str(val) if isinstance(val, Budget) else val
        return out

    def output_config(self) -> Dict[str, Any]:
        """The parameters this method's tokens and logits depend on: :meth:`config` without the
        ``placement_params`` (two configs with equal output configs give the same outputs, so an
        accuracy measured for one holds for the other)."""
        return {k: v for k, v in self.config().items() if k not in self.placement_params}

    def scheduled_params(self) -> Tuple[str, ...]:
        """The parameters this run adapts as it goes (e.g. a scheduler-owned ratio left None); ()
        for a method whose parameters all hold still. Their values in a result follow the timings of
        the machine that made it."""
        return ()

    def priced_knobs(self, breakdown: Mapping[str, Any]) -> Dict[str, Any]:
        """The :meth:`scheduled_params` at the values a projection priced them (read from its
        prediction's ``breakdown``). An accuracy belongs next to a projected speed only when measured
        with the method's parameters updated with these."""
        return {k: float(breakdown[k]) for k in self.scheduled_params() if k in breakdown}
