"""`make figures` draws without touching anything but the committed PNGs, and `aggregate --all`
names no experiment that does not exist (results/projected is a script's CSVs, not `+exp=projected`)."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _target(name):
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{name}:.*?\n((?:\t.*\n|[^\n\S]*\\\n)+)", text, re.M)
    assert m, name
    return m.group(1)


def test_make_figures_writes_notebooks_to_an_ignored_place_and_rewrites_no_summary():
    recipe = _target("figures")
    assert "aggregate.py" not in recipe and "+exp=" not in recipe  # summaries belong to `make results`
    assert "paper_speedup_figure.py" in recipe and "build/notebooks" in recipe
    ignored = subprocess.run(["git", "check-ignore", "-q", "build/notebooks/accuracy.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0


def test_aggregate_all_does_not_suggest_a_missing_experiment(tmp_path):
    shutil.copytree(ROOT / "results" / "quickstart", tmp_path / "quickstart")
    (tmp_path / "projected").mkdir()
    (tmp_path / "projected" / "a100.csv").write_text("x\n1\n")
    p = subprocess.run([sys.executable, "experiments/aggregate.py", "--all", "--results-dir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "+exp=projected" not in p.stdout and "projected: skipped (no runs: not an experiment" in p.stdout
    assert "quickstart: 3 run(s)" in p.stdout
