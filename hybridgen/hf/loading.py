"""Build an :class:`~hybridgen.hf.engine.HFEngine` from what :func:`hybridgen.model.load_model`
resolved (a config dict, a checkpoint directory, a tokenizer directory).

weights: 'real' (the checkpoint, through ``AutoModelForCausalLM.from_pretrained``) or 'random'
(transformers' own initialisation under ``torch.manual_seed(seed)``); 'dummy' fills exist only
for the lean engine's architectures. num_layers keeps the first N decoder layers.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from hybridgen.errors import ConfigError
from hybridgen.hf.attention import ATTN_IMPLEMENTATION
from hybridgen.hf.engine import HFEngine, HFModelSpec, spec_of_config


def hf_config(cfg: Dict[str, Any], num_layers: Optional[int] = None):
    """A transformers config object from a config.json dict (optionally cut to ``num_layers``)."""
    from transformers import AutoConfig

    cfg = dict(cfg)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ConfigError("the checkpoint's config.json has no model_type; it is not a transformers checkpoint")
    try:
        config = AutoConfig.for_model(model_type, **cfg)
    except ValueError as err:
        raise ConfigError(f"transformers does not know model_type {model_type!r} ({err}); upgrade transformers "
                          "or use a supported checkpoint") from None
    if num_layers is not None:
        total = config.num_hidden_layers
        if not isinstance(num_layers, int) or not 0 < num_layers <= total:
            raise ConfigError(f"num_layers must be in 1..{total}, got {num_layers!r}")
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types)[:num_layers]
    return config


def hf_spec(cfg: Dict[str, Any], name: str) -> HFModelSpec:
    """The architecture of a config.json dict as the backend sees it (no weights)."""
    return spec_of_config(hf_config(cfg), name)


def load_hf_engine(name: str, cfg: Dict[str, Any], checkpoint: Optional[Path], tokenizer: Any,
                   weights: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   num_layers: Optional[int] = None) -> HFEngine:
    from transformers import AutoModelForCausalLM

    config = hf_config(cfg, num_layers)
    if weights == "real":
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), config=config, dtype=dtype,
                                                     attn_implementation=ATTN_IMPLEMENTATION)
    elif weights == "random":
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    else:
        raise ConfigError(f"weights={weights!r} exists only on the lean engine (OPT/Llama/Qwen2 shapes); use "
                          f"weights='random' or 'real' for {name}")
    engine = HFEngine(model.to(device), tokenizer, name=name)
    stated = None if checkpoint is None else Path(checkpoint) / "hybridgen_provenance.json"
    if stated is not None and stated.is_file():  # e.g. "base model, Q4_K_M dequantised" in every run record
        engine.spec.provenance = json.loads(stated.read_text())
    return engine
