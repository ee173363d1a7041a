"""Messages and progress bars: one verbosity setting for the library and its command lines.

Library modules log through ``logging.getLogger(__name__)`` (all under the ``hybridgen``
logger); result tables stay on stdout as prints. A command line calls :func:`setup` once with
its verbosity (``-v``/``-q`` flags, a ``log_level=`` config key, or ``HYBRIDGEN_LOG_LEVEL``):

    from hybridgen import log
    log.setup("quiet")        # debug | info (default) | warning | quiet (= error)

Progress bars (:func:`bar`, tqdm on stderr) follow the same setting: shown at ``info`` and
``debug``, hidden at ``warning`` and ``quiet``. A library user who never calls :func:`setup`
gets Python's defaults: warnings only, and no bars (except those asked for explicitly, such as
``generate(..., progress=True)``).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable, Optional, Union

from hybridgen.errors import ConfigError

ROOT = "hybridgen"
ENV = "HYBRIDGEN_LOG_LEVEL"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "quiet": logging.ERROR,
          "error": logging.ERROR, "critical": logging.CRITICAL}
#: loggers :func:`setup` configures: the library's, and the harness's (hybridgen_harness/, experiments/, benchmarks/)
NAMES = (ROOT, "hybridgen_harness", "experiments", "benchmarks", "baselines")
_HANDLER_FLAG = "_hybridgen_handler"


def parse_level(value: Union[None, str, int]) -> int:
    """'debug' | 'info' | 'warning' | 'quiet' | 'error' (any case) or a logging level number -> the number."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    key = str(value).strip().lower()
    if key in LEVELS:
        return LEVELS[key]
    raise ConfigError(f"unknown log level {value!r}; choose one of: {', '.join(LEVELS)}")


def level_from_flags(verbose: int = 0, quiet: int = 0, default: Union[None, str, int] = None) -> int:
    """The level of ``-v`` (debug) / ``-q`` (warning; ``-qq``: quiet) flags, else ``default`` or the env."""
    if verbose:
        return logging.DEBUG
    if quiet:
        return logging.WARNING if quiet == 1 else logging.ERROR
    return parse_level(default if default is not None else os.environ.get(ENV, "info"))


class _StderrHandler(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is at each message (so redirections and
    pytest's capture see it), never to the stream that was current at :func:`setup`."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # logging.StreamHandler.__init__ assigns it
        pass


def setup(level: Union[None, str, int] = None) -> int:
    """Send our loggers' messages to stderr at ``level`` (None: ``$HYBRIDGEN_LOG_LEVEL``, else info).

    Safe to call more than once (one handler per logger; the last level wins). Our loggers and
    their children are enabled again: a ``logging.config.dictConfig`` with
    ``disable_existing_loggers`` (Hydra's ``hydra_logging: disabled`` has it) switches off every
    logger that existed before it. Returns the level.
    """
    n = parse_level(level if level is not None else os.environ.get(ENV, "info"))
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and any(name == r or name.startswith(r + ".") for r in NAMES):
            lg.disabled = False
    for name in NAMES:
        lg = logging.getLogger(name)
        lg.setLevel(n)
        if not any(getattr(h, _HANDLER_FLAG, False) for h in lg.handlers):
            h = _StderrHandler()
            h.setFormatter(logging.Formatter("%(message)s"))
            setattr(h, _HANDLER_FLAG, True)
            lg.addHandler(h)
            lg.propagate = False
    return n


def progress_enabled() -> bool:
    """True when bars should show: the ``hybridgen`` logger is at info or more verbose."""
    return logging.getLogger(ROOT).isEnabledFor(logging.INFO)


def bar(iterable: Optional[Iterable[Any]] = None, total: Optional[int] = None, desc: str = "",
        unit: str = "it", disable: Optional[bool] = None, **kwargs: Any):
    """A tqdm bar on stderr, hidden unless :func:`progress_enabled` (or ``disable`` says otherwise)."""
    from tqdm.auto import tqdm

    off = (not progress_enabled()) if disable is None else bool(disable)
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=off, file=sys.stderr, **kwargs)
