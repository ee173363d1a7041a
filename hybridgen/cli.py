"""The ``hybridgen`` command (also ``python -m hybridgen``).

    hybridgen run +exp=quickstart results_dir=/tmp/x   # an experiment (experiments/run.py's arguments)
    hybridgen methods                                  # every registered method, its parameters and defaults
    hybridgen figures [--results-dir results]          # aggregate the results, draw every figure
    hybridgen --version

``methods`` is the library's own. ``run`` and ``figures`` belong to the experiment harness
(``experiments/``), which the library never imports: they are found through the
``hybridgen.commands`` entry-point group, as methods are (a checkout's pyproject wins over
installed metadata, as in :mod:`hybridgen.methods.registry`).
"""
from __future__ import annotations

import importlib
import sys
from importlib import metadata
from typing import Callable, Dict, List, Optional, Sequence

GROUP = "hybridgen.commands"
_OWN = {"methods": "every registered method with its parameters, types and defaults"}
_HELP = {"run": "run an experiment: hybridgen run +exp=NAME [key=value ...] (-q/-v; --help: Hydra's help)",
         "figures": "aggregate the results and draw every figure: hybridgen figures [--results-dir DIR]"}


def commands() -> Dict[str, str]:
    """Subcommand name -> "module:function" of the harness's commands (entry points, then the checkout's)."""
    from hybridgen.methods.registry import pyproject_entry_points

    found = {ep.name: ep.value for ep in metadata.entry_points(group=GROUP)}
    found.update(pyproject_entry_points(GROUP))
    return found


def _usage(found: Dict[str, str]) -> str:
    from hybridgen import __version__

    lines = [f"usage: hybridgen <command> [arguments]   (hybridgen {__version__})", "", "commands:"]
    for name in sorted(set(_OWN) | set(found)):
        lines.append(f"  {name:<9} {_OWN.get(name) or _HELP.get(name, found.get(name, ''))}")
    return "\n".join(lines)


def _methods(argv: List[str]) -> int:
    from hybridgen.methods.catalog import format_catalog

    if argv and argv[0] in ("-h", "--help"):
        print("usage: hybridgen methods [NAME ...]   (every registered method when none is named)")
        return 0
    print(format_catalog(argv or None))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv`` (default: the command line); the exit status."""
    from hybridgen import __version__, runtime

    runtime.apply_or_exit()  # thread/env settings before torch loads (every entry point: hybridgen/runtime.py)
    from hybridgen.errors import HybridGenError

    args = list(sys.argv[1:] if argv is None else argv)
    found = commands()
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage(found))
        return 0 if args else 2
    if args[0] in ("--version", "version"):
        print(f"hybridgen {__version__}")
        return 0
    name, rest = args[0], args[1:]
    try:
        if name == "methods":
            return _methods(rest)
        if name not in found:
            from hybridgen.errors import unknown_name

            raise unknown_name("command", name, sorted(set(_OWN) | set(found)))
        module, _, attr = found[name].partition(":")
        try:
            func: Callable[[List[str]], int] = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            from hybridgen.errors import ConfigError

            raise ConfigError(f"command {name!r} is declared as {found[name]!r} but cannot be loaded "
                              f"({type(err).__name__}: {err}); install the harness: pip install '.[harness]'") from None
        return int(func(rest) or 0)
    except HybridGenError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
