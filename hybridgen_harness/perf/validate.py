"""The performance model's validation command (and, re-exported from
:mod:`hybridgen.perf.compare`, ``compare_to_measured``)::

    python -m hybridgen_harness.perf.validate --json FILE [--md FILE] [--probe-dir DIR] [--quick] [--no-local]
        [--rounds N] [--steps N] [--force]

It prints predicted vs measured for (a) every row of the H200-host probe files
(``shared/measurements/h200-host-2026-11-30``, source ``h200-probe``, priced on the
``h200-host`` profile; :mod:`hybridgen_harness.perf.probe_rows`) and (b) this machine: a profile
measured in the same command and real per-layer runs of full, hybrid-exact, hybridgen and
every baseline that declares validation rows at two shapes (source ``this-machine``;
:mod:`hybridgen_harness.perf.local_rows`; each row's prediction adds the method's per-call
residual measured at a short context, and keeps the model alone's prediction and error beside it). When the probe files cannot be read (e.g. in CI) it says
so in one line and skips (a). JSON: ``{"rows": [{"name", "source", "predicted_s",
"measured_s", "error_pct", "within_25pct", "fitted", ...}], "not_modelled": [...],
"summary": {...}, "machine": {...}}``. ``--quick``: one tiny shape, one round (seconds; for
tests). A row's ``fitted`` names a profile figure derived from that very measurement
(agreement by construction); the summary counts the independent rows apart.
"""
from __future__ import annotations

if __name__ == "__main__":  # as a command: thread/env settings before torch loads
    from hybridgen import runtime

    runtime.apply_or_exit()

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Union

from hybridgen.errors import cli_errors
from hybridgen.perf.compare import ErrorRow, ErrorTable, compare_to_measured  # noqa: F401 (re-exported)

TOLERANCE_PCT = 25.0


# ------------------------------------------------------------------ the validation command
def summarize(rows: Sequence[Any]) -> Dict[str, Any]:
    """Counts of rows within +-TOLERANCE_PCT (all, and the independent ones: not fitted), and
    the mean absolute error per source."""
    def count(errors: List[float]) -> Dict[str, Any]:
        errs = [abs(e) for e in errors]
        return {"rows": len(errs), "within_25pct": sum(e <= TOLERANCE_PCT for e in errs),
                "mean_abs_error_pct": round(sum(errs) / len(errs), 1) if errs else None,
                "max_abs_error_pct": round(max(errs), 1) if errs else None}
    out = {"all": count([r.error_pct for r in rows]), "independent": count([r.error_pct for r in rows if not r.fitted])}
    for src in sorted({r.source for r in rows}):
        out[src] = count([r.error_pct for r in rows if r.source == src])
    out["outside_25pct"] = [r.name for r in rows if abs(r.error_pct) > TOLERANCE_PCT]
    alone = [r.extra["model_only_error_pct"] for r in rows if "model_only_error_pct" in r.extra]
    if alone:  # this machine's rows priced by the model without their measured per-call residual
        out["model_only"] = count(alone)
    return out


