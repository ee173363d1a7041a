"""Method-level harness shared by the baseline tests (not a test module).

Thin names over :mod:`hybridgen.testing` (the one method driver, ``rel_err`` and the public
``conformance`` check a method author calls): ``run_method`` binds a
method, prefills every layer with seeded random q/k/v and runs decode steps, recording every
output with the full K/V history so a test can compare against a dense reference or check an
invariant after each step.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.methods import MethodContext
from hybridgen.testing import Record, Run, Shape, dense_reference, drive, left_padding, method_context, rel_err

__all__ = ["POOL", "Record", "Run", "dense_ref", "left_padding", "make_ctx", "rel_err", "run_method"]

POOL = CPUAttentionPool(workers=1)


def make_ctx(B, Hq, Hkv, D, T, steps, dtype=torch.float32, layers=2, rotary=None, engine=None) -> MethodContext:
    return method_context(Shape(B, Hq, Hkv, D, T), steps, dtype=dtype, layers=layers, pool=POOL, rotary=rotary,
                          engine=engine)


def run_method(method, shape, steps, seed=0, valid=None, dtype=torch.float32, layers=2, rotary=None,
               after_step: Optional[Callable[[object, int], None]] = None, kv_fn=None, release=False) -> Run:
    """Prefill ``layers`` layers and run ``steps`` decode steps with seeded random tensors.

    shape: (B, Hq, Hkv, D, T). kv_fn(layer, t_positions, q, k) may transform q and keys (e.g. rotate).
    after_step(method, step) runs after every step's end_step().
    """
    return drive(method, shape, steps, seed=seed, valid=valid, dtype=dtype, layers=layers, rotary=rotary,
                 pool=POOL, after_step=after_step, kv_fn=kv_fn, release=release)


def dense_ref(rec: Record, scale: float) -> torch.Tensor:
    """Float64 dense attention of the record's query over its full history."""
    return dense_reference(rec, scale)
