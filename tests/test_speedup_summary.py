"""The README's summary of the paper comparison is generated from its table (hybridgen_harness.speedup_summary)."""
from pathlib import Path

import pytest

from hybridgen_harness import speedup_summary as summary
from hybridgen_harness.result_tables import splice

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "results" / "paper_speedup" / "table.csv"


def _row(case, gpu, baseline, speedup, fits=True, hg_ms=10.0, batch=1, bound="GPU"):
    return {"case": case, "gpu": gpu, "baseline": baseline, "row": baseline.upper(), "speedup": speedup,
            "baseline_fits": fits, "hybridgen_fits": True, "hybridgen_step_ms": hg_ms, "hybridgen_bound": bound,
            "batch": batch, "top1": "0.9", "kl": "0.01", "hybridgen_top1": "0.95", "hybridgen_kl": "0.004",
            "model": "m", "prompt": "1024", "gen": "32"}


@pytest.fixture()
def rows():
    return [
        # h200: full fits everywhere -> out of regime
        _row("template", "h200", "full", 1.0), _row("template", "h200", "h2o", 0.5),
        _row("template", "h200", "flexgen", 1.1),
        # rtx5090 template: full does not fit -> in regime; h2o behind, flexgen ahead
        _row("template", "rtx5090", "full", None, fits=False, hg_ms=170, bound="PCIe"),
        _row("template", "rtx5090", "h2o", 0.6, hg_ms=170, bound="PCIe"),
        _row("template", "rtx5090", "flexgen", 3.0, hg_ms=170, bound="PCIe"),
        # rtx5090 32K: batch 1 out, batch 8 in; flexgen 0.8x there -> mixed over the in-regime cells
        _row("long-b1", "rtx5090", "full", 1.0, batch=1), _row("long-b1", "rtx5090", "h2o", 1.2, batch=1),
        _row("long-b1", "rtx5090", "flexgen", 2.0, batch=1),
        _row("long-b8", "rtx5090", "full", None, fits=False, batch=8, bound="PCIe"),
        _row("long-b8", "rtx5090", "h2o", 0.3, batch=8, bound="PCIe"),
        _row("long-b8", "rtx5090", "flexgen", 0.8, batch=8, bound="PCIe"),
    ]


def test_columns_split_by_the_regime_of_full(rows):
    titles = [t for t, _ in summary.groups(rows)]
    assert titles == ["H200 template (out)", "RTX 5090 template (IN)", "RTX 5090 32K b1 (out)", "RTX 5090 32K b8 (IN)"]
    table = [ln for ln in summary.readme_block(rows).splitlines() if ln.startswith("| ")]
    assert table[1].startswith("| **HybridGen step** (bound by) | 10 ms (GPU) | 170 ms (PCIe) |")
    assert "| H2O | 0.50x | 0.60x | 1.20x | 0.30x | 0.900 / 0.01 |" in table


def test_verdict_reads_the_in_regime_cells_only(rows):
    text = summary.verdict(rows)
    assert "(the KV fits the GPU's budget: H200 template, RTX 5090 32K b1) HybridGen's speedup over `full` is 1.00x" in text
    assert "bound by PCIe" in text and "ahead of none; behind H2O 0.30-0.60x" in text
    assert "either, cell by cell: FLEXGEN 0.80-3.00x" in text  # 3.0x on the template, 0.8x at b8: not "ahead"


def test_the_readme_holds_what_the_committed_table_gives():
    rows = summary.load_table(TABLE)
    readme = (ROOT / "README.md").read_text()
    assert f"{summary.README_BEGIN}\n{summary.readme_block(rows)}{summary.README_END}" in readme
    assert f"{summary.VERDICT_BEGIN}\n{summary.verdict(rows)}{summary.VERDICT_END}" in readme
    assert splice(readme, summary.verdict(rows), summary.VERDICT_BEGIN, summary.VERDICT_END) == readme
