"""Sizes, time budget, thread split and method construction of one GPU benchmark run."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hybridgen.methods import KVMethod, build_method, method_parameters

METHODS = ("full", "hybrid-exact", "hybridgen", "hybridgen-no-sketch", "hybridgen-plain", "flexgen-stream",
           "flexgen-cpu")
# run at the configured top-k (and, end to end, with cfg.e2e_hybridgen): HybridGen (by default the
# oldest host slice streamed over PCIe, the scheduler balancing it: issue 22, item 4; the int4 key
# sketch scanned), the same without the sketch (its bf16 keys bf16-dot scanned) and its plain split
# (nothing streamed)
AT_TOPK = ("hybridgen", "hybridgen-no-sketch", "hybridgen-plain")
HOST_METHODS = METHODS[1:]
# run with nothing on the host (host share 0, gpu_budget=1.0) at every context beside ``full``: the
# split methods must then cost what ``full`` costs (issue 22: HybridGen runs full's code path)
FITS_METHODS = ("hybridgen", "hybrid-exact")
Emit = Callable[[Dict[str, Any]], None]


def default_threads() -> int:
    """Threads of the CPU branch: every core this process may use but one, which stays with the
    main thread that launches the GPU work. The branch's key scan (``scan_threads``) and its
    torch ops (``torch_threads``: top-k, gather, exact logits, FlexGen's CPU attention) run one
    after the other on the CPU pool's threads, so both get the same cores; with
    ``OMP_WAIT_POLICY=passive`` idle OpenMP threads sleep instead of spinning on them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


@dataclass
class BenchConfig:
    """Sizes of one benchmark run (defaults: one H200; :meth:`smoke`: a tiny CPU run).

    budget_s: wall-clock budget of the whole run; margin_s: kept free at its end (writing the
    report, a slow last item); kernels_reserve_s: kept for the kernels section (which includes
    CuPy's first compile) while the per-layer grid runs.
    """

    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    batch: int = 8
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    contexts: List[int] = field(default_factory=lambda: [8192, 16384, 32768, 65536])
    shares: List[float] = field(default_factory=lambda: [0.5, 0.75, 0.9, 0.95])
    target: Tuple[int, float] = (32768, 0.9)
    steps: int = 5
    warmup: int = 2
    topk_ratio: float = 0.05
    e2e_model: str = "llama-3.1-8b"
    e2e_layers: int = 4
    e2e_context: int = 16384
    e2e_share: float = 0.9
    e2e_tokens: int = 8
    # dummy weights give a stand-in query cosine of ~0.01, which switches speculation off:
    # -1 keeps it on so the end-to-end rows exercise the cross-layer pipeline
    e2e_hybridgen: Dict[str, Any] = field(default_factory=lambda: {"min_stand_in_cos": -1.0})
    read_bytes: int = 2 << 30
    kernel_contexts: List[int] = field(default_factory=lambda: [8192, 32768, 65536])
    kernel_reps: int = 20
    budget_s: float = 300.0
    margin_s: float = 30.0
    kernels_reserve_s: float = 60.0
    profile: str = "h200-host"
    torch_threads: int = field(default_factory=default_threads)
    scan_threads: int = field(default_factory=default_threads)

    @classmethod
    def smoke(cls) -> "BenchConfig":
        return cls(device="cpu", batch=1, heads=4, kv_heads=2, head_dim=32, contexts=[256, 512], shares=[0.5, 0.9],
                   target=(512, 0.9), steps=2, warmup=1, e2e_model="smollm2-135m", e2e_layers=1, e2e_context=128,
                   e2e_tokens=3, read_bytes=64 << 20, kernel_contexts=[256], kernel_reps=3, budget_s=240.0,
                   margin_s=10.0, kernels_reserve_s=5.0)

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.head_dim)

    @property
    def dtype_name(self) -> str:
        """The dtype as the performance model names it."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]


class Clock:
    """Global time guard: ``expired(reserve_s)`` once less than ``reserve_s`` is left before
    ``budget_s - margin_s``."""

    def __init__(self, budget_s: float, margin_s: float = 0.0):
        self.t0 = time.perf_counter()
        self.budget_s, self.margin_s = budget_s, margin_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.margin_s - self.elapsed()

    def expired(self, reserve_s: float = 0.0) -> bool:
        return self.left() < reserve_s


# ------------------------------------------------------------------ device helpers
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Return cached GPU (and pinned host) memory between configurations."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)
        if host_empty is not None:
            host_empty()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def error_row(row: Dict[str, Any], err: BaseException) -> Dict[str, Any]:
    """``row`` marked as failed with the error in one line."""
    row.update(status="error", error=f"{type(err).__name__}: {err}"[:300])
    return row


# ------------------------------------------------------------------ methods
def method_params(name: str, share: float, topk_ratio: Optional[float]) -> Tuple[str, Dict[str, Any]]:
    """(registry name, parameters) of one benchmark method at a host share (1 - gpu_budget)."""
    gpu_budget = round(1.0 - share, 6)
    if name == "full":
        return "full", {}
    if name == "hybrid-exact":
        return "hybrid-exact", {"gpu_budget": gpu_budget}
    if name in ("hybridgen", "hybridgen-no-sketch", "hybridgen-plain"):
        params: Dict[str, Any] = {"gpu_budget": gpu_budget}
        if topk_ratio is not None:
            params["topk_ratio"] = topk_ratio
        if name == "hybridgen-no-sketch":  # the bf16-dot scan of the keys themselves
            params["key_sketch"] = "none"
        if name == "hybridgen-plain":
            params["three_way"] = False
        return "hybridgen", params
    if name in ("flexgen-stream", "flexgen-cpu"):
        return "flexgen", {"gpu_budget": gpu_budget, "attention_on": "gpu" if name == "flexgen-stream" else "cpu"}
    raise ValueError(name)


def method_record(names=METHODS) -> Dict[str, Dict[str, Any]]:
    """What each benchmark method ran, beside its results (``environment.json``'s ``bench_methods``):
    its registry name and every parameter of a plain value (numbers, strings, booleans, None)
    but the budget and top-k, which each row states, so the runs are re-priced as they ran
    whatever the defaults become (:mod:`benchmarks.gpu.validation_rows`)."""
    out = {}
    for name in names:
        m = make_method(name, 0.5)
        params = {p: getattr(m, p) for p in method_parameters(m.name) if p not in ("gpu_budget", "topk_ratio")}
        out[name] = {"method": m.name, "params": {k: v for k, v in params.items()
                                                   if isinstance(v, (bool, int, float, str, type(None)))}}
    return out


def make_method(name: str, share: float, topk_ratio: Optional[float] = None,
                extra: Optional[Dict[str, Any]] = None) -> KVMethod:
    """Build through the registry, keeping only parameters the method declares."""
    reg, params = method_params(name, share, topk_ratio)
    params.update(extra or {})
    known = set(method_parameters(reg))
    return build_method(reg, **{k: v for k, v in params.items() if k in known})
