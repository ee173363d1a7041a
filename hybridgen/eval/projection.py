"""PROJECTED decode-step time of a run on a hardware profile (:mod:`hybridgen.perf`), for result files.

The run's method is built once from (name, params) with ``build_method`` (or passed built)
and prices itself (``method.layer_cost``): the GPU share is its ``gpu_budget``, the kept or
fetched share its ``budget`` (a token budget is divided by the context), and so on. hybridgen's
top-k ratio and three-way fraction are the fixed ones or, when the scheduler owns them (None), their
last values in the run's scheduler trace (without one, where the model's scheduler settles);
``priced`` records every run-time knob at the value priced (:meth:`~hybridgen.methods.KVMethod.priced_knobs`). A method without a
cost gives ``{"projected": True, "status": "not modelled", ...}`` instead of raising, so a
sweep never aborts.

Choice (the model is per step): the context is taken at mid-generation, prompt_len + gen_len // 2.
Every number carries ``projected: true``; nothing here is a measurement. ``fits_host`` and
``host_bytes`` ({"dram": bytes, "cxl": bytes}) are the prediction's host-capacity check where the
model makes one (True / {} where it does not).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Union

DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
NUMBERS = ("step_s", "decode_tokens_per_s", "cpu_branch_s", "gpu_branch_s", "transfer_s", "fits_gpu")


def _scheduled_knobs(trace: Optional[Mapping[str, Any]], knobs: Any) -> Dict[str, float]:
    """The last value the scheduler chose for each of ``knobs`` in a run's trace (absent: no decision)."""
    out: Dict[str, float] = {}
    for d in (trace or {}).get("scheduler", []):
        if d.get("knob") in knobs:
            out[d["knob"]] = float(d["new"])
    return out


def run_method(method: Union[str, Any], params: Optional[Mapping[str, Any]] = None,
               trace: Optional[Mapping[str, Any]] = None) -> Any:
    """The method instance to price: built from (name, params), or the instance given; a knob the
    run's scheduler owned (:meth:`~hybridgen.methods.KVMethod.scheduled_params`) at the trace's last value."""
    from hybridgen.methods import build_method

    m = build_method(method, **dict(params or {})) if isinstance(method, str) else method
    last = _scheduled_knobs(trace, m.scheduled_params())
    return dataclasses.replace(m, **last) if last else m


def project(method: Union[str, Any], params: Optional[Mapping[str, Any]], spec, batch: int, prompt_len: int,
            gen_len: int, dtype: str, profile: str, trace: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A dict of projected step numbers for one run (see module docstring).

    method: a registered name (built with ``params``) or a built KVMethod (``params`` ignored).
    """
    from hybridgen.methods import build_method
    from hybridgen.perf import NotModelled, Workload, predict_step

    built = build_method(method, **dict(params or {})) if isinstance(method, str) else method
    m = run_method(built, trace=trace)
    from_trace = {k: getattr(m, k) for k in built.scheduled_params() if k not in m.scheduled_params()}
    kw: Dict[str, Any] = {"batch": int(batch), "context": int(prompt_len + gen_len // 2),
                          "dtype": DTYPE.get(dtype, dtype)}
    try:
        p = predict_step(m, spec, Workload(**kw), profile)
    except NotModelled as err:
        return {"projected": True, "status": "not modelled", "reason": str(err),
                "profile": getattr(profile, "name", str(profile)),
                "method": m.name, "workload": kw, **{k: None for k in NUMBERS}}
    return {"projected": True, "status": "ok", "profile": p.profile, "method": p.method, "perf_cost": p.cost,
            "workload": kw, "step_s": p.total_s, "decode_tokens_per_s": p.tokens_per_s(int(batch)),
            "cpu_branch_s": p.cpu_branch_s, "gpu_branch_s": p.gpu_branch_s, "transfer_s": p.transfer_s,
            "fits_gpu": p.fits_gpu, "fits_host": p.fits_host, "host_bytes": dict(p.host_bytes),
            "priced": {**from_trace, **m.priced_knobs(p.breakdown)}}
