"""Every paper figure, drawn from the committed results: its labels, legend entries and marks
(matplotlib objects, not pixels): provenance badges, readable log ticks, "does not fit", error
bars, HybridGen present, no clipped bar, no heatmap of single samples."""
import os
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen_harness import plotdata  # noqa: E402
from hybridgen_harness.figures import accuracy, marks, memory, speed  # noqa: E402


@pytest.fixture(autouse=True)
def committed_results(monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_RESULTS", str(ROOT / "results"))
    yield
    plt.close("all")


def tick_texts(axis):
    axis.figure.canvas.draw()
    return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]


def legend_texts(legend):
    return [t.get_text() for t in legend.get_texts()]


def hatched(ax):
    return [p for p in ax.patches if p.get_hatch() == marks.DOES_NOT_FIT_HATCH]


def test_marks_read_as_a_reader_expects():
    fig, ax = plt.subplots()
    ax.set_yscale("log")
    ax.set_ylim(0.3, 30)
    marks.times_ticks(ax.yaxis)
    labels = tick_texts(ax.yaxis)
    assert "1x" in labels and "2x" in labels and "10x" in labels
    assert not any("10^" in t or "times" in t for t in labels)  # not matplotlib's default "$\\mathdefault{10^{0}}$"
    marks.badge(ax, "projected")
    assert marks.provenance_of(ax) == "projected"
    with pytest.raises(ValueError, match="provenance 'guessed'"):
        marks.badge(ax, "guessed")
    assert marks.wrap("a " * 50, 20).count("\n") >= 4 and "a " * 3 in marks.wrap("a " * 50, 20)


def test_paper_speedup_marks_projected_and_emulated_panels_apart():
    from experiments.paper_speedup_figure import BAND_LABEL, ERROR_LABEL, draw, read_table

    rows = read_table(ROOT / "results" / "paper_speedup" / "table.csv")
    fig = draw(rows)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.has_data()]
    kinds = [marks.provenance_of(ax) for ax in panels]
    assert kinds.count("projected") == 5 and kinds.count("emulated") == 1  # every panel says which it is
    assert "5 PROJECTED panels" in fig._suptitle.get_text() and "1 EMULATED panel" in fig._suptitle.get_text()
    (legend,) = fig.legends
    entries = legend_texts(legend)
    for entry in (BAND_LABEL, "A100 80GB", "H100 80GB", "RTX 5090 32GB", "H200 141GB", "this CPU (emulated)",
                  marks.DOES_NOT_FIT, ERROR_LABEL):
        assert entry in entries
    template, emulated = panels[0], panels[-1]
    # RTX 5090 at the template: five baselines do not fit (table.csv) -> five hatched bars
    misfits = [r for r in rows if r["case"] == "template" and r["gpu"] == "rtx5090" and r["speedup"] is None
               and r["baseline"] != "full"]
    assert len(hatched(template)) == len(misfits) >= 1
    assert not hatched(emulated)  # the emulated bars are plain: hatching means "does not fit" only
    assert any(isinstance(c, ErrorbarContainer) for c in template.containers)
    for ax in panels:
        ticks = tick_texts(ax.yaxis)
        assert "1x" in ticks and not any("10^" in t for t in ticks)
        assert "…" not in ax.get_title()
    assert "32 new tokens" in emulated.get_title() and "batch 20" in template.get_title().replace("\n", " ")


def test_emulated_speedup_has_repeat_whiskers_and_its_badge():
    fig = speed.speedup(plotdata.runs("speedup"))
    left, right = fig.axes[:2]
    assert marks.provenance_of(left) == marks.provenance_of(right) == "emulated"
    assert any(isinstance(c, ErrorbarContainer) for c in left.containers)
    assert legend_texts(left.get_legend()) == ["range over 2 repeats"]
    assert "hybridgen" in tick_texts(left.yaxis) and "hybridgen" not in tick_texts(right.yaxis)
    assert "HybridGen speedup" in right.get_xlabel()


