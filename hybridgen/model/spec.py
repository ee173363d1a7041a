"""Model architecture spec, read from a Hugging Face ``config.json`` dict, and the shipped configs.

Families: ``opt`` (learned positions with offset 2, LayerNorm, ReLU MLP, biases everywhere,
pre- or post-norm, optional embedding projection), ``llama`` (RMSNorm, SwiGLU, rotary with
optional 'linear' or 'llama3' scaling, GQA, optional attention/MLP biases) and ``qwen2``
(Llama with q/k/v biases).

Both the transformers 4 style (``rope_theta`` + ``rope_scaling``) and the transformers 5 style
(``rope_parameters``) of rotary settings are read.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hybridgen.errors import ConfigError
from hybridgen.model.hf_layout import hf_param_shapes

CONFIG_DIR = Path(__file__).with_name("configs")
FAMILIES = ("opt", "llama", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}


@dataclass
class ModelSpec:
    """Architecture hyper-parameters of one decoder-only model.

    Shapes: embeddings [vocab_size, embed_dim]; per layer q [num_heads*head_dim, hidden_size],
    k/v [num_kv_heads*head_dim, hidden_size]; MLP [intermediate_size, hidden_size].
    ``embed_dim`` differs from ``hidden_size`` only for OPT models with ``word_embed_proj_dim``.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm: str = "rms"                   # 'rms' | 'layer'
    norm_eps: float = 1e-5
    activation: str = "silu"            # MLP nonlinearity
    gated_mlp: bool = True              # SwiGLU (gate, up, down) vs plain (fc1, fc2)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False             # LayerNorm has a bias
    pre_norm: bool = True               # OPT-350m style post-norm when False
    final_norm: bool = True
    tie_embeddings: bool = False
    embed_dim: Optional[int] = None     # OPT word_embed_proj_dim (None = hidden_size)
    learned_positions: bool = False     # OPT: learned absolute positions ...
    position_offset: int = 0            # ... looked up at position + offset (2 for OPT)
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_params: Dict[str, float] = field(default_factory=dict)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    name: str = ""

    def __post_init__(self):
        if self.embed_dim is None:
            self.embed_dim = self.hidden_size
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "max_positions"):
            val = getattr(self, key)
            if not isinstance(val, int) or val <= 0:
                raise ConfigError(f"model spec {self.name or ''}: {key} must be a positive integer, got {val!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model spec {self.name}: num_heads {self.num_heads} is not a multiple of "
                              f"num_kv_heads {self.num_kv_heads}; fix the config")
        if self.family not in FAMILIES:
            raise ConfigError(f"unknown model family {self.family!r}; supported: {', '.join(FAMILIES)}")

    # ------------------------------------------------------------------ derived
    @property
    def scale(self) -> float:
        """Softmax scale 1/sqrt(head_dim)."""
        return self.head_dim ** -0.5

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def uses_rotary(self) -> bool:
        return not self.learned_positions

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """KV bytes per token across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem

    def param_shapes(self) -> Dict[str, tuple]:
        """Parameter name (HF naming) -> shape, embeddings counted once when tied."""
        return {name: shape for name, (shape, _kind) in hf_param_shapes(self).items()}

    def param_count(self) -> int:
        n = 0
        for shape in self.param_shapes().values():
            size = 1
            for s in shape:
                size *= s
            n += size
        return n

    def with_layers(self, num_layers: Optional[int]) -> "ModelSpec":
        """A copy with ``num_layers`` layers (a truncated model of a real shape)."""
        if num_layers is None:
            return self
        if not isinstance(num_layers, int) or num_layers <= 0:
            raise ConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
        d = asdict(self)
        d["num_layers"] = num_layers
        return ModelSpec(**d)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_config(cls, cfg: Dict[str, Any], name: str = "") -> "ModelSpec":
        """Build a spec from the contents of an HF ``config.json``.

        Unknown ``model_type`` or unsupported features (sliding windows, exotic RoPE types,
        non-SiLU Llama activations) raise :class:`ConfigError` in one line.
        """
        if not isinstance(cfg, dict):
            raise ConfigError(f"a model config must be a dict (the contents of config.json), got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type == "opt":
            return _opt_spec(cfg, name)
        if model_type in ("llama", "qwen2"):
            return _llama_spec(cfg, name, model_type)
        raise ConfigError(f"unsupported model_type {model_type!r} in {name or 'config'}; "
                          f"supported: {', '.join(FAMILIES)} (OPT, Llama, Qwen2 checkpoints)")


def _need(cfg: Dict[str, Any], key: str, name: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"config {name or ''} lacks {key!r}; add it to config.json")
    return cfg[key]


def _activation(value: str, name: str) -> str:
    act = _ACTIVATIONS.get(str(value).lower())
    if act is None:
        raise ConfigError(f"config {name}: unsupported activation {value!r}; supported: {', '.join(_ACTIVATIONS)}")
    return act


def _opt_spec(cfg: Dict[str, Any], name: str) -> ModelSpec:
    hidden = _need(cfg, "hidden_size", name)
    heads = _need(cfg, "num_attention_heads", name)
    if hidden % heads:
        raise ConfigError(f"config {name}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
    if not cfg.get("layer_norm_elementwise_affine", True):
        raise ConfigError(f"config {name}: OPT without layer-norm affine weights is not supported")
    bias = bool(cfg.get("enable_bias", True))
    pre = bool(cfg.get("do_layer_norm_before", True))
    return ModelSpec(
        family="opt", name=name,
        vocab_size=_need(cfg, "vocab_size", name), hidden_size=hidden,
        num_layers=_need(cfg, "num_hidden_layers", name), num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=_need(cfg, "ffn_dim", name),
        max_positions=_need(cfg, "max_position_embeddings", name),
        norm="layer", norm_eps=1e-5, norm_bias=True,  # HF OPT uses nn.LayerNorm's default eps
        activation=_activation(cfg.get("activation_function", "relu"), name), gated_mlp=False,
        qkv_bias=bias, o_bias=bias, mlp_bias=bias,
        pre_norm=pre, final_norm=pre and not cfg.get("_remove_final_layer_norm", False),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        embed_dim=cfg.get("word_embed_proj_dim") or hidden,
        learned_positions=True, position_offset=2,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=_first(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
    )


def _first(value: Any) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        return value[0] if value else None
    return value


def _rope(cfg: Dict[str, Any], name: str) -> tuple:
    """(theta, type, params) from either config style."""
    if isinstance(cfg.get("rope_parameters"), dict):
        rp = dict(cfg["rope_parameters"])
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        rp = dict(cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta", 10000.0)
    rtype = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    rp.pop("rope_theta", None)
    if rtype not in ROPE_TYPES:
        raise ConfigError(f"config {name}: unsupported rope type {rtype!r}; supported: {', '.join(ROPE_TYPES)}")
    if rtype == "linear" and "factor" not in rp:
        raise ConfigError(f"config {name}: linear rope scaling needs a 'factor'")
    if rtype == "llama3":
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rp:
                raise ConfigError(f"config {name}: llama3 rope scaling needs {key!r}")
    params = {k: float(v) for k, v in rp.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return float(theta), rtype, params


def _llama_spec(cfg: Dict[str, Any], name: str, model_type: str) -> ModelSpec:
    hidden = _need(cfg, "hidden_size", name)
    heads = _need(cfg, "num_attention_heads", name)
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    act = _activation(cfg.get("hidden_act", "silu"), name)
    if act != "silu":
        raise ConfigError(f"config {name}: {model_type} with activation {act!r} is not supported (only silu)")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"config {name}: sliding-window attention is not supported; set use_sliding_window=false")
    theta, rtype, params = _rope(cfg, name)
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    return ModelSpec(
        family=model_type, name=name,
        vocab_size=_need(cfg, "vocab_size", name), hidden_size=hidden,
        num_layers=_need(cfg, "num_hidden_layers", name), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=_need(cfg, "intermediate_size", name),
        max_positions=_need(cfg, "max_position_embeddings", name),
        norm="rms", norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), activation="silu", gated_mlp=True,
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_theta=theta, rope_type=rtype, rope_params=params,
        bos_token_id=cfg.get("bos_token_id"), eos_token_id=_first(cfg.get("eos_token_id")),
        pad_token_id=cfg.get("pad_token_id"),
    )


# ---------------------------------------------------------------------- shipped configs
def list_models() -> List[str]:
    """Names of the architecture configs shipped with the package (usable with dummy/random weights)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def shipped_config(name: str) -> Dict[str, Any]:
    """The HF config dict of a shipped model name."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        from hybridgen.errors import unknown_name
        raise unknown_name("model", name, list_models())
    return json.loads(path.read_text())


def read_config_file(path: Path, name: str = "") -> Dict[str, Any]:
    """Read a config.json; a malformed file is a ConfigError naming the file."""
    from hybridgen.model.config_check import check_hf_config

    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); fix or re-download it") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} cannot be read ({getattr(err, 'strerror', None) or err}); fix or re-download it") from None
    return check_hf_config(cfg, str(path))  # 0 heads, text for a number...: one line naming file and key
