"""Filesystem-safe names of runs: one rule for every directory a run writes.

Used by the results store of the experiments (``hybridgen_harness.results.run_name``) and by
``hybridgen-lm-eval`` (``hybridgen.eval.lm_eval_cli.run_dir_name``), so a method with the same
parameters reads the same in both directory names.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

_SAFE = re.compile(r"[^A-Za-z0-9._=+-]+")


def format_value(value: Any) -> str:
    """A parameter value as name text: floats by ``%g``, booleans as 1/0, lists joined by '+'."""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return "+".join(format_value(v) for v in value)
    return str(value)


def slug(text: str, max_len: int = 80) -> str:
    """Filesystem-safe fragment: runs of unsafe characters become '_'; '/' never survives."""
    out = _SAFE.sub("_", str(text)).strip("_") or "x"
    return out[:max_len]


def method_part(method: str, params: Mapping[str, Any]) -> str:
    """``<method>[-<param>=<value>...]`` (params sorted by name), at most 120 characters."""
    meth = slug(method, 30)
    if params:
        meth += "-" + "-".join(f"{slug(k, 20)}={slug(format_value(v), 20)}" for k, v in sorted(params.items()))
    return slug(meth, 120)
