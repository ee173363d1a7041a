"""+exp=paper_speedup (issue 11): its sweep, its `--cfg job`, and the table it is reported in.

The table builder (experiments/paper_speedup.py) is checked on hand-made run records (the speedup
is the baseline's step over HybridGen's, OOM and labels are shown), and the committed table
(results/paper_speedup/) on its shape: a row per baseline, a column per GPU, every cell labelled.
"""
import csv
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests._inprocess import resolved_job  # noqa: E402
from experiments import paper_speedup as ps  # noqa: E402

GPUS = ["a100", "h100", "rtx5090", "h200"]
# the "at least" list of baselines, as conf/method presets
REQUIRED = ["flexgen", "flexgen-int4", "infinigen", "h2o-offload", "snapkv", "streamingllm", "quest", "uvm"]
# issue 14's peers, as presets: in every projected case, and (but for the offloaded twin) emulated with fidelity
PEERS = ["pyramidkv", "pyramidkv-offload", "shadowkv", "shadowkv-b20", "magicpig"]
LABELS = ("measured", "emulated", "projected")
COMMITTED = ROOT / "results" / "paper_speedup"


def _sweep_methods():
    conf = yaml.safe_load((ROOT / "conf" / "exp" / "paper_speedup.yaml").read_text())
    return conf["hydra"]["sweeper"]["params"]["method"].split(","), conf["hydra"]["sweeper"]["parts"]


def test_the_experiment_sweeps_every_required_baseline_on_every_gpu():
    methods, parts = _sweep_methods()
    # the paper comparison runs HybridGen's default (issue 22: the scheduler owns the split), not a fixed top-k
    assert "hybridgen" in methods and "hybridgen-b20" not in methods and "full" in methods
    assert set(REQUIRED) <= set(methods), sorted(set(REQUIRED) - set(methods))
    projected = [p for p in parts if "exp.kind" not in p]
    assert projected and all(p["hardware"].split(",") == GPUS for p in projected)
    emulated = [p for p in parts if p.get("exp.kind") == "generate"]
    assert len(emulated) == 1 and emulated[0]["hardware"] == "cpu-emulated" and emulated[0]["exp.fidelity"] is True


def test_the_peers_are_swept_like_the_baselines():
    methods, parts = _sweep_methods()
    assert set(PEERS) <= set(methods), sorted(set(PEERS) - set(methods))
    emulated = [p for p in parts if p.get("exp.kind") == "generate"][0]["method"].split(",")
    assert set(PEERS) - {"pyramidkv-offload"} <= set(emulated)  # its fidelity is pyramidkv's (same tokens)
    for preset in PEERS:
        assert (ROOT / "conf" / "method" / f"{preset}.yaml").is_file(), preset
        assert preset in ps.LABELS, preset


@pytest.mark.slow
def test_the_experiment_resolves_to_the_union_of_its_parts(prepared_cache):
    from experiments import preflight

    points = preflight.resolve_points(["+exp=paper_speedup"])
    methods, _ = _sweep_methods()
    proj = [cfg for _, cfg in points if cfg.exp.kind == "project"]
    gen = [cfg for _, cfg in points if cfg.exp.kind == "generate"]
    cases = {(c.hardware.name, c.model.name, c.workload.batch, c.workload.prompt_len) for c in proj}
    want = {(g, "opt-13b", 20, 1920) for g in GPUS} | {(g, "llama-3.1-8b", b, 32640) for g in GPUS for b in (1, 2, 4, 8)}
    assert cases == want
    assert len(proj) == len(want) * len(methods)
    # emulated: every runnable method once, on this machine, real SmolLM2, with fidelity to full
    assert gen and all(c.hardware.name == "cpu-emulated" and c.model.name == "smollm2-135m" and c.exp.fidelity
                       for c in gen)
    assert len(gen) == len({c.method.name + str(dict(c.method.params)) for c in gen})


def test_cfg_job_resolves():
    cfg = resolved_job("paper_speedup")
    assert cfg["exp"]["name"] == "paper_speedup" and cfg["exp"]["kind"] == "project"
    assert cfg["model"]["name"] == "opt-13b" and cfg["workload"]["batch"] == 20


