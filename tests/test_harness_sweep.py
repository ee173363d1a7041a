"""Sweeps are Hydra's own: its BasicSweeper expands them (glob, range, lists, the experiment's
``hydra.sweeper.params``), its launcher runs them, ``--config-dir`` adds the user's config files,
and experiments/preflight.py validates every point first. The jobs of one process share the
loaded model and the fidelity reference."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import preflight  # noqa: E402
from hybridgen_harness import results  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402
from tests.test_harness_results import ENV  # noqa: E402

TINY = ["model=tiny-random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=12",
        "workload.gen_len=3", "exp.warmup=false", "progress=false"]


def _methods(points):
    return [p.cfg.method.name for p in points]


def _presets(pattern):
    """The conf/method presets a glob pattern names (what Hydra's glob() must expand to)."""
    from fnmatch import fnmatch

    return sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml") if fnmatch(p.stem, pattern))


def test_glob_range_and_lists_expand_through_hydras_sweeper():
    h2 = _presets("h2*")
    assert "h2o" in h2 and "full" not in h2
    assert [p.overrides for p in preflight.resolve_points(["method=glob(h2*)"])] == [[f"method={m}"] for m in h2]
    assert _methods(preflight.resolve_points(["method=glob([full,h2*])"])) == ["full"] + ["h2o"] * len(h2)
    pts = preflight.resolve_points(["method=h2o", "workload.batch=range(1,4)", "++method.params.budget=0.1,0.3"])
    assert sorted((p.cfg.workload.batch, p.cfg.method.params.budget) for p in pts) == [
        (b, v) for b in (1, 2, 3) for v in (0.1, 0.3)]


def test_the_command_line_replaces_the_experiments_sweep_of_a_key():
    assert _methods(preflight.resolve_points(["+exp=quickstart"])) == ["full", "hybrid-exact", "hybridgen"]
    pts = preflight.resolve_points(["+exp=quickstart", "method=glob(h*,exclude=hybrid*)"])
    assert [p.overrides[0] for p in pts] == [f"method={m}" for m in _presets("h*") if not m.startswith("hybrid")]
    # budget_sweep sweeps ++method.params.budget; a method.params.budget on the command line replaces it
    from experiments.validate import method_param_overrides

    pts = preflight.resolve_points(method_param_overrides(["+exp=budget_sweep", "method=h2o",
                                                           "method.params.budget=0.3"]))
    assert [(p.cfg.method.name, p.cfg.method.params.budget) for p in pts] == [("h2o", 0.3)]


def test_a_search_path_adds_a_users_config_group_option(tmp_path):
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "myhw.yaml").write_text("name: myhw\ngpu_capacity: 1MiB\n")
    (pt,) = preflight.resolve_points([f"hydra.searchpath=[file://{tmp_path}]", "hardware=myhw"])
    assert pt.cfg.hardware.name == "myhw" and pt.cfg.hardware.gpu_capacity == "1MiB"
    with pytest.raises(ConfigError, match="unknown hardware 'myhw'; choose one of: a100, a100-dram, cpu-emulated"):
        preflight.resolve_points(["hardware=myhw"])


def test_a_bad_point_fails_in_one_line_naming_it_before_anything_runs(tmp_path):
    from tests.test_reliability_bad_inputs import _in_process

    from experiments import run

    rc, out, err = _in_process(lambda: run.main(["method=h2o,full", "method.params.budget=0.3",
                                                 f"results_dir={tmp_path}/r", *TINY]))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: method 'full' has no parameter 'budget'") and "at sweep point method=full" in lines[0]
    assert not (tmp_path / "r").exists() and out == ""


def test_config_dir_glob_and_one_model_load_in_a_real_multirun(tmp_path):
    """The issue's three: ``--config-dir`` with the user's hardware file in a real run,
    ``method=glob(...)``, and two methods in one ``-m`` loading the model once."""
    conf = tmp_path / "myconf"
    (conf / "hardware").mkdir(parents=True)
    (conf / "hardware" / "myhw.yaml").write_text("name: myhw\ndescription: my machine\ngpu: none\n"
                                                  "dram_capacity: 64MiB\nthreads: 1\n")
    args = ["-m", "--config-dir", str(conf), "hardware=myhw", "method=glob([full,h2*])", "exp.fidelity=true",
            f"results_dir={tmp_path}/r", *TINY]
    p = subprocess.run([sys.executable, "experiments/run.py", *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    presets = ["full", *_presets("h2*")]
    runs = results.ResultsStore(tmp_path / "r", "adhoc").finished_runs()
    metrics = [json.loads((r / "metrics.json").read_text()) for r in runs]
    assert len(runs) == len(presets) >= 2 and {"full", "h2o"} <= {m["method"]["name"] for m in metrics}
    assert all(m["hardware"]["name"] == "myhw" and m["hardware"]["dram_capacity"] == "64MiB" for m in metrics)
    assert all(m["fidelity"]["available"] is True for m in metrics)
    assert p.stderr.count("loaded Engine(") == 1, p.stderr          # one model load for every job
    assert "reference generation" not in p.stderr                   # full's own run is h2o's reference
    assert f"adhoc: {len(presets)} point(s)" in p.stderr
    assert not (tmp_path / "r" / "adhoc" / ".multirun").exists()     # no empty Hydra bookkeeping left


UNION_EXP = """# @package _global_
defaults:
  - override /hydra/sweeper: union
exp:
  name: u
hydra:
  sweeper:
    params:
      method: full,h2o
    parts:
      - workload.batch: 1,2
      - workload.batch: 4
        seed: 1
"""


def test_the_union_sweeper_runs_one_product_per_part(tmp_path):
    from tests.test_reliability_bad_inputs import _in_process

    from experiments import run

    (tmp_path / "exp").mkdir()
    (tmp_path / "exp" / "u.yaml").write_text(UNION_EXP)
    search = f"hydra.searchpath=[file://{tmp_path}]"
    pts = preflight.resolve_points([search, "+exp=u"])
    assert sorted((p.cfg.method.name, p.cfg.workload.batch, p.cfg.seed) for p in pts) == [
        ("full", 1, 0), ("full", 2, 0), ("full", 4, 1), ("h2o", 1, 0), ("h2o", 2, 0), ("h2o", 4, 1)]
    assert len(preflight.resolve_points([search, "+exp=u", "method=h2o"])) == 3   # the command line wins
    # the sweeper itself (not only the preflight) runs exactly those jobs
    rc, out, err = _in_process(lambda: run.main([search, "+exp=u", "exp.kind=project", "hardware=h100",
                                                 "model=opt-125m", f"results_dir={tmp_path}/r"]))
    assert rc == 0, err[-2000:]
    assert "u: 6 point(s)" in err and len(results.ResultsStore(tmp_path / "r", "u").finished_runs()) == 6
