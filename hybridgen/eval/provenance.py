"""What makes two runs comparable: the realized hardware, the code version, the kernels that ran.

- :func:`realized_device` is the hardware a measurement really ran on: the CUDA device's name
  (``"NVIDIA H200"``) when torch sees CUDA (the engine then runs there), else
  ``"cpu-emulated"`` (the gpu tier lives in host memory). It is part of a run's identity (its
  hash and readable name, see :mod:`hybridgen_harness.results`), so numbers from another machine are
  never taken for this one's.
- :func:`code_version` is the git commit, dirty flag and a fingerprint of the uncommitted
  changes of this checkout. It is recorded in
  every run's metrics but is NOT part of the identity: a finished run of another commit is
  reused (skipped) with a visible note naming both commits, and ``force=true`` re-runs it
  (documented choice: re-running every point after every commit would make resuming a
  sweep across a one-line fix impossible; the note keeps the reuse visible).
- :func:`kernels_used` names the kernel paths of one run: the CPU key scan and top-k the
  method's settings resolve to for the KV dtype (the resolution ``scan_logits`` itself
  applies), and how often the CUDA attention dispatch took CuPy or torch during the run
  (counted by :mod:`hybridgen.attention.cuda`).
"""
from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

import torch

CPU_EMULATED = "cpu-emulated"


def realized_device() -> str:
    """The CUDA device name when torch sees CUDA, else ``'cpu-emulated'``."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return CPU_EMULATED


@functools.lru_cache(maxsize=1)
def code_version() -> Dict[str, Any]:
    """{'commit': 40-hex or None, 'dirty': bool or None, 'diff_sha1': 12-hex or None} of this checkout.

    diff_sha1 fingerprints the uncommitted changes to tracked files (``git diff HEAD``), so two
    runs from the same dirty checkout are known to share their code. Cached per process.
    """
    from hybridgen.eval.environment import git_state

    out: Dict[str, Any] = dict(git_state())
    out["diff_sha1"] = None
    if out.get("dirty"):
        root = Path(__file__).resolve().parents[2]
        try:
            diff = subprocess.run(["git", "diff", "HEAD", "--no-color", "--no-ext-diff"], cwd=root,
                                  capture_output=True, timeout=30).stdout
            out["diff_sha1"] = hashlib.sha1(diff).hexdigest()[:12]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return out


def describe_version(version: Optional[Mapping[str, Any]]) -> str:
    """'abc12345' / 'abc12345+dirty:1a2b3c4d5e6f' / 'unknown' for a code_version() record."""
    if not version or not version.get("commit"):
        return "unknown"
    dirty = f"+dirty:{version.get('diff_sha1') or '?'}" if version.get("dirty") else ""
    return str(version["commit"])[:8] + dirty


def same_code(a: Optional[Mapping[str, Any]], b: Optional[Mapping[str, Any]]) -> bool:
    """True when both records name the same commit with the same uncommitted changes (or none)."""
    if not a or not b or not a.get("commit") or not b.get("commit"):
        return False
    if a["commit"] != b["commit"] or bool(a.get("dirty")) != bool(b.get("dirty")):
        return False
    return not a.get("dirty") or (a.get("diff_sha1") is not None and a.get("diff_sha1") == b.get("diff_sha1"))


def cuda_dispatch_counts() -> Dict[str, int]:
    """A copy of the CUDA attention dispatch counters ({'flash': n, 'cupy': m, 'torch': k}); {} without them."""
    try:
        from hybridgen.attention.cuda import dispatch_counts
    except ImportError:  # pragma: no cover - the CUDA package is part of the library
        return {}
    return {str(k): int(v) for k, v in dict(dispatch_counts).items()}


def kernels_used(method_config: Mapping[str, Any], kv_dtype: torch.dtype,
                 cuda_before: Mapping[str, int]) -> Dict[str, Any]:
    """The kernel paths of one run.

    method_config: the method's ``config()``; kv_dtype: the dtype its KV is kept in (the
    model's); cuda_before: :func:`cuda_dispatch_counts` taken before the run.
    Returns {'cpu_scan': 'numba' | 'torch' | None (the method has no CPU scan),
    'cpu_topk': ..., 'cuda_attention': {'flash': calls, 'cupy': calls, 'torch': calls} during the run,
    'numba_available': bool, 'cupy_available': bool}.
    """
    from hybridgen.attention import cpu_scan

    scan = method_config.get("scan_backend")
    after = cuda_dispatch_counts()
    try:
        from hybridgen.attention.cuda import kernels_available

        cupy_ok = bool(kernels_available())
    except ImportError:  # pragma: no cover
        cupy_ok = False
    return {
        "cpu_scan": cpu_scan.resolve_backend(str(scan), kv_dtype) if scan is not None else None,
        "cpu_topk": method_config.get("topk_backend"),
        "cuda_attention": {k: after.get(k, 0) - int(cuda_before.get(k, 0)) for k in after},
        "numba_available": bool(cpu_scan.numba_available()),
        "cupy_available": cupy_ok,
    }
