"""Command lines of the scripts (benchmarks, validation, profiler): parsed strictly, checked, one line.

- :func:`strict_parser`: ``argparse`` without prefix matching (``--cpu-smok`` is an error, not
  ``--cpu-smoke``);
- :func:`parse_checked`: parse, then refuse a negative or non-finite number in any flag (none of
  these scripts has a meaningful negative count, time or size) with ``error: <one line>``, exit 2;
- :func:`check_output_dir`: a results folder the script will fill: refused when it is a file, a
  dangling link, unwritable or full, or when it already holds one of the files the script writes
  and ``--force`` is not given (a committed result is never overwritten by accident).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Iterable, Optional, Sequence

from hybridgen.errors import ConfigError, HybridGenError


def strict_parser(**kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser that never expands an abbreviated flag."""
    return argparse.ArgumentParser(allow_abbrev=False, **kwargs)


def exit_one_line(err: BaseException) -> "SystemExit":
    """Print ``error: <message>`` and return SystemExit(2) for the caller to raise."""
    print(f"error: {err}", file=sys.stderr, flush=True)
    return SystemExit(2)


def check_numbers(ns: argparse.Namespace, allow_negative: Iterable[str] = ()) -> None:
    """Every int/float flag (and list of them) of ``ns``: finite and >= 0 (except ``allow_negative``)."""
    skip = set(allow_negative)
    for name, value in vars(ns).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or name in skip:
                continue
            flag = "--" + name.replace("_", "-")
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{flag} must be a finite number, got {v}")
            if v < 0:
                raise ConfigError(f"{flag} must be >= 0, got {v}")


def parse_checked(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
                  allow_negative: Iterable[str] = ()) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with :func:`check_numbers`; a bad number exits 2 with one line."""
    ns = parser.parse_args(argv)
    try:
        check_numbers(ns, allow_negative)
    except HybridGenError as err:
        raise exit_one_line(err) from None
    return ns


def exit_on_existing_output(ns: argparse.Namespace, name: str = "json") -> None:
    """The output file flag ``--<name>`` (when given) checked before anything is measured: usable,
    and never overwritten without ``--force``; a bad one exits 2 with one line."""
    from hybridgen.validation.paths import check_output_file

    value = getattr(ns, name, None)
    if value is None:
        return
    try:
        check_output_file("--" + name.replace("_", "-"), value, getattr(ns, "force", False))
    except HybridGenError as err:
        raise exit_one_line(err) from None


def check_output_dir(flag: str, value: "os.PathLike | str", force: bool, writes: Sequence[str] = ()) -> Path:
    """The folder ``value`` a script fills with ``writes`` (file names): usable, and none of them
    there unless ``force``. Returns the folder (``~`` expanded); ConfigError with one line."""
    from hybridgen.validation.paths import check_writable
    from hybridgen.validation.paths import require_path

    path = require_path(flag, value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {value} is a file, not a folder; choose another {flag}")
    there = [name for name in writes if (path / name).exists()]
    if there and not force:
        raise ConfigError(f"{flag} {value} already holds {', '.join(there)}; pass --force to overwrite, "
                          f"or choose another {flag}")
    check_writable(path, name=flag, fix=f"choose another {flag}")
    return path
