"""Section 3: the CPU key scan's GB/s (pageable and pinned keys) against the host's plain read.

Keys [B, Hkv, host tokens, D] at the target point (context x host share), query [B, Hq, D];
the read is ``torch.sum`` over ``cfg.read_bytes`` of float32. Median of 5 after a warm-up.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from benchmarks.gpu.config import BenchConfig, Emit, error_row
from hybridgen.timing import median_time


def run_scan(cfg: BenchConfig, device: torch.device, emit: Emit) -> None:
    """One row for the read bandwidth, one per (scan backend, memory kind)."""
    def best(fn):
        return median_time(fn, 5)

    buf = torch.ones(cfg.read_bytes // 4, dtype=torch.float32)
    read = cfg.read_bytes / best(lambda: buf.sum()) / 1e9
    del buf
    emit({"section": "scan", "method": "host read (torch.sum)", "gbps": read, "pct_of_read": 100.0, "status": "ok"})
    ctxt, share = cfg.target
    host_tokens = int(round(ctxt * share))
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(cfg.batch, cfg.kv_heads, host_tokens, cfg.head_dim, generator=g).to(cfg.dtype)
    q = torch.randn(cfg.batch, cfg.heads, cfg.head_dim, generator=g).to(cfg.dtype)
    nbytes = keys.numel() * keys.element_size()
    try:
        from hybridgen.attention import cpu_scan

        variants = [(f"scan {cpu_scan.resolve_backend('auto', keys.dtype)} (auto)", "auto"), ("scan torch", "torch")]
        scan = lambda kk, backend: cpu_scan.scan_logits(q, kk, cfg.scale, backend=backend)  # noqa: E731
    except ImportError:
        from hybridgen.attention.partial import attention_logits

        variants = [("scan torch matmul", "torch")]
        scan = lambda kk, backend: attention_logits(q[:, :, None], kk, cfg.scale)  # noqa: E731
    pinned = None
    if device.type == "cuda":
        try:
            pinned = keys.pin_memory()
        except Exception:  # noqa: BLE001
            pinned = None
    for label, backend in variants:
        for mem, kk in (("pageable", keys), ("pinned", pinned)):
            if kk is None:
                continue
            row: Dict[str, Any] = {"section": "scan", "method": f"{label}, {mem} keys", "host_tokens": host_tokens}
            try:
                gbps = nbytes / best(lambda: scan(kk, backend)) / 1e9
                row.update(gbps=gbps, pct_of_read=100 * gbps / read, status="ok")
            except Exception as err:  # noqa: BLE001
                error_row(row, err)
            emit(row)
