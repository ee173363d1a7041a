"""Predicted vs measured rows for the H200-host probe files (``shared/measurements/h200-host-2026-11-30``).

The three probe scripts there time plain-torch code (not the project's), so each row is
priced with the cost function of the project method that does the same work, with the
arguments that describe what the probe's code does (documented per row):

- ``h200_probe`` (MHA layer: batch 8, 32 heads, head dim 128, fp16 KV): ``cpu_bf16`` /
  ``cpu_fp32`` = CPU attention over all the KV (a split with no GPU part, pageable memory);
  ``gpu_sdpa`` = ``full`` (fused); ``gpu`` = one unfused partial (a FlexGen stream with
  everything on the GPU); ``fetch`` = FlexGen streaming all the KV; ``hybrid_<f>`` = the
  exact split at GPU share f, **serial** (the probe's blocking ``q.to('cpu')`` waits for the
  GPU partial first), host KV pageable;
- ``h200_alp_probe`` (Llama-3.1-8B GQA layer, bf16, 90% on the host, top-k 5%): ``stream``
  = FlexGen streaming, ``cpu_full`` = the exact split (serial, host KV pinned), ``alp`` =
  HybridGen not pipelined (serial, keys pinned, rows staged from pageable memory),
  ``cpu_scan`` = the key scan alone (pinned), ``cpu_scan_fp32`` = the fp32 scan of a
  pageable fp32 copy of the keys;
- ``h200_cpu_scan_probe``: the row-major torch scans (pageable) and the plain read; the
  other variants (transposed keys, einsum, naive numba, torch.compile) are kernels the code
  does not have and are listed as not modelled.

A row is ``fitted`` when a figure of the profile was derived from that very measurement
(its ``fitted`` names the figure): agreement there is by construction, not a check.
Times are seconds; every prediction is PROJECTED.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

from hybridgen.errors import ConfigError
from hybridgen.perf.context import CostContext
from hybridgen.hybrid.cost import hybridgen_cost
from hybridgen.perf.costs import PARTIAL_KERNELS, cpu_attention_split_cost, full_cost, stream_cost
from hybridgen.perf.profiles import HardwareProfile, load_profile
from hybridgen.shapes import ModelShape, Workload

PROBE_DIR = Path(__file__).resolve().parents[3] / "shared" / "measurements" / "h200-host-2026-11-30"
SOURCE = "h200-probe"
FILES = ("h200_probe_2026-11-30.json", "h200_alp_probe_2026-11-30.json", "h200_cpu_scan_probe_2026-11-30.json")

# the probes' layers (only the attention shape matters for attention_layer_s)
MHA = ModelShape(name="probe-mha-layer", num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                 intermediate_size=14336, vocab_size=128256)
GQA = ModelShape(name="llama-3.1-8b-layer", num_layers=1, hidden_size=4096, num_heads=32, num_kv_heads=8,
                 head_dim=128, intermediate_size=14336, vocab_size=128256)
BATCH = 8
HOST_SHARE, TOPK = 0.9, 0.05  # alp_probe.py's H_SHARE and TOPK
SCAN_OPS = 3                  # q.to('cpu') + matmul + cast/scale of the probes' scans
ALP_HOST_OPS, ALP_GPU_KERNELS = 7, 8  # alp(): scan (3), amax, topk, 2 gathers; cat, softmax, 2 matmuls, ...


@dataclass
class Row:
    """One predicted vs measured time (seconds). fitted: the profile figure derived from this
    measurement ('' when the row is an independent check); note: how it was priced."""

    name: str
    source: str
    predicted_s: float
    measured_s: float
    fitted: str = ""
    note: str = ""
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        m = self.measured_s
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m) or m <= 0:
            raise ConfigError(f"{self.source}: the measured time of {self.name!r} is {m!r} s; a time must be a "
                              "positive finite number: the probe file is damaged, re-run the probe")

    @property
    def error_pct(self) -> float:
        """(predicted - measured) / measured, percent (positive: the model is pessimistic)."""
        return 100.0 * (self.predicted_s - self.measured_s) / self.measured_s

    def to_dict(self) -> Dict[str, Any]:
        d = {"name": self.name, "source": self.source, "predicted_s": self.predicted_s, "measured_s": self.measured_s,
             "error_pct": round(self.error_pct, 2), "within_25pct": abs(self.error_pct) <= 25.0,
             "fitted": self.fitted, "note": self.note}
        d.update(self.extra)
        return d


def _ctx(shape: ModelShape, context: int, hw: HardwareProfile, dtype: str = "bf16") -> CostContext:
    return CostContext(shape, Workload(batch=BATCH, context=context, dtype=dtype), hw)


def _bandwidth_rows(g: Dict[str, Any], scan: Dict[str, Any], hw: HardwareProfile) -> List[Row]:
    n = 2048 * 2 ** 20  # gpu_probe.py's copy buffer
    rows = []
    for key, fig, rate in (("h2d_pinned_GBs", "link.h2d_pinned_gbps", hw.link.h2d_pinned_gbps),
                           ("h2d_pageable_GBs", "link.h2d_pageable_gbps", hw.link.h2d_pageable_gbps),
                           ("d2h_pinned_GBs", "link.d2h_pinned_gbps", hw.link.d2h_pinned_gbps)):
        if g.get(key) and rate:
            rows.append(Row(f"copy {key[:-4]} 2 GiB", SOURCE, n / (rate * 1e9), n / (g[key] * 1e9), fitted=fig,
                            note="one copy at the profile's link rate"))
    if g.get("d2d_GBs_rw"):
        n2 = 2 * 4096 * 2 ** 20  # read + write bytes of a 4 GiB-class device copy (rate only matters)
        rows.append(Row("GPU device copy (read+write)", SOURCE, n2 / (hw.gpu.hbm_gbps * 1e9), n2 / (g["d2d_GBs_rw"] * 1e9),
                        note="gpu.hbm_gbps is the datasheet figure"))
    if scan.get("read_sum_GBs"):
        rows.append(Row("host read (torch.sum)", SOURCE, n / (hw.host.dram_read_gbps * 1e9),
                        n / (scan["read_sum_GBs"] * 1e9), fitted="host.dram_read_gbps"))
    return rows


def _gpu_probe_rows(g: Dict[str, Any], hw: HardwareProfile) -> List[Row]:
    rows = []
    for r in g.get("rows", []):
        L = int(r["L"])
        c = _ctx(MHA, L, hw)
        ms = lambda key: float(r[key]) * 1e-3  # noqa: E731
        rows.append(Row(f"MHA L={L} CPU attention bf16", SOURCE, cpu_attention_split_cost(c, 0.0, pinned=False).attn,
                        ms("cpu_bf16_ms"), fitted="host.cpu_attention_gbps.bf16 (midpoint of the three L)",
                        note="split with no GPU part, pageable KV"))
        c32 = _ctx(MHA, L, hw, "fp32")
        rows.append(Row(f"MHA L={L} CPU attention fp32", SOURCE, cpu_attention_split_cost(c32, 0.0, pinned=False).attn,
                        ms("cpu_fp32_ms"), fitted="host.cpu_attention_gbps.fp32",
                        note="split with no GPU part, pageable fp32 KV"))
        rows.append(Row(f"MHA L={L} GPU SDPA", SOURCE, full_cost(c).attn, ms("gpu_sdpa_ms"),
                        fitted="gpu.attention_gbps (midpoint)", note="full, fused"))
        rows.append(Row(f"MHA L={L} GPU matmul-softmax", SOURCE, stream_cost(c, 1.0).attn, ms("gpu_ms"),
                        note=f"one unfused partial ({PARTIAL_KERNELS} kernels)"))
        rows.append(Row(f"MHA L={L} stream (fetch)", SOURCE, stream_cost(c, 0.0).attn, ms("fetch_ms"),
                        note="FlexGen stream, all KV on the host, pinned copy"))
        for f in (0.5, 0.8, 0.9, 0.95, 0.98):
            key = f"hybrid_{f}_ms"
            if key not in r:
                continue
            lay = cpu_attention_split_cost(_ctx(MHA, L, hw), f, pinned=False, serial=True)
            fitted = "host.op_us" if (L == 4096 and f == 0.98) else ""
            rows.append(Row(f"MHA L={L} exact split, GPU share {f}", SOURCE, lay.attn, ms(key), fitted=fitted,
                            note="cpu-attention split, serial (blocking q.to), pageable host KV"))
    return rows


def _alp_rows(alp: List[Dict[str, Any]], hw: HardwareProfile) -> List[Row]:
    rows = []
    for r in alp:
        L = int(r["L"])
        c = _ctx(GQA, L, hw)
        gpu_budget = 1.0 - HOST_SHARE
        ms = lambda key: float(r[key]) * 1e-3  # noqa: E731
        rows.append(Row(f"GQA L={L} 90% host: FlexGen stream", SOURCE, stream_cost(c, gpu_budget, fused=False).attn,
                        ms("stream_ms"), fitted="gpu.gqa_attention_gbps",
                        note="pinned copy of the host K,V + unfused GQA partials + merge"))
        rows.append(Row(f"GQA L={L} 90% host: CPU attention split", SOURCE,
                        cpu_attention_split_cost(c, gpu_budget, pinned=True, serial=True, fused=False).attn,
                        ms("cpu_full_ms"),
                        note="exact split, serial, host KV pinned"))
        lay = hybridgen_cost(c, gpu_budget, TOPK, per_head=False, pipelined=False, mapping="dram", pinned=True,
                             staging_pinned=False, serial=True, host_ops=ALP_HOST_OPS, gpu_kernels=ALP_GPU_KERNELS,
                             fused_select=False, fused_share=False)  # the probe's step: plain torch
        rows.append(Row(f"GQA L={L} 90% host: HybridGen step", SOURCE, lay.attn, ms("alp_ms"),
                        fitted="host.topk_gbps, host.group_score_gbps" if L == 32768 else "",
                        note="hybridgen, not pipelined, serial, keys pinned, rows copied from pageable memory",
                        extra={"breakdown_ms": {k: round(v * 1e3, 3) for k, v in lay.breakdown.items()
                                                if k.endswith("_s")}}))
        key_bytes = c.B * int(r["host_tokens"]) * c.key_tok
        fixed = c.fixed(host_ops=SCAN_OPS, syncs=1)
        rows.append(Row(f"GQA L={L} key scan, pinned bf16", SOURCE,
                        key_bytes / (c.scan_rate(pinned=True) * 1e9) + fixed, ms("cpu_scan_ms"),
                        fitted="host.key_scan_pinned_gbps" if L == 32768 else "", note="pinned keys"))
        c32 = _ctx(GQA, L, hw, "fp32")
        rows.append(Row(f"GQA L={L} key scan, fp32 copy", SOURCE,
                        2 * key_bytes / (c32.scan_rate(pinned=False) * 1e9) + fixed, ms("cpu_scan_fp32_ms"),
                        note="kh.float(): a pageable fp32 copy, row-major"))
    return rows


def _scan_rows(scan: Dict[str, Any], hw: HardwareProfile) -> Tuple[List[Row], List[Dict[str, Any]]]:
    rows, skipped = [], []
    L = int(scan.get("L", 29491))
    c = _ctx(GQA, L, hw)
    key_bytes = c.B * L * c.key_tok
    for key, dtype, mult in (("torch_bf16_matmul", "bf16", 1), ("torch_fp32_matmul", "fp32", 2)):
        if isinstance(scan.get(key), dict) and "ms" in scan[key]:
            rate = _ctx(GQA, L, hw, dtype).scan_rate(pinned=False)
            rows.append(Row(f"GQA scan {L} tokens, {key} (pageable)", SOURCE, mult * key_bytes / (rate * 1e9),
                            scan[key]["ms"] * 1e-3, fitted=f"host.key_scan_gbps.{dtype}", note="scan alone"))
    for key in ("torch_bf16_matmul_KT", "torch_fp32_matmul_KT", "torch_fp32_einsum", "numba_fp32", "numba_bf16_bits",
                "torch_compile_bf16"):
        if isinstance(scan.get(key), dict) and "ms" in scan[key]:
            skipped.append({"name": f"GQA scan {L} tokens, {key}", "source": SOURCE,
                            "measured_s": scan[key]["ms"] * 1e-3,
                            "reason": "a kernel or key layout the code does not have (not modelled)"})
    return rows, skipped


def probe_rows(directory: Optional[Union[str, Path]] = None,
               profile: Union[str, HardwareProfile] = "h200-host") -> Tuple[List[Row], List[Dict[str, Any]]]:
    """(rows, not_modelled) for every measurement in the probe files; raises OSError /
    ValueError when a file cannot be read."""
    d = Path(directory) if directory is not None else PROBE_DIR
    hw = load_profile(profile)
    g, alp, scan = (json.loads((d / name).read_text()) for name in FILES)
    rows = _bandwidth_rows(g, scan, hw) + _gpu_probe_rows(g, hw) + _alp_rows(alp, hw)
    scan_rows, skipped = _scan_rows(scan, hw)
    skipped.append({"name": "host memcpy (read+write)", "source": SOURCE, "measured_s": None,
                    "reason": "the model has no host-to-host copy rate"})
    return rows + scan_rows, skipped
