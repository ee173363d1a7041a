"""Every piece of process-wide state of the CUDA kernels, in one place.

* availability: :func:`kernels_available` (cached probe of torch CUDA + CuPy + a device),
  and the ``HYBRIDGEN_CUPY`` switch read by :func:`mode`;
* compiled modules: :data:`compiled_kernels` (one entry per specialisation and device,
  guarded by :data:`compiled_kernels_lock`);
* first-use verification: :data:`verified` / :data:`rejected` kernels and the failures
  already warned about (:data:`warned`);
* :data:`dispatch_counts`: how often each path ran (benchmarks print it).

Other modules read these names through the module (``state.verified``), never by copying
them, so a test can replace one with ``monkeypatch.setattr(state, ...)``.
"""
from __future__ import annotations

import functools
import os
import threading
from typing import Any, Dict, Set, Tuple

import torch

#: how often each path ran in this process: {"flash": n, "cupy": m, "torch": k} (benchmarks print it).
dispatch_counts: Dict[str, int] = {"flash": 0, "cupy": 0, "torch": 0}

#: (dtype, head_dim, group, device index) -> {kernel name: CuPy RawKernel}
compiled_kernels: Dict[Tuple[torch.dtype, int, int, int], Dict[str, Any]] = {}
compiled_kernels_lock = threading.Lock()

#: (kernel entry point name, dtype) pairs whose first GPU-kernel result (CuPy or flash) matched torch
verified: Set[Tuple[str, torch.dtype]] = set()
#: entry point names whose first GPU-kernel result disagreed with torch, or whose kernel failed
#: (switched off for the process)
rejected: Set[str] = set()
#: (entry point name, exception type name) failures already warned about
warned: Set[Tuple[str, str]] = set()

_OFF = ("0", "off", "false", "no")


def mode() -> str:
    """``HYBRIDGEN_CUPY``, lower-cased: '1' (default, CuPy when it works), 'strict' (failures
    and disagreements raise) or '0'/'off'/'false'/'no' (CuPy never used)."""
    return os.environ.get("HYBRIDGEN_CUPY", "1").strip().lower()


def strict() -> bool:
    """True under ``HYBRIDGEN_CUPY=strict``."""
    return mode() == "strict"


def import_cupy() -> Any:
    """The ``cupy`` module, or None when it is missing or broken (an optional dependency)."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except Exception:  # noqa: BLE001 - ImportError, or a broken CuPy wheel
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def kernels_available() -> bool:
    """True when the CuPy kernels can run: torch sees CUDA, CuPy imports and sees a device.

    False (never an exception) without CUDA, without CuPy, with CuPy but no usable driver,
    or with ``HYBRIDGEN_CUPY=0``. Cached; ``kernels_available.cache_clear()`` re-probes.
    """
    if mode() in _OFF:
        return False
    try:
        if not torch.cuda.is_available():
            return False
    except Exception:  # noqa: BLE001 - a broken CUDA install means "not available"
        return False
    cp = import_cupy()
    if cp is None:
        return False
    try:
        return bool(cp.cuda.is_available()) and cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - CUDARuntimeError, missing driver, ...
        return False
