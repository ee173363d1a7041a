"""What a method holds where: the workload's KV shape and a method's footprint on it.

A method states its memory ONCE, in ``KVMethod.footprint(shape) -> Footprint``: the KV tokens
it keeps per tier and the exact bytes it allocates per tier (KV, masks, per-token metadata,
staging slots, sketches). Everything else derives from that statement:

- its placement under a GPU memory budget (:func:`fit_first`, :func:`fit_share`: the
  parameters whose footprint fits ``memory.gpu_kv``),
- the performance model's ``LayerCost.gpu_tokens`` / ``staging_tokens``,
- the conformance check (:func:`hybridgen.testing.conformance`): the store ledger's peak per
  tier after a real run equals ``footprint(shape).tier_bytes``.

Shapes: ``token_bytes`` = K+V bytes of one token of one sequence in one layer; ``mask_bytes``
= one validity byte per KV head and token when the batch is left-padded (``masked``, the
placement's worst case), else 0 (the projection's unpadded batch).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from hybridgen.errors import ConfigError
from hybridgen.shapes import DTYPE_BYTES, as_model_shape


@dataclass(frozen=True)
class KVShape:
    """The workload's KV shape: layers, KV heads, head dim, bytes per element, batch rows,
    context (prompt + generated tokens per row), new_tokens (the generated part) and masked
    (left-padded rows: methods allocate a validity mask next to their KV)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    batch: int
    context: int
    new_tokens: int = 0
    masked: bool = True

    def __post_init__(self):
        for f in ("layers", "kv_heads", "head_dim", "dtype_bytes", "batch", "context"):
            if int(getattr(self, f)) <= 0:
                raise ConfigError(f"KV shape: {f} must be positive, got {getattr(self, f)!r}")
        if not 0 <= self.new_tokens < self.context:
            raise ConfigError(f"KV shape: new_tokens must be in [0, context), got {self.new_tokens!r}")

    @property
    def prompt(self) -> int:
        """Prompt tokens per row."""
        return self.context - self.new_tokens

    @property
    def token_bytes(self) -> int:
        """K+V bytes of one token of one sequence in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def mask_bytes(self) -> int:
        """Validity-mask bytes of one token of one sequence in one layer (one bool per KV head;
        0 when the batch is not padded)."""
        return self.kv_heads if self.masked else 0

    @property
    def full_bytes(self) -> int:
        """The whole KV cache of the workload (every layer, row and token, with masks)."""
        return self.layers * self.batch * self.context * (self.token_bytes + self.mask_bytes)

    def kv_bytes(self, tokens: float, layers: Optional[int] = None, mask: bool = True) -> int:
        """Bytes of ``tokens`` tokens per row in ``layers`` layers (default all), masks included."""
        per = self.token_bytes + (self.mask_bytes if mask else 0)
        return int((self.layers if layers is None else layers) * self.batch * tokens * per)

    def tokens_in(self, nbytes: float, layers: Optional[int] = None, per_token_extra: int = 0) -> int:
        """Tokens per sequence per layer that ``nbytes`` holds over ``layers`` layers (default all)."""
        per = (layers or self.layers) * self.batch * (self.token_bytes + self.mask_bytes + per_token_extra)
        return max(0, int(nbytes // per))

    @classmethod
    def of_model(cls, model: Any, batch: int, prompt_len: int, gen_len: int, dtype: str = "bf16") -> "KVShape":
        """From a shipped model name, a :class:`hybridgen.shapes.ModelShape` or an engine ModelSpec."""
        s = as_model_shape(model)
        if dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown KV dtype {dtype!r}; choose one of: {', '.join(DTYPE_BYTES)}")
        return cls(s.num_layers, s.num_kv_heads, s.head_dim, DTYPE_BYTES[dtype], int(batch),
                   int(prompt_len) + int(gen_len), int(gen_len))


@dataclass(frozen=True)
class Footprint:
    """A method's memory on one workload, the single statement every other use derives from.

    gpu_tokens: KV tokens per row per layer resident on the gpu tier (mean over layers);
    host_tokens: KV tokens per row per layer on the host tiers (dram / cxl);
    staging_tokens: KV tokens per row of model-wide gpu staging slots (not per layer);
    tier_bytes: exact peak bytes per tier name ('gpu', 'dram', 'cxl') of everything the
    method allocates through the store: KV, masks, metadata, staging, sketches;
    shared_gpu_bytes: the part of tier_bytes['gpu'] that is model-wide (staging slots, fetch
    buffers, positions), not per layer.
    """

    gpu_tokens: float
    host_tokens: float = 0.0
    staging_tokens: float = 0.0
    tier_bytes: Mapping[str, int] = field(default_factory=dict)
    shared_gpu_bytes: int = 0

    @property
    def gpu_bytes(self) -> int:
        return int(self.tier_bytes.get("gpu", 0))

    @property
    def host_bytes(self) -> int:
        return int(sum(n for t, n in self.tier_bytes.items() if t != "gpu"))

    def fits(self, gpu_kv_bytes: int) -> bool:
        return self.gpu_bytes <= gpu_kv_bytes

    def cost_tokens(self, shape: KVShape) -> Tuple[float, float]:
        """(LayerCost.gpu_tokens, LayerCost.staging_tokens): the gpu bytes in KV tokens of the
        batch (``shape.batch * shape.token_bytes`` bytes each), per layer and model-wide, so the
        performance model's GPU memory, (L * gpu_tokens + staging_tokens) * B * kv_tok, is
        exactly ``gpu_bytes`` (masks, metadata and staging included)."""
        per = shape.batch * shape.token_bytes
        return (self.gpu_bytes - self.shared_gpu_bytes) / (shape.layers * per), self.shared_gpu_bytes / per


def with_memory(cost: Any, fp: Footprint, shape: KVShape) -> Any:
    """A ``hybridgen.perf.LayerCost`` whose gpu_tokens / staging_tokens are the footprint's
    (:meth:`Footprint.cost_tokens`): the cost states no memory of its own."""
    gpu, staging = fp.cost_tokens(shape)
    return dataclasses.replace(cost, gpu_tokens=gpu, staging_tokens=staging)


def add_bytes(*parts: Mapping[str, int]) -> Dict[str, int]:
    """Per-tier byte maps summed (tiers with 0 bytes dropped)."""
    out: Dict[str, int] = {}
    for p in parts:
        for tier, n in p.items():
            out[tier] = out.get(tier, 0) + int(n)
    return {t: n for t, n in out.items() if n}


def fit_first(method: Any, gpu_kv_bytes: int, shape: KVShape, candidates: Iterable[Mapping[str, Any]],
              what: str = "its smallest placement") -> Dict[str, Any]:
    """The first of ``candidates`` (parameter overrides, most GPU-hungry first) whose footprint
    fits ``gpu_kv_bytes``; refused in one line when none does."""
    need = None
    for over in candidates:
        fp = dataclasses.replace(method, **over).footprint(shape)
        if fp.fits(gpu_kv_bytes):
            return dict(over)
        need = fp.gpu_bytes
    raise refuse(method.name, need or 0, gpu_kv_bytes, what)


def fit_share(method: Any, gpu_kv_bytes: int, shape: KVShape, make: Callable[[int], Mapping[str, Any]],
              lo: int = 0, hi: Optional[int] = None) -> Dict[str, Any]:
    """The overrides ``make(n)`` with the largest n in [lo, hi] (default context) whose footprint
    fits ``gpu_kv_bytes``, by bisection (the footprint grows with n); refused when ``make(lo)``
    does not fit."""
    hi = shape.context if hi is None else hi

    def ok(n: int) -> bool:
        return dataclasses.replace(method, **make(n)).footprint(shape).fits(gpu_kv_bytes)

    if not ok(lo):
        need = dataclasses.replace(method, **make(lo)).footprint(shape).gpu_bytes
        raise refuse(method.name, need, gpu_kv_bytes, "its smallest gpu share")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return dict(make(lo))


def refuse(method: str, need: float, gpu_kv: int, what: str) -> ConfigError:
    """The one-line error of a method that cannot fit the budget."""
    from hybridgen.kv.tiers import _fmt

    return ConfigError(f"method {method!r} needs {_fmt(int(need))} of GPU memory for {what}, "
                       f"memory.gpu_kv gives {_fmt(int(gpu_kv))}; raise memory.gpu_kv or lower the workload")
