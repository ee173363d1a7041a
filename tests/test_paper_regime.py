"""+exp=paper_regime (issue 23): the in/out-of-regime label, the verdict from in-regime cells only,
both placements, host fit, the committed table and the README's generated verdict."""
import math
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests._inprocess import resolved_job  # noqa: E402
from experiments import paper_regime as pr  # noqa: E402
from hybridgen_harness import regime as rg  # noqa: E402

COMMITTED = ROOT / "results" / "paper_regime"
GPUS = ["a100", "h100", "h200"]


# -- the label ------------------------------------------------------------------------------------

def test_a_cell_just_above_the_budget_is_in_regime_and_just_below_is_not():
    budget = 100 * 2**30
    assert rg.regime_label(budget + 1, budget) == rg.IN_REGIME
    assert rg.regime_label(budget, budget) == rg.OUT_OF_REGIME  # fits exactly: the KV is on the GPU
    assert rg.regime_label(budget - 1, budget) == rg.OUT_OF_REGIME


def test_a_budget_that_is_not_positive_is_refused_in_one_line():
    from hybridgen.errors import ConfigError

    with pytest.raises(ConfigError, match="budget"):
        rg.regime_label(10, 0)


@pytest.mark.parametrize("hardware, batch, context, want", [
    ("a100", 8, 131072, rg.IN_REGIME),     # Llama-3.1-8B bf16 128K b8: 137 GB of KV against ~56 GB
    ("h200", 8, 131072, rg.IN_REGIME),     # ... against the H200's ~111 GB
    ("h200", 8, 32768, rg.OUT_OF_REGIME),  # 32K b8: 34 GB, fits every budget
    ("a100", 1, 32768, rg.OUT_OF_REGIME),
])
def test_the_regime_of_a_run_is_the_full_kv_against_the_auto_budget(hardware, batch, context, want):
    hw = yaml.safe_load((ROOT / "conf" / "hardware" / f"{hardware}.yaml").read_text())
    out = rg.regime_of_run(hw, {"name": "llama-3.1-8b", "dtype": "bfloat16"},
                           {"batch": batch, "prompt_len": context - 128, "gen_len": 128})
    assert out["regime"] == want
    kv = 32 * batch * context * (2 * 8 * 128 * 2 + 8)  # layers x rows x tokens x (K+V bf16 + mask)
    assert out["kv_bytes"] == kv and (kv > out["budget_bytes"]) == (want == rg.IN_REGIME)


# -- the verdict -----------------------------------------------------------------------------------

def _row(speedup, regime=rg.IN_REGIME, gpu="a100", baseline="flexgen", placement=pr.GPU_BUDGET, eb=10.0, eh=5.0,
         bound="PCIe", hbound="CPU"):
    return {"placement": placement, "gpu": gpu, "regime": regime, "baseline": baseline, "speedup": speedup,
            "baseline_error_pct": eb, "hybridgen_error_pct": eh, "bound": bound, "hybridgen_bound": hbound,
            "status": "ok" if speedup else "does not fit GPU (baseline)"}


def test_the_verdict_is_the_geometric_mean_of_the_in_regime_cells_only():
    rows = [_row(2.0), _row(8.0), _row(0.1, regime=rg.OUT_OF_REGIME), _row(0.2, regime=rg.OUT_OF_REGIME),
            _row(None), _row(50.0, gpu="h100"), _row(50.0, placement=pr.TEMPLATE), _row(50.0, baseline="h2o")]
    v = rg.verdict(rows, pr.GPU_BUDGET, "a100", "flexgen")
    assert v.speedup == pytest.approx(4.0)  # with the out-of-regime cells it would be ~0.79
    assert (v.cells, v.refused, v.refused_why) == (2, 1, "1x does not fit GPU (baseline)")
    assert v.low == pytest.approx(4.0 * 0.95 / 1.1) and v.high == pytest.approx(4.0 * 1.05 / 0.9)
    assert (v.bound, v.hybridgen_bound, v.outcome) == ("PCIe", "CPU", "reproduced")


@pytest.mark.parametrize("eb, eh", [(10.0, 5.0), (42.0, 70.0), (5.0, 60.0), (80.0, 20.0)])
def test_the_band_holds_every_measured_speedup_the_errors_allow(eb, eh):
    """From first principles: steps measured at predicted / (1 + e) for every error |e| <= E (the
    validation's e = (predicted - measured) / measured) give measured speedups that all lie in the
    band, and its two ends are reached (a band with the two sides' errors swapped fails here)."""
    pred_base, pred_hyb = 8.0, 2.0
    g = pred_base / pred_hyb
    low, high = rg.error_band(g, eb, eh)
    seen = []
    for e_b in (-eb / 100, 0.0, eb / 100):
        for e_h in (-eh / 100, 0.0, eh / 100):
            seen.append((pred_base / (1 + e_b)) / (pred_hyb / (1 + e_h)))
    assert all(low - 1e-12 <= s <= high + 1e-12 for s in seen)
    assert min(seen) == pytest.approx(low) and max(seen) == pytest.approx(high)