def test_projected_latency_draws_does_not_fit_and_plain_ticks():
    proj = plotdata.runs("speedup_projected")
    fig = speed.speedup_projected(proj)
    panels = {ax.get_title(): ax for ax in fig.axes}
    assert all(marks.provenance_of(ax) == "projected" for ax in panels.values())
    misfit = proj[~proj["projected.fits_gpu"].astype(bool)]
    assert len(misfit) and all(len(hatched(panels[p])) == (misfit["projected.profile"] == p).sum() for p in panels)
    assert marks.DOES_NOT_FIT in legend_texts(fig.legends[0])
    for ax in panels.values():
        assert not any("10^" in t for t in tick_texts(ax.xaxis))


def test_memory_per_tier_clips_no_bar():
    df = plotdata.runs("speedup")
    fig = memory.memory_per_tier(df)
    kv = fig.axes[0]
    tops = [p.get_y() + p.get_height() for p in kv.patches]
    totals = df[[f"memory.kv_peak_bytes_by_tier.{t}" for t in ("gpu", "dram", "cxl")]].fillna(0).sum(axis=1) / 2**20
    assert max(tops) == pytest.approx(totals.max())  # InfiniGen's stack, the tallest
    assert kv.get_ylim()[1] > 1.2 * max(tops)  # headroom: the bar and its total are inside the axes
    assert legend_texts(kv.get_legend()) == ["gpu", "dram", "cxl"]
    assert f"{totals.max():.0f}" in [t.get_text() for t in kv.texts]
    assert marks.provenance_of(fig.axes[1]) == "measured"


def test_accuracy_vs_budget_has_hybridgen_and_an_honest_title():
    df = plotdata.runs("budget_sweep")
    fig = accuracy.accuracy_vs_budget(df)
    top1, kl = fig.axes[:2]
    assert legend_texts(kl.get_legend())[0] == "hybridgen"
    assert set(df["method.name"]) == set(legend_texts(kl.get_legend()))
    title = fig._suptitle.get_text().replace("\n", " ")
    assert title.startswith("Fidelity to full vs KV budget") and "not task accuracy" in title
    assert "ONE 1024-token" in title and "32 teacher-forced positions" in title
    assert "Wilson" in top1.get_ylabel()
    assert sum(isinstance(c, ErrorbarContainer) for c in top1.containers) == df["method.name"].nunique()
    # HybridGen's x is its attended share g + t(1 - g): 0.1 + 0.1 * 0.9 = 0.19 for the 10% + 10% run
    (hg_line,) = [ln for ln in kl.lines if ln.get_label() == "hybridgen"]
    assert 0.19 in [round(x, 4) for x in hg_line.get_xdata()]


def test_accuracy_vs_memory_places_every_method_by_its_gpu_bytes():
    df = plotdata.runs("budget_sweep")
    fig = accuracy.accuracy_vs_memory(df, full_gpu_bytes=48e6)
    (ax,) = fig.axes
    entries = legend_texts(ax.get_legend())
    assert "hybridgen" in entries and "full (all KV on gpu)" in entries
    assert "gpu tier" in ax.get_xlabel() and ax.get_ylabel() == "top-1 agreement with full"
    (hg,) = [ln for ln in ax.lines if ln.get_label() == "hybridgen"]
    hg_rows = df[df["method.name"] == "hybridgen"]
    assert sorted(hg.get_xdata()) == pytest.approx(sorted(hg_rows["memory.kv_peak_bytes_by_tier.gpu"] / 2**20))
    assert not any("10^" in t for t in tick_texts(ax.xaxis))


def test_needle_shows_counts_not_a_single_sample_heatmap():
    cells = {}
    for d in plotdata.run_dirs("accuracy"):
        m = plotdata.load_json(d / "metrics.json")
        if m.get("needle"):
            cells[m["method"]["name"]] = m["needle"]
    fig = accuracy.needle_counts(cells, "emulated")
    assert not any(ax.images for ax in fig.axes)  # no heatmap
    counts, per_length = fig.axes[:2]
    texts = [t.get_text() for t in counts.texts]
    assert "2 / 9" in texts  # full finds 2 of its 9 needles
    assert "ONE needle per cell" in fig._suptitle.get_text().replace("\n", " ")
    assert legend_texts(per_length.get_legend()) == ["2K tokens (of 3)", "4K tokens (of 3)", "8K tokens (of 3)"]
    assert "hybridgen" in tick_texts(counts.yaxis)
