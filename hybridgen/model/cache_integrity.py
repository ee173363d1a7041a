"""Integrity of the converted model cache: a checksum of each file, recorded at conversion.

The SmolLM2 cache (``$HYBRIDGEN_CACHE/models/smollm2-135m``, :mod:`hybridgen.model.smollm2`) is
made by this project, so a damaged one is fixed by deleting it (it is converted again), never by
a re-download. At conversion :func:`write_manifest` records ``MANIFEST``: every file's size and
SHA-256. Then:

- sizes are checked on every check (:func:`problem` with ``hashes=False``: a stat per file);
- hashes on the first check of each directory in a process (:func:`verify`, memoised; ~1 s for
  the 540 MB checkpoint) and by ``python -m hybridgen.model.cache_integrity [DIR]``;
- a cache converted before manifests were kept is *adopted*: its manifest is written after the
  existing checks (headers and sizes of the safetensors) pass, and said once;
- a mismatch: one line, "... delete DIR (rm -r DIR) and rerun: it is prepared again from the GGUF".

4 MiB of zeros written over the embedding keep every size and header sound; only the hash sees it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path
from typing import Dict, Optional, Set, Tuple

from hybridgen.errors import MissingDataError

MANIFEST = "hybridgen_manifest.json"
_VERIFIED: Set[Tuple[str, float]] = set()   # (directory, manifest mtime) hashed in this process


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path) -> Path:
    """Record the size and SHA-256 of every file under ``directory`` (but the manifest) in MANIFEST."""
    directory = Path(directory)
    files: Dict[str, Dict[str, object]] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    out = directory / MANIFEST
    out.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    return out


def fix_text(directory: Path) -> str:
    return f"delete {directory} (rm -r {directory}) and rerun: it is prepared again from the GGUF"


def problem(directory: Path, hashes: bool) -> Optional[str]:
    """None when every file of the manifest is there with its size (and hash), else what is wrong."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is missing or unreadable"
    if not isinstance(files, dict) or not files or not all(isinstance(w, dict) for w in files.values()):
        return f"{MANIFEST} lists no files"
    for rel, want in files.items():
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != want.get("bytes"):
            return f"{rel} is {p.stat().st_size} bytes, {want.get('bytes')} when converted (truncated or overwritten)"
    if hashes:
        for rel, want in files.items():
            if _sha256(directory / rel) != want.get("sha256"):
                return f"{rel} does not match the checksum recorded at conversion (overwritten)"
    return None


def verify(directory: Path, adopt: bool = True) -> None:
    """Sizes always, hashes once per process; MissingDataError (one line, delete and rerun) on a mismatch.
    A cache without a manifest is adopted (see the module doc) when ``adopt``."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists() and adopt:
        from hybridgen.model.weights import checkpoint_problem

        if checkpoint_problem(directory) is None:
            try:
                write_manifest(directory)
            except OSError:
                return  # a read-only cache made before manifests: the header checks are all there is
            logging.getLogger(__name__).warning("hybridgen: recorded checksums of %s (converted before "
                                                "checksums were kept)", directory)
            _VERIFIED.add((str(directory), manifest.stat().st_mtime))  # just hashed
    key = (str(directory), manifest.stat().st_mtime if manifest.exists() else 0.0)
    why = problem(directory, hashes=key not in _VERIFIED)
    if why:
        raise MissingDataError(f"model cache {directory} is damaged: {why}; {fix_text(directory)}")
    _VERIFIED.add(key)


def main(argv=None) -> int:
    """``python -m hybridgen.model.cache_integrity [DIR]``: hash-verify the converted cache now."""
    from hybridgen.model import smollm2

    args = list(sys.argv[1:] if argv is None else argv)
    directory = Path(args[0]).expanduser() if args else smollm2.prepared_dir()
    if not directory.is_dir():
        print(f"error: {directory} is not a directory (no converted model there yet)", file=sys.stderr)
        return 2
    why = problem(directory, hashes=True)
    if why:
        print(f"error: model cache {directory} is damaged: {why}; {fix_text(directory)}", file=sys.stderr)
        return 2
    print(f"ok: {directory} matches its {MANIFEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
