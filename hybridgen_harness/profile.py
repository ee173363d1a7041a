"""Measure this machine into a hardware profile: ``python -m hybridgen_harness.profile [--out FILE] [--quick] [--force]``.

Measures (each only where the hardware exists; what cannot be measured is recorded as null):
- host<->GPU copies, pinned and pageable, both directions (CUDA only);
- GPU memory bandwidth (device-to-device copy, bytes read + written), dense bf16 matmul
  rate, kernel launch + sync cost, decode-attention bytes/s of the torch path and, when
  CuPy works, of the CuPy kernels (CUDA only);
- host memory read bandwidth per NUMA node (threads pinned to the node's CPUs, or to the
  nearest CPU node for a CPU-less CXL node, memory bound to the node with mbind; a single
  node machine is measured in-process, unbound);
- CPU decode attention (``partial_attention`` over host KV), the GQA key scan of
  ``hybridgen.attention.cpu_scan``, the group score (``group_scores``), ``torch.topk`` and
  the row gather (``gather_rows``) as bytes/s at decode shapes of a Llama-3.1-8B layer (batch 8,
  32 query heads, 8 KV heads, head dim 128); with CUDA, attention and scan again over
  pinned (page-locked) host KV, where the code keeps it; the fixed cost of one small host
  torch op (``op_us``);
- cores, memory, CPU model, versions.

The output has the schema of ``hybridgen/profiles/*.json`` with ``"measured": true``, the
date and ``host_info``, and loads with :func:`hybridgen.perf.load_profile`.

Choices: bandwidths are the median of several timed repetitions after one warm-up; buffers
are filled with non-zero data first (untouched pages would read as the shared zero page);
``--quick`` shrinks every buffer (about 20 s on a 2-core machine) at the cost of cache
effects on small buffers.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

if __name__ == "__main__":  # as a command: thread/env settings before torch loads
    from hybridgen import runtime

    runtime.apply_or_exit()

import torch

from hybridgen.errors import cli_errors
from hybridgen.eval.environment import cpu_model
from hybridgen_harness.profile_host import (SHAPE, ProfileConfig, decode_inputs, gbps, measure_cpu_kernels, measure_numa_nodes,
                                    mem_gb)
from hybridgen.timing import median_time


# ------------------------------------------------------------------ GPU (CUDA only)
def measure_gpu(cfg: ProfileConfig) -> Optional[Dict[str, Any]]:
    """Copies, HBM, matmul, launch cost and decode attention on CUDA device 0; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    props = torch.cuda.get_device_properties(dev)
    n = cfg.copy_bytes
    d_buf = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.ones(n, dtype=torch.uint8).pin_memory()
    pageable = torch.ones(n, dtype=torch.uint8)
    link = {
        "h2d_pinned_gbps": gbps(n, median_time(lambda: d_buf.copy_(pinned, non_blocking=True), cfg.reps, sync)),
        "h2d_pageable_gbps": gbps(n, median_time(lambda: d_buf.copy_(pageable), cfg.reps, sync)),
        "d2h_pinned_gbps": gbps(n, median_time(lambda: pinned.copy_(d_buf, non_blocking=True), cfg.reps, sync)),
        "d2h_pageable_gbps": gbps(n, median_time(lambda: pageable.copy_(d_buf), cfg.reps, sync)),
    }
    small = torch.ones(1, device=dev)
    link["latency_us"] = round(median_time(lambda: small.to("cpu"), 20) * 1e6, 1)
    del pinned, pageable, d_buf
    a = torch.ones(cfg.hbm_bytes // 4, device=dev)
    b = torch.empty_like(a)
    hbm = gbps(2 * cfg.hbm_bytes, median_time(lambda: b.copy_(a), cfg.reps, sync))
    del a, b
    m = cfg.matmul_n
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    tflops = round(2 * m ** 3 / median_time(lambda: x @ y, cfg.reps, sync) / 1e12, 1)
    del x, y
    launch_us = round(median_time(lambda: small.add_(1), 50, sync) * 1e6, 1)
    from hybridgen.attention import cuda as cuda_attention
    from hybridgen.attention.partial import partial_attention

    q, k, v = decode_inputs(cfg.gpu_tokens, torch.bfloat16, "cuda")
    kv_bytes = 2 * k.numel() * k.element_size()
    scale = 1 / math.sqrt(SHAPE["head_dim"])
    by_backend = {"torch": gbps(kv_bytes, median_time(lambda: partial_attention(q, k, v, scale), cfg.reps, sync))}
    if cuda_attention.kernels_available():
        try:
            by_backend["cupy"] = gbps(kv_bytes, median_time(
                lambda: cuda_attention.cupy_partial_attention(q, k, v, scale), cfg.reps, sync))
        except Exception as err:  # noqa: BLE001 - record, do not fail the profile
            by_backend["cupy_error"] = f"{type(err).__name__}: {err}"[:200]
    best = max(v for v in by_backend.values() if isinstance(v, float))
    gpu = {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1), "hbm_gbps": hbm,
           "attention_gbps": best, "matmul_tflops": tflops, "launch_us": launch_us,
           "gqa_attention_gbps": best}  # measured at the GQA shape (32 q heads, 8 KV heads)
    return {"gpu": gpu, "link": link, "attention_by_backend": by_backend}


