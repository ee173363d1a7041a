"""Paths from user input: ``~`` expanded everywhere, the rest refused with one line naming the path.

- :func:`require_path`: an empty path is refused (it would mean the current directory), ``~`` is
  expanded (the writability check and the writer must agree), a dangling symbolic link is refused;
- :func:`check_output_file`: a file an entry point is about to write: refused when it is a
  directory, or when it exists and ``force`` is not given (nothing is overwritten silently);
  its directory must be writable (:func:`hybridgen.results.check_writable`).

A read-only file system and a full one are caught by ``check_writable`` (a file is created and
removed in the nearest existing ancestor; less than ``MIN_FREE_BYTES`` free is refused).
"""
from __future__ import annotations

import os
from pathlib import Path

from hybridgen.errors import ConfigError

MIN_FREE_BYTES = 1 << 20  #: less than 1 MiB free: no result can be written there


def require_path(field: str, value: "os.PathLike | str | None") -> Path:
    """``value`` as a Path with ``~`` expanded; ConfigError for an empty path or a dangling link."""
    text = "" if value is None else os.fspath(value)
    if not str(text).strip():
        raise ConfigError(f"{field} is empty (it would mean the current directory); give a path, e.g. {field}=outputs")
    path = Path(text).expanduser()
    probe = path
    while probe != probe.parent:
        if probe.is_symlink() and not probe.exists():
            raise ConfigError(f"{field}={text}: {probe} is a symbolic link to nothing ({os.readlink(probe)}); "
                              "remove the link or point it at a directory")
        probe = probe.parent
    return path


def check_output_file(field: str, value: "os.PathLike | str", force: bool = False, example: str = "out.json") -> Path:
    """The file ``value`` may be written: not a directory, not an existing file unless ``force``,
    in a writable directory. Returns it (``~`` expanded)."""
    from hybridgen.results import check_writable

    path = require_path(field, value)
    if path.is_dir():
        raise ConfigError(f"{field} {value} is a directory; give a file name, e.g. {field} {path / example}")
    if path.exists() and not force:
        raise ConfigError(f"{field} {value} already exists; pass --force to overwrite it, or choose another {field}")
    check_writable(path.parent, name=f"{field} directory", fix=f"choose another {field}")
    return path