def markdown(result: Dict[str, Any]) -> str:
    """The validation table (ms) with each row's error, the summary and the run's facts."""
    m = result["machine"]
    lines = ["# Performance model vs measurements (predictions are PROJECTED)", "",
             f"Command: `{result['command']}`  ", f"Date: {m['date']}; machine: {m['machine']}; "
             f"load average before / after: {m['loadavg_before']} / {m['loadavg_after']}; elapsed {m['elapsed_s']} s", ""]
    if result.get("probe_skipped"):
        lines += [f"Part (a) skipped: {result['probe_skipped']}", ""]
    lines += ["h200-probe rows: the probe files' medians priced on the `h200-host` profile "
              "(`hybridgen_harness/perf/probe_rows.py` says which cost function and arguments price each). "
              "this-machine rows: a profile measured in the same command (CPU-emulated 'gpu' tier: its gpu/link "
              "figures are the CPU's own rates, branches added) and per-layer decode runs, paired: each run right "
              "after a profile measurement that predicts it; a row is the median over its pairs (the spread of "
              "the runs in the last column). Their prediction is the model's plus the method's per-call residual "
              "(measured minus predicted at a short context, same pair: `hybridgen_harness/perf/local_rows.py`), "
              "the cost of torch dispatch and thread hand-offs on this CPU that the model's counted fixed terms "
              "miss; the model alone and its error are in their own columns (the error a GPU projection carries "
              "is the model alone's).", ""]
    lines += ["| row | source | predicted ms | measured ms | error | within 25% | fitted from this row | "
              "measured min-max ms | per-call residual ms | model alone ms | model alone error |",
              "|---|---|---:|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        med = (f"{r['measured_min_s'] * 1e3:.2f}-{r['measured_max_s'] * 1e3:.2f}" if "measured_min_s" in r else "")
        alone = (f"{r['per_call_residual_s'] * 1e3:.3f} | {r['model_only_s'] * 1e3:.3f} | "
                 f"{r['model_only_error_pct']:+.1f}%" if "model_only_s" in r else " | | ")
        lines.append(f"| {r['name']} | {r['source']} | {r['predicted_s'] * 1e3:.3f} | {r['measured_s'] * 1e3:.3f} | "
                     f"{r['error_pct']:+.1f}% | {'yes' if r['within_25pct'] else '**no**'} | {r['fitted']} | {med} | "
                     f"{alone} |")
    s = result["summary"]
    lines += ["", f"Within +-25%: {s['all']['within_25pct']} of {s['all']['rows']} rows; independent rows (no "
              f"profile figure fitted to them): {s['independent']['within_25pct']} of {s['independent']['rows']}, "
              f"mean |error| {s['independent']['mean_abs_error_pct']}%."]
    for src in ("h200-probe", "this-machine"):
        if src in s:
            lines.append(f"- {src}: {s[src]['within_25pct']} of {s[src]['rows']} within 25%, mean |error| "
                         f"{s[src]['mean_abs_error_pct']}%, max {s[src]['max_abs_error_pct']}%")
    if "model_only" in s:
        mo = s["model_only"]
        lines.append(f"- this-machine, the model alone (no per-call residual): {mo['within_25pct']} of {mo['rows']} "
                     f"within 25%, mean |error| {mo['mean_abs_error_pct']}%")
    if s["outside_25pct"]:
        lines.append(f"- outside +-25%: {', '.join(s['outside_25pct'])}")
    if result.get("not_modelled"):
        lines += ["", "Not modelled (listed, not predicted):", ""]
        for r in result["not_modelled"]:
            ms = f"{r['measured_s'] * 1e3:.3f} ms" if r.get("measured_s") is not None else "-"
            lines.append(f"- {r['name']} ({r['source']}, measured {ms}): {r['reason']}")
    return "\n".join(lines) + "\n"


def run_validation(probe_dir: Optional[Union[str, Path]] = None, local: bool = True, quick: bool = False,
                   command: str = "python -m hybridgen_harness.perf.validate", rounds: int = 5,
                   steps: int = 6) -> Dict[str, Any]:
    """Compute every row: (a) the probe files (skipped with a one-line reason when unreadable),
    (b) this machine (``quick``: one tiny shape, one round; ``steps`` timed decode steps per run)."""
    from hybridgen_harness.perf import local_rows, probe_rows

    t0 = time.perf_counter()
    load0 = [round(x, 2) for x in os.getloadavg()]
    rows: List[Any] = []
    skipped: List[Dict[str, Any]] = []
    probe_skipped = None
    try:
        prow, skipped = probe_rows.probe_rows(probe_dir)
        rows += prow
    except (OSError, ValueError, KeyError) as err:
        where = probe_dir or probe_rows.PROBE_DIR
        probe_skipped = f"the H200-host probe files cannot be read at {where} ({type(err).__name__}); part (a) skipped"
        print(probe_skipped)
    profiles: List[Dict[str, Any]] = []
    if local:
        shapes = local_rows.TINY if quick else local_rows.SHAPES
        lrows, profiles = local_rows.local_rows(shapes, steps=steps, rounds=1 if quick else rounds, reps=3)
        brows, bprofiles = local_rows.local_rows(shapes, steps=steps, rounds=1 if quick else rounds, reps=3,
                                                 dtype="bf16", methods=local_rows.BF16_METHODS)
        rows += lrows + brows
        profiles += bprofiles
    machine = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.node(),
               "platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_before": load0,
               "loadavg_after": [round(x, 2) for x in os.getloadavg()],
               "elapsed_s": round(time.perf_counter() - t0, 1)}
    try:
        import torch

        machine.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                       cuda=torch.cuda.is_available())
    except ImportError:  # pragma: no cover
        pass
    return {"command": command, "machine": machine, "rows": [r.to_dict() for r in rows], "not_modelled": skipped,
            "summary": summarize(rows), "probe_skipped": probe_skipped, "this_machine_profiles": profiles,
            "projected": True}


