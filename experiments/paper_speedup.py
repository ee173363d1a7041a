"""``python experiments/paper_speedup.py [--results-dir outputs]``: the paper comparison's table and figure.

Reads the finished runs of ``+exp=paper_speedup`` (``<results-dir>/paper_speedup/<run>/metrics.json``)
and writes next to them:

- ``table.md``: per case (the InfiniGen template; 32K at batch 1, 2, 4, 8; the CPU-emulated run) one
  table with a row per baseline and a column per GPU; a cell is HybridGen's speedup over that
  baseline (baseline step time / HybridGen step time, same batch, so also the throughput ratio),
  labelled ``measured`` (a run on that GPU), ``emulated`` (a run on this machine's CPUs, gpu tier
  emulated) or ``projected`` (the performance model, with the band ``[low-high]`` the model's
  error allows, ``hybridgen_harness.regime.error_band``: each side's cost within its largest error
  on the validated rows of that cost function in every committed validation run,
  results/perfmodel/**/validation.json; ``not validated``
  where no row checks a side's cost), and the resource that bounds the baseline there (GPU, CPU or PCIe,
  the largest of the model's three branch totals). Fidelity columns: the method's top-1 agreement
  and mean KL to ``full`` from the emulated run (real SmolLM2, same method code, same KV budget);
- ``table.csv``: the same, one line per (case, GPU, baseline), every number;
- ``speedup.png``: the speedups per GPU with the paper's 1.41x-3.2x band drawn;
- the README's summary of ``table.csv`` (``hybridgen_harness.speedup_summary``), when the results
  directory is the repository's ``results/``;
- ``provenance.json``: this command, the code version(s) of the runs and of this script, the
  experiment's resolved settings per case, and the date.

Choices: the decode step is priced at mid-generation (hybridgen/eval/projection.py); a method whose
KV does not fit in the GPU memory budget (its placement is refused, or the model says it does not fit)
is shown as ``does not fit`` (it could not run there); an offloaded preset without its own emulated
run shows its GPU-resident preset's fidelity (same tokens, tests/test_offload.py), marked ``(= h2o)``; the
baseline rows are the method presets of the experiment's sweep (``method=NAME``), HybridGen is the
``hybridgen`` preset, its default configuration (or ``hybridgen-b20`` in a results folder of the
fixed top-k preset only; never a baseline row beside it), and ``full`` is shown as a reference row.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hybridgen.errors import ConfigError, cli_errors  # noqa: E402
from hybridgen_harness import regime as rg  # noqa: E402

EXP = "paper_speedup"
HYBRIDGEN_PRESETS = ("hybridgen", "hybridgen-b20")
GPUS = [("a100", "A100 80GB"), ("h100", "H100 80GB"), ("rtx5090", "RTX 5090 32GB"), ("h200", "H200 141GB")]
CPU_COLUMN = ("cpu-emulated", "this CPU (emulated)")
# preset -> row label; presets not named here are shown by their name
LABELS = {"flexgen": "FlexGen", "flexgen-int4": "FlexGen + INT4", "infinigen": "InfiniGen", "h2o": "H2O",
          "h2o-offload": "H2O offloaded (on FlexGen)", "snapkv": "SnapKV", "snapkv-offload": "SnapKV offloaded",
          "streamingllm": "StreamingLLM", "streamingllm-offload": "StreamingLLM offloaded", "quest": "Quest",
          "quest-offload": "Quest offloaded", "uvm": "UVM", "uvm-h2o": "UVM + H2O", "full": "full (reference)",
          "pyramidkv": "PyramidKV", "pyramidkv-offload": "PyramidKV offloaded", "shadowkv": "ShadowKV (fetch 1.56%)",
          "shadowkv-b20": "ShadowKV (fetch 20%)", "magicpig": "MagicPIG"}
# perf-model cost label -> validation rows that check it (name fragment, or the run's method)
VALIDATED_BY = {"full": ("GPU SDPA", "method:full"), "hybridgen": ("HybridGen step", "method:hybridgen"),
                "flexgen-stream": ("FlexGen stream", "stream (fetch)", "method:flexgen-stream"),
                "cpu-attention-split": ("CPU attention split", "exact split", "method:flexgen-cpu")}


def case_of(m: Dict[str, Any]) -> str:
    """'template' | 'long-b<batch>' | 'emulated' (| 'other') of one run's metrics."""
    w, model = m.get("workload") or {}, (m.get("model") or {}).get("name")
    if (m.get("run") or {}).get("kind") == "generate":
        return "emulated"
    if model == "opt-13b" and (w.get("batch"), w.get("prompt_len"), w.get("gen_len")) == (20, 1920, 128):
        return "template"
    if model == "llama-3.1-8b":
        return f"long-b{w.get('batch')}"
    return "other"


