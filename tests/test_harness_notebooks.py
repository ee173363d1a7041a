"""Figure notebooks (jupytext percent files are plain Python): with no results they explain what
to run instead of crashing; with (tiny) results they write their PNGs."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_harness_results import ENV, TINY  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.py"))


def _nb(path, results):
    env = {**ENV, "HYBRIDGEN_RESULTS": str(results), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_every_figure_is_covered():
    names = {p.stem for p in NOTEBOOKS}
    assert {"speedup", "throughput", "latency_breakdown", "accuracy", "needle", "scheduler_trace",
            "memory", "long_context"} <= names


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_without_results_explains_and_exits_cleanly(nb, tmp_path):
    p = _nb(nb, tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    said = p.stdout + p.stderr  # the explanation is a logged warning (stderr)
    assert any(cmd in said for cmd in ("+exp=", "python benchmarks/", "python experiments/"))  # the command
    # that makes its data
    assert not list((tmp_path / "figures").glob("*.png")) if (tmp_path / "figures").exists() else True


def test_cpu_scan_notebook_draws_the_benchmark_json(tmp_path):
    import shutil

    (tmp_path / "cpu_scan").mkdir()
    shutil.copy(ROOT / "results" / "cpu_scan" / "sketch_default_quick.json", tmp_path / "cpu_scan")
    p = _nb(ROOT / "notebooks" / "cpu_scan.py", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    out = tmp_path / "figures" / "cpu_scan.png"
    assert out.exists() and out.stat().st_size > 5000


def test_notebooks_draw_from_real_runs(tmp_path):
    for exp, methods in (("speedup", "full,hybridgen,h2o"), ("scheduler_trace", "hybridgen")):
        r = subprocess.run([sys.executable, "experiments/run.py", f"+exp={exp}", f"method={methods}",
                            f"results_dir={tmp_path}", *TINY, "workload.gen_len=9", "exp.repeats=1"],
                           cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
    for name, png in (("speedup", "speedup"), ("memory", "memory_per_tier"),
                      ("latency_breakdown", "latency_breakdown"), ("scheduler_trace", "scheduler_trace")):
        p = _nb(ROOT / "notebooks" / f"{name}.py", tmp_path)
        assert p.returncode == 0, (name, p.stderr[-2000:])
        out = tmp_path / "figures" / f"{png}.png"
        assert out.exists() and out.stat().st_size > 5000, name
