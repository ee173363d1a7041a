"""experiments/long_context.py and its report (hybridgen_harness.long_context)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from experiments import long_context as lc
from hybridgen.data import needle
from hybridgen.errors import ConfigError
from hybridgen_harness import long_context as report

SENTENCES = " ".join(f"Essay sentence number {i} talks about startups and {i % 7} founders." for i in range(400))


def test_methods_at_a_budget():
    got = {label: (name, params) for label, name, params in
           lc.method_configs(["full", "hybridgen", "h2o", "flexgen"], [0.2, 0.05])}
    assert got["full"] == ("full", {})
    assert got["hybridgen@0.2"] == ("hybridgen", {"gpu_budget": 0.1, "topk_ratio": 0.1})
    assert got["h2o@0.05"] == ("h2o", {"budget": 0.05})
    assert got["flexgen@0.2"] == ("flexgen", {"gpu_budget": 0.2})
    assert len(got) == 7
    with pytest.raises(ConfigError, match="unknown method 'h20'"):
        lc.method_configs(["h20"], [0.2])
    with pytest.raises(ConfigError, match="no budget"):
        lc.method_configs(["magicpig"], [0.2])


@pytest.mark.parametrize("argv, match", [
    (["--depths", "50,120"], "--depths"), (["--budgets", "0.2,1.5"], "--budgets"),
    (["--variants", "single,twokey"], "--variants"), (["--samples", "0"], "--samples")])
def test_bad_arguments_are_one_line_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        lc._arguments(["--out", "x", *argv])


def test_multi_needle_documents():
    docs = needle.build_docs(SENTENCES, [300], [50], samples=3, seed=1, variants=needle.VARIANTS)
    single, multikey, multivalue = docs
    assert [d["variant"] for d in docs] == ["single", "multikey", "multivalue"]
    needles = lambda doc: doc["prompt"].count(" is: ")  # noqa: E731  (the needle sentence's form)
    assert needles(single) == 1 and needles(multikey) == 1 + needle.DISTRACTORS
    assert needles(multivalue) == needle.VALUES
    values = multivalue["answer"].split()
    assert len(values) == needle.VALUES and all(v in multivalue["prompt"] for v in values)
    assert needle.score(f"{values[1]} and {values[0]}.", multivalue["answer"]) == 1.0
    assert needle.score(f"{values[0]}.", multivalue["answer"]) == 0.0
    # the single variant's documents are those of the hg_needle task before variants existed
    assert needle.build_docs(SENTENCES, [300], [50], samples=1, seed=1)[0]["prompt"] == single["prompt"]


def _rows(scores):
    """samples rows of documents d0.. for {label: [score per doc]}."""
    return [{"doc": f"d{i}", "length": 4096, "label": label, "method": label.split("@")[0], "score": s,
             "variant": "single", "peak_bytes_by_tier": {"gpu": 100 if label == "full" else 20}}
            for label, ss in scores.items() for i, s in enumerate(ss)]


def test_table_pairs_the_same_documents(tmp_path):
    rows = _rows({"full": [1, 1, 1, 0, 1, 1], "h2o@0.2": [0, 1, 0, 0, 1, 1]})
    rows.append({**rows[0], "doc": "d9"})  # a document only `full` finished: left out
    (tmp_path / "samples.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    t = report.table(report.load(tmp_path)).set_index("label")
    assert t.loc["full", "n"] == 6 and t.loc["full", "accuracy"] == pytest.approx(5 / 6)
    h = t.loc["h2o@0.2"]
    assert h["accuracy"] == pytest.approx(0.5) and h["delta"] == pytest.approx(-2 / 6)
    assert h["delta_lo"] <= h["delta"] <= h["delta_hi"] <= 0
    assert h["ci_lo"] < 0.5 < h["ci_hi"] and h["gpu_share"] == pytest.approx(0.2)
    assert h["budget"] == 0.2


def _refused(argv, capsys, match):
    with pytest.raises(SystemExit) as err:
        lc.main(argv)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error:") and match in line


def test_a_run_on_a_real_model_resumes_and_reports(tmp_path, monkeypatch, capsys):
    from hybridgen.data import sources

    monkeypatch.setattr(sources, "corpus", lambda name: SENTENCES)
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", "smollm2-135m", "--lengths", "160", "--depths", "60", "--samples", "2",
            "--budgets", "0.25", "--methods", "full,flexgen,h2o"]
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n{report.README_BEGIN}\nOLD-BLOCK\n{report.README_END}\nafter\n")
    lc.main([*argv, "--readme", str(readme)])
    rows = pd.read_json(out / "samples.jsonl", lines=True)
    assert len(rows) == 2 * 3 and set(rows["label"]) == {"full", "flexgen@0.25", "h2o@0.25"}
    by = rows.pivot(index="doc", columns="label", values="generation")
    assert (by["flexgen@0.25"] == by["full"]).all()  # lossless
    assert set(rows["dense_prefill_s"].groupby(rows["doc"]).nunique()) == {1}  # one prefill per document
    spliced = readme.read_text()
    assert "OLD-BLOCK" not in spliced and spliced.endswith(f"{report.README_END}\nafter\n")
    assert "| h2o | 25% |" in spliced and "`full` reaches" in spliced
    text = (out / "README.md").read_text()
    assert "`full` reaches" in text and (out / "accuracy_vs_length.png").exists()
    _refused(argv, capsys, "pass --resume")
    _refused([*argv[:-1], "full,h2o", "--resume"], capsys, "other arguments")
    lc.main([*argv, "--resume"])  # everything finished: nothing runs again, nothing is duplicated
    assert len(pd.read_json(out / "samples.jsonl", lines=True)) == len(rows)


COMMITTED = Path(__file__).resolve().parents[1] / "results" / "long_context" / "gemma3-270m"


@pytest.mark.skipif(not (COMMITTED / "samples.jsonl").exists(), reason="no committed long-context run")
def test_the_readme_block_is_generated_from_the_committed_run():
    run = json.loads((COMMITTED / "run.json").read_text())
    t = report.table(report.load(COMMITTED))
    block = report.readme_block(t, run, "results/long_context/gemma3-270m")
    readme = (COMMITTED.parents[2] / "README.md").read_text()
    assert f"{report.README_BEGIN}\n{block}{report.README_END}" in readme
    assert t.groupby("length")["n"].min().min() >= 40  # the floor per context length
