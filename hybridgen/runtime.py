"""Thread and environment settings of every entry point, applied in one place and recorded.

Every script and command calls :func:`apply` first, before anything imports torch::

    from hybridgen import runtime
    runtime.apply_or_exit()              # or apply(torch_threads=8, scan_threads=15)
    import torch

(``apply_or_exit`` is ``apply`` for a script's first lines: a bad setting prints one line and
exits with status 2.)

What it sets (a value already in the environment wins, so a user can still override it):

- ``NUMBA_THREADING_LAYER=workqueue``: numba's OpenMP layer clashes with torch's (matmuls
  about 25x slower on the 2-core development machine; docs/design.md, thread runtime).
- ``OMP_WAIT_POLICY=passive``: idle OpenMP threads sleep instead of spinning (a 2-thread
  decode step was ~15x slower with spinning while other processes shared the cores). libgomp
  reads it when torch loads it, so it only takes effect if torch is not imported yet; the
  record says whether it was (``torch_loaded_before``).
- ``TOKENIZERS_PARALLELISM=false`` (the tokenizers' own thread pool forks badly with ours),
  and, only with ``offline=True``, the Hugging Face offline switches. Entry points do not
  ask for them: network mode is the user's choice (``HF_HUB_OFFLINE=1`` etc. in the
  environment); the ``make`` targets and CI export them, so offline is their default.
- Thread counts: torch's intra-op threads (``torch_threads``) and the CPU key scan's threads
  (``scan_threads``, kept in ``HYBRIDGEN_SCAN_THREADS``; default: torch's thread count).
- ``HYBRIDGEN_CPU_ISA`` (not set, only checked): caps the instruction-set level of the CPU
  kernels (``portable``, ``avx2``, ``avx512``; default: the best the CPU has).
- glibc's allocator (:func:`tune_malloc`; ``HYBRIDGEN_MALLOC_TUNE=0`` leaves it alone, and a
  ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` or the same ``GLIBC_TUNABLES``
  (``glibc.malloc.mmap_threshold`` / ``trim_threshold``) in the environment wins): blocks up
  to 32 MiB come from the heap and freed memory stays in the process. By default glibc maps
  every block above its mmap threshold afresh and unmaps it when freed, so a tensor of a few
  MB made every decode step (a step's gathered K and V rows, its logits) page-faults all of
  its pages every step: on the 2-core development VM Quest's two 6.7 MB row gathers took
  2.2-5.5 ms per layer (six processes) against 1.2-1.8 ms with these settings (four; B=1, 8K
  tokens, fp32), up to half of its step, and how much depended on the heap's history.

It then imports torch (so torch is loaded before anything imports numba) and records what it
applied; :func:`record` returns that record, and ``hybridgen.eval.environment.environment()``
puts it into every run's ``environment.json``.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Tuple

from hybridgen.errors import ConfigError, cli_errors

#: variables every entry point sets (unless the environment already has them)
THREAD_ENV: Dict[str, str] = {
    "NUMBA_THREADING_LAYER": "workqueue",
    "OMP_WAIT_POLICY": "passive",
    "TOKENIZERS_PARALLELISM": "false",
}
#: Hugging Face switches: models and data come from disk only
OFFLINE_ENV: Dict[str, str] = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SCAN_THREADS_VAR = "HYBRIDGEN_SCAN_THREADS"
CPU_ISA_VAR = "HYBRIDGEN_CPU_ISA"
#: instruction-set levels of the CPU kernels (hybridgen.attention.native), lowest first
CPU_ISA_LEVELS = ("portable", "avx2", "avx512")
MALLOC_TUNE_VAR = "HYBRIDGEN_MALLOC_TUNE"
#: glibc mallopt settings (parameter code, value; glibc's environment variable that overrides
#: it): the mmap threshold at glibc's largest (32 MiB on 64-bit), trimming only above 1 GiB
MALLOC_SETTINGS: Dict[str, Tuple[int, int, str]] = {
    "mmap_threshold": (-3, 32 << 20, "MALLOC_MMAP_THRESHOLD_"),
    "trim_threshold": (-1, 1 << 30, "MALLOC_TRIM_THRESHOLD_"),
}

_record: Dict[str, Any] = {}


def _positive_int(value: Any, what: str) -> int:
    """``value`` as an int >= 1, or a one-line ConfigError naming ``what``."""
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ConfigError(f"{what} must be a whole number of threads >= 1, got {value!r}") from None
    if n < 1:
        raise ConfigError(f"{what} must be a whole number of threads >= 1, got {value!r}")
    return n


def cpu_isa_cap() -> int:
    """The level ``HYBRIDGEN_CPU_ISA`` caps the CPU kernels at (an index into
    :data:`CPU_ISA_LEVELS`; the highest when unset), or a one-line ConfigError."""
    text = os.environ.get(CPU_ISA_VAR, "").strip().lower()
    if not text:
        return len(CPU_ISA_LEVELS) - 1
    if text not in CPU_ISA_LEVELS:
        raise ConfigError(f"{CPU_ISA_VAR} must be one of {', '.join(CPU_ISA_LEVELS)}, got {text!r}")
    return CPU_ISA_LEVELS.index(text)


def tune_malloc() -> Dict[str, Any]:
    """Apply :data:`MALLOC_SETTINGS` with glibc's ``mallopt`` (module docstring); returns what
    was set: {'applied': True when every setting holds (ours or the environment's), 'glibc':
    version, setting: value, or 'MALLOC_..._=...' / 'GLIBC_TUNABLES' where the environment gives
    it (left to it), or 'refused'}. Not glibc (macOS, musl), or ``HYBRIDGEN_MALLOC_TUNE=0``:
    nothing set."""
    import ctypes

    raw = os.environ.get(MALLOC_TUNE_VAR, "").strip() or "1"
    if raw not in ("0", "1"):
        raise ConfigError(f"{MALLOC_TUNE_VAR} must be 1 (tune glibc's allocator, the default) or 0 (leave it), "
                          f"got {raw!r}")
    if raw == "0":
        return {"applied": False, "why": f"{MALLOC_TUNE_VAR}=0"}
    try:
        libc = ctypes.CDLL(None)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (AttributeError, OSError):
        return {"applied": False, "why": "not glibc"}
    version.restype = ctypes.c_char_p
    out: Dict[str, Any] = {"applied": True, "glibc": version().decode()}
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for name, (code, value, env) in MALLOC_SETTINGS.items():
        if os.environ.get(env):
            out[name] = f"{env}={os.environ[env]}"
        elif f"glibc.malloc.{name}=" in tunables:
            out[name] = "GLIBC_TUNABLES"
        elif mallopt(ctypes.c_int(code), ctypes.c_int(value)) == 1:
            out[name] = value
        else:
            out.update({name: "refused", "applied": False})
    return out


def scan_threads() -> int:
    """Threads of the CPU key scan: ``HYBRIDGEN_SCAN_THREADS`` if set, else torch's thread count."""
    return _scan_threads()


def _scan_threads() -> int:
    raw = os.environ.get(SCAN_THREADS_VAR)
    if raw is None or raw.strip() == "":
        import torch

        return max(1, torch.get_num_threads())
    return _positive_int(raw, f"{SCAN_THREADS_VAR} (threads of the CPU key scan; e.g. {SCAN_THREADS_VAR}=4)")


def apply(*, torch_threads: Optional[int] = None, scan_threads: Optional[int] = None,
          offline: bool = False) -> Dict[str, Any]:
    """Set the environment and thread counts of this process; return (and keep) the record.

    torch_threads: torch's intra-op threads (None: leave torch's default).
    scan_threads: the CPU key scan's threads (None: keep ``HYBRIDGEN_SCAN_THREADS`` if set,
    else follow torch's count). offline: also set the Hugging Face offline switches (default
    False: the environment decides, see module docstring). A bad value of either, or of ``HYBRIDGEN_SCAN_THREADS``
    or ``HYBRIDGEN_CPU_ISA``,
    raises a one-line ConfigError before anything runs. Safe to call more than once: the
    record's ``given`` and ``torch_loaded_before`` describe the process before the first call.
    """
    # every value is checked before anything is changed
    n_torch = None if torch_threads is None else _positive_int(torch_threads, "torch_threads")
    n_scan = None if scan_threads is None else _positive_int(scan_threads, "scan_threads")
    if n_scan is None and os.environ.get(SCAN_THREADS_VAR, "").strip():
        _scan_threads()  # a bad HYBRIDGEN_SCAN_THREADS fails here, before anything runs
    cpu_isa_cap()  # and a bad HYBRIDGEN_CPU_ISA
    malloc = tune_malloc()  # (a bad HYBRIDGEN_MALLOC_TUNE fails before anything changes)
    torch_loaded_before = "torch" in sys.modules
    wanted = dict(THREAD_ENV, **(OFFLINE_ENV if offline else {}))
    given = {k: os.environ[k] for k in wanted if k in os.environ}
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    if n_scan is not None:
        os.environ[SCAN_THREADS_VAR] = str(n_scan)
    import torch  # noqa: F401  (after OMP_WAIT_POLICY; before anything imports numba)

    if n_torch is not None:
        torch.set_num_threads(n_torch)
    first = not _record  # a later call (e.g. with the command line's thread counts) keeps what the first saw
    _record.update({
        "env": {k: os.environ.get(k) for k in (*wanted, SCAN_THREADS_VAR, CPU_ISA_VAR, MALLOC_TUNE_VAR)},
        "malloc": malloc,
        "given": sorted(given) if first else _record["given"],  # set before us: their values won
        "torch_loaded_before": torch_loaded_before if first else _record["torch_loaded_before"],
    })
    return record()


def apply_or_exit(**kwargs: Any) -> Dict[str, Any]:
    """:func:`apply` for a script's first lines: a bad setting prints ``error: <one line>`` and exits 2."""
    return cli_errors(apply)(**kwargs)


def record() -> Dict[str, Any]:
    """What :func:`apply` set, with the thread counts as they are now ({'applied': False} if never called)."""
    if not _record:
        return {"applied": False}
    import torch

    return dict(_record, env=dict(_record["env"]), applied=True, torch_threads=torch.get_num_threads(),
                scan_threads=_scan_threads())
