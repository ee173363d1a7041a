"""A lent GPU's per-layer runs of this code as validation rows of the performance model.

``benchmarks/bench_gpu.py`` times every method per layer on the GPU host (its CSV's ``layer``
section). This re-prices each of those runs with the CURRENT model (the same method instance and
profile as the benchmark's projection section, ``benchmarks.gpu.projection``) and writes them in
the format of ``results/perfmodel/validation.json`` (source ``gpu-run``), so the paper comparison's
bands (``experiments/paper_speedup.py``: a cost's largest error over every committed validation
file) carry the model's error on a real GPU host, not only on the probes and the CPU-emulated VM.

Kept: runs with at least half of the KV on the host (the split the paper's regime puts there) and
``full``; a method at its defaults labelled by the cost function that priced it, a variant of the
benchmark (:data:`VARIANTS`) by its own name, so only the former widen the comparison's bands.
Left out, and listed: the runs with nothing on the host (``gpu_budget=1.0``: they check that
path's cost, not the regime's) and any the model does not price. Run from the repository root.

    python -m benchmarks.gpu.validation_rows --csv results/gpu/bench_gpu.csv \\
        --json results/perfmodel/gpu_runs/validation.json
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from benchmarks.gpu.config import BenchConfig
from benchmarks.gpu.projection import projection_rows

SOURCE = "gpu-run"
MIN_HOST_SHARE = 0.5
#: the benchmark's non-default configurations (the keys scanned without HybridGen's default key
#: sketch; the fixed-top-k "plain" split): their rows check their own configuration, not the
#: default one the paper comparison prices. The runs of ``hybridgen-sketch`` (the int4 sketch
#: before it became the default: stagewise, 1.25x candidates) and of ``hybridgen`` before that
#: (no sketch) both count for the default's cost: they are the GPU host's measurements closest to it
VARIANTS = ("hybridgen-no-sketch", "hybridgen-plain")
#: what the benchmark's HybridGen methods ran before ``environment.json`` recorded it
#: (``bench_methods``, :func:`benchmarks.gpu.config.method_record`): until the int4 key sketch
#: became HybridGen's default, ``hybridgen`` and ``hybridgen-plain`` scanned the bf16 keys (no
#: sketch) and ``hybridgen-sketch`` was the int4 sketch with 1.25x candidates
RAN_BEFORE_THE_RECORD = {"hybridgen": {"method": "hybridgen", "params": {"key_sketch": "none"}},
                         "hybridgen-plain": {"method": "hybridgen", "params": {"key_sketch": "none", "three_way": False}},
                         "hybridgen-sketch": {"method": "hybridgen",
                                              "params": {"key_sketch": "int4", "sketch_oversample": 1.25}}}


def what_ran(csv_path: Path) -> Tuple[Dict[str, Dict[str, Any]], Optional[int]]:
    """(what each method of a bench_gpu CSV ran, the CPU branch's threads) from the
    ``environment.json`` beside it: its ``bench_methods`` (else :data:`RAN_BEFORE_THE_RECORD`) and
    its runtime's ``scan_threads`` (else None: the profile's cores)."""
    path = csv_path.parent / "environment.json"
    env = json.loads(path.read_text()) if path.is_file() else {}
    threads = (env.get("runtime") or {}).get("scan_threads")
    return env.get("bench_methods") or RAN_BEFORE_THE_RECORD, int(threads) if threads else None


def layer_runs(csv_path: Path) -> List[Dict[str, Any]]:
    """The finished per-layer runs of a bench_gpu CSV: {method, context, host_share, ms, status}."""
    runs = []
    with open(csv_path, newline="") as f:
        for r in csv.DictReader(f):
            if r.get("section") == "layer" and r.get("status") == "ok":
                runs.append({"method": r["method"], "context": int(float(r["context"])),
                             "host_share": float(r["host_share"]), "ms": float(r["ms"]), "status": "ok"})
    return runs


def validation_rows(csv_path: Path, cfg: Optional[BenchConfig] = None, gpu: str = "") -> Dict[str, Any]:
    """{'rows': [...], 'left_out': [...]} in validation.json's row format, re-priced now."""
    cfg = cfg or BenchConfig()
    runs = layer_runs(csv_path)
    kept = [r for r in runs if r["method"] == "full" or r["host_share"] >= MIN_HOST_SHARE]
    left_out = [f"{r['method']} @ {r['context']} / {int(round(r['host_share'] * 100))}%: "
                + ("nothing on the host" if r["host_share"] == 0 else f"under {MIN_HOST_SHARE:.0%} of the KV on the host")
                for r in runs if r not in kept]
    ran, threads = what_ran(csv_path)
    priced, _ = projection_rows(cfg, kept, ran, threads)
    on = f"{cfg.profile}" + (f" with the run's {threads} CPU-branch threads as its cores" if threads else "")
    rows = []
    for p in priced:
        if p["status"] != "ok":
            left_out.append(f"{p['method']}: not modelled")
            continue
        # a method at its defaults is labelled by the cost function that priced it (what the paper
        # summaries match a cell's cost to); a variant by its own name, as this machine's rows are
        bench_method = p["method"].split(" @ ")[0]
        label = bench_method if bench_method in VARIANTS else p["cost"]
        rows.append({"name": f"{gpu + ' ' if gpu else ''}run: {p['method']}", "source": SOURCE, "method": label,
                     "bench_method": bench_method,
                     "predicted_s": p["projected_ms"] / 1e3, "measured_s": p["ms"] / 1e3,
                     "error_pct": p["error_pct"], "within_25pct": abs(p["error_pct"]) <= 25.0, "fitted": None,
                     "note": f"per-layer decode of {csv_path.name} (batch {cfg.batch}, {cfg.heads} q heads, "
                             f"{cfg.kv_heads} kv heads, {cfg.dtype_name}) priced on {on} by the model now"})
    return {"rows": rows, "left_out": left_out, "source_csv": str(csv_path)}


def main(argv=None) -> int:
    from hybridgen.validation.cli import exit_on_existing_output, parse_checked
    from hybridgen_harness.results import write_json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", required=True, help="a bench_gpu.csv of a GPU host (its layer section)")
    ap.add_argument("--json", required=True, help="where to write the rows (validation.json format)")
    ap.add_argument("--gpu", default="", help="the GPU's name for the row names (e.g. H200)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    args = parse_checked(ap, argv)
    exit_on_existing_output(args)
    if not Path(args.csv).is_file():
        print(f"error: --csv {args.csv} is not a file (bench_gpu.py writes one: --out DIR)", file=sys.stderr)
        return 2
    out = validation_rows(Path(args.csv), gpu=args.gpu)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.json), out)
    errs = [abs(r["error_pct"]) for r in out["rows"]]
    print(f"{len(out['rows'])} rows ({sum(e <= 25 for e in errs)} within 25%, largest |error| "
          f"{max(errs, default=0):.0f}%), {len(out['left_out'])} left out -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