def build_profile(cfg: ProfileConfig, name: str, quick: bool) -> Dict[str, Any]:
    """Run every measurement and return the profile dict (schema of hybridgen/profiles)."""
    t0 = time.perf_counter()
    nodes = measure_numa_nodes(cfg)
    cpu = measure_cpu_kernels(cfg)
    gpu = measure_gpu(cfg)
    dram_nodes = [n for n in nodes if n["kind"] == "dram" and n.get("read_gbps")]
    cxl_nodes = [n for n in nodes if n["kind"] == "cxl" and n.get("read_gbps")]
    how = f"measured by `python -m hybridgen_harness.profile{' --quick' if quick else ''}`"
    null_gpu = {"name": None, "memory_gb": None, "hbm_gbps": None, "attention_gbps": None, "matmul_tflops": None,
                "launch_us": None, "gqa_attention_gbps": None}
    null_link = {"name": None, "h2d_pinned_gbps": None, "h2d_pageable_gbps": None, "d2h_pinned_gbps": None,
                 "d2h_pageable_gbps": None, "latency_us": None}
    profile = {
        "name": name,
        "description": f"Measured profile of {platform.node() or 'this machine'} ({cpu_model()}); "
                       + ("GPU: " + gpu["gpu"]["name"] if gpu else "no CUDA device: GPU and link not measured"),
        "measured": True,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": gpu["gpu"] if gpu else null_gpu,
        "link": dict(null_link, **gpu["link"], name="host<->GPU link (measured)") if gpu else null_link,
        "host": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "dram_gb": mem_gb(),
            "dram_read_gbps": dram_nodes[0]["read_gbps"] if dram_nodes else None,
            "cpu_attention_gbps": cpu["cpu_attention_gbps"],
            "key_scan_gbps": cpu["key_scan_gbps"],
            "topk_gbps": cpu["topk_gbps"],
            "group_score_gbps": cpu["group_score_gbps"],
            "gather_gbps": cpu["gather_gbps"],
            "op_us": cpu["op_us"],
            "key_scan_pinned_gbps": cpu["key_scan_pinned_gbps"],
            "cpu_attention_pinned_gbps": cpu["cpu_attention_pinned_gbps"],
            "key_sketch_gbps": cpu["key_sketch_gbps"],
            "select_gbps": cpu["select_gbps"],
            "key_scan_bf16dot_gbps": cpu["key_scan_bf16dot_gbps"],
            "numa_nodes": [{"node": n["node"], "kind": n["kind"], "read_gbps": n.get("read_gbps"),
                            "capacity_gb": n.get("capacity_gb")} for n in nodes],
        },
        "cxl": None,
        "sources": {
            "gpu": how if gpu else "not measured: no CUDA device",
            "link": how if gpu else "not measured: no CUDA device",
            "host": how,
        },
        "host_info": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "numa_measurements": nodes,
            "key_scan_backend": cpu["key_scan_backend"],
            "decode_shape": dict(SHAPE, cpu_tokens=cfg.cpu_tokens, gpu_tokens=cfg.gpu_tokens),
            "gpu_attention_by_backend": gpu["attention_by_backend"] if gpu else None,
            "quick": quick,
            "elapsed_s": None,
        },
    }
    if cxl_nodes:  # a CPU-less node was measured: record it as the CXL node (added latency not measured)
        c = cxl_nodes[0]
        profile["cxl"] = {"name": f"CPU-less NUMA node {c['node']}", "link_gbps": c["read_gbps"],
                          "read_gbps": c["read_gbps"], "added_latency_ns": 0, "capacity_gb": c.get("capacity_gb")}
        profile["sources"]["cxl"] = how + " (read bandwidth only; latency not measured, recorded as 0)"
    profile["host_info"]["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return profile


def _summary(p: Dict[str, Any]) -> str:
    h, g, lk = p["host"], p["gpu"], p["link"]
    rows = [("host read GB/s per node", ", ".join(f"{n['node']}:{n['read_gbps']}" for n in h["numa_nodes"])),
            ("CPU attention GB/s", json.dumps(h["cpu_attention_gbps"])),
            ("key scan GB/s", json.dumps(h["key_scan_gbps"])),
            ("key sketch scan GB/s", json.dumps(h.get("key_sketch_gbps") or {})),
            ("top-k GB/s", h["topk_gbps"]),
            ("fused selection GB/s", h.get("select_gbps")),
            ("bf16-dot selection scan GB/s", h.get("key_scan_bf16dot_gbps")),
            ("H2D pinned / pageable GB/s", f"{lk['h2d_pinned_gbps']} / {lk['h2d_pageable_gbps']}"),
            ("GPU HBM / attention GB/s", f"{g['hbm_gbps']} / {g['attention_gbps']}")]
    return "\n".join(f"  {k:30s} {v}" for k, v in rows)


def check_out(out: Path, force: bool) -> None:
    """Before measuring: ``out`` must be a new file (or ``force``) whose directory can be created and written.

    One-line ConfigError otherwise; creates nothing (a temporary probe file is removed at once).
    """
    from hybridgen.validation.paths import check_output_file

    check_output_file("--out", out, force, example="measured.json")


@cli_errors
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridgen_harness.profile", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/profiles/measured.json",
                        help="profile JSON to write (checked before measuring; never overwritten without --force)")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    parser.add_argument("--quick", action="store_true", help="small buffers (about 20 s on 2 cores)")
    parser.add_argument("--name", default=None, help="profile name (default: measured-<host>)")
    args = parser.parse_args(argv)
    out = Path(args.out).expanduser()
    check_out(out, args.force)  # an unwritable or existing --out fails now, not after minutes of measuring
    existed = out.exists()
    name = args.name or f"measured-{(platform.node() or 'host').split('.')[0]}"
    cfg = ProfileConfig.quick() if args.quick else ProfileConfig()
    profile = build_profile(cfg, name, args.quick)
    from hybridgen.perf import profile_from_dict

    profile_from_dict(profile, where="measured profile")  # the file must load like a shipped one
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    os.replace(tmp, out)  # atomic: an interrupted write never leaves half a profile
    replaced = " (replaced the existing file: --force)" if existed else ""
    print(f"wrote {out}{replaced} ({profile['host_info']['elapsed_s']} s)\n{_summary(profile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
