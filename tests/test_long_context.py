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
    assert got["hybridgen@0.2"] == ("hybridgen", {"gpu_budget": 0.1, "topk_ratio": 0.1, "three_way": False})
    assert got["h2o@0.05"] == ("h2o", {"budget": 0.05})
    assert got["flexgen@0.2"] == ("flexgen", {"gpu_budget": 0.2})
    assert len(got) == 7
    spec = lc.method_configs(["infinigen:partial_weight_ratio=1.0"], [0.2])
    assert spec == [("infinigen:partial_weight_ratio=1.0@0.2", "infinigen", {"budget": 0.2, "partial_weight_ratio": "1.0"})]
    with pytest.raises(ConfigError, match="partial_weight_ratio"):
        lc.method_configs(["infinigen:partial_weight_ratio=3"], [0.2])
    with pytest.raises(ConfigError, match="which --budgets sets"):
        lc.method_configs(["hybridgen:gpu_budget=0.07"], [0.2])
    with pytest.raises(ConfigError, match="twice"):
        lc.method_configs(["full", "h2o", "h2o"], [0.2])
    with pytest.raises(ConfigError, match="unknown method 'h20'"):
        lc.method_configs(["h20"], [0.2])
    with pytest.raises(ConfigError, match="no budget"):
        lc.method_configs(["magicpig"], [0.2])


@pytest.mark.parametrize("argv, match", [
    (["--depths", "50,120"], "--depths"), (["--budgets", "0.2,1.5"], "--budgets"),
    (["--variants", "single,twokey"], "--variants"), (["--samples", "0"], "--samples"),
    (["--source", "ruler", "--variants", "niah_single_2"], "--variants"),  # downloads essays: not offline
    (["--source", "ruler", "--variants", "single"], "--variants"),
    (["--source", "ruler", "--depths", "50"], "RULER's tasks place their own"),
    (["--variants", "single,single"], "each once")])
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



def test_single_needle_documents_are_those_before_variants_existed():
    """Pinned from hybridgen/data/needle.py at 5d6c667: the hg_needle task's documents are unchanged."""
    import hashlib

    docs = needle.build_docs(SENTENCES, [300, 500], [0, 50, 100], samples=2, seed=1)
    digest = hashlib.sha1("\x00".join(d["prompt"] + "|" + d["answer"] + "|" + d["id"] for d in docs).encode())
    assert digest.hexdigest() == "7e3812baf976c532ac4d7e8e4b813f04e1e1d577"


def _rows(scores):
    """samples rows of documents d0.. for {label: [score per doc]}."""
    return [{"doc": f"d{i}", "length": 4096, "label": label, "method": label.split("@")[0], "score": s,
             "variant": "single", "peak_bytes_by_tier": {"gpu": 100 if label == "full" else 20}}
            for label, ss in scores.items() for i, s in enumerate(ss)]


def test_table_pairs_the_same_documents(tmp_path):
    rows = _rows({"full": [1, 1, 1, 0, 0, 1], "h2o@0.2": [0, 1, 0, 0, 0, 1], "snapkv@0.2": [1, 1, 1, 0, 0, 1]})
    rows = rows[:12] + rows[12:][::-1]  # snapkv's rows in another order: pairing is by document, not position
    rows.append({**rows[0], "doc": "d9"})  # a document only `full` finished: left out
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "samples.jsonl").write_text(text + '{"doc": "d1', encoding="utf-8")  # a write cut short
    t = report.table(report.load(tmp_path)).set_index("label")
    assert t.loc["full", "n"] == 6 and t.loc["full", "accuracy"] == pytest.approx(4 / 6)
    h = t.loc["h2o@0.2"]
    assert h["accuracy"] == pytest.approx(2 / 6) and h["delta"] == pytest.approx(-2 / 6)
    assert h["delta_lo"] <= h["delta"] <= h["delta_hi"] <= 0
    assert h["ci_lo"] < 2 / 6 < h["ci_hi"] and h["gpu_share"] == pytest.approx(0.2)
    assert h["budget"] == 0.2
    # equal to `full` on every document: no discordant pair, so the rule-of-three bound 3/n;
    # paired by position (reversed), 4 of 6 pairs would disagree
    s = t.loc["snapkv@0.2"]
    assert s["delta"] == 0 and (s["delta_lo"], s["delta_hi"]) == (-0.5, 0.5)
    (tmp_path / "samples.jsonl").write_text(text + text)
    with pytest.raises(ConfigError, match="repeated"):
        report.load(tmp_path)


