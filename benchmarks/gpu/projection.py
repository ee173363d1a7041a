"""Section 7: the performance model's PROJECTED per-layer attention against the measured rows.

Each measured per-layer row is priced with the same method instance the layer section built
(``hybridgen`` with ``pipeline=False``: one layer alone has no cross-layer overlap) on the
``cfg.profile`` hardware profile; a method without a cost is reported as not modelled.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.gpu.config import AT_TOPK, BenchConfig, make_method
from hybridgen.methods import build_method, method_parameters


def projection_rows(cfg: BenchConfig, layer_rows: List[Dict[str, Any]],
                    ran: Optional[Dict[str, Dict[str, Any]]] = None,
                    threads: Optional[int] = None) -> Tuple[List[Dict[str, Any]], str]:
    """(rows, markdown table) of projected vs measured ms per (method, context, host share).

    ran: what each benchmark method ran ({name: {"method", "params"}}, as
    :func:`~benchmarks.gpu.config.method_record` records it); a method named there is priced
    with those parameters (the row's budget and top-k as the benchmark sets them), any other
    as the benchmark builds it now. threads: the CPU branch's threads in the run (the benchmark
    leaves a core to the main thread); the profile's host cores stand for them, as the model
    hands whole rows to ``cores`` threads (None: the profile's own)."""
    from hybridgen import perf as pm

    profile = pm.load_profile(cfg.profile)
    if threads:
        profile = dataclasses.replace(profile, host=dataclasses.replace(profile.host, cores=int(threads)))
    shape = pm.ModelShape(name="llama-3.1-8b-layer", num_layers=32, hidden_size=cfg.heads * cfg.head_dim,
                          num_heads=cfg.heads, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          intermediate_size=14336, vocab_size=128256)
    preds, meas, not_modelled = {}, {}, []
    for r in layer_rows:
        if r.get("status") != "ok":
            continue
        key = f"{r['method']} @ {r['context']} / {int(round(r['host_share'] * 100))}%"
        topk = cfg.topk_ratio if r["method"] in AT_TOPK else None
        if ran and r["method"] in ran:  # as it ran: its parameters, the row's budget and top-k
            rec = ran[r["method"]]
            known = method_parameters(rec["method"])
            params = {**rec["params"], "gpu_budget": round(1.0 - r["host_share"], 6),
                      **({"topk_ratio": topk} if topk is not None else {})}
            method = build_method(rec["method"], **{k: v for k, v in params.items() if k in known})
        else:
            method = make_method(r["method"], r["host_share"], topk)
        if method.name == "hybridgen":
            method = dataclasses.replace(method, pipeline=False)
        try:
            preds[key] = pm.predict_step(method, shape, pm.Workload(batch=cfg.batch, context=r["context"],
                                                                    dtype=cfg.dtype_name), profile)
        except pm.NotModelled:
            not_modelled.append(key)
            continue
        meas[key] = r["ms"] / 1e3
    table = pm.compare_to_measured(preds, meas, field="attention_layer_s")
    rows = [{"section": "projection", "method": row.key, "projected_ms": row.predicted_s * 1e3,
             "ms": row.measured_s * 1e3, "error_pct": row.error_pct, "cost": preds[row.key].cost, "status": "ok"}
            for row in table.rows]
    rows += [{"section": "projection", "method": key, "status": "not modelled"} for key in not_modelled]
    md = table.to_markdown()
    if not_modelled:
        md += "\n\nnot modelled: " + ", ".join(not_modelled)
    return rows, md
