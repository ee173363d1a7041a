"""Command line and order of the sections: scan, the target layer point, end to end, the rest of
the per-layer grid, kernels, projection, report (see the package docstring)."""
from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from benchmarks.gpu.config import METHODS, BenchConfig, Clock, error_row, free, method_record
from benchmarks.gpu.e2e import run_e2e
from benchmarks.gpu.kernels import run_kernels
from benchmarks.gpu.layer import LayerGrid, grid
from benchmarks.gpu.projection import projection_rows
from benchmarks.gpu.report import environment, write
from benchmarks.gpu.scan import run_scan
from hybridgen import runtime
from hybridgen.errors import ConfigError, HybridGenError
from hybridgen.validation.cli import check_output_dir, exit_one_line, parse_checked, strict_parser

ROOT = Path(__file__).resolve().parents[2]
OUTPUT_FILES = ("bench_gpu.csv", "bench_gpu.md", "environment.json")  #: what report.write puts in --out


def _positive_list(flag: str, text: str, kind: type) -> None:
    """A comma list of positive finite numbers of ``kind``; ConfigError naming the flag otherwise."""
    for item in text.split(","):
        try:
            x = kind(item)
        except ValueError:
            raise ConfigError(f"{flag} takes a comma list of {kind.__name__} values, got {item!r}") from None
        if not (math.isfinite(x) and x > 0) or (flag == "--shares" and x > 1):
            raise ConfigError(f"{flag} values must be {'in (0, 1]' if flag == '--shares' else '> 0'}, got {item!r}")
SECTIONS = "scan,layer,e2e,kernels,projection"


def parse_config(argv: Optional[List[str]]) -> "tuple[BenchConfig, argparse.Namespace]":
    ap = strict_parser(prog="benchmarks/bench_gpu.py",
                       description="GPU benchmark of HybridGen against the baselines (benchmarks/gpu/)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (checks that the script runs)")
    ap.add_argument("--out", default=None, help="output folder (default $OUT, else results/gpu or results/gpu_smoke)")
    ap.add_argument("--budget-s", type=float, default=None, help="global time budget in seconds (default 300)")
    ap.add_argument("--contexts", default=None, help="comma list, e.g. 8192,32768")
    ap.add_argument("--shares", default=None, help="comma list of host shares, e.g. 0.5,0.9")
    ap.add_argument("--sections", default=SECTIONS)
    ap.add_argument("--torch-threads", type=int, default=None, help="torch threads (default: all cores but one)")
    ap.add_argument("--scan-threads", type=int, default=None, help="CPU key-scan threads (default: all cores but one)")
    ap.add_argument("--force", action="store_true", help="overwrite the files of an earlier run in the output folder")
    args = parse_checked(ap, argv)
    try:
        if args.contexts:
            _positive_list("--contexts", args.contexts, int)
        if args.shares:
            _positive_list("--shares", args.shares, float)
    except HybridGenError as err:
        raise exit_one_line(err) from None
    cfg = BenchConfig.smoke() if args.cpu_smoke else BenchConfig()
    if args.budget_s is not None:
        cfg.budget_s = args.budget_s
    if args.contexts:
        cfg.contexts = [int(x) for x in args.contexts.split(",")]
    if args.shares:
        cfg.shares = [float(x) for x in args.shares.split(",")]
    if cfg.target[0] not in cfg.contexts or cfg.target[1] not in cfg.shares:
        cfg.target = (cfg.contexts[len(cfg.contexts) // 2], cfg.shares[-1])
    if args.torch_threads is not None:
        cfg.torch_threads = args.torch_threads
    if args.scan_threads is not None:
        cfg.scan_threads = args.scan_threads
    return cfg, args


def main(argv: Optional[List[str]] = None) -> int:
    cfg, args = parse_config(argv)
    runtime.apply_or_exit(torch_threads=cfg.torch_threads, scan_threads=cfg.scan_threads)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; run with --cpu-smoke for the CPU version", file=sys.stderr)
        return 2
    device = torch.device(cfg.device)
    sections = set(args.sections.split(","))
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / ("results/gpu_smoke" if args.cpu_smoke else "results/gpu"))
    try:  # before any measurement: a committed result is never overwritten without --force
        check_output_dir("--out", out_dir, args.force, OUTPUT_FILES)
    except HybridGenError as err:
        raise exit_one_line(err) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock(cfg.budget_s, cfg.margin_s)
    rows: List[Dict[str, Any]] = []
    env = environment(device)
    print(f"[bench_gpu] {env}", flush=True)

    def emit(row: Dict[str, Any]) -> None:
        row.setdefault("elapsed_s", round(clock.elapsed(), 1))
        rows.append(row)
        show = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "section"}
        print(f"[{row['section']}] {show}", flush=True)

    def guarded(section: str, fn: Callable[[], None], reserve_s: float = 0.0) -> None:
        if section not in sections:
            return
        if clock.expired(reserve_s):
            emit({"section": section, "method": "*", "status": "skipped (time guard)"})
            return
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - a failed section is one error row
            emit(error_row({"section": section, "method": "*"}, err))
            traceback.print_exc(limit=3)
            free(device)

    reserve = cfg.kernels_reserve_s if "kernels" in sections else 0.0
    order = grid(cfg)
    layers = LayerGrid(cfg, device, clock, emit, reserve_s=reserve)
    guarded("scan", lambda: run_scan(cfg, device, emit), reserve)
    guarded("layer", lambda: layers.run(order[:len(METHODS)]), reserve)
    guarded("e2e", lambda: run_e2e(cfg, device, clock, emit, reserve), reserve)
    guarded("layer", lambda: layers.run(order[len(METHODS):]), reserve)
    layers.close()
    guarded("kernels", lambda: run_kernels(cfg, device, clock, emit))
    proj_md = ""
    if "projection" in sections:
        try:
            prow, proj_md = projection_rows(cfg, [r for r in rows if r["section"] == "layer"], method_record(),
                                            cfg.scan_threads)
            rows.extend(prow)
        except Exception as err:  # noqa: BLE001
            proj_md = f"(projection failed: {type(err).__name__}: {err})"
    command = "python3 benchmarks/bench_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = write(out_dir, cfg, rows, env, command, clock.elapsed(), args.cpu_smoke, proj_md)
    print("\n" + text, flush=True)
    print(f"[bench_gpu] wrote {out_dir / 'bench_gpu.csv'}, {out_dir / 'bench_gpu.md'} and environment.json "
          f"in {clock.elapsed():.0f} s")
    return 0
