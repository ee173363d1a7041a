"""What a prediction is about: the model's shape and one decode step's workload.

A :class:`ModelShape` holds the architecture numbers the model needs (from a ``ModelSpec``,
a dict or a shipped config name). A :class:`Workload` holds what the RUN decides: batch,
context, KV dtype and an optional KV-mapping override. What the METHOD decides (its GPU
budget, top-k ratio, pipelining...) comes from the method instance, never from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from hybridgen.errors import ConfigError, unknown_name

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
MAPPINGS = ("semantic", "dram", "cxl", "interleaved")


@dataclass(frozen=True)
class ModelShape:
    """What the model needs of an architecture. weight_bytes: bytes per weight element."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mlp_matrices: int = 3
    weight_bytes: int = 2

    def __post_init__(self):
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "mlp_matrices", "weight_bytes"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"model shape {self.name!r}: {f} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model shape {self.name!r}: num_heads must be a multiple of num_kv_heads")

    @property
    def layer_params(self) -> int:
        """Parameters of one layer's attention projections and MLP (norms and biases ignored)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + self.mlp_matrices * h * self.intermediate_size

    def weights_bytes(self, num_layers: Optional[int] = None) -> int:
        """Bytes of the weights (the one estimate): ``num_layers`` (default all) layers of
        projections and MLP, plus the embedding and the LM head (vocab x hidden each)."""
        L = self.num_layers if num_layers is None else int(num_layers)
        return L * self.layer_params * self.weight_bytes + 2 * self.vocab_size * self.hidden_size * self.weight_bytes

    @classmethod
    def from_spec(cls, spec: Any, name: str = "", weight_bytes: int = 2) -> "ModelShape":
        """From an engine ModelSpec (or anything with its attribute names, or such a dict)."""
        get = (lambda k, d=None: spec.get(k, d)) if isinstance(spec, Mapping) else \
            (lambda k, d=None: getattr(spec, k, d))
        gated = get("gated_mlp", True)
        return cls(name=name or str(get("name", "") or "model"), num_layers=int(get("num_layers")),
                   hidden_size=int(get("hidden_size")), num_heads=int(get("num_heads")),
                   num_kv_heads=int(get("num_kv_heads") or get("num_heads")), head_dim=int(get("head_dim")),
                   intermediate_size=int(get("intermediate_size")), vocab_size=int(get("vocab_size")),
                   mlp_matrices=3 if gated else 2, weight_bytes=weight_bytes)

    @classmethod
    def named(cls, name: str, weight_bytes: int = 2) -> "ModelShape":
        """A shipped model config by name (``hybridgen/model/configs``)."""
        try:
            from hybridgen.model.spec import ModelSpec, list_models, shipped_config
        except ImportError as err:  # pragma: no cover - engine missing
            raise ConfigError(f"model configs unavailable ({err}); pass a ModelShape") from None
        if name not in list_models():
            raise unknown_name("model", name, list_models())
        return cls.from_spec(ModelSpec.from_hf_config(shipped_config(name), name), name, weight_bytes)


def as_model_shape(model: Union[str, ModelShape, Any]) -> ModelShape:
    """A ModelShape from a ModelShape, a shipped model name, or an engine ModelSpec / dict."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, str):
        return ModelShape.named(model)
    return ModelShape.from_spec(model)


@dataclass(frozen=True)
class Workload:
    """One decode step's workload: what the run decides, not the method.

    batch: sequences; context: tokens per sequence (KV length at this step); dtype: 'bf16' |
    'fp16' | 'fp32' (KV and weights); mapping: None = each method's own host-KV placement,
    else 'semantic' | 'dram' | 'cxl' | 'interleaved' for every method that keeps KV on the host.
    """

    batch: int = 8
    context: int = 32768
    dtype: str = "bf16"
    mapping: Optional[str] = None

    def __post_init__(self):
        if self.batch <= 0 or self.context <= 0:
            raise ConfigError("workload: batch and context must be positive")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"workload: unknown dtype {self.dtype!r}; choose one of: bf16, fp16, fp32")
        if self.mapping is not None and self.mapping not in MAPPINGS:
            raise unknown_name("mapping", self.mapping, MAPPINGS)

    @property
    def kv_bytes(self) -> int:
        """Bytes per KV element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def dtype_key(self) -> str:
        """The dtype as the profiles' rate tables name it ('bf16', 'fp16', 'fp32')."""
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, self.dtype)
