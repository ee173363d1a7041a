"""Fixed per-layer cost of a KV method at a tiny context, next to ``full`` in the same run.

At a tiny context attention costs almost nothing, so what a layer spends beyond ``full`` is
the method's fixed cost: Python, small ops, allocations and syncs. Per method this prints

- ``ms_per_layer``: median (and quartiles) decode time per layer over the timed steps
  (``step_s`` / layers of :class:`hybridgen.testing.MethodDriver`; the methods' steps are
  interleaved so they share the machine's load; the first step is warm-up);
- ``torch_calls``: top-level torch calls per layer on the caller's thread
  (``TorchFunctionMode``; property reads such as ``.shape`` excluded);
- ``aten_ops``: aten operators per layer on the caller's thread (``TorchDispatchMode``: on a
  GPU each is roughly one launch or copy).

The CPU branch runs on the pool's threads, so its ops are not counted (only the caller's
thread is instrumented, which is the layer's critical path on a GPU host). Without CUDA both
branches run on the CPU: the times mix them, the op counts do not.

    .venv/bin/python benchmarks/bench_fixed_cost.py --json FILE [--steps 30] [--context 256]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Dict, List, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.methods import build_method
from hybridgen.testing import MethodDriver
from hybridgen.validation.cli import exit_on_existing_output, parse_checked  # noqa: E402


class _CountCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            self.n += 1
        return func(*args, **(kwargs or {}))


class _CountAten(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def measure(configs: List[Tuple[str, Dict[str, Any]]], shape, layers: int, steps: int, pool) -> List[Dict[str, Any]]:
    """Decode ``steps`` steps of every config, interleaved step by step (so they share the
    machine's load; the warm-up step is excluded), then one instrumented step each."""
    runs = []
    for name, params in configs:
        method = build_method(name, **params)
        driver = MethodDriver(method, shape, steps + 3, seed=0, history=False, layers=layers, pool=pool)
        driver.prefill()
        runs.append((name, params, method, driver))
    for _ in range(steps + 1):
        for *_, driver in runs:
            driver.step()
    rows = []
    for name, params, method, driver in runs:
        per_layer = [s / layers for s in driver.run.step_s[1:]]
        calls, aten = _CountCalls(), _CountAten()
        with calls:
            driver.step()
        with aten:
            driver.step()
        method.release()
        q1, q3 = statistics.quantiles(per_layer, n=4)[0], statistics.quantiles(per_layer, n=4)[2]
        rows.append({"method": name, "params": params, "ms_per_layer": 1e3 * statistics.median(per_layer),
                     "ms_q1": 1e3 * q1, "ms_q3": 1e3 * q3,
                     "torch_calls_per_layer": calls.n / layers, "aten_ops_per_layer": aten.n / layers})
    return rows


def main(argv: List[str] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", default=None)
    ap.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    a = parse_checked(ap, argv)
    exit_on_existing_output(a)  # checked before measuring, never overwritten without --force
    shape = (1, 32, 8, 128, a.context)  # Llama-3.1-8B's attention shape, batch 1
    pool = CPUAttentionPool(workers=1)
    configs: List[Tuple[str, Dict[str, Any]]] = [("full", {})]
    for params in ({"topk_ratio": 0.05, "ship": "logits"}, {"topk_ratio": 0.05, "ship": "partial"}):
        try:
            build_method("hybridgen", **params)
            configs.append(("hybridgen", params))
        except Exception as exc:  # noqa: BLE001 - e.g. a parameter this checkout lacks
            configs.append(("hybridgen", {"topk_ratio": 0.05}))
            print(f"hybridgen {params}: {exc}")
            break
    rows = measure(configs, shape, a.layers, a.steps, pool)
    out = {"rows": rows, "loadavg": os.getloadavg(), "cuda": torch.cuda.is_available(), "shape": shape}
    print(f"{'method':<10} {'params':<40} {'ms/layer':>9} {'(q1-q3)':>14} {'calls':>6} {'aten':>6}")
    for r in rows:
        print(f"{r['method']:<10} {json.dumps(r['params']):<40} {r['ms_per_layer']:9.3f} "
              f"({r['ms_q1']:.3f}-{r['ms_q3']:.3f}) {r['torch_calls_per_layer']:6.1f} {r['aten_ops_per_layer']:6.1f}")
    print(f"loadavg {out['loadavg']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
