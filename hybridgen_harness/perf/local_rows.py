"""Predicted vs measured rows on THIS machine, measured in the same process (source ``this-machine``).

1. A measured profile (:func:`measure_profile`): the host figures by the machinery of
   ``python -m hybridgen_harness.profile`` (read bandwidth, CPU attention, key scan, group score,
   top-k, the fixed cost of one host op), in the run's dtype. Without CUDA the methods'
   'gpu' tier is emulated on the CPU, so the profile's gpu / link entries are the CPU's
   own rates, measured here: ``gpu.attention_gbps`` (and ``gqa_attention_gbps``) = CPU
   ``partial_attention`` over the KV (what the emulated GPU partials run), ``hbm_gbps`` =
   the host read bandwidth, ``launch_us`` = ``host.op_us`` = one small torch op,
   ``matmul_tflops`` = a CPU matmul, every ``link`` copy rate = a host memcpy (what a
   host->'gpu' copy is here), ``latency_us`` = one small copy, and
   ``gpu.emulated_on_host = true``: the two branches share the cores, so the model adds
   them instead of taking their max, and host KV is not pinned. On a CUDA machine the
   profile's gpu / link sections are measured on the GPU instead (``measure_gpu``).
2. Real per-layer decode runs (:func:`hybridgen.testing.MethodDriver`, seeded random
   q/k/v, no history) of ``full``, ``hybrid-exact``, ``hybridgen`` (top-k 5%, nothing streamed, not
   pipelined; also with ``key_sketch='int4'``, and three-way at a 30% streamed share) and of every registered method that declares
   ``validation_rows`` (FlexGen streaming, CPU attention and INT4, InfiniGen, Quest, SnapKV and
   StreamingLLM; :func:`validation_methods`),
   90% of the KV on the host, at
   two shapes, in fp32; and of ``full`` and ``hybridgen`` (its default bf16-dot scan, and
   ``scan='exact'``) with bf16 KV (:data:`BF16_METHODS`); each run right after a profile measurement; measured = the median step time /
   layers (the first, warm-up step with any kernel compilation excluded), predicted =
   ``predict_step(method, ...).attention_layer_s`` on the profile measured just before,
   plus the method's per-call residual (below); a row is the median over the rounds of each
   (see :func:`local_rows`).

The per-call residual: on this CPU every torch op, view and thread hand-off of a method's
decode costs microseconds that the model's fixed terms (GPU kernel and host op COUNTS x one
small op) do not capture (``results/perfmodel/validation.json`` has every residual). So
each pair also runs the method at :data:`SMALL_TOKENS` tokens (same batch, heads, dtype),
where the context-proportional terms are negligible, and adds (measured - predicted) there
to the prediction at the row's context: a two-point model whose constant term is measured
and whose context-proportional term is the cost model's: a row's prediction is the median of
its pairs' model predictions plus the median of their residuals. The row keeps the model alone
(``model_only_s``) and the residual (``per_call_residual_s``) beside it, so both errors are
reported, and every pair's four times (``pairs_ms``). GPU projections have no such term (their
fixed costs are the counted launches).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from hybridgen.perf.predict import predict_step
from hybridgen_harness.perf.probe_rows import Row
from hybridgen.perf.profiles import HardwareProfile, profile_from_dict
from hybridgen.shapes import ModelShape, Workload

SOURCE = "this-machine"
GPU_BUDGET = 0.1
TOPK = 0.05
# the split methods' common settings: 90% of the KV on the host, a pinned top-k, the CPU branch of
# the layer itself (no lookahead), nothing streamed (a row below adds the three-way split; its copy
# is a memcpy on a machine without CUDA, so only a GPU host validates its PCIe side)
HYBRIDGEN = {"gpu_budget": GPU_BUDGET, "topk_ratio": TOPK, "pipeline": False, "three_way": False}
# (label, registered method, parameters) of the library's methods; a registered method adds its own
# rows (:func:`validation_methods`)
LIBRARY_METHODS: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("full", "full", {}),
    ("hybrid-exact", "hybrid-exact", {"gpu_budget": GPU_BUDGET}),
    ("hybridgen", "hybridgen", {**HYBRIDGEN, "key_sketch": "none"}),
    ("hybridgen-sketch-int4", "hybridgen", {**HYBRIDGEN, "key_sketch": "int4"}),
    # the default's three-way split at a pinned share: the CPU branch over the rest, the streamed
    # slice copied and attended on the 'gpu' (here the host's own cores: a memcpy, branches added)
    ("hybridgen-three-way", "hybridgen", {**HYBRIDGEN, "three_way": True, "stream_ratio": 0.3}),
)
# bf16 KV: HybridGen's branch fused per (batch, KV head) row (csrc/branch.c), the default's int4 key
# sketch or the bf16-dot scan of the keys, runs only on bf16 host keys (fp32 keys past the sketch's
# blocks are scanned exactly, stagewise), so these rows are the ones that time it; ``full`` and the
# exact scan beside them on the same dtype
BF16_METHODS: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("full", "full", {}),
    ("hybridgen", "hybridgen", {**HYBRIDGEN, "key_sketch": "none"}),
    ("hybridgen-sketch-int4", "hybridgen", {**HYBRIDGEN, "key_sketch": "int4"}),
    ("hybridgen-scan-exact", "hybridgen", {**HYBRIDGEN, "key_sketch": "none", "scan": "exact"}),
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LocalShape:
    """One validation shape: batch, query heads, KV heads, head dim, prompt tokens."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    tokens: int

    @property
    def tuple(self) -> Tuple[int, int, int, int, int]:
        return (self.batch, self.heads, self.kv_heads, self.head_dim, self.tokens)

    def label(self) -> str:
        return f"B={self.batch} Hq={self.heads} Hkv={self.kv_heads} D={self.head_dim} T={self.tokens}"


