"""Execute run points: generation (timed) or accuracy (lm-eval), written to the results store.

One point = one run directory ``results/<exp>/<run-name>/`` (see hybridgen_harness.results; its
name and identity: experiments/point.py). A :class:`experiments.session.Session` keeps the
loaded engine and reference generations between points; the process's one
(:func:`experiments.session.shared_session`) outlives a Hydra job, so the jobs of a sweep that
the launcher runs in this process (Hydra's basic launcher: all of them, in turn) load each
model once and compute each fidelity reference once.

metrics.json of a generation run (all sizes in bytes, times in seconds unless named _ms):
    run          name, exp, status, started/finished, wall_s, overrides
    model        config + spec + weight bytes;  method: name + every parameter
    workload, hardware (config, resolved capacities, store description with emulated flags)
    latency      prefill_s, decode_s, total_s, decode_ms_per_token, step_ms {mean,p50,p90,max},
                 repeats (each timed generation; the median-total one is reported)
    throughput   decode_tokens_per_s, e2e_tokens_per_s, prefill_tokens_per_s
    memory       kv_bytes_by_tier (end of decode), kv_peak_bytes_by_tier, host_peak_rss_bytes
                 (VmHWM reset at the start of the timed region), gpu_peak_allocated_bytes
    transfer     bytes_h2d, bytes_d2h, h2d_bytes_per_step
    method_stats the method's own counters; breakdown: its *_s timers (CPU/GPU branch, copies)
    fidelity     top1_agreement, mean_kl vs exp.reference (teacher-forced), or null
    scheduler    decisions + trace file (trace.json) when the method has a scheduler
    environment  versions, git commit, CPU, CUDA, NUMA layout
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from experiments.point import build, key_params, name_of, placement_refusal, realized, store_capacities
from experiments.session import Outcome, Session
from hybridgen.errors import HybridGenError
from hybridgen_harness.result_tables import format_table
from hybridgen_harness.results import CONFIG, ResultsStore, write_json


# ----------------------------------------------------------------------------- one point
def prompts(cfg: DictConfig, engine) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    from hybridgen.data.sources import prompt_ids

    w = cfg.workload
    ids = prompt_ids(engine.tokenizer, engine.spec.vocab_size, w.source, int(w.batch), int(w.prompt_len),
                     int(cfg.seed))
    return ids, None


def _median_index(values: List[float]) -> int:
    order = sorted(range(len(values)), key=lambda i: values[i])
    return order[(len(order) - 1) // 2]


def run_generation(cfg: DictConfig, session: Session, out_dir: Path) -> Dict[str, Any]:
    """Timed generation of one point; returns metrics (writes trace.json into out_dir)."""
    from hybridgen.eval.generation import (fidelity_metrics, make_store, scheduler_trace, step_stats,
                                           teacher_forced_logits, weight_bytes)
    from hybridgen.eval.memory import PeakMemory
    from hybridgen.eval.provenance import cuda_dispatch_counts, kernels_used

    engine = session.engine(cfg)
    caps = store_capacities(cfg, engine)  # memory.gpu_kv's Placement, resolved once per point
    ids, mask = prompts(cfg, engine)
    gen_len = int(cfg.workload.gen_len)
    if cfg.exp.warmup:
        # First time this process sees this workload shape: warm up at full length (allocator,
        # thread pools, kernels); afterwards a short run through the method's own code paths.
        shape = (session._engine_key, tuple(ids.shape))
        warm = ids if shape not in session.warmed else ids[:, : min(ids.shape[1], 32)]
        session.warmed.add(shape)
        engine.generate(warm, build(cfg), max_new_tokens=min(2, gen_len), store=make_store(cfg.hardware, engine, caps))
    runs, totals = [], []
    trace = None
    cuda_before = cuda_dispatch_counts()
    for r in range(int(cfg.exp.repeats)):
        method = build(cfg)
        store = make_store(cfg.hardware, engine, caps)
        with PeakMemory() as pm:
            res = engine.generate(ids, method, max_new_tokens=gen_len, attention_mask=mask, store=store,
                                  return_logits=bool(cfg.exp.fidelity), progress=bool(cfg.progress), keep=True)
        try:
            trace = scheduler_trace(method) if cfg.exp.trace else None
        finally:
            engine.release()
        runs.append((res, pm.result()))
        totals.append(res.prefill_s + res.decode_s)
    res, mem = runs[_median_index(totals)]
    B, n = int(res.tokens.shape[0]), int(res.tokens.shape[1])
    steps = len(res.step_s)
    stats = {k: v for k, v in res.method_stats.items() if not isinstance(v, (list, dict))}
    total_s = res.prefill_s + res.decode_s
    metrics: Dict[str, Any] = {
        "latency": {"prefill_s": res.prefill_s, "decode_s": res.decode_s, "total_s": total_s,
                    "decode_ms_per_token": 1e3 * res.decode_s / steps if steps else None,
                    "step_ms": step_stats(res.step_s),
                    "repeats": [{"prefill_s": x.prefill_s, "decode_s": x.decode_s} for x, _ in runs]},
        "throughput": {"decode_tokens_per_s": B * steps / res.decode_s if res.decode_s > 0 else None,
                       "e2e_tokens_per_s": B * n / total_s if total_s > 0 else None,
                       "prefill_tokens_per_s": B * ids.shape[1] / res.prefill_s if res.prefill_s > 0 else None},
        "memory": {"kv_bytes_by_tier": res.bytes_by_tier, "kv_peak_bytes_by_tier": res.peak_bytes_by_tier,
                   "kv_peak_total_bytes": sum(res.peak_bytes_by_tier.values()), **mem},
        "transfer": {"bytes_h2d": stats.get("bytes_h2d", 0), "bytes_d2h": stats.get("bytes_d2h", 0),
                     "h2d_bytes_per_step": stats.get("bytes_h2d", 0) / steps if steps else None},
        "method_stats": stats,
        "breakdown": {k: v for k, v in stats.items() if k.endswith("_s")},
        "kernels": kernels_used(build(cfg).config(), engine.dtype, cuda_before),
        "hardware": {**OmegaConf.to_container(cfg.hardware), "capacities": caps,
                     "store": res.store_description},
        "model": {**OmegaConf.to_container(cfg.model), "spec": engine.spec.to_dict(), "weight_bytes": weight_bytes(engine)},
        "fidelity": None,
        "scheduler": None,
        "sample": {"new_tokens": n, "text": _decode(engine, res.tokens[0])},
    }
    if cfg.exp.fidelity:
        session.offer_reference(cfg, res)
        try:
            ref = session.reference(cfg, engine, ids, mask)
            same = bool(torch.equal(ref.tokens, res.tokens))
            logits = res.logits if same else teacher_forced_logits(
                engine, build(cfg), ids, mask, ref.tokens, store=make_store(cfg.hardware, engine, caps))
        except HybridGenError as err:  # keep the method's measurement; say why fidelity is missing
            session.log(f"fidelity unavailable: {err}")
            metrics["fidelity"] = {"reference": cfg.exp.reference, "available": False, "reason": str(err)}
        else:
            metrics["fidelity"] = {"reference": cfg.exp.reference, "available": True,
                                   "reference_store": "unlimited tiers", "tokens_identical": same,
                                   "teacher_forced": not same, "steps": n,
                                   "token_match_rate": float((ref.tokens == res.tokens).float().mean()),
                                   **fidelity_metrics(ref.logits, logits)}
    if cfg.hardware.profile:
        metrics["projected"] = _projection(cfg, engine.spec, trace)
    if trace:
        write_json(out_dir / "trace.json", trace)
        metrics["scheduler"] = {"decisions": len(trace.get("scheduler", [])), "trace_file": "trace.json"}
    return metrics


def _projection(cfg: DictConfig, spec, trace=None) -> Dict[str, Any]:
    from hybridgen.eval.projection import project

    w = cfg.workload
    return project(cfg.method.name, build(cfg).config(), spec, int(w.batch), int(w.prompt_len), int(w.gen_len),
                   cfg.model.dtype, cfg.hardware.profile, trace)


def run_projection(cfg: DictConfig) -> Dict[str, Any]:
    """exp.kind=project: no generation, only the performance model's projection (labelled)."""
    from hybridgen.model.loading import shipped_config
    from hybridgen.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(shipped_config(cfg.model.name), name=cfg.model.name)
    if cfg.model.num_layers:
        spec = spec.with_layers(int(cfg.model.num_layers))
    refused = placement_refusal(cfg)
    projected = _projection(cfg, spec) if refused is None else {
        "projected": True, "status": "does not fit", "reason": refused, "profile": cfg.hardware.profile,
        "method": cfg.method.name, "step_s": None, "decode_tokens_per_s": None, "cpu_branch_s": None,
        "gpu_branch_s": None, "transfer_s": None, "fits_gpu": False}
    return {"projected": projected,
            "hardware": OmegaConf.to_container(cfg.hardware),
            "model": {**OmegaConf.to_container(cfg.model), "spec": spec.to_dict()}}


