"""Messages and progress bars: one verbosity setting for the library and its command lines.

Library modules log through ``logging.getLogger(__name__)`` (all under the ``hybridgen``
logger); result tables stay on stdout as prints. A command line sets the verbosity once,
transformers-style, from its flags (``-v``/``-q``, lm-eval's ``--verbosity``, Hydra's
``hydra.verbose``) or ``HYBRIDGEN_LOG_LEVEL``:

    from hybridgen import log
    log.set_verbosity("quiet")   # debug | info (default) | warning | quiet (= error)

Every entry point means the same by each level: ``debug`` adds debug messages; ``info``
shows progress messages and bars; ``warning`` and ``quiet`` show neither (quiet: errors
only). Progress bars (:func:`bar`, tqdm on stderr) follow the setting, and so do the
libraries we drive (transformers' and lm-eval's loggers, transformers' bars). While a bar
is drawn, messages go through ``tqdm.contrib.logging`` (:func:`redirect`), so a line never
cuts a bar. A library user who never sets a verbosity gets Python's defaults: warnings only,
no automatic bars, and the bars asked for explicitly (``generate(..., progress=True)``).
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
#: loggers of the libraries we drive: quiet hides their info lines too
THIRD_PARTY = ("lm_eval", "transformers", "datasets", "huggingface_hub", "accelerate")
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


def set_verbosity(level: Union[None, str, int] = None) -> int:
    """Send our loggers' messages to stderr at ``level`` (None: ``$HYBRIDGEN_LOG_LEVEL``, else info).

    Bars are shown at info and debug, hidden above; the loggers of the libraries we drive
    (:data:`THIRD_PARTY`) follow (see :func:`_third_party`), and so do transformers' and
    datasets' own bars.

    Safe to call more than once (one handler per logger; the last level wins). Our loggers and
    their children are enabled again: a ``logging.config.dictConfig`` with
    ``disable_existing_loggers`` (Hydra's ``hydra_logging: disabled`` has it) switches off every
    logger that existed before it. Returns the level.
    """
    n = parse_level(level if level is not None else os.environ.get(ENV, "info"))
    changed = not verbosity_was_set() or logging.getLogger(ROOT).level != n
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
    _third_party(n)
    if changed:
        logging.getLogger(ROOT).debug("verbosity: %s", logging.getLevelName(n).lower())
    return n


setup = set_verbosity  # the older name, used by the command lines


def get_verbosity() -> int:
    """The level of the ``hybridgen`` logger (Python's default, warning, when never set)."""
    return logging.getLogger(ROOT).getEffectiveLevel()


def _third_party(n: int) -> None:
    """Our level for the libraries we drive: lm-eval's follows ours; the Hugging Face libraries keep
    their default (warning) unless ours hides more (their debug output is not ours to ask for)."""
    if n > logging.INFO or "transformers" in sys.modules:  # first: its import sets its logger's level
        from transformers.utils import logging as hf_logging

        (hf_logging.enable_progress_bar if n <= logging.INFO else hf_logging.disable_progress_bar)()
    if "datasets" in sys.modules:
        import datasets

        (datasets.enable_progress_bars if n <= logging.INFO else datasets.disable_progress_bars)()
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(n if name == "lm_eval" else max(n, logging.WARNING))


def hide_foreign_bars(level: Union[None, str, int]) -> None:
    """At warning and quieter, also the bars of libraries that offer no switch (lm-eval's request
    building): tqdm's own ``TQDM_DISABLE``, which tqdm reads when imported, so a command line
    calls this first, before it imports torch, transformers or lm-eval (a no-op after that)."""
    n = parse_level(level if level is not None else os.environ.get(ENV, "info"))
    if n > logging.INFO and "tqdm" not in sys.modules:
        os.environ.setdefault("TQDM_DISABLE", "1")


def progress_enabled() -> bool:
    """True when bars should show: the ``hybridgen`` logger is at info or more verbose."""
    return logging.getLogger(ROOT).isEnabledFor(logging.INFO)


def verbosity_was_set() -> bool:
    """True once :func:`set_verbosity` ran in this process (its handler is on our logger)."""
    return any(getattr(h, _HANDLER_FLAG, False) for h in logging.getLogger(ROOT).handlers)


def bar(iterable: Optional[Iterable[Any]] = None, total: Optional[int] = None, desc: str = "",
        unit: str = "it", disable: Optional[bool] = None, explicit: bool = False, **kwargs: Any):
    """A tqdm bar on stderr, shown when :func:`progress_enabled`.

    ``disable=True`` hides it whatever the verbosity; ``explicit=True`` marks a bar the
    caller asked for (``progress=True``): it shows also when no verbosity was ever set, and
    hides when one hides bars.
    """
    from tqdm.auto import tqdm

    if disable is None or not disable:
        shown = progress_enabled() or (explicit and not verbosity_was_set())
    else:
        shown = False
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not shown, file=sys.stderr, **kwargs)


def redirect():
    """A context in which our messages are written through tqdm (a line never cuts a bar)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger(n) for n in NAMES])
