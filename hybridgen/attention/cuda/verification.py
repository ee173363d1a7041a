"""First-use verification: the first GPU-kernel result (CuPy, or torch's flash kernel with its LSE) of each
entry point and dtype is checked against torch.

The kernel source is tested on the CPU (a C++ emulator of the CUDA thread model) and compiled
by NVRTC in the test suite; this check guards GPUs and drivers it has not run on. A kernel
whose first result disagrees with the torch primitive on the same inputs (beyond
:data:`VERIFY_TOL`) is switched off for the process with one warning, or raises under
``HYBRIDGEN_CUPY=strict``. Results are recorded in :mod:`hybridgen.attention.cuda.state`.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Tuple

import torch

from hybridgen.attention.cuda import state

#: largest max-relative error accepted on the first call, per dtype
VERIFY_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def max_rel_err(got: Any, ref: Any) -> float:
    """Largest |got - ref| / max |ref| over the finite entries of a tensor or a tuple of tensors;
    inf when got and ref are not finite at the same places."""
    pairs = zip(got, ref) if isinstance(ref, tuple) else [(got, ref)]
    err = 0.0
    for a, b in pairs:
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        if not bool((torch.isfinite(a) == finite).all()):
            return math.inf
        diff = (a[finite] - b[finite]).abs().max() if bool(finite.any()) else a.new_zeros(())
        err = max(err, float(diff) / max(float(b[finite].abs().max()) if bool(finite.any()) else 0.0, 1e-6))
    return err


def check_result(name: str, dtype: torch.dtype, result: Any, torch_fn: Callable[..., Any],
                 args: Tuple[Any, ...], path: str = "cupy") -> Tuple[Any, str]:
    """(value to return, path taken: ``path`` or 'torch') for a GPU kernel's result of entry point
    `name` (a CuPy kernel, or torch's flash kernel with ``path='flash'``).

    Trusted once (name, dtype) has been verified; otherwise compared with ``torch_fn(*args)``.
    A disagreement rejects `name` for the process (RuntimeError under HYBRIDGEN_CUPY=strict)
    and returns the torch result.
    """
    key = (name, dtype)
    if key in state.verified:
        return result, path
    ref = torch_fn(*args)
    err = max_rel_err(result, ref)
    if err <= VERIFY_TOL.get(dtype, 3e-2):
        state.verified.add(key)
        return result, path
    msg = (f"GPU kernel {name} disagrees with torch on its first call ({dtype}, max relative "
           f"error {err:.2e}); using the fallback for the rest of this process")
    if state.strict():
        raise RuntimeError(msg)
    state.rejected.add(name)
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return ref, "torch"
