"""The README's per-profile projected verdict is generated from results/projected/*-e2e.csv."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridgen_harness import projected_summary as ps  # noqa: E402

PROFILES = ps.PROFILES


def _row(method, step, fits="True", bound="GPU", status="ok"):
    return {"profile": "p", "method": method, "step_ms": str(step), "fits_gpu": fits, "bound": bound, "status": status}


def test_a_line_ranks_every_method_against_hybridgens_default():
    line = ps.profile_line([_row("hybridgen-three-way", 200, bound="PCIe"), _row("hybridgen", 300, bound="CPU"),
                            _row("flexgen-stream", 500, bound="PCIe"), _row("full", 20),
                            _row("quest", 30, fits="False"), _row("magicpig", None, status="not modelled")])
    assert line.startswith("- **p**: HybridGen three-way (the default) 200 ms, the plain split 300 ms, bound by PCIe.")
    assert "Faster than flexgen-stream 500 ms (2.50x, PCIe-bound)" in line
    assert "Slower than full 20 ms (0.10x, GPU-bound)" in line
    assert "Does not fit the GPU: quest (30 ms)" in line and "magicpig" not in line


def test_without_the_default_the_line_says_so():
    assert ps.profile_line([_row("full", 20)]) == "- **p**: HybridGen's default not priced."


def test_the_readme_block_is_what_the_generator_makes_from_the_committed_tables():
    readme = (ROOT / "README.md").read_text()
    assert readme.count(ps.BEGIN) == 1 and readme.count(ps.END) == 1
    block = ps.readme_block(ROOT / "results" / "projected", PROFILES)
    assert readme.split(ps.BEGIN, 1)[1].split(ps.END, 1)[0] == "\n" + block
    assert block.count("\n") == len(PROFILES)


def test_the_committed_tables_are_the_current_model():
    """results/projected/ is regenerated with the model: a model change without `python
    benchmarks/projected_table.py` fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("projected_table", ROOT / "benchmarks" / "projected_table.py")
    pt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pt)
    from hybridgen import perf as pm

    for name in PROFILES:
        rows = pt.e2e_rows(pm.load_profile(name))
        committed = {r["method"]: r for r in ps.read_e2e(ROOT / "results" / "projected" / f"{name}-e2e.csv")}
        for r in rows:
            if r.get("step_ms") is not None and r["method"] in committed:
                assert float(committed[r["method"]]["step_ms"]) == pytest.approx(r["step_ms"], rel=1e-9), (name, r)
