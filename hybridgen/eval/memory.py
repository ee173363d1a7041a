"""Peak memory of a code region, measured (not estimated).

Host: the process's resident-set high-water mark (VmHWM). On Linux the mark is reset at the
start of the region by writing '5' to /proc/self/clear_refs, so the peak belongs to the
region; where that is not permitted the process-lifetime peak (ru_maxrss) is reported and
``host_peak_scope`` says 'process'. GPU: torch.cuda.max_memory_allocated after
reset_peak_memory_stats (None without CUDA).
"""
from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any, Dict, Optional


def _read_status_kib(field: str) -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class PeakMemory:
    """Context manager; after exit ``result()`` gives host/GPU peaks in bytes."""

    def __init__(self):
        self.scope = "process"
        self.host_peak: Optional[int] = None
        self.host_start: Optional[int] = None
        self.gpu_peak: Optional[int] = None

    def __enter__(self) -> "PeakMemory":
        import torch

        self.scope = "region" if _reset_hwm() else "process"
        rss = _read_status_kib("VmRSS")
        self.host_start = rss * 1024 if rss is not None else None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        hwm = _read_status_kib("VmHWM")
        if hwm is not None:
            self.host_peak = hwm * 1024
        else:  # ru_maxrss: KiB on Linux, bytes on macOS
            r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.host_peak = r if sys.platform == "darwin" else r * 1024
            self.scope = "process"
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.gpu_peak = int(torch.cuda.max_memory_allocated())

    def result(self) -> Dict[str, Any]:
        return {"host_peak_rss_bytes": self.host_peak, "host_rss_start_bytes": self.host_start,
                "host_peak_scope": self.scope, "gpu_peak_allocated_bytes": self.gpu_peak}