def _refused(argv, capsys, match):
    with pytest.raises(SystemExit) as err:
        lc.main(argv)
    assert err.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error:") and match in line


def test_a_report_of_a_folder_without_a_run_is_a_one_line_error(tmp_path, capsys):
    _refused(["--out", str(tmp_path), "--report"], capsys, "holds no run")
    _refused(["--out", str(tmp_path), "--report", "--readme", str(tmp_path / "nope.md")], capsys, "holds no run")


def test_a_run_on_a_real_model_resumes_and_reports(tmp_path, monkeypatch, capsys):
    from hybridgen.data import sources

    from hybridgen.model import shared_prefill

    monkeypatch.setattr(sources, "corpus", lambda name: SENTENCES)
    recorded = []
    record = shared_prefill.record_prefill
    monkeypatch.setattr(shared_prefill, "record_prefill", lambda *a, **k: recorded.append(1) or record(*a, **k))
    out = tmp_path / "run"
    argv = ["--out", str(out), "--model", "smollm2-135m", "--lengths", "160", "--depths", "30,60", "--samples", "2",
            "--budgets", "0.25", "--methods", "full,flexgen,h2o"]
    readme = tmp_path / "README.md"
    readme.write_text(f"# top\n{report.README_BEGIN}\nOLD-BLOCK\n{report.README_END}\nafter\n")
    lc.main([*argv, "--readme", str(readme)])
    rows = pd.read_json(out / "samples.jsonl", lines=True)
    assert len(rows) == 4 * 3 and set(rows["label"]) == {"full", "flexgen@0.25", "h2o@0.25"}
    # sample-major: a run stopped early has covered every depth
    assert list(dict.fromkeys(rows["doc"])) == ["needle-160-30-0", "needle-160-60-0", "needle-160-30-1-multikey",
                                                "needle-160-60-1-multikey"]
    by = rows.pivot(index="doc", columns="label", values="generation")
    assert (by["flexgen@0.25"] == by["full"]).all()  # lossless
    assert len(recorded) == 4  # one dense prefill per document, whatever the number of methods
    spliced = readme.read_text()
    assert "OLD-BLOCK" not in spliced and spliced.endswith(f"{report.README_END}\nafter\n")
    assert "| h2o | 25% |" in spliced and "`full` reaches" in spliced
    text = (out / "README.md").read_text()
    assert "`full` reaches" in text and (out / "accuracy_vs_length.png").exists()
    _refused(argv, capsys, "pass --resume")
    _refused([*argv[:-1], "full,h2o", "--resume"], capsys, "other arguments")
    assert json.loads((out / "run.json").read_text())["command"].endswith("--methods full,flexgen,h2o --readme "
                                                                          + str(readme))
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    (out / "samples.jsonl").write_text("".join(lines[:-2]) + lines[-1][:9])  # killed while writing a document
    lc.main([*argv, "--resume"])  # only the missing (document, configuration) pairs run again
    again = pd.read_json(out / "samples.jsonl", lines=True)
    assert len(recorded) == 5 and len(again) == len(rows)
    key = ["doc", "label"]
    assert again.set_index(key).sort_index()["generation"].equals(rows.set_index(key).sort_index()["generation"])


