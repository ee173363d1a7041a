"""Section 2: end-to-end decode tokens/s with dummy weights, every method at the e2e host share.

The decode loop is driven here (``engine.prefill`` + ``engine.decode_step``) rather than
through ``generate`` so each step's CPU and GPU branch times are known: the first decode
step is a warm-up and is left out of every median and of ``step_over_max_branch``.
``hybridgen`` runs with ``cfg.e2e_hybridgen`` (speculation kept on, see BenchConfig), the
others with their defaults except the host share.
"""
from __future__ import annotations

import inspect
import statistics
import time
import traceback
from typing import Any, Dict, List

import torch

from benchmarks.gpu.config import AT_TOPK, METHODS, BenchConfig, Clock, Emit, error_row, free, make_method, sync
from hybridgen.kv import TieredStore


def _decode(engine, method, ids: torch.Tensor, tokens: int, device: torch.device) -> Dict[str, Any]:
    """Prefill + ``tokens - 1`` greedy decode steps; per-step seconds and branch seconds."""
    out: Dict[str, Any] = {"step_s": [], "cpu_s": [], "gpu_s": []}
    with torch.no_grad():
        sync(device)
        t0 = time.perf_counter()
        tok = engine.prefill(ids, None, method, TieredStore(gpu_device=engine.device), tokens).argmax(-1)
        sync(device)
        out["prefill_s"] = time.perf_counter() - t0
        toks = [tok]
        try:
            for _ in range(tokens - 1):
                before = dict(method.stats)
                t = time.perf_counter()
                tok = engine.decode_step(tok, method).argmax(-1)
                sync(device)
                out["step_s"].append(time.perf_counter() - t)
                out["cpu_s"].append(method.stats.get("cpu_branch_s", 0.0) - before.get("cpu_branch_s", 0.0))
                out["gpu_s"].append(method.stats.get("gpu_branch_s", 0.0) - before.get("gpu_branch_s", 0.0))
                toks.append(tok)
            out["stats"] = dict(method.stats)
        finally:
            engine.release()
    out["tokens"] = torch.stack(toks, 1)
    return out


def run_e2e(cfg: BenchConfig, device: torch.device, clock: Clock, emit: Emit, reserve_s: float = 0.0) -> None:
    """One row per method: prefill s, median step ms, tokens/s, branch times, token agreement with full."""
    from hybridgen.model import load_model

    kwargs = dict(weights="dummy", dtype=cfg.dtype, device=str(device), num_layers=cfg.e2e_layers)
    if "tokenizer" in inspect.signature(load_model).parameters:
        kwargs["tokenizer"] = False
    engine = load_model(cfg.e2e_model, **kwargs)
    # one causal SDPA call over the whole prompt (flash): the chunked path passes a mask, and
    # a masked SDPA may fall back to the math kernel, which needs tens of GB at 16K x batch 8
    engine.attn_chunk = max(engine.attn_chunk, cfg.e2e_context)
    spec = engine.spec
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec.vocab_size, (cfg.batch, cfg.e2e_context), generator=g).to(device)
    ref_tokens = None
    for name in METHODS:
        row: Dict[str, Any] = {"section": "e2e", "context": cfg.e2e_context, "host_share": cfg.e2e_share,
                               "method": name, "model": f"{cfg.e2e_model} x{spec.num_layers} layers (dummy)"}
        if clock.expired(reserve_s):
            emit(dict(row, status="skipped (time guard)"))
            continue
        try:
            extra = cfg.e2e_hybridgen if name in AT_TOPK else None
            res = _decode(engine, make_method(name, cfg.e2e_share, None, extra), ids, cfg.e2e_tokens, device)
            warm = 1 if len(res["step_s"]) > 1 else 0  # the first decode step is a warm-up
            steps: List[float] = res["step_s"][warm:]
            step = statistics.median(steps)
            row.update(status="ok", prefill_s=res["prefill_s"], step_ms=step * 1e3, tok_s=cfg.batch / step,
                       layer_ms=step * 1e3 / spec.num_layers)
            if name == "full":
                ref_tokens = res["tokens"]
            elif ref_tokens is not None:
                row["token_agree"] = float((res["tokens"] == ref_tokens).float().mean())
            st = res["stats"]
            if "cpu_branch_s" in st:
                cpu, gpu = res["cpu_s"][warm:], res["gpu_s"][warm:]
                row.update(cpu_branch_ms=statistics.median(cpu) * 1e3, gpu_branch_ms=statistics.median(gpu) * 1e3,
                           step_over_max_branch=statistics.median(s / max(c, g_, 1e-12)
                                                                  for s, c, g_ in zip(steps, cpu, gpu)),
                           speculative_scans=st.get("speculative_scans"))
        except Exception as err:  # noqa: BLE001 - one failure is one error row
            error_row(row, err)
            traceback.print_exc(limit=3)
        emit(row)
        free(device)
    del engine
    free(device)
