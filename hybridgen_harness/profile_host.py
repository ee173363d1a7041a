"""The profiler's host measurements: read bandwidth per NUMA node and the CPU kernels' rates.

Used by ``python -m hybridgen_harness.profile`` (:mod:`hybridgen_harness.profile`, which adds the GPU and
writes the profile) and by the performance model's in-process validation
(:mod:`hybridgen_harness.perf.local_rows`). Every rate is GB/s of the bytes a kernel reads, the median
of ``reps`` timed repetitions after one warm-up, at the decode shape of a Llama-3.1-8B layer
(``SHAPE``: batch 8, 32 query heads, 8 KV heads, head dim 128) unless a shape is given. The
kernels that read KV (attention, key scans, row gathers) cycle over copies of it that together
exceed the caches (:func:`cold`, ``COLD_BYTES``), so a small shape is not timed from L3.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hybridgen.timing import median_time

SHAPE = {"batch": 8, "heads": 32, "kv_heads": 8, "head_dim": 128}
#: the working set a rate is measured over: larger than the caches (this machine's L3 is 32 MiB),
#: so that a kernel reads its KV from memory, as a decode step does
COLD_BYTES = 256 << 20


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


def gbps(nbytes: float, seconds: float) -> float:
    return float(f"{nbytes / seconds / 1e9:.4g}") if seconds > 0 else float("nan")  # 4 significant digits


# ------------------------------------------------------------------ host memory
def _read_bandwidth(buf: torch.Tensor, reps: int) -> float:
    """GB/s of a full read of ``buf`` (float32) by torch's CPU threads."""
    return gbps(buf.numel() * buf.element_size(), median_time(lambda: buf.sum(), reps))


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
        code = (f"import json; from hybridgen_harness.profile_host import node_read_child; "
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
def cold(tensors, min_bytes: int = COLD_BYTES):
    """A function returning, at each call, the next of enough copies of ``tensors`` (a tuple)
    that cycling through them touches at least ``min_bytes``: each call's data was last read
    min_bytes ago, so it comes from memory, not the caches (one copy, the tensors themselves,
    when they are that large already)."""
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    copies = max(1, math.ceil(min_bytes / max(1, nbytes)))
    sets = [tuple(tensors)] + [tuple(t.clone() for t in tensors) for _ in range(copies - 1)]
    return itertools.cycle(sets).__next__


def decode_inputs(tokens: int, dtype: torch.dtype, device: str = "cpu", shape: Optional[Dict[str, int]] = None):
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
    bf16dot: Optional[float] = None
    attn_pinned: Dict[str, float] = {}
    scan_pinned: Dict[str, float] = {}
    scale = 1 / math.sqrt(sh["head_dim"])
    for name in dtypes:
        q, k, v = decode_inputs(cfg.cpu_tokens, names[name], shape=sh)
        kv_bytes = 2 * k.numel() * k.element_size()
        attn[name] = gbps(kv_bytes, median_time(lambda kv=cold((k, v)): partial_attention(q, *kv(), scale), cfg.reps))
        keys = cold((k,))
        try:
            from hybridgen.attention.cpu_scan import resolve_backend, scan_logits

            backend = resolve_backend("auto", k.dtype)
            fn = lambda nxt=keys: scan_logits(q, nxt()[0], scale, backend=backend)  # noqa: E731
        except ImportError:
            from hybridgen.attention.partial import attention_logits

            backend = "torch-matmul"
            fn = lambda nxt=keys: attention_logits(q, nxt()[0], scale)  # noqa: E731
        scan[name] = gbps(k.numel() * k.element_size(), median_time(fn, cfg.reps))
        scan_backend[name] = backend
        if torch.cuda.is_available():  # the code pins host KV when CUDA exists: measure that too
            from hybridgen.attention.partial import attention_logits

            kp, vp = k.pin_memory(), v.pin_memory()
            attn_pinned[name] = gbps(kv_bytes, median_time(lambda: partial_attention(q, kp, vp, scale), cfg.reps))
            pfn = (lambda: scan_logits(q, kp, scale, backend=backend)) if backend != "torch-matmul" else \
                (lambda: attention_logits(q, kp, scale))
            scan_pinned[name] = gbps(k.numel() * k.element_size(), median_time(pfn, cfg.reps))
            del kp, vp
        if name == "bf16":
            bf16dot = _bf16dot_scan_gbps(q, keys, scale, cfg.reps)
        keys = fn = None  # free the copies
        if not sketch:  # the sketch scan reads its codes, whatever the keys' dtype
            sketch = _sketch_gbps(q, k, cfg.reps)
            select_rate = _select_gbps(q, k, cfg.reps)
        if topk is None:
            logits = torch.randn(sh["batch"], sh["heads"], cfg.cpu_tokens)
            kk = max(1, cfg.cpu_tokens // 20)
            topk = gbps(logits.numel() * 4,
                         median_time(lambda: torch.topk(logits, kk, dim=-1, sorted=False), cfg.reps))
            group = _group_score_gbps(logits, sh["kv_heads"], cfg.reps)
            gather = _gather_gbps(v, cfg.reps)
        q = k = v = None  # free this dtype's inputs
    return {"cpu_attention_gbps": attn, "key_scan_gbps": scan, "key_scan_backend": scan_backend, "topk_gbps": topk,
            "group_score_gbps": group, "gather_gbps": gather, "key_scan_pinned_gbps": scan_pinned,
            "cpu_attention_pinned_gbps": attn_pinned, "key_sketch_gbps": sketch, "select_gbps": select_rate,
            "key_scan_bf16dot_gbps": bf16dot,
            "op_us": measure_op_us(cfg.reps)}


def _bf16dot_scan_gbps(q: torch.Tensor, keys, scale: float, reps: int) -> Optional[float]:
    """GB/s of bf16 keys [B, Hkv, T, D] (``keys()[0]``: :func:`cold` copies) through the bf16-dot
    selection scan (HybridGen's default ``scan``; None where the C kernels are not built)."""
    from hybridgen.attention import native
    from hybridgen.attention.cpu_scan import scan_logits_stats

    if native.lib() is None:
        return None
    k = keys()[0]
    return gbps(k.numel() * k.element_size(),
                median_time(lambda nxt=keys: scan_logits_stats(q, nxt()[0], scale, precision="bf16dot"), reps))


def _group_score_gbps(logits: torch.Tensor, kv_heads: int, reps: int) -> Optional[float]:
    """GB/s of fp32 logits [B, Hq, T] reduced to one score per KV group (the code's group_scores)."""
    try:
        from hybridgen.attention.cpu_scan import group_scores
    except ImportError:
        return None
    return gbps(logits.numel() * 4, median_time(lambda: group_scores(logits, kv_heads, "max"), reps))


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
    rows = cold((values,))
    return gbps(nbytes, median_time(lambda nxt=rows: gather_rows(nxt()[0], idx), reps))


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
    return gbps(logits.numel() * 4, median_time(lambda: select(logits, Hkv, kk, False, "max", stats=stats), reps))


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
        out[kind] = gbps(B * Hkv * T * sk.bytes_per_token, median_time(lambda: sk.scan(q, scale, 0, T), reps))
        sk.release()
    return out


def measure_op_us(reps: int = 5) -> float:
    """Fixed cost (us) of one small host-side torch op (dispatch + the intra-op threads), the
    per-op term of a split layer's fixed cost (profile ``host.op_us``)."""
    x = torch.ones(8, 32, 128)
    n = 50
    per = median_time(lambda: [x.mul(1.0001) for _ in range(n)], max(3, reps)) / n
    return round(per * 1e6, 2)


def mem_gb() -> Optional[float]:
    """This host's memory (GB, /proc/meminfo), None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return round(int(line.split()[1]) * 1024 / 1e9, 1)
    except OSError:
        pass
    return None