def _decode(engine, tokens) -> Optional[str]:
    tok = getattr(engine, "tokenizer", None)
    if tok is None:
        return None
    return tok.decode(tokens.tolist(), skip_special_tokens=True)[:400]


def run_accuracy(cfg: DictConfig, session: Session, out_dir: Path) -> Dict[str, Any]:
    from experiments.accuracy import evaluate
    from hybridgen.eval.provenance import cuda_dispatch_counts, kernels_used

    engine = session.engine(cfg)
    before = cuda_dispatch_counts()
    body = evaluate(engine, cfg, out_dir, log=session.log)
    return {**body, "kernels": kernels_used(build(cfg).config(), engine.dtype, before)}


def summary_row(cfg: DictConfig, m: Dict[str, Any]) -> Dict[str, Any]:
    """The few numbers printed in the end-of-run table."""
    row: Dict[str, Any] = {"method": cfg.method.name}
    kp = key_params(cfg)
    row["params"] = ",".join(f"{k}={v}" for k, v in kp.items()) or "-"
    if cfg.exp.kind == "accuracy":
        for task, vals in (m.get("accuracy") or {}).items():
            named = [vals[k] for k in ("acc_norm", "acc", "exact_match", "word_perplexity") if k in vals]
            if not named and vals and all(str(k).isdigit() for k in vals):  # RULER: a score per context length
                row.update({f"{task}@{n}": v for n, v in vals.items()})
            else:
                row[task] = named[0] if named else None
        fid = m.get("fidelity") or {}
        row["top1"] = fid.get("top1_agreement")
        row["KL"] = fid.get("mean_kl")
        return row
    if cfg.exp.kind == "project":
        row.update({"batch": cfg.workload.batch, "prompt": cfg.workload.prompt_len, "gen": cfg.workload.gen_len,
                    **_projected_columns(m["projected"])})
        return row
    lat, mem = m["latency"], m["memory"]
    row.update({"batch": cfg.workload.batch, "prompt": cfg.workload.prompt_len, "gen": cfg.workload.gen_len,
                "prefill_s": lat["prefill_s"], "ms/tok": lat["decode_ms_per_token"],
                "tok/s": m["throughput"]["decode_tokens_per_s"],
                "gpu_MiB": mem["kv_peak_bytes_by_tier"].get("gpu", 0) / 2**20,
                "host_MiB": (mem["kv_peak_bytes_by_tier"].get("dram", 0) + mem["kv_peak_bytes_by_tier"].get("cxl", 0)) / 2**20,
                "H2D_MiB": m["transfer"]["bytes_h2d"] / 2**20})
    fid = m.get("fidelity") or {}
    if fid:
        row["top1"] = fid.get("top1_agreement")
        row["KL"] = fid.get("mean_kl")
    if m.get("projected"):
        row.update(_projected_columns(m["projected"]))
    return row


