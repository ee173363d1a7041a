"""Finished points are dropped before launch (experiments/skip_finished.py, the union sweeper):
a re-run of a finished sweep launches no job and says ``skip (done): <run dir>`` for each point,
a partly finished sweep launches only the missing points, ``force=true`` launches them all, and
the end-of-sweep table still lists every point of the sweep, in its order."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import preflight, runner  # noqa: E402
from experiments.skip_finished import launch_only_unfinished  # noqa: E402
from tests.test_harness_sweep import TINY  # noqa: E402
from tests._inprocess import run_main as _main  # noqa: E402

FAST = [*TINY, "exp.fidelity=false"]
STATUSES = ("done", "skipped", "failed", "missing")


@pytest.fixture
def launched(monkeypatch):
    """The points the launcher ran (runner.run_point is what every launched job calls)."""
    calls = []
    real = runner.run_point

    def counting(cfg, session, overrides=()):
        calls.append(cfg.method.name)
        return real(cfg, session, overrides)

    monkeypatch.setattr(runner, "run_point", counting)
    return calls


def _table(out):
    """(status, method) of each row of the end-of-sweep table, in order."""
    rows = [ln.split() for ln in out.split("generated text")[0].splitlines()]
    return [(r[0], r[1]) for r in rows if len(r) > 1 and r[0] in STATUSES]


def test_a_finished_sweep_launches_nothing_and_a_partial_one_only_the_missing_point(tmp_path, launched):
    args = ["method=full,streamingllm", f"results_dir={tmp_path}", *FAST]
    rc, out, err = _main(args)
    assert rc == 0, err[-2000:]
    assert launched == ["full", "streamingllm"]
    assert _table(out) == [("done", "full"), ("done", "streamingllm")]

    launched.clear()
    rc, out, err = _main(args)                                   # the same sweep again: 0 jobs
    assert rc == 0, err[-2000:]
    assert launched == []
    skips = [ln for ln in err.splitlines() if ln.startswith("skip (done): ")]
    assert len(skips) == 2 and all(str(tmp_path / "adhoc") in ln for ln in skips)
    assert "2 point(s) skipped (finished; force=true re-runs them), 0 to launch" in err
    assert "run: " not in err
    assert _table(out) == [("skipped", "full"), ("skipped", "streamingllm")]
    assert not (tmp_path / "adhoc" / ".multirun").exists()     # no bookkeeping left by the empty sweep

    launched.clear()                                           # one new point between two finished ones
    rc, out, err = _main(["method=full,h2o,streamingllm", f"results_dir={tmp_path}", *FAST])
    assert rc == 0, err[-2000:]
    assert launched == ["h2o"]
    assert "2 point(s) skipped (finished; force=true re-runs them), 1 to launch" in err
    assert "[1/1] method=h2o" in err                           # job numbers count the launched points
    assert _table(out) == [("skipped", "full"), ("done", "h2o"), ("skipped", "streamingllm")]

    launched.clear()
    rc, out, err = _main([*args, "force=true"])                # force=true launches every point
    assert rc == 0, err[-2000:]
    assert launched == ["full", "streamingllm"]
    assert "skip (done)" not in err and "skipped" not in err
    assert _table(out) == [("done", "full"), ("done", "streamingllm")]


def test_quiet_still_shows_the_skipped_points_in_the_table(tmp_path, launched):
    args = ["-q", "method=full", f"results_dir={tmp_path}", *FAST]
    assert _main(args)[0] == 0 and launched == ["full"]
    launched.clear()
    rc, out, err = _main(args)
    assert rc == 0 and launched == [] and _table(out) == [("skipped", "full")]


def test_jobs_the_preflight_did_not_compose_are_launched_unchanged(monkeypatch):
    jobs = [["method=full"], ["method=h2o"]]
    monkeypatch.setattr(preflight, "PLAN", preflight.Plan())
    monkeypatch.setattr("experiments.skip_finished.PLAN", preflight.PLAN)
    assert launch_only_unfinished(jobs) == jobs                # no preflight in this process
    preflight.PLAN.points = [preflight.Point(["method=full"], None)]
    assert launch_only_unfinished(jobs) == jobs                # the sweeper sees other points
    assert preflight.PLAN.skipped == []


def test_a_finished_sweep_on_the_local_submitit_launcher_starts_no_process(tmp_path, launched):
    """Must-show: ``hydra/launcher=local`` (submitit_local) re-run of a finished 2-point sweep."""
    import subprocess

    from hybridgen_harness import results
    from tests.test_harness_results import ENV

    args = ["method=full,streamingllm", f"results_dir={tmp_path}", *FAST]
    assert _main(args)[0] == 0 and len(results.ResultsStore(tmp_path, "adhoc").finished_runs()) == 2
    p = subprocess.run([sys.executable, "experiments/run.py", "-m", *args, "hydra/launcher=local"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count("skip (done): ") == 2 and "0 to launch" in p.stderr
    assert p.stdout.count(" skipped ") == 2
    assert not list(tmp_path.rglob(".submitit"))      # submitit made no job folder: nothing was launched
