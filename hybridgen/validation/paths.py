"""Paths from user input: ``~`` expanded everywhere, the rest refused with one line naming the path.

- :func:`require_path`: an empty path is refused (it would mean the current directory), ``~`` is
  expanded (the writability check and the writer must agree), a dangling symbolic link is refused;
- :func:`check_writable`: files can be created under a directory (nothing is left behind);
- :func:`pid_alive`: a process exists on this host;
- :func:`check_output_file`: a file an entry point is about to write: refused when it is a
  directory, or when it exists and ``force`` is not given (nothing is overwritten silently);
  its directory must be writable (:func:`check_writable`).

A read-only file system and a full one are caught by ``check_writable`` (a file is created and
removed in the nearest existing ancestor; less than ``MIN_FREE_BYTES`` free is refused).
"""
from __future__ import annotations

import os
import shutil
import tempfile
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
    path = require_path(field, value)
    if path.is_dir():
        raise ConfigError(f"{field} {value} is a directory; give a file name, e.g. {field} {path / example}")
    if path.exists() and not force:
        raise ConfigError(f"{field} {value} already exists; pass --force to overwrite it, or choose another {field}")
    check_writable(path.parent, name=f"{field} directory", fix=f"choose another {field}")
    return path


def check_writable(root: os.PathLike | str, name: str = "results_dir", fix: str = "choose a writable results_dir=DIR"
                   ) -> None:
    """One-line ConfigError unless files can be written under ``root``; creates nothing.

    The nearest existing ancestor must be a directory in which a file can be created (tried
    with a temporary file that is removed at once; permission bits alone do not tell for root
    or for read-only mounts). ``name`` and ``fix`` word the message for the caller's option.
    """
    path = require_path(name, root)  # empty, a dangling link: one line; '~' expanded
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"{name}={root}: {probe} is a file, not a directory; {fix}")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".hybridgen-write-test-", dir=probe)
        os.close(fd)
        os.unlink(tmp)
        free = shutil.disk_usage(probe).free
    except OSError as err:
        why = err.strerror or type(err).__name__
        raise ConfigError(f"{name}={root} is not writable (cannot create a file in {probe}: {why}); {fix}") from None
    if free < MIN_FREE_BYTES:
        raise ConfigError(f"{name}={root}: the file system of {probe} is full ({free} bytes free); free space or {fix}")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a stale temporary directory's owner is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
