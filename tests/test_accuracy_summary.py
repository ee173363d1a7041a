"""The README's accuracy summary is generated from the accuracy runs (hybridgen_harness.accuracy_summary)."""
import json
from pathlib import Path

import pytest

from hybridgen_harness import accuracy_summary as summary
from hybridgen_harness.results import ResultsStore

ROOT = Path(__file__).resolve().parents[1]
MC = "hg_bigbench_demo"


def _write_run(root: Path, name: str, method: str, answers, needles=(1, 0), params=None, top1=1.0, kl=0.0):
    """A finished run folder: 3-choice items answered 1 (right) or 0, two needle cells."""
    d = root / name
    d.mkdir(parents=True)
    rows = [{"task": MC, "doc_id": i, "doc": {"choices": ["a", "b", "c"]}, "acc_norm": float(a)}
            for i, a in enumerate(answers)]
    rows += [{"task": summary.NEEDLE, "doc_id": i, "exact_match": float(v)} for i, v in enumerate(needles)]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "metrics.json").write_text(json.dumps({
        "model": {"name": "smollm2-135m"}, "method": {"name": method, "params": params or {}},
        "accuracy": {"hg_ppl_pydoc": {"word_perplexity": 60.0 + 10 * (1 - top1)}},
        "fidelity": {"top1_agreement": top1, "mean_kl": kl}}))
    return d


@pytest.fixture()
def runs(tmp_path):
    right = [1] * 60 + [0] * 40
    worse = [0] * 30 + [1] * 30 + [0] * 40  # 30 items lost, none gained
    return summary.load([
        _write_run(tmp_path, "a", "full", right),
        _write_run(tmp_path, "b", "flexgen", right, kl=1e-7),
        _write_run(tmp_path, "c", "hybrid-exact", right, kl=2e-7),
        _write_run(tmp_path, "d", "h2o", worse, needles=(0, 0), top1=0.5, kl=0.8),
        _write_run(tmp_path, "e", "hybridgen", right, params={"topk_ratio": 0.1}, top1=0.9, kl=0.02),
    ])


def test_block_reads_the_runs(runs):
    block = summary.readme_block(runs)
    lines = block.splitlines()
    table = [ln for ln in lines if ln.startswith("| ")]
    assert table[1].startswith("| full | 0.600 ± 0.049 |")
    # identical rows share one; the rest follow by top-1, highest first
    assert [r.split(" | ")[0][2:] for r in table[1:]] == ["full", "flexgen, hybrid-exact", "hybridgen (topk 0.1)", "h2o"]
    h2o = table[-1]
    assert "| 0.300 | -0.300 [" in h2o and "significant" in h2o and "| no |" in h2o and "| 0 of 2 |" in h2o
    assert "| 1 of 2 | 60.0 | 1.000 | < 1e-4 |" in table[2]  # lossless row: KL below display precision
    assert "Chance: demo 0.333 (`full` 0.600 [" in block and "above chance" in block
    assert "KL < 1e-4: flexgen, hybrid-exact." in block  # hybridgen has every answer right but KL 0.02
    assert "Significantly different from `full`: h2o on demo (-0.300)." in block


def test_a_method_that_differs_on_one_needle_is_not_called_identical(tmp_path):
    right = [1] * 50 + [0] * 50
    runs = summary.load([_write_run(tmp_path, "a", "full", right),
                         _write_run(tmp_path, "b", "flexgen", right, needles=(0, 0), kl=1e-7)])
    assert "KL < 1e-4: none." in summary.readme_block(runs)


def test_no_reference_run_is_an_error(tmp_path):
    runs = summary.load([_write_run(tmp_path, "b", "flexgen", [1, 0])])
    with pytest.raises(ValueError, match="no 'full' run"):
        summary.readme_block(runs)


def test_the_readme_block_is_generated_from_the_committed_runs():
    runs = summary.load(ResultsStore(ROOT / "results", "accuracy").finished_runs())
    block = summary.readme_block(runs)
    assert f"{summary.README_BEGIN}\n{block}{summary.README_END}" in (ROOT / "README.md").read_text()
