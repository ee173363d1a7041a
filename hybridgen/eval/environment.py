"""What a result needs to be trusted later: versions, device, CPU, NUMA layout, git state."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict

PACKAGES = ("torch", "transformers", "numpy", "hydra-core", "omegaconf", "lm_eval", "datasets", "numba",
            "cupy-cuda12x", "pandas")


def _version(pkg: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def git_state() -> Dict[str, Any]:
    """Commit and dirty flag of the repository this file lives in (None outside git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty if commit else None}


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else platform)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> Dict[str, Any]:
    """Versions, device, CPU and NUMA layout of this process (cheap; call once per run)."""
    import torch

    from hybridgen import runtime
    from hybridgen.kv import numa

    cuda = torch.cuda.is_available()
    env: Dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": platform.node(),
        "packages": {p: _version(p) for p in PACKAGES},
        "hybridgen": _version("hybridgen"),
        "git": git_state(),
        "cpu": {"model": cpu_model(), "logical_cores": os.cpu_count(),
                "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "torch_threads": torch.get_num_threads()},
        "cuda": {"available": cuda,
                 "device": torch.cuda.get_device_name(0) if cuda else None,
                 "version": torch.version.cuda,
                 "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None},
        "numa": [{"node": n.node, "cpus": len(n.cpus), "mem_bytes": n.mem_bytes, "cpu_less": n.cpu_less}
                 for n in numa.numa_nodes()],
        "numa_binding_supported": numa.binding_supported(),
        "env_vars": {k: os.environ.get(k) for k in ("NUMBA_THREADING_LAYER", "OMP_WAIT_POLICY", "OMP_NUM_THREADS",
                                                    "TOKENIZERS_PARALLELISM", "HYBRIDGEN_SCAN_THREADS",
                                                    "HF_HUB_OFFLINE", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID")},
        "runtime": runtime.record(),  # what hybridgen.runtime.apply() set (thread counts as they are now)
    }
    return env
