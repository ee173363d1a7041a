"""Tiny checkpoints for the reliability tests, written straight with safetensors (no transformers
needed), and the ways a checkpoint on disk gets damaged: empty file, truncated file, flipped
bytes that read as NaN, and finite but huge weights whose logits overflow."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import torch

#: a 2-layer Llama with GQA (4 query / 2 KV heads of 8), a byte-sized vocabulary
TINY_CONFIG: Dict = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 260, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 256,
    "eos_token_id": 257, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32",
}


def write_checkpoint(path: Path, seed: int = 0, lm_head_value: float = None) -> Path:
    """A complete tiny HF checkpoint directory (config.json + model.safetensors) at ``path``.

    lm_head_value: fill lm_head with this (finite) value, e.g. 3e38 so every logit overflows.
    """
    from safetensors.torch import save_file

    from hybridgen.model.spec import ModelSpec
    from hybridgen.model.hf_layout import hf_param_shapes

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec.from_hf_config(TINY_CONFIG, name="tiny")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, kind) in hf_param_shapes(spec).items():
        tensors[name] = torch.ones(shape) if kind == "norm" else torch.randn(shape, generator=g) * 0.02
    if lm_head_value is not None:
        tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], float(lm_head_value))
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def make_empty(path: Path) -> None:
    (Path(path) / "model.safetensors").write_bytes(b"")


def make_truncated(path: Path) -> None:
    f = Path(path) / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def make_nan_bytes(path: Path) -> None:
    """Overwrite 64 bytes inside the first tensor's data with 0xFF (float32 NaN); the header stays valid."""
    f = Path(path) / "model.safetensors"
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + n]))
    first = min((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")[0]
    start = 8 + n + first
    data[start:start + 64] = b"\xff" * 64
    f.write_bytes(bytes(data))


def fake_smollm2_cache(cache_root: Path, damage=None, **kw) -> Path:
    """A prepared 'smollm2-135m' cache under ``cache_root`` (set HYBRIDGEN_CACHE to it) holding the
    tiny checkpoint, optionally damaged by ``damage(path)``."""
    path = write_checkpoint(Path(cache_root) / "models" / "smollm2-135m", **kw)
    if damage is not None:
        damage(path)
    return path
