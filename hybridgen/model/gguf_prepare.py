"""Prepare a local transformers checkpoint once from a GGUF file (shared by the real models).

:func:`prepare_once` loads the GGUF with transformers (dequantised to plain linear layers),
copies its state dict into a model built from the same config (transformers refuses to save a
GGUF-loaded model) and saves it with the tokenizer and a provenance file. Choices:

- saved in float32: dequantised values (fp16 scale x small integer code, + fp16 min for Q4_1)
  generally need more than bf16's 8 mantissa bits, so float32 keeps the GGUF's weights
  exactly; runs in bf16 cast at load time;
- atomic: everything is written to a temporary sibling directory (``.<name>-<pid>-*``) that
  is renamed into place, so an interrupted preparation never leaves a half-written model that
  looks complete; a killed one's temp directory is removed on the next start;
- checksummed: the size and SHA-256 of each file are recorded at conversion and verified on
  use (:mod:`hybridgen.model.cache_integrity`); a mismatch says to delete the directory and rerun.
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


def cache_root() -> Path:
    """Root of hybridgen's caches: $HYBRIDGEN_CACHE or ~/.cache/hybridgen."""
    return Path(os.environ.get("HYBRIDGEN_CACHE") or "~/.cache/hybridgen").expanduser()


def is_prepared(path: Path) -> bool:
    """True when ``path`` holds a complete checkpoint: config.json and sound safetensors files
    (header and size checked, see :func:`hybridgen.model.weights.checkpoint_problem`)."""
    from hybridgen.model.weights import checkpoint_problem

    return path.is_dir() and checkpoint_problem(path) is None


def check_location(target: Path) -> None:
    """The cache path: a dangling link, a file where a directory goes: one line naming it."""
    for p in [target, *target.parents]:
        if p.is_symlink() and not p.exists():
            raise MissingDataError(f"model cache path {p} is a symbolic link to nothing ({os.readlink(p)}); remove "
                                   "the link or point it at a directory (or set HYBRIDGEN_CACHE to a directory)")
        if p.exists() and not p.is_dir():
            raise MissingDataError(f"model cache path {p} is a file, not a directory; move it away or set "
                                   "HYBRIDGEN_CACHE to a directory")


def clean_stale_temp(target: Path) -> None:
    """Remove the temp directories of ``target``'s conversions whose process is gone (a SIGKILL leaves one)."""
    from hybridgen.validation.paths import pid_alive

    name = target.name
    for d in target.parent.glob(f".{name}-*-*"):
        pid = d.name[len(name) + 2:].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def prepare_once(target: Path, find_gguf: Callable[[], Path], label: str, provenance: Dict[str, Any],
                 verbose: bool = True) -> Path:
    """The checkpoint directory ``target``, converted from ``find_gguf()`` on first use and
    verified against its recorded checksums on every use.

    label: the model's name in the one log line; provenance: facts written to
    ``hybridgen_provenance.json`` next to the weights (base model, quantisation, source).
    """
    from hybridgen.model import cache_integrity

    check_location(target)
    if target.parent.is_dir():
        clean_stale_temp(target)
    if is_prepared(target):
        cache_integrity.verify(target)
        return target
    if target.exists():
        from hybridgen.model.weights import checkpoint_problem

        why = checkpoint_problem(target) if target.is_dir() else "not a directory"
        raise MissingDataError(f"{target} exists but is not a complete checkpoint ({why}); delete it "
                               f"(rm -r {target}) and rerun: it is prepared again from the GGUF")
    gguf = find_gguf()
    if verbose:
        logging.getLogger(__name__).warning("hybridgen: preparing %s once (GGUF -> safetensors) into %s", label, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-{os.getpid()}-", dir=target.parent))
    except OSError as err:
        raise MissingDataError(f"model cache {target.parent} is not writable ({err.strerror or err}); set "
                               "HYBRIDGEN_CACHE to a writable directory") from None
    try:
        convert_gguf(gguf, tmp, provenance)
        cache_integrity.write_manifest(tmp)
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
    """The GGUF dequantised into a float32 safetensors checkpoint (+ tokenizer, provenance) in ``out``."""
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