def _projected_columns(pr: Dict[str, Any]) -> Dict[str, Any]:
    """The projected columns of a table row; a method without a performance-model cost says so."""
    if pr.get("status") in ("not modelled", "does not fit") or pr.get("step_s") is None:
        status = pr.get("status") or "not modelled"
        return {"profile": pr.get("profile"), "step_ms (projected)": status, "tok/s (projected)": status}
    return {"profile": pr["profile"], "step_ms (projected)": 1e3 * pr["step_s"],
            "tok/s (projected)": pr["decode_tokens_per_s"], "fits_gpu": pr["fits_gpu"]}


def _skipped(cfg: DictConfig, session: Session, store: ResultsStore, name: str, why: str = "done") -> Outcome:
    """The Outcome of a finished run that is reused; a run measured at another commit says so."""
    from hybridgen.eval.provenance import code_version, describe_version, same_code
    from hybridgen_harness.results import load_run

    m = load_run(store.run_dir(name))
    then = (m.get("run") or {}).get("code") or (m.get("environment") or {}).get("git")
    now = code_version()
    note = ""
    if not same_code(then, now):
        note = (f"measured at code {describe_version(then)}, this checkout is {describe_version(now)}; "
                "force=true re-runs it")
    session.log(f"skip ({why}): {store.run_dir(name)}" + (f" ({note})" if note else ""))
    return Outcome(name, "skipped", _safe_row(cfg, m), note=note)


