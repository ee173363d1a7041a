"""A method registered only by an entry point (no conf/method preset) is a first-class option of
the ``method`` group: ``method=NAME`` runs it, ``'method=glob(*)'`` sweeps it and ``--help``
lists it (experiments/schema.py, ``register_method_options``)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_methods_registry import make_outside_package

ROOT = Path(__file__).resolve().parents[1]
NAME = "last-tokens"
TINY = ["model=tiny-random", "workload=random", "workload.prompt_len=24", "workload.gen_len=3", "progress=false"]


@pytest.fixture(scope="module")
def outside_env(tmp_path_factory):
    """An environment whose PYTHONPATH holds a package declaring NAME by its entry point only."""
    root = make_outside_package(tmp_path_factory.mktemp("outside"), NAME)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}


def _python(code: str, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=timeout)


def test_method_equals_name_runs_an_entry_point_only_method(outside_env, tmp_path):
    assert not (ROOT / "conf" / "method" / f"{NAME}.yaml").exists()
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), f"method={NAME}",
                          "method.params.keep=64", *TINY, f"results_dir={tmp_path}"],
                         capture_output=True, text=True, cwd=ROOT, env=outside_env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = [d for d in (tmp_path / "adhoc").iterdir() if (d / "DONE").exists()]
    assert len(runs) == 1 and f"__{NAME}-keep=64__" in runs[0].name, runs
    metrics = json.loads((runs[0] / "metrics.json").read_text())
    assert metrics["method"] == {"name": NAME, "params": {"keep": 64}}


def test_glob_sweeps_and_help_list_it_and_a_preset_file_still_wins(outside_env, tmp_path):
    presets = sorted(p.stem for p in (ROOT / "conf" / "method").glob("*.yaml"))
    user = tmp_path / "conf" / "method"
    user.mkdir(parents=True)
    (user / f"{NAME}.yaml").write_text(f"name: {NAME}\nparams:\n  keep: 8\n")
    out = _python(f"""
        import json, warnings
        from experiments import preflight
        tiny = {TINY!r} + ["results_dir={tmp_path / 'res'}"]
        every = preflight.resolve_points(["method=glob(*)"] + tiny)
        only = preflight.resolve_points(["method=glob(last-*)"] + tiny)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Hydra: the file is validated against the stored option
            mine = preflight.resolve_points(["method={NAME}", "hydra.searchpath=[file://{tmp_path / 'conf'}]"] + tiny)
        print(json.dumps({{"every": [p.overrides for p in every], "every_names": [p.cfg.method.name for p in every],
                          "only": [p.cfg.method.name for p in only],
                          "mine": [dict(p.cfg.method.params) for p in mine]}}))
        """, outside_env)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    swept = sorted(o.split("=", 1)[1] for pt in got["every"] for o in pt if o.startswith("method="))
    assert swept == sorted(presets + [NAME]), swept          # every preset once, and the outside method
    assert NAME in got["every_names"] and got["only"] == [NAME]
    assert got["mine"] == [{"keep": 8}]                      # a user's preset of that name wins over the option

    helped = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--help"], capture_output=True,
                            text=True, cwd=ROOT, env=outside_env, timeout=300)
    assert helped.returncode == 0, helped.stderr[-2000:]
    line = next(ln for ln in helped.stdout.splitlines() if ln.startswith("method:"))
    assert NAME in [w.strip() for w in line.split(":", 1)[1].split(",")] and "h2o" in line


def test_without_the_package_the_name_is_refused_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), f"method={NAME}", *TINY,
                          f"results_dir={tmp_path}"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and f"unknown method '{NAME}'; choose one of: " in err[0] and "h2o" in err[0], err
