"""Where the harness's packaged files are: the Hydra configs and the figure notebooks.

In a source checkout they are the top-level ``conf/`` and ``notebooks/`` (where the docs, the
tests and ``--config-dir`` examples name them). An installed wheel carries them inside this
package, as ``experiments/conf/`` and ``experiments/notebooks/`` (the mapping is setup.py's),
so ``hybridgen run +exp=quickstart`` works from any directory without a checkout.
"""
from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def _packaged_or_checkout(name: str) -> Path:
    inside = _PACKAGE / name
    return inside if inside.is_dir() else _PACKAGE.parent / name


#: the Hydra config tree (config.yaml, exp/, method/, model/, hardware/, workload/, hydra/)
CONF_DIR = _packaged_or_checkout("conf")
#: the figure notebooks (jupytext percent scripts, runnable as plain Python)
NOTEBOOKS_DIR = _packaged_or_checkout("notebooks")
