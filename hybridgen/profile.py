"""Measure this machine into a hardware profile: ``python -m hybridgen.profile [--out FILE] [--quick] [--force]``.

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
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

if __name__ == "__main__":  # as a command: thread/env settings before torch loads
    from hybridgen import runtime

    runtime.apply_or_exit()

import torch

from hybridgen.errors import cli_errors
from hybridgen.eval.environment import cpu_model
from hybridgen.timing import median_time

SHAPE = {"batch": 8, "heads": 32, "kv_heads": 8, "head_dim": 128}


@dataclass(frozen=True)
class ProfileConfig:
    """Sizes of one profiling run (bytes; tokens per sequence for the attention shapes)."""

    dram_bytes: int = 2 << 30
    cpu_tokens: int = 16384
    gpu_tokens: int = 32768
    copy_bytes: int = 1 << 30
    hbm_bytes: int = 2 << 30
    matmul_n: int = 8192
    reps: int = 5

    @classmethod
    def quick(cls) -> "ProfileConfig":
        return cls(dram_bytes=256 << 20, cpu_tokens=2048, gpu_tokens=8192, copy_bytes=128 << 20,
                   hbm_bytes=512 << 20, matmul_n=4096, reps=3)


def _gbps(nbytes: float, seconds: float) -> float:
    return float(f"{nbytes / seconds / 1e9:.4g}") if seconds > 0 else float("nan")  # 4 significant digits


# ------------------------------------------------------------------ host memory
def _read_bandwidth(buf: torch.Tensor, reps: int) -> float:
    """GB/s of a full read of ``buf`` (float32) by torch's CPU threads."""
    return _gbps(buf.numel() * buf.element_size(), median_time(lambda: buf.sum(), reps))


def _node_cpus(node: int) -> List[int]:
    """CPUs to read ``node`` from: its own, or the nearest CPU node's for a CPU-less node."""
    from hybridgen.kv import numa

    nodes = {n.node: n for n in numa.numa_nodes()}
    if nodes[node].cpus:
        return list(nodes[node].cpus)
    dist_file = Path(f"/sys/devices/system/node/node{node}/distance")
    dists = [int(x) for x in dist_file.read_text().split()] if dist_file.exists() else []
    order = sorted((d, i) for i, d in enumerate(dists) if i in nodes and nodes[i].cpus)
    best = order[0][1] if order else next(n.node for n in nodes.values() if n.cpus)
    return list(nodes[best].cpus)


def node_read_child(node: int, nbytes: int, reps: int) -> Dict[str, Any]:
    """In a child process pinned to the node's CPUs: read bandwidth of memory bound to ``node``."""
    from hybridgen.kv import numa

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    raw = numa.alloc_on_node(nbytes, node)
    buf = raw.view(torch.float32)
    buf.fill_(1.0)
    return {"node": node, "read_gbps": _read_bandwidth(buf, reps), "bound": True,
            "threads": torch.get_num_threads()}


def measure_numa_nodes(cfg: ProfileConfig) -> List[Dict[str, Any]]:
    """One entry per NUMA node: {node, kind ('dram' | 'cxl'), read_gbps, capacity_gb, bound, cpus}."""
    from hybridgen.kv import numa

    nodes = numa.numa_nodes()
    out = []
    if not numa.binding_supported():
        buf = torch.ones(cfg.dram_bytes // 4, dtype=torch.float32)
        n = nodes[0]
        out.append({"node": n.node, "kind": "dram", "read_gbps": _read_bandwidth(buf, cfg.reps),
                    "capacity_gb": round(n.mem_bytes / 1e9, 1) if n.mem_bytes else None, "bound": False,
                    "cpus": len(n.cpus)})
        return out
    for n in nodes:
        cpus = _node_cpus(n.node)
        code = (f"import json; from hybridgen.profile import node_read_child; "
                f"print(json.dumps(node_read_child({n.node}, {cfg.dram_bytes}, {cfg.reps})))")
        root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                             preexec_fn=lambda c=cpus: os.sched_setaffinity(0, c))
        entry = {"node": n.node, "kind": "cxl" if n.cpu_less else "dram", "read_gbps": None,
                 "capacity_gb": round(n.mem_bytes / 1e9, 1) if n.mem_bytes else None, "bound": False,
                 "cpus": len(cpus)}
        if res.returncode == 0 and res.stdout.strip():
            entry.update(json.loads(res.stdout.strip().splitlines()[-1]))
        else:
            entry["error"] = (res.stderr.strip().splitlines() or ["failed"])[-1][:200]
        out.append(entry)
    return out