def _metrics(preset, gpu, step_s, kind="project", fits=True, cost="flexgen-stream", top1=None, batch=20):
    name = {"hybridgen-b20": "hybridgen", "flexgen-int4": "flexgen"}.get(preset, preset)
    m = {"run": {"name": f"{preset}-{gpu}", "kind": kind, "overrides": ["+exp=paper_speedup", f"method={preset}"],
                 "realized": {"device": "projected" if kind == "project" else "cpu-emulated"}},
         "method": {"name": name, "params": {}}, "hardware": {"name": gpu},
         "model": {"name": "opt-13b" if kind == "project" else "smollm2-135m", "dtype": "float16"},
         "workload": {"batch": batch, "prompt_len": 1920, "gen_len": 128}}
    if kind == "project":
        m["projected"] = {"status": "ok", "step_s": step_s, "fits_gpu": fits, "perf_cost": cost,
                          "cpu_branch_s": 0.0, "gpu_branch_s": 0.1 * step_s, "transfer_s": step_s}
    else:
        m["latency"] = {"decode_ms_per_token": 1e3 * step_s}
        m["fidelity"] = {"top1_agreement": top1, "mean_kl": 0.01}
    return m


def test_speedup_cells_are_ratios_with_labels_oom_and_fidelity():
    validation = {"rows": [{"name": "GQA L=8192 90% host: FlexGen stream", "error_pct": -1.8, "fitted": ""},
                           {"name": "GQA L=32768 90% host: FlexGen stream", "error_pct": 12.0, "fitted": ""},
                           {"name": "x FlexGen stream", "error_pct": 90.0, "fitted": "link.h2d"},
                           {"name": "GQA L=8192 90% host: HybridGen step", "error_pct": -20.0, "fitted": ""}]}
    runs = [_metrics("hybridgen", "a100", 0.100, cost="hybridgen"), _metrics("flexgen", "a100", 0.250),
            _metrics("hybridgen-b20", "a100", 0.050, cost="hybridgen"),  # a stale fixed-top-k run: not the row
            _metrics("h2o", "a100", 0.050, fits=False, cost="h2o"),
            _metrics("hybridgen", "h100", 0.200, cost="hybridgen"), _metrics("flexgen", "h100", 0.100),
            _metrics("hybridgen", "cpu-emulated", 0.080, kind="generate", top1=0.97),
            _metrics("flexgen", "cpu-emulated", 0.120, kind="generate", top1=1.0)]
    rows = ps.speedups([ps.point(m, validation) for m in runs])
    by = {(r["case"], r["gpu"], r["baseline"]): r for r in rows}
    assert by[("template", "a100", "flexgen")]["speedup"] == pytest.approx(2.5)
    assert not any(r["baseline"] == "hybridgen-b20" for r in rows)  # the stale preset is no baseline row
    assert by[("template", "h100", "flexgen")]["speedup"] == pytest.approx(0.5)
    assert by[("template", "a100", "flexgen")]["model_error_pct"] == pytest.approx(12.0)  # fitted rows left out
    assert by[("template", "a100", "flexgen")]["bound"] == "PCIe"
    assert by[("template", "a100", "h2o")]["speedup"] is None
    assert by[("emulated", "cpu-emulated", "flexgen")]["speedup"] == pytest.approx(1.5)
    assert by[("template", "a100", "flexgen")]["top1"] == 1.0  # fidelity from the emulated run of the same preset
    # the band from BOTH sides' errors: HybridGen's 20%, FlexGen's 12% (2.5 x 0.8 / 1.12, 2.5 x 1.2 / 0.88)
    assert by[("template", "a100", "flexgen")]["hybridgen_error_pct"] == pytest.approx(20.0)
    assert ps.cell(by[("template", "a100", "flexgen")]) == "2.50x projected [1.79-3.41] (PCIe)"
    assert ps.cell({**by[("template", "a100", "flexgen")], "hybridgen_error_pct": None}) == \
        "2.50x projected (not validated) (PCIe)"
    assert ps.cell(by[("template", "a100", "h2o")]).startswith("does not fit (baseline) projected")
    assert ps.cell(by[("emulated", "cpu-emulated", "flexgen")]) == "1.50x emulated"
    md = ps.markdown(rows)
    assert "| baseline | A100 80GB | H100 80GB | top-1 vs full | KL vs full |" in md
    assert "| baseline | this CPU (emulated) |" in md


