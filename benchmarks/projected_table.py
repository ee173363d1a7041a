"""PROJECTED version of the GPU benchmark table for the paper's GPUs (performance model only).

    python benchmarks/projected_table.py [--profiles a100-80gb-cxl,h100-80gb-cxl,rtx5090-cxl,h200-host]
                                         [--out results/projected]

For each hardware profile (``hybridgen/profiles``; the paper's A100, H100 and RTX 5090 hosts
with a CXL node, plus the H200 host whose measured table ``bench_gpu.py`` produces) it writes
``<profile>.csv`` and ``<profile>.md`` and one ``projected.md`` with every table:
1. per-layer decode attention (ms) of full, hybrid-exact, hybridgen (its int4 key sketch, and
   without it, ``hybridgen-no-sketch``), FlexGen streaming and FlexGen CPU-compute for a Llama-3.1-8B-shaped layer (batch 8, 32 q heads, 8 KV heads, head
   dim 128, bf16) at host shares 50/75/90/95% and contexts 8K-64K (the grid of
   ``bench_gpu.py``; single layer, no cross-layer pipelining), with the ratios the issue
   targets; a what-if column gives hybridgen with a key scan at 80% of the host read
   bandwidth (the issue's scan target) instead of the profile's scan rate;
2. end-to-end decode step and tokens/s of the 32-layer model at 90% host share (gpu_budget
   0.1 for every method that has one) for every registered method, FlexGen in its three
   modes, hybridgen with and without the key sketch (cross-layer pipelining), with GPU-fit
   flags; a method without a
   performance-model cost is listed as "not modelled".

Nothing here is measured: every table and file is labelled PROJECTED. The model's formulas
and the profiles' sources are in ``hybridgen/perf/`` and ``hybridgen/profiles``; its measured
error is in ``results/perfmodel/validation.md`` (``python -m hybridgen_harness.perf.validate``).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen import perf as pm  # noqa: E402
from hybridgen.methods import KVMethod, available_methods, build_method, method_parameters  # noqa: E402
from hybridgen.validation.cli import parse_checked  # noqa: E402
from hybridgen_harness import projected_summary  # noqa: E402
from hybridgen_harness.result_tables import splice  # noqa: E402

DEFAULT_OUT = ROOT / "results" / "projected"

LAYER = pm.ModelShape(name="llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256)
CONTEXTS = (8192, 16384, 32768, 65536)
SHARES = (0.5, 0.75, 0.9, 0.95)
# (column label, registered method, parameters beyond the table's share)
TABLE_METHODS = (("full", "full", {}), ("hybrid-exact", "hybrid-exact", {}), ("hybridgen", "hybridgen", {}),
                 ("hybridgen-no-sketch", "hybridgen", {"key_sketch": "none"}),
                 ("flexgen-stream", "flexgen", {}), ("flexgen-cpu", "flexgen", {"attention_on": "cpu"}))
E2E_ORDER = ("full", "hybrid-exact", "hybridgen", "flexgen", "infinigen", "h2o", "snapkv", "streamingllm", "quest")
MODES = {"flexgen": (("flexgen-stream", {}), ("flexgen-cpu", {"attention_on": "cpu"}),
                     ("flexgen-int4", {"compress_kv": True})),
         "hybridgen": (("hybridgen", {}), ("hybridgen-no-sketch", {"key_sketch": "none"}),
                       ("hybridgen-three-way", {"three_way": True}))}
TOPK = 0.05
LABEL = "PROJECTED (performance model, not measured)"


def scan_target_profile(prof: pm.HardwareProfile) -> pm.HardwareProfile:
    """What-if: the key scan (exact or bf16-dot) runs at 80% of the host read bandwidth, pinned or
    not (the issue's scan target; selection, copies and fixed costs as the profile says)."""
    rate = 0.8 * prof.host.dram_read_gbps
    scans = {k: rate for k in (prof.host.key_scan_gbps or {"bf16": rate})}
    return dataclasses.replace(prof, name=prof.name + " (scan at 80% of read)",
                               host=dataclasses.replace(prof.host, key_scan_gbps=scans, key_scan_pinned_gbps=scans,
                                                        key_scan_bf16dot_gbps=rate))


def table_method(name: str, share: float, pipelined: bool, **params: Any) -> KVMethod:
    """A registered method at the table's host share: gpu_budget = 1 - share when the method has
    one, hybridgen at top-k TOPK with or without cross-layer pipelining, its plain split (every host
    token scanned) unless ``params`` turn three-way on (its default: the scheduler's stream)."""
    known = method_parameters(name)
    if "gpu_budget" in known:
        params["gpu_budget"] = round(1.0 - share, 6)
    if name == "hybridgen":
        params = {"three_way": False, **params, "topk_ratio": TOPK, "pipeline": pipelined}
    return build_method(name, **params)


def e2e_methods() -> List[Tuple[str, str, Dict[str, Any]]]:
    """(label, registered name, parameters) of every registered method, FlexGen in each mode."""
    names = [n for n in E2E_ORDER if n in available_methods()]
    names += [n for n in available_methods() if n not in names]
    return [(label, n, p) for n in names for label, p in MODES.get(n, ((n, {}),))]


def layer_rows(prof: pm.HardwareProfile) -> List[Dict]:
    what_if = scan_target_profile(prof)
    rows = []
    for ctx in CONTEXTS:
        for share in SHARES:
            w = pm.Workload(batch=8, context=ctx)
            row = {"profile": prof.name, "context": ctx, "host_share": share, "projected": True}
            for label, name, params in TABLE_METHODS:
                method = table_method(name, share, pipelined=False, **params)
                row[f"{label}_ms"] = pm.predict_step(method, LAYER, w, prof).attention_layer_s * 1e3
            hybridgen = table_method("hybridgen", share, pipelined=False, key_sketch="none")  # scans the keys
            row["hybridgen_scan80_ms"] = pm.predict_step(hybridgen, LAYER, w, what_if).attention_layer_s * 1e3
            row["hg_vs_stream"] = row["flexgen-stream_ms"] / row["hybridgen_ms"]
            row["hg_vs_cpu"] = row["flexgen-cpu_ms"] / row["hybridgen_ms"]
            row["hg_scan80_vs_stream"] = row["flexgen-stream_ms"] / row["hybridgen_scan80_ms"]
            row["hg_scan80_vs_cpu"] = row["flexgen-cpu_ms"] / row["hybridgen_scan80_ms"]
            row["hg_nosketch_vs_stream"] = row["flexgen-stream_ms"] / row["hybridgen-no-sketch_ms"]
            rows.append(row)
    return rows


def e2e_rows(prof: pm.HardwareProfile, context: int = 32768, share: float = 0.9) -> List[Dict]:
    rows = []
    w = pm.Workload(batch=8, context=context)
    for label, name, params in e2e_methods():
        row: Dict[str, Any] = {"profile": prof.name, "method": label, "context": context, "host_share": share}
        try:
            p = pm.predict_step(table_method(name, share, pipelined=True, **params), LAYER, w, prof)
        except pm.NotModelled:
            row.update({k: None for k in ("step_ms", "tok_s", "cpu_branch_ms", "gpu_branch_ms", "transfer_ms",
                                          "fits_gpu", "bound")}, projected=True, status="not modelled")
        else:
            busy = {"CPU": p.cpu_branch_s, "GPU": p.gpu_branch_s, "PCIe": p.transfer_s}
            row.update(step_ms=p.total_s * 1e3, tok_s=p.tokens_per_s(w.batch), cpu_branch_ms=p.cpu_branch_s * 1e3,
                       gpu_branch_ms=p.gpu_branch_s * 1e3, transfer_ms=p.transfer_s * 1e3, fits_gpu=p.fits_gpu,
                       bound=max(busy, key=busy.get), projected=True, status="ok")
        rows.append(row)
    return rows


def layer_markdown(rows: List[Dict]) -> str:
    cols = [label for label, _, _ in TABLE_METHODS]
    lines = ["| context | host | " + " | ".join(cols) + " | hybridgen, scan 80% (what-if) | HG vs stream | HG vs cpu "
             "| HG(80%) vs stream | HG(80%) vs cpu | HG-no-sketch vs stream |", "|" + "---|" * (len(cols) + 8)]
    for r in rows:
        cells = " | ".join(f"{r[f'{c}_ms']:.3f}" for c in cols)
        lines.append(f"| {r['context']} | {int(round(r['host_share'] * 100))}% | {cells} | {r['hybridgen_scan80_ms']:.3f} | "
                     f"{r['hg_vs_stream']:.2f}x | {r['hg_vs_cpu']:.2f}x | {r['hg_scan80_vs_stream']:.2f}x | "
                     f"{r['hg_scan80_vs_cpu']:.2f}x | {r['hg_nosketch_vs_stream']:.2f}x |")
    return "\n".join(lines)


def e2e_markdown(rows: List[Dict]) -> str:
    lines = ["| method | step ms | tokens/s | CPU branch ms | GPU branch ms | PCIe ms | busiest | fits GPU |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['method']} | {r['status']} | | | | | | |")
            continue
        lines.append(f"| {r['method']} | {r['step_ms']:.2f} | {r['tok_s']:.1f} | {r['cpu_branch_ms']:.2f} | "
                     f"{r['gpu_branch_ms']:.2f} | {r['transfer_ms']:.2f} | {r['bound']} | "
                     f"{'yes' if r['fits_gpu'] else 'NO'} |")
    return "\n".join(lines)


def write_csv(path: Path, rows: List[Dict]) -> None:
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def profile_section(prof: pm.HardwareProfile, lrows: List[Dict], erows: List[Dict]) -> str:
    cxl = (f"CXL: {prof.cxl.name}, {prof.cxl.read_gbps} GB/s read, +{prof.cxl.added_latency_ns:.0f} ns"
           if prof.cxl else "no CXL node")
    facts = (f"GPU {prof.gpu.name}: {prof.gpu.hbm_gbps} GB/s HBM ({prof.gpu.attention_gbps} GB/s decode attention), "
             f"{prof.gpu.memory_gb} GB; link {prof.link.name}: {prof.link.h2d_pinned_gbps} GB/s pinned H2D; host: "
             f"{prof.host.dram_read_gbps} GB/s read, key scan {prof.host.key_scan_gbps.get('bf16')} GB/s bf16 "
             f"({prof.host.key_scan_pinned_gbps.get('bf16')} on pinned memory, where FlexGen and hybrid-exact keep host KV; hybridgen's host KV is pageable), CPU "
             f"attention {prof.host.cpu_attention_gbps.get('bf16')} GB/s bf16, the code's fused selection "
             f"{prof.host.select_gbps or 'not in the profile: torch group score + top-k'} GB/s of fp32 logits "
             f"(torch's group score + top-k {prof.host.group_score_gbps} / {prof.host.topk_gbps} GB/s), int4 key sketch "
             f"scan {prof.host.key_sketch_gbps.get('int4') or 'not measured: at the key scan rate per byte'} GB/s, "
             f"{prof.host.op_us} us per host op; GQA partials on the GPU {prof.gpu.gqa_attention_gbps} GB/s; {cxl}")
    return "\n".join([
        f"## {prof.name} — {LABEL}", "", prof.description, "", facts, "",
        "### Per-layer decode attention, ms (PROJECTED; Llama-3.1-8B layer, batch 8, bf16, top-k 5%, one layer, "
        "no cross-layer pipelining)", "", layer_markdown(lrows), "",
        f"### End-to-end decode step, 32 layers, {erows[0]['context']} tokens, "
        f"{int(erows[0]['host_share'] * 100)}% host (PROJECTED; hybridgen pipelined)", "", e2e_markdown(erows), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default=",".join(projected_summary.PROFILES))
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--readme", default=None,
                    help="also write the per-profile summary between the markers of this README (default: the "
                         "repository's README.md when --out is the repository's results/projected)")
    args = parse_checked(ap, argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"# {LABEL}", "",
                "Every number below comes from `hybridgen/perf/` applied to the hardware profiles in "
                "`hybridgen/profiles` (datasheet figures and H200-host measurements, each cited in the profile's "
                "`sources`). They are projections, not measurements. Regenerate with "
                "`python benchmarks/projected_table.py`. The model's error against measurements (H200-host probe "
                "files and this machine) is in `results/perfmodel/validation.md`.", ""]
    for name in args.profiles.split(","):
        prof = pm.load_profile(name)
        lrows, erows = layer_rows(prof), e2e_rows(prof)
        write_csv(out / f"{name}.csv", lrows)
        write_csv(out / f"{name}-e2e.csv", erows)
        text = profile_section(prof, lrows, erows)
        (out / f"{name}.md").write_text(f"# {LABEL}\n\n" + text)
        sections.append(text)
        target = next(r for r in lrows if r["context"] == 32768 and r["host_share"] == 0.9)
        print(f"[projected] {name}: 32K/90%: hybridgen {target['hybridgen_ms']:.2f} ms, "
              f"{target['hg_vs_stream']:.2f}x FlexGen stream, {target['hg_vs_cpu']:.2f}x CPU-compute "
              f"(scan at 80%: {target['hg_scan80_vs_stream']:.2f}x / {target['hg_scan80_vs_cpu']:.2f}x)")
    (out / "projected.md").write_text("\n".join(sections))
    print(f"[projected] wrote {out}/projected.md and per-profile CSV/MD files (all PROJECTED)")
    readme = Path(args.readme) if args.readme else (ROOT / "README.md" if out.resolve() == DEFAULT_OUT.resolve()
                                                      else None)
    if readme is not None:
        block = projected_summary.readme_block(out, args.profiles.split(","))
        readme.write_text(splice(readme.read_text(), block, projected_summary.BEGIN, projected_summary.END))
        print(f"[projected] summary spliced into {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
