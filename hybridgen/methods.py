"""The KV-method protocol every method implements, budgets, and the method registry.

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
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, Optional, Type, Union

import torch
from torch import Tensor

from hybridgen.errors import ConfigError, unknown_name
from hybridgen.kv.tiers import TieredStore


@dataclass(frozen=True)
class Budget:
    """A KV budget: a ratio of the context (0 < ratio <= 1) or an absolute token count.

    Parse user text with :meth:`parse`: '20%', '0.2', '512' (tokens), '512t'.
    """

    ratio: Optional[float] = None
    tokens: Optional[int] = None

    def __post_init__(self):
        if (self.ratio is None) == (self.tokens is None):
            raise ConfigError("a budget is either a ratio (e.g. 0.2 or '20%') or a token count (e.g. 512), not both")
        if self.ratio is not None and not (0.0 <= self.ratio <= 1.0) or (isinstance(self.ratio, float) and math.isnan(self.ratio)):
            raise ConfigError(f"a budget ratio must be in [0, 1], got {self.ratio}")
        if self.tokens is not None and self.tokens < 0:
            raise ConfigError(f"a budget token count must be >= 0, got {self.tokens}")

    @classmethod
    def parse(cls, value: Union["Budget", str, float, int, dict]) -> "Budget":
        if isinstance(value, Budget):
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - {"ratio", "tokens"})
            if unknown:
                raise ConfigError(f"a budget has only 'ratio' or 'tokens', not {', '.join(map(repr, unknown))}")
            return cls(**value)
        if isinstance(value, bool):
            raise ConfigError(f"cannot read {value!r} as a budget; write e.g. 0.2, '20%' or 512")
        if isinstance(value, float):
            return cls(ratio=value)
        if isinstance(value, int):
            return cls(tokens=value)
        text = str(value).strip().lower()
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*%", text)
        if m:
            return cls(ratio=float(m.group(1)) / 100)
        m = re.fullmatch(r"([0-9]+)\s*t?(?:okens)?", text)
        if m:
            return cls(tokens=int(m.group(1)))
        m = re.fullmatch(r"[0-9]*\.[0-9]+|[01]", text)
        if m:
            return cls(ratio=float(text))
        raise ConfigError(f"cannot read {value!r} as a budget; write e.g. 0.2, '20%' or 512")

    def resolve(self, context_len: int) -> int:
        """Tokens allowed for a context of ``context_len`` tokens (at least 0, at most the context)."""
        if self.tokens is not None:
            return min(self.tokens, context_len)
        return min(context_len, int(math.ceil(self.ratio * context_len)))

    def __str__(self) -> str:
        return f"{self.ratio:g}" if self.ratio is not None else f"{self.tokens}t"


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

    Counters every method keeps (``stats``): 'bytes_h2d' (host->GPU bytes moved),
    'bytes_d2h', plus method-specific ones. The engine reads ``stats`` and the store.
    """

    name: ClassVar[str] = "abstract"
    ctx: Optional[MethodContext] = field(default=None, init=False, repr=False, compare=False)
    stats: Dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)

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


# ------------------------------------------------------------------------- registry
_REGISTRY: Dict[str, Callable[..., KVMethod]] = {}


def register(name: str) -> Callable[[Type[KVMethod]], Type[KVMethod]]:
    """Class decorator: make a method constructible by name."""

    def deco(cls: Type[KVMethod]) -> Type[KVMethod]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_builtin_methods() -> None:
    import baselines  # noqa: F401  (registers the baselines)
    import hybridgen.hybrid_exact  # noqa: F401
    import hybridgen.hybrid  # noqa: F401


def available_methods() -> list:
    _load_builtin_methods()
    return sorted(_REGISTRY)


def build_method(name: str, **params: Any) -> KVMethod:
    """A fresh method instance by registry name; unknown names or parameters fail in one line.

    Parameters named 'budget' or ending in '_budget' accept budget text ('20%', 512, 0.2).
    """
    _load_builtin_methods()
    if name not in _REGISTRY:
        raise unknown_name("method", name, _REGISTRY)
    cls = _REGISTRY[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    bad = sorted(set(params) - set(fields))
    if bad:
        raise ConfigError(f"method {name!r} has no parameter {', '.join(map(repr, bad))}; "
                          f"its parameters are: {', '.join(sorted(fields)) or 'none'}")
    for key, val in list(params.items()):
        if key == "budget" or key.endswith("_budget"):
            params[key] = Budget.parse(val)
    try:
        return cls(**params)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"bad parameters for method {name!r}: {err}") from None
