"""PROJECTED decode-step time of a run on a hardware profile (hybridgen.perfmodel), for result files.

Maps a run's method configuration onto the performance model's method names and workload:

- flexgen -> 'flexgen' (streamed), 'flexgen-cpu' (attention_on=cpu) or 'flexgen-int4' (compress_kv);
- hybrid-exact / hybridgen: host_share = 1 - gpu_budget (a token budget is divided by the prompt);
  hybridgen's top-k ratio is the fixed ``topk_ratio`` or, when the scheduler owns it, the last
  ratio of the run's scheduler trace (its start, 0.05, without one);
- h2o / snapkv / streamingllm / quest / infinigen: budget_ratio = the budget share of the prompt.

Choice (the model is per step): the context is taken at mid-generation, prompt_len + gen_len // 2.
Every number carries ``projected: true``; nothing here is a measurement.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _share(value: Any, prompt_len: int) -> float:
    from hybridgen.methods import Budget

    b = Budget.parse(value)
    return float(b.ratio) if b.ratio is not None else min(1.0, b.tokens / max(prompt_len, 1))


def perf_method(name: str, params: Mapping[str, Any]) -> str:
    if name == "flexgen":
        if params.get("compress_kv"):
            return "flexgen-int4"
        return "flexgen-cpu" if params.get("attention_on") == "cpu" else "flexgen"
    return name


def project(method: str, params: Mapping[str, Any], spec, batch: int, prompt_len: int, gen_len: int,
            dtype: str, profile: str, trace: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A dict of projected step numbers for one run (see module docstring)."""
    from hybridgen.perfmodel import Workload, predict_step

    kw: Dict[str, Any] = {"batch": int(batch), "context": int(prompt_len + gen_len // 2),
                          "dtype": DTYPE.get(dtype, dtype)}
    if method in ("hybrid-exact", "hybridgen"):
        kw["host_share"] = 1.0 - _share(params.get("gpu_budget", 0.1), prompt_len)
    if method == "hybridgen":
        ratio = params.get("topk_ratio")
        if ratio is None:
            decisions = [d for d in (trace or {}).get("scheduler", []) if d.get("knob") == "topk_ratio"]
            ratio = decisions[-1]["new"] if decisions else 0.05
        kw.update(topk_ratio=float(ratio), per_head=bool(params.get("per_head", False)),
                  pipelined=bool(params.get("pipeline", True)), mapping=params.get("mapping"),
                  sinks=int(params.get("sinks", 4)))
    if "budget" in params:
        kw["budget_ratio"] = _share(params["budget"], prompt_len)
    if method == "quest":
        kw["page_size"] = int(params.get("page_size", 16))
    if method == "infinigen":
        kw["partial_ratio"] = float(params.get("partial_weight_ratio", 0.2))
    if method == "flexgen" and params.get("compress_kv"):
        kw["int4_group"] = int(params.get("group_size", 64))
    p = predict_step(perf_method(method, params), spec, Workload(**kw), profile)
    return {"projected": True, "profile": p.profile, "perf_method": p.method, "workload": kw,
            "step_s": p.total_s, "decode_tokens_per_s": p.tokens_per_s(int(batch)),
            "cpu_branch_s": p.cpu_branch_s, "gpu_branch_s": p.gpu_branch_s, "transfer_s": p.transfer_s,
            "fits_gpu": p.fits_gpu}