def _print(result: Dict[str, Any]) -> None:
    print(f"{'row':62s} {'source':12s} {'pred ms':>10s} {'meas ms':>10s} {'error':>8s}")
    for r in result["rows"]:
        flag = "" if r["within_25pct"] else "  <-- outside 25%"
        fit = "  (fitted)" if r["fitted"] else ""
        print(f"{r['name'][:62]:62s} {r['source']:12s} {r['predicted_s'] * 1e3:10.3f} {r['measured_s'] * 1e3:10.3f} "
              f"{r['error_pct']:+7.1f}%{fit}{flag}")
    s = result["summary"]
    print(f"within +-25%: {s['all']['within_25pct']}/{s['all']['rows']} rows; independent "
          f"{s['independent']['within_25pct']}/{s['independent']['rows']} (mean |error| "
          f"{s['independent']['mean_abs_error_pct']}%)")


@cli_errors
def main(argv: Optional[Sequence[str]] = None) -> int:
    from hybridgen.validation.cli import strict_parser
    from hybridgen.validation.paths import check_output_file

    ap = strict_parser(prog="python -m hybridgen_harness.perf.validate",
                       description="Performance model: predicted vs measured (PROJECTED predictions).")
    ap.add_argument("--json", required=True, help="write the rows here (JSON)")
    ap.add_argument("--md", default=None, help="also write the table as markdown")
    ap.add_argument("--probe-dir", default=None, help="the H200-host probe files (default ../shared/measurements/...)")
    ap.add_argument("--quick", action="store_true", help="one tiny shape, one round (seconds)")
    ap.add_argument("--no-local", action="store_true", help="skip the runs on this machine (part b)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds of profile + runs per shape (default 5)")
    ap.add_argument("--steps", type=int, default=6,
                    help="timed decode steps per run on this machine, after a warm-up step (default 6)")
    ap.add_argument("--force", action="store_true", help="overwrite existing --json / --md files")
    args = ap.parse_args(argv)
    check_output_file("--json", args.json, args.force)  # before measuring; never overwritten without --force
    if args.md:
        check_output_file("--md", args.md, args.force, example="table.md")
    cmd = "python -m hybridgen_harness.perf.validate " + " ".join(argv if argv is not None else sys.argv[1:])
    from hybridgen.errors import ConfigError

    if args.rounds < 1:
        raise ConfigError(f"--rounds {args.rounds} must be at least 1; e.g. --rounds 5")
    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps} must be at least 1; e.g. --steps 6")
    result = run_validation(args.probe_dir, local=not args.no_local, quick=args.quick, command=cmd.strip(),
                            rounds=args.rounds, steps=args.steps)
    _print(result)
    out = Path(args.json).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.md:
        Path(args.md).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).expanduser().write_text(markdown(result))
    print(f"wrote {out}" + (f" and {args.md}" if args.md else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