SHAPES = (LocalShape(1, 32, 8, 128, 8192), LocalShape(2, 32, 8, 128, 8192))
#: the context at which each pair measures a method's per-call residual (module docstring): short
#: enough that the KV-proportional terms are a small part of the step, long enough for every
#: method's budget and window to be non-empty
SMALL_TOKENS = 256
TINY = (LocalShape(1, 8, 2, 64, 1024),)


@dataclass(frozen=True)
class Pair:
    """One (profile, run) pair of a row (seconds per layer): the model's prediction and the
    measurement at SMALL_TOKENS, then at the row's context."""

    model_small: float
    measured_small: float
    model: float
    measured: float

    @property
    def residual(self) -> float:
        """The per-call residual: measured - predicted at SMALL_TOKENS."""
        return self.measured_small - self.model_small


def _gbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _memcpy_gbps(nbytes: int, reps: int) -> float:
    from hybridgen.timing import median_time

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return _gbps(nbytes, median_time(lambda: dst.copy_(src), reps))


def _matmul_tflops(reps: int) -> float:
    from hybridgen.timing import median_time

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    return round(2 * n ** 3 / median_time(lambda: a @ b, reps) / 1e12, 4)


def measure_profile(shape: Optional[LocalShape] = None, dtype: str = "fp32", reps: int = 3,
                    dram_bytes: int = 128 << 20) -> Dict[str, Any]:
    """The measured profile dict of this machine (schema of hybridgen/profiles); CPU kernel
    rates at ``shape`` (default: the profiler's Llama-3.1-8B layer, batch 8, 8192 tokens) in
    ``dtype``."""
    from hybridgen.eval.environment import cpu_model
    from hybridgen_harness.profile import measure_gpu
    from hybridgen_harness.profile_host import ProfileConfig, measure_cpu_kernels, measure_numa_nodes, mem_gb

    shape = shape or LocalShape(8, 32, 8, 128, 8192)
    cfg = ProfileConfig(dram_bytes=dram_bytes, cpu_tokens=shape.tokens, reps=reps)
    t0 = time.perf_counter()
    nodes = measure_numa_nodes(cfg)
    cpu = measure_cpu_kernels(cfg, dtypes=(dtype,), shape={"batch": shape.batch, "heads": shape.heads,
                                                           "kv_heads": shape.kv_heads, "head_dim": shape.head_dim})
    read = next((n["read_gbps"] for n in nodes if n["kind"] == "dram" and n.get("read_gbps")), None)
    how = "measured in-process by hybridgen_harness.perf.validate (the machinery of python -m hybridgen_harness.profile)"
    gpu_meas = measure_gpu(cfg) if torch.cuda.is_available() else None
    if gpu_meas is not None:
        gpu, link = gpu_meas["gpu"], dict(gpu_meas["link"], name="host<->GPU link (measured)")
        gpu_how = how + " on the CUDA device"
    else:
        memcpy = _memcpy_gbps(dram_bytes // 2, reps)
        op_us = cpu["op_us"]
        att = cpu["cpu_attention_gbps"][dtype]
        gpu = {"name": "emulated on the host CPU (no CUDA)", "memory_gb": mem_gb(), "hbm_gbps": read,
               "attention_gbps": att, "gqa_attention_gbps": att, "matmul_tflops": _matmul_tflops(reps),
               "launch_us": op_us, "emulated_on_host": True}
        link = {"name": "host memcpy (emulated host->gpu copy)", "h2d_pinned_gbps": memcpy, "h2d_pageable_gbps": memcpy,
                "d2h_pinned_gbps": memcpy, "d2h_pageable_gbps": memcpy, "latency_us": op_us}
        gpu_how = (how + "; no CUDA: the CPU's own rates (attention = CPU partial_attention, hbm = host read, "
                   "launch = one small torch op, link = host memcpy)")
    host = {"cpu": cpu_model(), "cores": os.cpu_count(), "dram_gb": mem_gb(), "dram_read_gbps": read,
            "cpu_attention_gbps": cpu["cpu_attention_gbps"], "key_scan_gbps": cpu["key_scan_gbps"],
            "topk_gbps": cpu["topk_gbps"], "group_score_gbps": cpu["group_score_gbps"], "op_us": cpu["op_us"],
            "gather_gbps": cpu["gather_gbps"],
            "key_scan_pinned_gbps": cpu["key_scan_pinned_gbps"],
            "cpu_attention_pinned_gbps": cpu["cpu_attention_pinned_gbps"],
            "key_sketch_gbps": cpu["key_sketch_gbps"], "select_gbps": cpu["select_gbps"],
            "key_scan_bf16dot_gbps": cpu["key_scan_bf16dot_gbps"],
            "numa_nodes": [{"node": n["node"], "kind": n["kind"], "read_gbps": n.get("read_gbps"),
                            "capacity_gb": n.get("capacity_gb")} for n in nodes]}
    return {"name": "this-machine", "measured": True, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "description": f"measured in-process on {platform.node() or 'this machine'} ({cpu_model()})",
            "gpu": gpu, "link": link, "host": host, "cxl": None,
            "sources": {"gpu": gpu_how, "link": gpu_how, "host": how},
            "host_info": {"torch_threads": torch.get_num_threads(), "shape": list(shape.tuple), "dtype": dtype,
                          "key_scan_backend": cpu["key_scan_backend"],
                          "elapsed_s": round(time.perf_counter() - t0, 1)}}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def validation_methods() -> List[Tuple[str, str, Dict[str, Any]]]:
    """(label, registered method, parameters) of every row: the library's (:data:`LIBRARY_METHODS`),
    then, in registry order, each registered method whose class itself declares ``validation_rows``
    (a tuple of (label, parameters)), its parameters on top of ``gpu_budget=GPU_BUDGET`` where
    the method has that parameter (a split method: 90% of the KV on the host); a method keeping a
    budget (the evicting methods, InfiniGen) runs at its own default budget."""
    from hybridgen.methods.registry import available_methods, method_class

    out = list(LIBRARY_METHODS)
    library = {name for _, name, _ in LIBRARY_METHODS}
    for name in available_methods():
        if name in library:
            continue
        cls = method_class(name)
        split = {"gpu_budget": GPU_BUDGET} if "gpu_budget" in {f.name for f in dataclasses.fields(cls)} else {}
        for label, params in cls.__dict__.get("validation_rows", ()):  # its own rows, not a parent's
            out.append((label, name, {**split, **params}))
    return out


def measure_layer(name: str, params: Dict[str, Any], shape: LocalShape, steps: int, dtype: torch.dtype,
                  device: str, layers: int = 2, seed: int = 0) -> Tuple[float, List[float]]:
    """(median seconds per layer of one decode step, every timed step's per-layer seconds)."""
    from hybridgen.methods import build_method
    from hybridgen.testing import MethodDriver

    method = build_method(name, **params)
    driver = MethodDriver(method, shape.tuple, steps + 1, seed=seed, history=False, sync=_sync, layers=layers,
                          dtype=dtype, device=device)
    driver.prefill()
    for _ in range(steps + 1):
        driver.step()
    method.release()
    per_layer = [s / layers for s in driver.run.step_s[1:]]  # the first step warms up (JIT, allocations)
    return statistics.median(per_layer), per_layer


def median_profile(raws: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One profile dict from several measurements of the same machine: the median of every
    numeric figure (the first dict's other values): the representative profile reported."""
    def merge(vals: List[Any]) -> Any:
        first = vals[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in vals if isinstance(v, dict) and k in v]) for k in first}
        if isinstance(first, list):
            return [merge([v[i] for v in vals if isinstance(v, list) and len(v) > i]) for i in range(len(first))]
        nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if isinstance(first, (int, float)) and not isinstance(first, bool) and len(nums) == len(vals):
            return statistics.median(nums)
        return first
    return merge(list(raws))


def _model(shape: LocalShape, dtype: str) -> ModelShape:
    return ModelShape(name="validation-layer", num_layers=2, hidden_size=shape.heads * shape.head_dim,
                      num_heads=shape.heads, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      intermediate_size=4 * shape.heads * shape.head_dim, vocab_size=32000,
                      weight_bytes=4 if dtype == "fp32" else 2)


def local_rows(shapes: Sequence[LocalShape] = SHAPES, steps: int = 6, rounds: int = 5, dtype: str = "fp32",
               reps: int = 3, methods: Optional[Sequence[Tuple[str, str, Dict[str, Any]]]] = None
               ) -> Tuple[List[Row], List[Dict[str, Any]]]:
    """(rows, the measured profile dict of each shape): every method of ``methods`` (default
    :func:`validation_methods`) at every shape, its KV in ``dtype`` (a row's name says the dtype
    when it is not fp32).

    Per shape, ``rounds`` times, for each method in turn: measure the profile at that shape,
    predict the method's layer with it, then run the method ``steps`` timed steps (after a
    warm-up step): one (predicted, measured) pair, taken while the machine's load is the same
    for both (a shared machine is noisy). A row is the median of its pairs' predictions and
    the median of their measurements (every pair is kept); the reported profile is the
    median of the shape's measurements.
    """
    from hybridgen.methods import build_method

    device = "cuda" if torch.cuda.is_available() else "cpu"
    methods = list(methods) if methods is not None else validation_methods()
    tag = "" if dtype == "fp32" else f" {dtype}"
    rows, profiles = [], []
    for shape in shapes:
        model = _model(shape, dtype)
        small = dataclasses.replace(shape, tokens=min(SMALL_TOKENS, shape.tokens))
        # the context at the middle timed step (prompt + generated tokens)
        work = Workload(batch=shape.batch, context=shape.tokens + 1 + steps // 2, dtype=dtype)
        work_small = dataclasses.replace(work, context=small.tokens + 1 + steps // 2)
        raws: List[Dict[str, Any]] = []
        pairs: Dict[str, List[Pair]] = {label: [] for label, _, _ in methods}
        for _ in range(rounds):
            for label, name, params in methods:  # interleaved: the load of the moment hits both alike
                raw = measure_profile(shape, dtype=dtype, reps=reps)
                raws.append(raw)
                hw = profile_from_dict(raw, where="measured profile of this machine")
                pred, pred_small = (predict_step(build_method(name, **params), model, w, hw).attention_layer_s
                                    for w in (work, work_small))
                meas_small = statistics.median(measure_layer(name, params, small, steps, DTYPES[dtype], device)[1])
                meas = statistics.median(measure_layer(name, params, shape, steps, DTYPES[dtype], device)[1])
                pairs[label].append(Pair(pred_small, meas_small, pred, meas))
        rep = median_profile(raws)
        rep["host_info"]["rounds"] = rounds
        profiles.append(rep)
        hw_rep: HardwareProfile = profile_from_dict(rep, where="measured profile of this machine")
        for label, name, params in methods:
            got = pairs[label]
            meas = [p.measured for p in got]
            measured, model_only = statistics.median(meas), statistics.median(p.model for p in got)
            residual = statistics.median(p.residual for p in got)
            breakdown = predict_step(build_method(name, **params), model, work, hw_rep).breakdown
            rows.append(Row(f"{label}{tag} {shape.label()}", SOURCE, model_only + residual, measured,
                            note=f"per-layer decode; median over {len(meas)} (profile, run) pairs, each run the "
                                 f"median of {steps} steps after a warm-up; predicted = model + the per-call "
                                 f"residual measured at {small.tokens} tokens",
                            extra={"method": label, "shape": list(shape.tuple), "dtype": dtype,
                                   "model_only_s": model_only,
                                   "model_only_error_pct": round(100 * (model_only - measured) / measured, 2),
                                   "per_call_residual_s": residual, "small_tokens": small.tokens,
                                   "pairs_ms": [[round(x * 1e3, 3) for x in dataclasses.astuple(p)] for p in got],
                                   "pairs_fields": [f.name for f in dataclasses.fields(Pair)],
                                   "measured_min_s": min(meas), "measured_max_s": max(meas),
                                   "loadavg": [round(x, 2) for x in os.getloadavg()],
                                   "breakdown_ms": {k: round(v * 1e3, 3) for k, v in breakdown.items()
                                                    if k.endswith("_s")}}))
    return rows, profiles