def test_the_band_is_open_above_when_the_baseline_may_be_priced_at_zero():
    assert rg.error_band(2.0, 100.0, 10.0) == (pytest.approx(2.0 * 0.9 / 2.0), math.inf)
    assert rg.error_band(2.0, 10.0, 150.0)[0] == 0.0  # e >= -100%: never a negative speedup


@pytest.mark.parametrize("speedups, eb, want", [
    ([0.5, 0.5], 10.0, "refuted"),
    ([1.45], 10.0, "inconclusive"),   # 1.45 x 0.95 / 1.1 < 1.41 < 1.45
    ([1.45], None, "not validated"),  # no band: a point estimate, however far from 1.41x, decides nothing
    ([0.2], None, "not validated"),
    ([], 10.0, "untested"),
])
def test_the_outcome_compares_the_band_with_the_papers_lower_bound(speedups, eb, want):
    v = rg.verdict([_row(s, eb=eb) for s in speedups], pr.GPU_BUDGET, "a100", "flexgen")
    assert v.outcome == want
    if eb is None and speedups:
        assert v.low is None and "not validated in 1 of 1 cells" in rg.band_text(v)


def test_one_unvalidated_cell_leaves_the_verdict_without_a_band():
    rows = [_row(5.0), _row(6.0), _row(0.9, eb=None)]
    v = rg.verdict(rows, pr.GPU_BUDGET, "a100", "flexgen")
    assert (v.cells, v.unvalidated, v.low, v.outcome) == (3, 1, None, rg.NOT_VALIDATED)
    assert "not validated in 1 of 3 cells" in rg.band_text(v)


# -- the cells: placements, host fit ---------------------------------------------------------------

def _point(preset, placement=pr.GPU_BUDGET, step=1.0, fits=True, fits_host=True, hardware="a100"):
    return {"placement": placement, "hardware": hardware, "gpu": hardware.removesuffix("-dram"), "cxl": True,
            "case": "llama-3.1-8b 128K b8", "preset": preset, "model": "llama-3.1-8b", "batch": 8,
            "prompt": 130944, "gen": 128, "kv_bytes": 137e9, "budget_bytes": 56e9, "regime": rg.IN_REGIME,
            "step_s": step, "fits": fits, "fits_host": fits_host, "bound": "PCIe", "error_pct": 8.0, "cost": "x",
            "params": "{}", "host_dram_bytes": None, "host_cxl_bytes": None}


def test_a_baseline_over_host_memory_is_shown_so_and_has_no_speedup():
    pts = [_point("hybridgen", step=0.5), _point("flexgen", step=2.0, fits_host=False), _point("infinigen", step=1.0)]
    cells = {c["baseline"]: c for c in pr.cells(pts) if c["placement"] == pr.GPU_BUDGET}
    assert cells["flexgen"]["speedup"] is None and cells["flexgen"]["status"] == "does not fit host memory (baseline)"
    assert cells["infinigen"]["speedup"] == pytest.approx(2.0) and cells["infinigen"]["status"] == "ok"
    assert "does not fit host memory" in pr.cell_text(cells["flexgen"])


def test_the_template_placement_takes_every_kv_on_the_host_and_full_cannot_run():
    pts = [_point("hybridgen", step=1.0), _point("hybridgen", pr.TEMPLATE, step=2.0), _point("h2o", step=0.1),
           _point("h2o-offload", step=8.0), _point("flexgen", pr.TEMPLATE, step=4.0), _point("flexgen", step=3.0),
           _point("full", fits=False, step=None)]
    tpl = {c["baseline"]: c for c in pr.cells(pts) if c["placement"] == pr.TEMPLATE}
    assert tpl["h2o"]["run_preset"] == "h2o-offload" and tpl["h2o"]["speedup"] == pytest.approx(4.0)
    assert tpl["flexgen"]["speedup"] == pytest.approx(2.0)  # both host-only: 4 / 2, not the budget runs' 3 / 1
    assert tpl["full"]["status"] == pr.CANNOT_RUN and tpl["full"]["speedup"] is None
    fair = {c["baseline"]: c for c in pr.cells(pts) if c["placement"] == pr.GPU_BUDGET}
    assert fair["h2o"]["speedup"] == pytest.approx(0.1) and fair["flexgen"]["speedup"] == pytest.approx(3.0)
    assert fair["full"]["status"] == "does not fit GPU (baseline)"
    refused = pr.cells([_point("hybridgen"), {**_point("infinigen", step=None, fits=False), "status": "does not fit",
                                              "reason": "partial keys do not fit"}])
    inf = next(c for c in refused if (c["placement"], c["baseline"]) == (pr.GPU_BUDGET, "infinigen"))
    assert inf["status"] == "placement refused (baseline)" and inf["reason"] == "partial keys do not fit"