def finished_outcome(cfg: DictConfig, session: Session) -> Optional[Outcome]:
    """The 'skipped' Outcome of a finished point, its ``skip (done): <run dir>`` line logged; None
    when the point must run (not finished, or force=true). The one skip decision: a job makes it
    (:func:`run_point`), and so does the sweeper before launching (experiments/skip_finished.py)."""
    store = ResultsStore(cfg.results_dir, cfg.exp.name)
    name = name_of(cfg)
    if cfg.force or not store.is_done(name):
        return None
    return _skipped(cfg, session, store, name)


def run_point(cfg: DictConfig, session: Session, overrides: List[str] = ()) -> Outcome:
    """Run one point unless it is finished (force=true replaces it).

    The run's lock is held from the skip check to the rename (hybridgen_harness.results): an identical
    run in another process waits for it, then skips. A finished run from another commit is
    reused with a note (see hybridgen.eval.provenance). A HybridGenError (user error: capacity,
    missing data, non-finite numbers...) propagates (nothing is written); any other exception
    is a bug in some method or the harness: its trace is printed and the sweep goes on
    (Outcome 'failed').
    """
    from hybridgen.eval.provenance import code_version

    finished = finished_outcome(cfg, session)
    if finished is not None:
        return finished
    store = ResultsStore(cfg.results_dir, cfg.exp.name)
    name = name_of(cfg)
    started = time.time()
    try:
        with store.locked(name, log=session.log):
            if store.is_done(name) and not cfg.force:  # finished by another process while we waited
                return _skipped(cfg, session, store, name, "done by another process")
            store.clean_stale()
            session.log(f"run: {store.run_dir(name)}")
            if cfg.hardware.threads:
                from hybridgen import runtime

                runtime.apply(torch_threads=int(cfg.hardware.threads))  # recorded in environment.json
            with store.writing(name, force=bool(cfg.force), log=session.log) as tmp:
                (tmp / CONFIG).write_text(OmegaConf.to_yaml(cfg))
                kind = cfg.exp.kind
                body = (run_accuracy(cfg, session, tmp) if kind == "accuracy" else
                        run_projection(cfg) if kind == "project" else run_generation(cfg, session, tmp))
                metrics = {
                    "schema": 1,
                    "run": {"name": name, "exp": cfg.exp.name, "status": "ok", "kind": cfg.exp.kind,
                            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                            "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": time.time() - started,
                            "overrides": list(overrides), "command": " ".join(sys.argv),
                            "code": code_version(), "realized": realized(cfg),
                            "threads": {"torch": torch.get_num_threads()}},
                    "model": OmegaConf.to_container(cfg.model), "method": {"name": cfg.method.name, "params": build(cfg).config()},
                    "workload": OmegaConf.to_container(cfg.workload), "seed": int(cfg.seed),
                    **body,
                    "environment": session.environment(),
                }
                write_json(tmp / "metrics.json", metrics)
    except HybridGenError:
        raise  # a user error: the entry point prints one line (finished runs stay done)
    except Exception as err:  # a bug, not a user error: keep the trace, keep the sweep going
        traceback.print_exc()
        session.log(f"failed: {name}: {type(err).__name__}: {err}")
        return Outcome(name, "failed", {"method": cfg.method.name}, f"{type(err).__name__}: {err}")
    return Outcome(name, "done", summary_row(cfg, metrics))


def _safe_row(cfg: DictConfig, m: Dict[str, Any]) -> Dict[str, Any]:
    try:
        return summary_row(cfg, m)
    except (KeyError, TypeError):
        return {"method": cfg.method.name}


def print_table(outcomes: List[Outcome], file=None) -> None:
    rows = []
    for o in outcomes:
        rows.append({"status": o.status, **o.row})
    cols: List[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    print(format_table(rows, cols), file=file or sys.stdout)
    failed = [o for o in outcomes if o.status == "failed"]
    for o in failed:
        print(f"failed: {o.name}: {o.error}", file=sys.stderr)
    for o in outcomes:
        if o.note:
            print(f"note: {o.status} {o.name}: {o.note}", file=file or sys.stdout)
