"""Prepare a local transformers checkpoint once from a GGUF file (shared by the real models).

:func:`prepare_once` loads the GGUF with transformers (dequantised to plain linear layers),
copies its state dict into a model built from the same config (transformers refuses to save a
GGUF-loaded model) and saves it with the tokenizer and a provenance file. Everything is
written to a temporary sibling directory renamed into place, so an interrupted preparation
never leaves a half-written model that looks complete. Saved in float32: dequantised k-quant
values (fp16 scales x small integer codes) generally need more than bf16's 8 mantissa bits.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict

from hybridgen.errors import MissingDataError


def is_prepared(path: Path) -> bool:
    """True when ``path`` holds a complete checkpoint: config.json and sound safetensors files
    (header and size checked, see :func:`hybridgen.model.weights.checkpoint_problem`)."""
    from hybridgen.model.weights import checkpoint_problem

    return path.is_dir() and checkpoint_problem(path) is None


def prepare_once(target: Path, find_gguf: Callable[[], Path], label: str, provenance: Dict[str, Any],
                 verbose: bool = True) -> Path:
    """The checkpoint directory ``target``, converted from ``find_gguf()`` on first use.

    label: the model's name in the one log line; provenance: facts written to
    ``hybridgen_provenance.json`` next to the weights (base model, quantisation, source).
    """
    if is_prepared(target):
        return target
    if target.exists():
        from hybridgen.model.weights import checkpoint_problem

        why = checkpoint_problem(target) if target.is_dir() else "not a directory"
        raise MissingDataError(f"{target} exists but is not a complete checkpoint ({why}); delete it "
                               f"(rm -r {target}) and rerun: it is prepared again from the GGUF")
    gguf = find_gguf()
    if verbose:
        logging.getLogger(__name__).warning("hybridgen: preparing %s once (GGUF -> safetensors) into %s", label, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf, tmp, provenance)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_prepared(target):  # not a concurrent preparation that won the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, out: Path, provenance: Dict[str, Any]) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    dst = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    dst.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(str(out))
    (out / "hybridgen_provenance.json").write_text(json.dumps({
        **provenance, "source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "float32",
        "transformers": transformers.__version__, "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