def _committed_rows():
    path = COMMITTED / "table.csv"
    if not path.is_file():
        pytest.skip("no committed results/paper_speedup/table.csv yet (python experiments/run.py "
                    "+exp=paper_speedup results_dir=results; python experiments/paper_speedup.py --results-dir results)")
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_committed_table_has_a_row_per_baseline_and_a_labelled_cell_per_gpu():
    rows = _committed_rows()
    for case in ("template", "long-b1", "long-b8"):
        for base in REQUIRED:
            for gpu in GPUS:
                hit = [r for r in rows if (r["case"], r["baseline"], r["gpu"]) == (case, base, gpu)]
                assert len(hit) == 1, (case, base, gpu)
                assert hit[0]["label"] in LABELS
    md = (COMMITTED / "table.md").read_text()
    header = "| baseline | A100 80GB | H100 80GB | RTX 5090 32GB | H200 141GB | top-1 vs full | KL vs full |"
    assert header in md
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith(("| baseline", "| **HybridGen")):
            cells = line.strip("|").split("|")[1:-2]
            assert all(any(lab in c for lab in LABELS) or c.strip() == "-" for c in cells), line
    assert (COMMITTED / "speedup.png").stat().st_size > 10_000
    assert (COMMITTED / "provenance.json").is_file()


def test_committed_table_has_the_peers_rows():
    rows = _committed_rows()
    cases = ["template"] + [f"long-b{b}" for b in (1, 2, 4, 8)]
    for case in cases:
        for base in PEERS:
            for gpu in GPUS:
                hit = [r for r in rows if (r["case"], r["baseline"], r["gpu"]) == (case, base, gpu)]
                assert len(hit) == 1, (case, base, gpu)
                r = hit[0]
                assert r["label"] == "projected" and r["method"] == base.split("-")[0], r
                # priced by its own cost function (not "not modelled"), or placed out: does not fit
                assert r["speedup"] or r["baseline_fits"] == "False", r
                assert r["cost"].startswith(r["method"]) or r["baseline_fits"] == "False", r
    for base in PEERS:  # fidelity to full from the emulated run of the same code (the offloaded twin: pyramidkv's)
        hit = [r for r in rows if (r["case"], r["baseline"]) == ("emulated", base)]
        assert base == "pyramidkv-offload" or (len(hit) == 1 and hit[0]["label"] == "emulated" and hit[0]["top1"]), base
    md = (COMMITTED / "table.md").read_text()
    for base in PEERS:
        assert md.count(f"| {ps.LABELS[base]} |") == len(cases) + (base != "pyramidkv-offload"), base


def test_bands_take_the_largest_error_over_every_validation_run(tmp_path):
    """Two runs of the validation: a cost's error is the larger of its rows in both (one noisy
    run alone would narrow the band); a missing file is a one-line error, none is no band."""
    import json

    from hybridgen.errors import ConfigError

    def run(err_hg, err_full):
        return {"rows": [{"name": "x", "method": "hybridgen", "model_only_error_pct": err_hg},
                         {"name": "y GPU SDPA", "error_pct": err_full}]}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(run(-12.0, 3.0)))
    b.write_text(json.dumps(run(-30.0, -2.0)))
    both = ps.load_validation([str(a), str(b)])
    assert both["files"] == [str(a), str(b)] and len(both["rows"]) == 4  # (outside the repository: as given)
    assert ps.model_error("hybridgen", both) == pytest.approx(30.0)
    assert ps.model_error("full", both) == pytest.approx(3.0)
    assert ps.model_error("hybridgen", ps.load_validation([str(a)])) == pytest.approx(12.0)
    assert ps.load_validation([]) is None and ps.validation_label(None) == "no validation file"
    with pytest.raises(ConfigError, match="--validation: .*missing.json is not a file"):
        ps.load_validation([str(a), str(tmp_path / "missing.json")])
    assert any(f.replace("\\", "/").endswith("results/perfmodel/validation.json") for f in ps.validation_files())