def preset_of(m: Dict[str, Any]) -> str:
    """The method preset the run was asked for (its ``method=NAME`` override), else the method name."""
    for o in (m.get("run") or {}).get("overrides") or []:
        key, _, val = str(o).partition("=")
        if key.lstrip("+~") == "method":
            return val
    return (m.get("method") or {}).get("name", "?")


def validation_files() -> List[str]:
    """The committed validation runs (``results/perfmodel/validation.json`` and the repeats in its
    subfolders): the default of ``--validation``."""
    return [str(p) for p in sorted((_ROOT / "results" / "perfmodel").glob("**/validation.json"))]


def load_validation(paths: Optional[Sequence[str]] = None) -> Optional[Dict[str, Any]]:
    """Every row of the validation files ``paths`` (default: :func:`validation_files`) as one
    {'rows': [...], 'files': [...]}, so a cost's band is its largest error over all of those runs
    (one run of the 2-core VM moves a row by 10-20 points); None when ``paths`` is empty. A path
    that is not a file is a one-line ConfigError."""
    rows, files = [], []
    for path in validation_files() if paths is None else paths:
        if not Path(path).is_file():
            raise ConfigError(f"--validation: {path} is not a file (make one: python -m "
                              "hybridgen_harness.perf.validate --json FILE)")
        rows += json.loads(Path(path).read_text()).get("rows", [])
        full = Path(path).resolve()
        files.append(str(full.relative_to(_ROOT)) if full.is_relative_to(_ROOT) else str(path))
    return {"rows": rows, "files": files} if files else None


def validation_label(validation: Optional[Dict[str, Any]]) -> str:
    """The validation files a summary used (relative to the repository), for its text."""
    return ", ".join(validation["files"]) if validation else "no validation file"


def model_error(cost: Optional[str], validation: Optional[Dict[str, Any]]) -> Optional[float]:
    """Largest |error| (%) of the model alone on the validation rows that check ``cost`` (None: none do)."""
    keys = VALIDATED_BY.get(cost or "", ())
    if not cost or not validation:
        return None
    errs = []
    for row in validation.get("rows", []):
        hit = row.get("method") == cost or any(  # a row labelled by the cost that prices it (local_rows.py)
            row.get("method") == k[7:] if k.startswith("method:") else k in row.get("name", "") for k in keys)
        # a projection is the model alone: a this-machine row's error without its measured per-call
        # residual (local_rows.py) where it has one
        err = row.get("model_only_error_pct", row.get("error_pct"))
        if hit and err is not None and not row.get("fitted"):
            errs.append(abs(float(err)))
    return max(errs) if errs else None


def _bound(p: Dict[str, Any]) -> str:
    parts = {"GPU": p.get("gpu_branch_s") or 0.0, "CPU": p.get("cpu_branch_s") or 0.0, "PCIe": p.get("transfer_s") or 0.0}
    return max(parts, key=parts.get)