def test_a_document_past_the_models_positions_is_refused_before_any_runs(tmp_path, monkeypatch, capsys):
    """A cell at the model's limit is built to fit (prompt + answer + special tokens); a prompt that
    still does not fit is a one-line error before the first prefill, not a crash mid-run."""
    from hybridgen.data import sources
    from hybridgen.model import shared_prefill

    monkeypatch.setattr(sources, "corpus", lambda name: SENTENCES * 400)
    monkeypatch.setattr(shared_prefill, "record_prefill", lambda *a, **k: pytest.fail("a document ran"))
    built = []
    build = needle.build_docs
    monkeypatch.setattr(needle, "build_docs", lambda *a, **k: built.append(k["max_tokens"]) or [
        dict(d, prompt=d["prompt"] * 60) for d in build(*a, **k)])
    _refused(["--out", str(tmp_path / "run"), "--model", "smollm2-135m", "--lengths", "8192", "--depths", "50",
              "--samples", "1", "--methods", "full"], capsys, "prompt tokens + 12 new exceed smollm2-135m's 8192")
    assert built == [8192 - 24]  # positions less the longest answer (SmolLM2's tokenizer adds no special token)
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_the_identity_of_a_needle_run_is_unchanged_by_the_source_argument():
    """Runs made before --source existed resume: a needle run's identity has no 'source' key."""
    needle_args = lc._arguments(["--out", "x"])
    assert "source" not in lc._identity(needle_args) and needle_args.depths == [10.0, 30.0, 50.0, 70.0, 90.0]
    ruler_args = lc._arguments(["--out", "x", "--source", "ruler"])
    ident = lc._identity(ruler_args)
    assert ident["source"] == "ruler" and ident["depths"] is None
    assert ident["variants"] == ["niah_single_1", "niah_multikey_2", "niah_multikey_3"]


def test_a_ruler_run_scores_lm_evals_samples_as_lm_eval_does(tmp_path, capsys):
    """--source ruler on SmolLM2 at 512 tokens: the documents are lm-eval's RULER samples (the
    prompt its instance sends, its answers), each method starts from one prefill per sample, a
    score is lm-eval's own process_results for the sample, and the report says RULER."""
    import random

    from lm_eval.tasks import TaskManager, get_task_dict

    from hybridgen.eval import ruler_docs
    from hybridgen.model import smollm2

    out = tmp_path / "ruler"
    argv = ["--out", str(out), "--source", "ruler", "--model", "smollm2-135m", "--lengths", "512", "--samples", "1",
            "--variants", "niah_single_1,niah_multikey_2", "--budgets", "0.25", "--methods", "full,flexgen"]
    lc.main(argv)
    rows = pd.read_json(out / "samples.jsonl", lines=True)
    assert sorted(rows["doc"].unique()) == ["ruler-niah_multikey_2-512-0", "ruler-niah_single_1-512-0"]
    by = rows.pivot(index="doc", columns="label", values="generation")
    assert (by["flexgen@0.25"] == by["full"]).all()  # lossless
    raw = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]  # "" stays a string
    tokenizer = str(smollm2.prepared_dir())  # the prepared model's tokenizer, as the run's engine has it
    manager = TaskManager(metadata={"tokenizer": tokenizer, "max_seq_lengths": [512]})
    docs = {d["id"]: d for d in ruler_docs.build_docs(["niah_single_1", "niah_multikey_2"], [512], 1, tokenizer)}
    for task_name in ("niah_single_1", "niah_multikey_2"):
        random.seed(0)  # as lm-eval's simple_evaluate(random_seed=0) before it builds the task
        task = get_task_dict([task_name], manager)[task_name]
        task.build_all_requests(rank=0, world_size=1, limit=1)
        inst = task.instances[0]
        row = next(r for r in raw if r["doc"] == f"ruler-{task_name}-512-0" and r["label"] == "full")
        assert row["answer"] == list(inst.doc["outputs"]) and row["tokens"] <= 512
        assert docs[row["doc"]]["prompt"] == inst.args[0]  # the context lm-eval sends the model
        assert row["generation"] == row["decoded"]  # RULER scores the whole generation (no stop string)
        assert row["generated_tokens"] <= ruler_docs.NEW_TOKENS[task_name]
        assert row["score"] == task.process_results(inst.doc, [row["generation"]])["512"]
        assert ruler_docs.score(inst.doc["outputs"][0], row["answer"]) == 1.0
    # the generation stops at EOS, as lm-eval's does (SmolLM2 ends its answer within a few tokens)
    assert (rows["generated_tokens"] < rows["variant"].map(ruler_docs.NEW_TOKENS)).any()
    text = (out / "README.md").read_text()
    assert text.startswith("# RULER needle tasks at long context") and "string_match_all" in text
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.README_BEGIN}\nneedle block\n{report.README_END}\n")
    _refused([*argv, "--readme", str(readme), "--resume"], capsys, "no ruler summary markers")  # before any run
    begin, end = report.readme_markers("ruler")
    readme.write_text(readme.read_text() + f"{begin}\nOLD-RULER-BLOCK\n{end}\n")
    lc.main(["--out", str(out), "--report", "--readme", str(readme)])
    spliced = readme.read_text()
    assert "needle block" in spliced and "OLD-RULER-BLOCK" not in spliced and "RULER tasks" in spliced
    assert f"{begin}\n**Long context, RULER's needle tasks** (" in spliced  # told apart from the needle block