def test_a_projection_records_the_host_fit_of_the_prediction(monkeypatch):
    """The prediction's fits_host / host_bytes (the host-capacity model) reach the run's record."""
    import dataclasses

    import hybridgen.perf as perf
    from hybridgen.eval.projection import project

    real = perf.predict_step

    @dataclasses.dataclass(frozen=True)
    class Over:  # a prediction that does not fit the host (stub: the capacity model is priced elsewhere)
        base: object
        fits_host: bool = False
        host_bytes: dict = dataclasses.field(default_factory=lambda: {"dram": 137e9, "cxl": 413e9})

        def __getattr__(self, name):
            return getattr(self.base, name)

    monkeypatch.setattr(perf, "predict_step", lambda *a, **k: Over(real(*a, **k)))
    out = project("flexgen", {}, "llama-3.1-8b", 32, 130944, 128, "bfloat16", "h200-host")
    assert out["fits_host"] is False and out["host_bytes"] == {"dram": 137e9, "cxl": 413e9}
    monkeypatch.setattr(perf, "predict_step", real)
    plain = project("flexgen", {}, "llama-3.1-8b", 1, 1024, 32, "bfloat16", "h200-host")
    assert plain["fits_host"] is getattr(real(*_args()), "fits_host", True)


def _args():
    from hybridgen.perf import Workload

    return "flexgen", "llama-3.1-8b", Workload(batch=1, context=1040, dtype="bf16"), "h200-host"


# -- the experiment and the committed results ------------------------------------------------------

def test_cfg_job_resolves():
    cfg = resolved_job("paper_regime")
    assert cfg["exp"]["name"] == "paper_regime" and cfg["exp"]["kind"] == "project"


def test_the_sweep_has_hybridgens_default_and_every_baseline_on_every_gpu_with_and_without_cxl():
    conf = yaml.safe_load((ROOT / "conf" / "exp" / "paper_regime.yaml").read_text())
    params = conf["hydra"]["sweeper"]["params"]
    methods = params["method"].split(",")
    assert "hybridgen" in methods and "full" in methods
    assert set(pr.VERDICT_BASELINES) <= set(methods)
    assert params["hardware"].split(",") == [h for g in GPUS for h in (g, f"{g}-dram")]
    for g in GPUS:
        dram = yaml.safe_load((ROOT / "conf" / "hardware" / f"{g}-dram.yaml").read_text())
        assert dram["cxl_capacity"] == 0 and not dram["profile"].endswith("-cxl")


@pytest.mark.skipif(not (COMMITTED / "table.csv").is_file(), reason="no committed results/paper_regime/")
def test_the_committed_table_has_in_regime_cells_on_every_gpu_for_every_baseline():
    rows = pr.read_table(COMMITTED / "table.csv")
    assert {r["regime"] for r in rows} == {rg.IN_REGIME, rg.OUT_OF_REGIME}
    for placement in pr.PLACEMENTS:
        for gpu in GPUS:
            for base in pr.VERDICT_BASELINES:
                inside = [r for r in rows if (r["placement"], r["gpu"], r["baseline"], r["regime"])
                          == (placement, gpu, base, rg.IN_REGIME)]
                assert inside, (placement, gpu, base)
    for r in rows:  # every cell labelled, and its label is the KV against the budget
        assert (r["regime"] == rg.IN_REGIME) == (r["kv_gb"] > r["gpu_kv_budget_gb"])
        assert r["regime"] in pr.cell_text(r)
        assert r["speedup"] is None or math.isclose(r["speedup"], r["baseline_step_ms"] / r["hybridgen_step_ms"],
                                                    rel_tol=1e-9)


@pytest.mark.skipif(not (COMMITTED / "table.csv").is_file(), reason="no committed results/paper_regime/")
def test_the_readme_verdict_is_what_the_generator_prints_from_the_committed_table():
    verdict = pr.verdict_markdown(pr.read_table(COMMITTED / "table.csv"))
    readme = (ROOT / "README.md").read_text()
    assert readme.count(pr.BEGIN) == 1 and readme.count(pr.END) == 1
    assert readme.split(pr.BEGIN, 1)[1].split(pr.END, 1)[0] == "\n" + verdict
    assert (COMMITTED / "README.md").read_text().endswith(verdict)


def test_splice_replaces_only_the_block_between_the_markers():
    text = f"a\n{pr.BEGIN}\nold\n{pr.END}\nb\n"
    assert pr.splice(text, "new\n", pr.BEGIN, pr.END) == f"a\n{pr.BEGIN}\nnew\n{pr.END}\nb\n"
    from hybridgen.errors import ConfigError

    with pytest.raises(ConfigError, match="markers"):
        pr.splice("no markers", "x", pr.BEGIN, pr.END)
