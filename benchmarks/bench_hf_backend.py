"""Lean engine vs the transformers backend (a script, not a test): one decode step, same method.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_hf_backend.py [--ctx 512] [--steps 16] \
        [--methods full,hybrid-exact] [--models smollm2-135m,llama-2-7b:2]

Per model and method: the median wall time of one decode step (``step_s`` of generate; after a
warm-up, the fastest of ``--passes`` interleaved passes) on the lean engine and through hybridgen.hf, their ratio, and the
load time. ``smollm2-135m`` uses the real weights on both; ``NAME:L`` a shipped shape cut to L
layers with the lean engine's 'dummy' weights and transformers' 'random' init (the backend
has no dummy fill). Timings are CPU timings here unless CUDA is present; on a shared machine
compare only rows measured together. The 1-minute load average is printed with each row.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hybridgen.model import load_model, smollm2


def load(name: str, backend: str, device: str):
    base, _, layers = name.partition(":")
    t0 = time.perf_counter()
    if base == smollm2.MODEL_NAME and not layers:
        where = base if backend == "lean" else str(smollm2.ensure_smollm2())
        engine = load_model(where, weights="real", device=device, backend=backend)
    else:
        weights = "dummy" if backend == "lean" else "random"
        engine = load_model(base, weights=weights, device=device, backend=backend,
                            num_layers=int(layers) if layers else None, tokenizer=False)
    return engine, time.perf_counter() - t0


def step_ms(engines, method: str, ctx: int, steps: int, passes: int):
    """The fastest pass's median decode-step ms per engine (passes interleave the engines)."""
    ids = torch.randint(10, 1000, (1, ctx), generator=torch.Generator().manual_seed(0))
    best = [float("inf")] * len(engines)
    for e in engines:
        e.generate(ids.to(e.device), method, max_new_tokens=3)  # warm-up
    for _ in range(passes):
        for i, e in enumerate(engines):
            res = e.generate(ids.to(e.device), method, max_new_tokens=steps + 1)
            best[i] = min(best[i], 1e3 * statistics.median(res.step_s))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--methods", default="full,hybrid-exact")
    ap.add_argument("--models", default="smollm2-135m,llama-2-7b:2")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(f"device={args.device} ctx={args.ctx} steps={args.steps} threads={torch.get_num_threads()}")
    print(f"{'model':<16} {'method':<13} {'lean ms':>8} {'hf ms':>8} {'hf/lean':>7} {'load lean s':>11} "
          f"{'load hf s':>9} {'load1':>5}")
    for name in args.models.split(","):
        lean, t_lean = load(name, "lean", args.device)
        hf, t_hf = load(name, "transformers", args.device)
        for method in args.methods.split(","):
            a, b = step_ms([lean, hf], method, args.ctx, args.steps, args.passes)
            print(f"{name:<16} {method:<13} {a:8.2f} {b:8.2f} {b / a:7.2f} {t_lean:11.1f} {t_hf:9.1f} "
                  f"{os.getloadavg()[0]:5.1f}")
        del lean, hf


if __name__ == "__main__":
    main()