# ------------------------------------------------------------------ CPU attention kernels
def _decode_inputs(tokens: int, dtype: torch.dtype, device: str = "cpu", shape: Optional[Dict[str, int]] = None):
    sh = shape or SHAPE
    B, Hq, Hkv, D = sh["batch"], sh["heads"], sh["kv_heads"], sh["head_dim"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype).to(device)
    k = torch.randn(B, Hkv, tokens, D, generator=g).to(dtype).to(device)
    v = torch.randn(B, Hkv, tokens, D, generator=g).to(dtype).to(device)
    return q, k, v


def measure_cpu_kernels(cfg: ProfileConfig, dtypes=("bf16", "fp32"), shape: Optional[Dict[str, int]] = None
                        ) -> Dict[str, Any]:
    """CPU attention, key scan, group score and top-k throughput (GB/s of bytes read) per KV
    dtype; shape: {batch, heads, kv_heads, head_dim} of the decode layer (default SHAPE)."""
    sh = shape or SHAPE
    from hybridgen.attention.partial import partial_attention

    names = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    attn, scan, scan_backend, topk, group, gather, sketch, select_rate = {}, {}, {}, None, None, None, {}, None
    attn_pinned: Dict[str, float] = {}
    scan_pinned: Dict[str, float] = {}
    scale = 1 / math.sqrt(sh["head_dim"])
    for name in dtypes:
        q, k, v = _decode_inputs(cfg.cpu_tokens, names[name], shape=sh)
        kv_bytes = 2 * k.numel() * k.element_size()
        attn[name] = _gbps(kv_bytes, median_time(lambda: partial_attention(q, k, v, scale), cfg.reps))
        try:
            from hybridgen.attention.cpu_scan import resolve_backend, scan_logits

            backend = resolve_backend("auto", k.dtype)
            fn = lambda: scan_logits(q, k, scale, backend=backend)  # noqa: E731
        except ImportError:
            from hybridgen.attention.partial import attention_logits

            backend = "torch-matmul"
            fn = lambda: attention_logits(q, k, scale)  # noqa: E731
        scan[name] = _gbps(k.numel() * k.element_size(), median_time(fn, cfg.reps))
        scan_backend[name] = backend
        if torch.cuda.is_available():  # the code pins host KV when CUDA exists: measure that too
            from hybridgen.attention.partial import attention_logits

            kp, vp = k.pin_memory(), v.pin_memory()
            attn_pinned[name] = _gbps(kv_bytes, median_time(lambda: partial_attention(q, kp, vp, scale), cfg.reps))
            pfn = (lambda: scan_logits(q, kp, scale, backend=backend)) if backend != "torch-matmul" else \
                (lambda: attention_logits(q, kp, scale))
            scan_pinned[name] = _gbps(k.numel() * k.element_size(), median_time(pfn, cfg.reps))
            del kp, vp
        if not sketch:  # the sketch scan reads its codes, whatever the keys' dtype
            sketch = _sketch_gbps(q, k, cfg.reps)
            select_rate = _select_gbps(q, k, cfg.reps)
        if topk is None:
            logits = torch.randn(sh["batch"], sh["heads"], cfg.cpu_tokens)
            kk = max(1, cfg.cpu_tokens // 20)
            topk = _gbps(logits.numel() * 4,
                         median_time(lambda: torch.topk(logits, kk, dim=-1, sorted=False), cfg.reps))
            group = _group_score_gbps(logits, sh["kv_heads"], cfg.reps)
            gather = _gather_gbps(v, cfg.reps)
        del q, k, v
    return {"cpu_attention_gbps": attn, "key_scan_gbps": scan, "key_scan_backend": scan_backend, "topk_gbps": topk,
            "group_score_gbps": group, "gather_gbps": gather, "key_scan_pinned_gbps": scan_pinned,
            "cpu_attention_pinned_gbps": attn_pinned, "key_sketch_gbps": sketch, "select_gbps": select_rate,
            "op_us": measure_op_us(cfg.reps)}


def _group_score_gbps(logits: torch.Tensor, kv_heads: int, reps: int) -> Optional[float]:
    """GB/s of fp32 logits [B, Hq, T] reduced to one score per KV group (the code's group_scores)."""
    try:
        from hybridgen.attention.cpu_scan import group_scores
    except ImportError:
        return None
    return _gbps(logits.numel() * 4, median_time(lambda: group_scores(logits, kv_heads, "max"), reps))


def _gather_gbps(values: torch.Tensor, reps: int) -> Optional[float]:
    """GB/s of V rows gathered at random indices (5% of the tokens per (batch, KV head)) by the
    code's ``gather_rows``: rows of head_dim elements, latency- rather than bandwidth-bound."""
    try:
        from hybridgen.attention.cpu_scan import gather_rows
    except ImportError:
        return None
    B, Hkv, T, D = values.shape
    k = max(1, T // 20)
    idx = torch.stack([torch.randperm(T)[:k] for _ in range(B * Hkv)]).view(B, Hkv, k)
    nbytes = B * Hkv * k * D * values.element_size()
    return _gbps(nbytes, median_time(lambda: gather_rows(values, idx), reps))


def _select_gbps(q: torch.Tensor, keys: torch.Tensor, reps: int) -> Optional[float]:
    """GB/s of fp32 logits through the code's selection (``cpu_scan.select`` after a scan with
    its block statistics: group score + top-k 5%, the C kernel where it builds), as HybridGen
    selects; None when the scan API is missing."""
    try:
        from hybridgen.attention.cpu_scan import scan_logits_stats, select
    except ImportError:
        return None
    B, Hkv, T, D = keys.shape
    logits, _, stats = scan_logits_stats(q, keys, D ** -0.5)
    kk = max(1, T // 20)
    return _gbps(logits.numel() * 4, median_time(lambda: select(logits, Hkv, kk, False, "max", stats=stats), reps))


def _sketch_gbps(q: torch.Tensor, keys: torch.Tensor, reps: int) -> Dict[str, float]:
    """GB/s of key-sketch bytes (codes + parameters) read by each sketch kind's scan of ``keys``
    [B, Hkv, T, D] (bf16) for q [B, Hq, D]: the ``key_sketch`` variant's scan rate."""
    try:
        from hybridgen.attention.key_sketch import SKETCH_KINDS, KeySketch
        from hybridgen.kv import TieredStore
    except ImportError:
        return {}
    B, Hkv, T, D = keys.shape
    if D % 8:
        return {}
    tier, out = TieredStore()["dram"], {}
    scale = D ** -0.5
    for kind in SKETCH_KINDS:
        sk = KeySketch(tier, kind, B, Hkv, D, T, f"profile/{kind}")
        sk.sync(keys)
        out[kind] = _gbps(B * Hkv * T * sk.bytes_per_token, median_time(lambda: sk.scan(q, scale, 0, T), reps))
        sk.release()
    return out


def measure_op_us(reps: int = 5) -> float:
    """Fixed cost (us) of one small host-side torch op (dispatch + the intra-op threads), the
    per-op term of a split layer's fixed cost (profile ``host.op_us``)."""
    x = torch.ones(8, 32, 128)
    n = 50
    per = median_time(lambda: [x.mul(1.0001) for _ in range(n)], max(3, reps)) / n
    return round(per * 1e6, 2)


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
        "h2d_pinned_gbps": _gbps(n, median_time(lambda: d_buf.copy_(pinned, non_blocking=True), cfg.reps, sync)),
        "h2d_pageable_gbps": _gbps(n, median_time(lambda: d_buf.copy_(pageable), cfg.reps, sync)),
        "d2h_pinned_gbps": _gbps(n, median_time(lambda: pinned.copy_(d_buf, non_blocking=True), cfg.reps, sync)),
        "d2h_pageable_gbps": _gbps(n, median_time(lambda: pageable.copy_(d_buf), cfg.reps, sync)),
    }
    small = torch.ones(1, device=dev)
    link["latency_us"] = round(median_time(lambda: small.to("cpu"), 20) * 1e6, 1)
    del pinned, pageable, d_buf
    a = torch.ones(cfg.hbm_bytes // 4, device=dev)
    b = torch.empty_like(a)
    hbm = _gbps(2 * cfg.hbm_bytes, median_time(lambda: b.copy_(a), cfg.reps, sync))
    del a, b
    m = cfg.matmul_n
    x = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    tflops = round(2 * m ** 3 / median_time(lambda: x @ y, cfg.reps, sync) / 1e12, 1)
    del x, y
    launch_us = round(median_time(lambda: small.add_(1), 50, sync) * 1e6, 1)
    from hybridgen.attention import cuda as cuda_attention
    from hybridgen.attention.partial import partial_attention

    q, k, v = _decode_inputs(cfg.gpu_tokens, torch.bfloat16, "cuda")
    kv_bytes = 2 * k.numel() * k.element_size()
    scale = 1 / math.sqrt(SHAPE["head_dim"])
    by_backend = {"torch": _gbps(kv_bytes, median_time(lambda: partial_attention(q, k, v, scale), cfg.reps, sync))}
    if cuda_attention.kernels_available():
        try:
            by_backend["cupy"] = _gbps(kv_bytes, median_time(
                lambda: cuda_attention.cupy_partial_attention(q, k, v, scale), cfg.reps, sync))
        except Exception as err:  # noqa: BLE001 - record, do not fail the profile
            by_backend["cupy_error"] = f"{type(err).__name__}: {err}"[:200]
    best = max(v for v in by_backend.values() if isinstance(v, float))
    gpu = {"name": props.name, "memory_gb": round(props.total_memory / 1e9, 1), "hbm_gbps": hbm,
           "attention_gbps": best, "matmul_tflops": tflops, "launch_us": launch_us,
           "gqa_attention_gbps": best}  # measured at the GQA shape (32 q heads, 8 KV heads)
    return {"gpu": gpu, "link": link, "attention_by_backend": by_backend}


# ------------------------------------------------------------------ host facts
def _mem_gb() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return None


def build_profile(cfg: ProfileConfig, name: str, quick: bool) -> Dict[str, Any]:
    """Run every measurement and return the profile dict (schema of hybridgen/profiles)."""
    t0 = time.perf_counter()
    nodes = measure_numa_nodes(cfg)
    cpu = measure_cpu_kernels(cfg)
    gpu = measure_gpu(cfg)
    dram_nodes = [n for n in nodes if n["kind"] == "dram" and n.get("read_gbps")]
    cxl_nodes = [n for n in nodes if n["kind"] == "cxl" and n.get("read_gbps")]
    how = f"measured by `python -m hybridgen.profile{' --quick' if quick else ''}`"
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
            "dram_gb": _mem_gb(),
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
            ("H2D pinned / pageable GB/s", f"{lk['h2d_pinned_gbps']} / {lk['h2d_pageable_gbps']}"),
            ("GPU HBM / attention GB/s", f"{g['hbm_gbps']} / {g['attention_gbps']}")]
    return "\n".join(f"  {k:30s} {v}" for k, v in rows)


def check_out(out: Path, force: bool) -> None:
    """Before measuring: ``out`` must be a new file (or ``force``) whose directory can be created and written.

    One-line ConfigError otherwise; creates nothing (a temporary probe file is removed at once).
    """
    from hybridgen.errors import ConfigError

    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a file name, e.g. --out {out / 'measured.json'}")
    if out.exists() and not force:
        raise ConfigError(f"--out {out} already exists; pass --force to overwrite it, or choose another --out")
    from hybridgen.results import check_writable

    check_writable(out.parent, name="--out directory", fix="choose another --out")


@cli_errors
def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridgen.profile", description=__doc__.splitlines()[0])
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