COMMITTED = Path(__file__).resolve().parents[1] / "results" / "long_context" / "gemma3-270m"


@pytest.mark.skipif(not (COMMITTED / "table.csv").exists(), reason="no reported long-context run")
def test_the_committed_folder_readme_regenerates_byte_for_byte(tmp_path):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(COMMITTED, copy)
    report.write_report(copy)
    assert (copy / "README.md").read_text() == (COMMITTED / "README.md").read_text()


@pytest.mark.skipif(not (COMMITTED / "table.csv").exists(), reason="no reported long-context run")
def test_the_readme_block_is_generated_from_the_committed_run():
    run = json.loads((COMMITTED / "run.json").read_text())
    t = report.table(report.load(COMMITTED))
    block = report.readme_block(t, run, "results/long_context/gemma3-270m")
    readme = (COMMITTED.parents[2] / "README.md").read_text()
    assert f"{report.README_BEGIN}\n{block}{report.README_END}" in readme
    assert t.groupby("length")["n"].min().min() >= 40  # the floor per context length


COMMITTED_RULER = COMMITTED.parent / "gemma3-270m-ruler"


@pytest.mark.skipif(not (COMMITTED_RULER / "table.csv").exists(), reason="no reported RULER run")
def test_the_readme_ruler_block_is_generated_from_the_committed_ruler_run():
    run = json.loads((COMMITTED_RULER / "run.json").read_text())
    t = report.table(report.load(COMMITTED_RULER))
    block = report.readme_block(t, run, "results/long_context/gemma3-270m-ruler")
    begin, end = report.readme_markers("ruler")
    assert f"{begin}\n{block}{end}" in (COMMITTED.parents[2] / "README.md").read_text()


def test_block_owner_names_the_run_a_readme_block_summarises():
    """experiments/long_context.py --report replaces the README's block only for the run it names
    (another run folder, e.g. a 16K-only run, leaves it unless --readme is given)."""
    from hybridgen_harness.long_context import README_BEGIN, README_END, block_owner, readme_markers

    text = (f"intro\n{README_BEGIN}\n**Long context** (...; `results/long_context/gemma3-270m`, generated from "
            f"its `table.csv`). ...\n{README_END}\nrest")
    assert block_owner(text, "needle") == "results/long_context/gemma3-270m"
    assert block_owner(text, "ruler") is None  # no ruler block in this text
    begin, end = readme_markers("ruler")
    assert block_owner(f"{begin}\nnothing named\n{end}", "ruler") is None