def point(m: Dict[str, Any], validation: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """One run as a flat record: case, gpu, preset, step seconds, label, model error, bound, fidelity."""
    run, hw = m.get("run") or {}, m.get("hardware") or {}
    fid = m.get("fidelity") or {}
    rec = {"case": case_of(m), "gpu": hw.get("name"), "preset": preset_of(m),
           "method": (m.get("method") or {}).get("name"), "params": json.dumps((m.get("method") or {}).get("params", {}),
                                                                                sort_keys=True, default=str),
           "model": (m.get("model") or {}).get("name"), "dtype": (m.get("model") or {}).get("dtype"),
           "batch": (m.get("workload") or {}).get("batch"), "prompt": (m.get("workload") or {}).get("prompt_len"),
           "gen": (m.get("workload") or {}).get("gen_len"), "run": run.get("name"),
           "top1": fid.get("top1_agreement"), "kl": fid.get("mean_kl"), "code": run.get("code")}
    if run.get("kind") == "project":
        p = m.get("projected") or {}
        ok = p.get("status") == "ok" and p.get("step_s") is not None
        fits = bool(p.get("fits_gpu")) if ok else False if p.get("status") == "does not fit" else None
        rec.update(label="projected", step_s=p.get("step_s") if ok else None, fits=fits, reason=p.get("reason"),
                   cost=p.get("perf_cost"), bound=_bound(p) if ok else None,
                   error_pct=model_error(p.get("perf_cost"), validation), status=p.get("status"),
                   priced=json.dumps(p.get("priced") or {}, sort_keys=True))
    else:
        device = (run.get("realized") or {}).get("device", "cpu-emulated")
        lat = m.get("latency") or {}
        steps = lat.get("decode_ms_per_token")
        rec.update(label="emulated" if device == "cpu-emulated" else "measured",
                   step_s=steps / 1e3 if steps else None, fits=True, cost=None, bound=None, error_pct=None,
                   status="ok" if steps else "no time", reason=None)
        if rec["label"] == "emulated":
            rec["gpu"] = CPU_COLUMN[0]
    return rec


def load_points(root: Path, validation: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    from hybridgen_harness.results import ResultsStore, load_run

    store = ResultsStore(root, EXP)
    pts = add_offload_twins([point(load_run(d), validation) for d in store.finished_runs()], ("case", "gpu"))
    if not pts:
        raise ConfigError(f"no finished runs under {Path(root) / EXP}; run: python experiments/run.py "
                          f"+exp={EXP} results_dir={root}")
    return pts


def add_offload_twins(pts: List[Dict[str, Any]], group: Sequence[str]) -> List[Dict[str, Any]]:
    """``pts`` plus the twin of each streamed run: a preset's derived placement equal to its offloaded
    preset's ('h2o' placed as offload=stream = 'h2o-offload') is one run (same identity, launched once),
    shown in both rows; ``group``: the point keys of one table column (e.g. case and gpu)."""
    have = {(*(p[k] for k in group), p["preset"]) for p in pts}
    out = list(pts)
    for p in pts:
        if json.loads(p["params"]).get("offload") != "stream":
            continue
        name = str(p["preset"])
        twin = name[:-len("-offload")] if name.endswith("-offload") else f"{name}-offload"
        if (*(p[k] for k in group), twin) not in have:
            out.append({**p, "preset": twin})
    return out


def speedups(points: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per (case, gpu, baseline preset): HybridGen's speedup over it, with labels."""
    out = []
    groups: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["case"], p["gpu"]), {})[p["preset"]] = p
    fidelity = {p["preset"]: p for p in points if p["case"] == "emulated"}
    for (case, gpu), by_preset in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
        hg_name = next((h for h in HYBRIDGEN_PRESETS if h in by_preset), None)
        hg = by_preset.get(hg_name) if hg_name else None
        for preset, p in sorted(by_preset.items()):
            if preset in HYBRIDGEN_PRESETS:  # HybridGen's row (another of its presets is no baseline)
                continue
            hg_ok = bool(hg and hg["step_s"] and hg["fits"] is not False)
            base_ok = bool(p["step_s"] and p["fits"] is not False)
            sp = p["step_s"] / hg["step_s"] if hg_ok and base_ok else None
            # an offloaded preset ('h2o-offload') gives the GPU-resident one's tokens (tests/test_offload.py):
            # without its own emulated run its fidelity is that one's, marked in fidelity_from
            own = preset if preset in fidelity else preset.rsplit("-offload", 1)[0]
            f = fidelity.get(own, {})
            out.append({"case": case, "gpu": gpu, "baseline": preset, "row": LABELS.get(preset, preset),
                        "method": p["method"], "params": p["params"], "label": p["label"],
                        "model_error_pct": p["error_pct"], "cost": p["cost"],
                        "hybridgen_error_pct": hg["error_pct"] if hg else None,
                        "baseline_step_ms": 1e3 * p["step_s"] if p["step_s"] else None,
                        "hybridgen_step_ms": 1e3 * hg["step_s"] if hg and hg["step_s"] else None,
                        "speedup": sp, "baseline_fits": p["fits"], "hybridgen_fits": hg["fits"] if hg else None,
                        "bound": p["bound"], "hybridgen_bound": hg["bound"] if hg else None,
                        "model": p["model"], "batch": p["batch"], "prompt": p["prompt"], "gen": p["gen"],
                        "top1": f.get("top1"), "kl": f.get("kl"), "fidelity_from": own if f else None,
                        "reason": p.get("reason") or (hg or {}).get("reason"),
                        "hybridgen_top1": (fidelity.get(hg_name) or {}).get("top1"),
                        "hybridgen_kl": (fidelity.get(hg_name) or {}).get("kl")})
    return out


def speedup_band(r: Dict[str, Any]):
    """(low, high) of a projected speedup from both sides' model errors (None, None: a side not validated)."""
    if r["speedup"] is None:
        return None, None
    return rg.error_band(r["speedup"], r["model_error_pct"], r.get("hybridgen_error_pct"))


def cell(r: Dict[str, Any]) -> str:
    """'2.13x projected [1.80-2.52] (PCIe)' / 'does not fit (baseline) projected' / '0.91x emulated'."""
    lab = r["label"]
    if r["speedup"] is None:
        who = "baseline" if r["baseline_fits"] is False else "HybridGen" if r["hybridgen_fits"] is False else None
        return f"{'does not fit (' + who + ')' if who else 'n/a'} {lab}"
    if lab == "projected":
        lo, hi = speedup_band(r)
        lab += f" [{lo:.2f}-{hi:.2f}]" if lo is not None else " (not validated)"
    bound = f" ({r['bound']})" if r.get("bound") else ""
    return f"{r['speedup']:.2f}x {lab}{bound}"


def _uvm_reason() -> str:
    try:
        from hybridgen.methods.uvm import PROJECTED_ONLY_REASON
    except ImportError:
        return "projected only"
    return PROJECTED_ONLY_REASON


def _fid(r: Dict[str, Any], key: str, fmt: str) -> str:
    text = _num(r[key], fmt)
    return text + (f" (= {r['fidelity_from']})" if r.get("fidelity_from") not in (None, r["baseline"]) and text != "-"
                   else "")


CASE_TITLES = {"template": "InfiniGen's template: OPT-13B fp16, prompt 1920, 128 new tokens, batch 20",
               "emulated": "This machine (2 CPU cores, gpu tier emulated): real SmolLM2-135M, 1K pydoc prompt, 32 new tokens"}


def _case_title(case: str, rows: Sequence[Dict[str, Any]]) -> str:
    if case in CASE_TITLES:
        return CASE_TITLES[case]
    r = rows[0]
    return f"Long context: {r['model']}, prompt {r['prompt']} + {r['gen']} new tokens, batch {r['batch']}"


def _case_order(case: str) -> tuple:
    if case == "template":
        return (0, 0)
    if case.startswith("long-b"):
        return (1, int(case[6:]))
    return (2, 0)


def markdown(rows: Sequence[Dict[str, Any]]) -> str:
    lines = []
    for case in sorted({r["case"] for r in rows}, key=_case_order):
        rs = [r for r in rows if r["case"] == case]
        cols = [CPU_COLUMN] if case == "emulated" else [g for g in GPUS if any(r["gpu"] == g[0] for r in rs)]
        lines += [f"### {_case_title(case, rs)}", "",
                  "| baseline | " + " | ".join(c[1] for c in cols) + " | top-1 vs full | KL vs full |",
                  "|---|" + "---|" * len(cols) + "---:|---:|"]
        hg = {r["gpu"]: r["hybridgen_step_ms"] for r in rs}
        hg_bound = {r["gpu"]: r["hybridgen_bound"] for r in rs}
        any_r = rs[0]
        lines.append("| **HybridGen step ms** | " + " | ".join(
            (f"{hg[c[0]]:.1f} ms" + (f" ({hg_bound[c[0]]})" if hg_bound.get(c[0]) else "")) if hg.get(c[0]) else "-"
            for c in cols) + f" | {_num(any_r['hybridgen_top1'])} | {_num(any_r['hybridgen_kl'], '.2g')} |")
        for base in sorted({r["baseline"] for r in rs}, key=lambda b: (b == "full", list(LABELS).index(b)
                                                                         if b in LABELS else 99, b)):
            by_gpu = {r["gpu"]: r for r in rs if r["baseline"] == base}
            first = next(iter(by_gpu.values()))
            lines.append(f"| {first['row']} | " + " | ".join(cell(by_gpu[c[0]]) if c[0] in by_gpu else "-" for c in cols)
                         + f" | {_fid(first, 'top1', '.3f')} | {_fid(first, 'kl', '.2g')} |")
        lines.append("")
    return "\n".join(lines)


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(float(x), fmt)


def figure(rows: Sequence[Dict[str, Any]], path: Path) -> Path:
    """The speedup figure (experiments/paper_speedup_figure.py draws it)."""
    from experiments.paper_speedup_figure import figure as draw_figure

    return draw_figure(rows, path)


@cli_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", default="outputs")
    p.add_argument("--validation", nargs="*", default=None,
                   help="validation JSON files whose rows give the bands (default: every committed run)")
    args = p.parse_args(argv)
    from hybridgen.eval.provenance import code_version
    from hybridgen_harness.results import write_json

    validation = load_validation(args.validation)
    pts = load_points(Path(args.results_dir), validation)
    rows = speedups(pts)
    out = Path(args.results_dir) / EXP
    head = ("# HybridGen vs the baselines under each GPU's memory budget (`+exp=paper_speedup`)\n\n"
            f"Made by `python experiments/paper_speedup.py --results-dir {args.results_dir}` from "
            f"{len(pts)} runs of `python experiments/run.py +exp=paper_speedup results_dir={args.results_dir}`. "
            "A cell: HybridGen's speedup over the baseline (baseline decode step / HybridGen's, same batch), "
            "its label (projected [low-high]: the band both sides' model errors allow, each cost's largest error "
            "on the validated rows of that cost, "
            f"{validation_label(validation)}; emulated: timed on this machine's CPUs), "
            "and the resource bounding the baseline. does not fit: that method's KV cannot be placed in that GPU's "
            "KV budget (memory.gpu_kv=auto). UVM rows: " + _uvm_reason() + ". "
            "Fidelity: teacher-forced top-1 / mean KL to `full` in the emulated run (real SmolLM2-135M, 1K prompt, 32 teacher-forced steps, 20% KV budget; "
            "ShadowKV: its fetch budget, the paper's 1.56% or 20%; MagicPIG: no budget, its paper configuration). "
            "The peers' rows (PyramidKV, ShadowKV, MagicPIG; issue 14) are priced as this repo's code runs them; README.md says what they show.\n\n")
    (out / "table.md").write_text(head + markdown(rows))
    with (out / "table.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    figure(rows, out / "speedup.png")
    if out.resolve() == (_ROOT / "results" / EXP).resolve():  # the committed table: its README summary too
        from hybridgen_harness import speedup_summary
        from hybridgen_harness.result_tables import splice

        readme = _ROOT / "README.md"
        table = speedup_summary.load_table(out / "table.csv")
        text = splice(readme.read_text(), speedup_summary.readme_block(table), speedup_summary.README_BEGIN,
                      speedup_summary.README_END)
        readme.write_text(splice(text, speedup_summary.verdict(table), speedup_summary.VERDICT_BEGIN,
                                 speedup_summary.VERDICT_END))
    cases = {}
    for pt in pts:
        cases.setdefault(pt["case"], {k: pt[k] for k in ("model", "dtype", "batch", "prompt", "gen")})
    codes = sorted({json.dumps(pt["code"], sort_keys=True) for pt in pts})
    write_json(out / "provenance.json", {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "code": code_version(), "run_codes": [json.loads(c) for c in codes], "runs": len(pts), "cases": cases,
        "validation": validation["files"] if validation else None, "paper_band": rg.PAPER_BAND,
        "rows": {b: LABELS.get(b, b) for b in sorted({r["baseline"] for r in rows})}})
    print(f"{len(rows)} cells -> {out / 'table.md'}, {out / 'table.csv'}, {out / 'speedup.png'}")


if __name__ == "__main__":
    main()
