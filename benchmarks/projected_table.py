"""PROJECTED version of the GPU benchmark table for the paper's GPUs (performance model only).

    python benchmarks/projected_table.py [--profiles a100-80gb-cxl,h100-80gb-cxl,rtx5090-cxl,h200-host]
                                         [--out results/projected]

For each hardware profile (``hybridgen/profiles``; the paper's A100, H100 and RTX 5090 hosts
with a CXL node, plus the H200 host whose measured table ``bench_gpu.py`` produces) it writes
``<profile>.csv`` and ``<profile>.md`` and one ``projected.md`` with every table:
1. per-layer decode attention (ms) of full, hybrid-exact, hybridgen, FlexGen streaming and
   FlexGen CPU-compute for a Llama-3.1-8B-shaped layer (batch 8, 32 q heads, 8 KV heads, head
   dim 128, bf16) at host shares 50/75/90/95% and contexts 8K-64K (the grid of
   ``bench_gpu.py``; single layer, no cross-layer pipelining), with the ratios the issue
   targets; a what-if column gives hybridgen with a key scan at 80% of the host read
   bandwidth (the issue's scan target) instead of the profile's scan rate;
2. end-to-end decode step and tokens/s of the 32-layer model at 90% host share for every
   method the model knows (hybridgen with cross-layer pipelining), with GPU-fit flags.

Nothing here is measured: every table and file is labelled PROJECTED. The model's formulas
and the profiles' sources are in ``hybridgen/perfmodel.py`` and ``hybridgen/profiles``.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen import perfmodel as pm  # noqa: E402

LAYER = pm.ModelShape(name="llama-3.1-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256)
CONTEXTS = (8192, 16384, 32768, 65536)
SHARES = (0.5, 0.75, 0.9, 0.95)
TABLE_METHODS = (("full", "full"), ("hybrid-exact", "hybrid-exact"), ("hybridgen", "hybridgen"),
                 ("flexgen-stream", "flexgen"), ("flexgen-cpu", "flexgen-cpu"))
TOPK = 0.05
LABEL = "PROJECTED (performance model, not measured)"


def scan_target_profile(prof: pm.HardwareProfile) -> pm.HardwareProfile:
    """What-if: the key scan runs at 80% of the host read bandwidth."""
    rate = 0.8 * prof.host.dram_read_gbps
    scans = {k: rate for k in (prof.host.key_scan_gbps or {"bf16": rate})}
    return dataclasses.replace(prof, name=prof.name + " (scan at 80% of read)",
                               host=dataclasses.replace(prof.host, key_scan_gbps=scans))


def layer_rows(prof: pm.HardwareProfile) -> List[Dict]:
    what_if = scan_target_profile(prof)
    rows = []
    for ctx in CONTEXTS:
        for share in SHARES:
            w = pm.Workload(batch=8, context=ctx, host_share=share, topk_ratio=TOPK, pipelined=False)
            row = {"profile": prof.name, "context": ctx, "host_share": share, "projected": True}
            for label, method in TABLE_METHODS:
                row[f"{label}_ms"] = pm.predict_step(method, LAYER, w, prof).attention_layer_s * 1e3
            row["hybridgen_scan80_ms"] = pm.predict_step("hybridgen", LAYER, w, what_if).attention_layer_s * 1e3
            row["hg_vs_stream"] = row["flexgen-stream_ms"] / row["hybridgen_ms"]
            row["hg_vs_cpu"] = row["flexgen-cpu_ms"] / row["hybridgen_ms"]
            row["hg_scan80_vs_stream"] = row["flexgen-stream_ms"] / row["hybridgen_scan80_ms"]
            row["hg_scan80_vs_cpu"] = row["flexgen-cpu_ms"] / row["hybridgen_scan80_ms"]
            rows.append(row)
    return rows


def e2e_rows(prof: pm.HardwareProfile, context: int = 32768, share: float = 0.9) -> List[Dict]:
    rows = []
    w = pm.Workload(batch=8, context=context, host_share=share, topk_ratio=TOPK, pipelined=True)
    for method in pm.METHODS:
        if method == "flexgen":
            continue  # same as flexgen-stream
        p = pm.predict_step(method, LAYER, w, prof)
        rows.append({"profile": prof.name, "method": method, "context": context, "host_share": share,
                     "step_ms": p.total_s * 1e3, "tok_s": p.tokens_per_s(w.batch), "cpu_branch_ms": p.cpu_branch_s * 1e3,
                     "gpu_branch_ms": p.gpu_branch_s * 1e3, "transfer_ms": p.transfer_s * 1e3, "fits_gpu": p.fits_gpu,
                     "projected": True})
    return rows


def layer_markdown(rows: List[Dict]) -> str:
    cols = [label for label, _ in TABLE_METHODS]
    lines = ["| context | host | " + " | ".join(cols) + " | hybridgen, scan 80% (what-if) | HG vs stream | HG vs cpu "
             "| HG(80%) vs stream | HG(80%) vs cpu |", "|" + "---|" * (len(cols) + 7)]
    for r in rows:
        cells = " | ".join(f"{r[f'{c}_ms']:.3f}" for c in cols)
        lines.append(f"| {r['context']} | {int(round(r['host_share'] * 100))}% | {cells} | {r['hybridgen_scan80_ms']:.3f} | "
                     f"{r['hg_vs_stream']:.2f}x | {r['hg_vs_cpu']:.2f}x | {r['hg_scan80_vs_stream']:.2f}x | "
                     f"{r['hg_scan80_vs_cpu']:.2f}x |")
    return "\n".join(lines)


def e2e_markdown(rows: List[Dict]) -> str:
    lines = ["| method | step ms | tokens/s | CPU branch ms | GPU branch ms | PCIe ms | fits GPU |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['step_ms']:.2f} | {r['tok_s']:.1f} | {r['cpu_branch_ms']:.2f} | "
                     f"{r['gpu_branch_ms']:.2f} | {r['transfer_ms']:.2f} | {'yes' if r['fits_gpu'] else 'NO'} |")
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
             f"{prof.host.dram_read_gbps} GB/s read, key scan {prof.host.key_scan_gbps.get('bf16')} GB/s bf16, CPU "
             f"attention {prof.host.cpu_attention_gbps.get('bf16')} GB/s bf16; {cxl}")
    return "\n".join([
        f"## {prof.name} — {LABEL}", "", prof.description, "", facts, "",
        "### Per-layer decode attention, ms (PROJECTED; Llama-3.1-8B layer, batch 8, bf16, top-k 5%, one layer, "
        "no cross-layer pipelining)", "", layer_markdown(lrows), "",
        f"### End-to-end decode step, 32 layers, {erows[0]['context']} tokens, "
        f"{int(erows[0]['host_share'] * 100)}% host (PROJECTED; hybridgen pipelined)", "", e2e_markdown(erows), ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="a100-80gb-cxl,h100-80gb-cxl,rtx5090-cxl,h200-host")
    ap.add_argument("--out", default=str(ROOT / "results" / "projected"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = [f"# {LABEL}", "",
                "Every number below comes from `hybridgen/perfmodel.py` applied to the hardware profiles in "
                "`hybridgen/profiles` (datasheet figures and H200-host measurements, each cited in the profile's "
                "`sources`). They are projections, not measurements. Regenerate with "
                "`python benchmarks/projected_table.py`.", ""]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
