"""Local lm-eval tasks on generated fixtures (BIG-bench MC, needle, perplexity), the hub tasks'
loaders on local fixture files, and one lm-eval run end to end through the adapter."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_eval_lm_adapter import _byte_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def fixture_cache(tmp_path_factory):
    """A data cache with tiny BIG-bench JSONL files and two essays."""
    import os

    root = tmp_path_factory.mktemp("hgcache")
    data = root / "data"
    (data / "jsonl").mkdir(parents=True)
    docs = [{"id": f"s{i}", "query": f"Q: Is {i} even?\nA:", "choices": [" yes", " no"], "gold": i % 2}
            for i in range(6)]
    for key in ("social_iqa", "winowhy", "step_inference", "strategyqa"):
        (data / "jsonl" / f"bigbench_{key}.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    (data / "essays").mkdir()
    (data / "essays" / "a.txt").write_text(" ".join(f"Essay sentence {i} is plain." for i in range(400)))
    old = os.environ.get("HYBRIDGEN_CACHE")
    os.environ["HYBRIDGEN_CACHE"] = str(root)
    from hybridgen.data import sources

    sources.corpus.cache_clear()
    yield data
    sources.corpus.cache_clear()
    if old is None:
        os.environ.pop("HYBRIDGEN_CACHE", None)
    else:
        os.environ["HYBRIDGEN_CACHE"] = old


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridgen.model import load_model

    d = tmp_path_factory.mktemp("tiny-llama-tasks")
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(cfg).save_pretrained(d)
    _byte_tokenizer().save_pretrained(d)
    return load_model(str(d), weights="real"), d


@pytest.fixture(scope="module")
def task_manager(tiny):
    from lm_eval.tasks import TaskManager

    from hybridgen.eval.tasks_data import tasks_dir

    return TaskManager(include_path=str(tasks_dir()),
                       metadata={"tokenizer": str(tiny[1]), "needle_lengths": [400], "needle_depths": [0, 100],
                                 "needle_samples": 1})


def test_local_tasks_are_indexed(task_manager):
    names = set(task_manager.all_tasks)
    for t in ("hg_bigbench_social_iqa", "hg_bigbench_winowhy", "hg_bigbench_step_inference",
              "hg_bigbench_strategyqa", "hg_needle", "hg_ppl_pydoc", "hg_ppl_pg_text"):
        assert t in names


def test_bigbench_task_reads_the_cache(fixture_cache, task_manager):
    t = task_manager.load(["hg_bigbench_social_iqa"])["tasks"]["hg_bigbench_social_iqa"]
    docs = list(t.test_docs())
    assert len(docs) == 6
    assert t.doc_to_text(docs[1]) == "Q: Is 1 even?\nA:" and t.doc_to_choice(docs[1]) == [" yes", " no"]
    assert t.doc_to_target(docs[1]) == 1


def test_needle_task_builds_docs_at_token_lengths(fixture_cache, task_manager, tiny):
    t = task_manager.load(["hg_needle"])["tasks"]["hg_needle"]
    docs = list(t.test_docs())
    assert [(d["length"], d["depth"]) for d in docs] == [(400, 0.0), (400, 100.0)]
    tok = tiny[0].tokenizer
    for d in docs:
        assert 360 <= len(tok(d["prompt"], add_special_tokens=False)["input_ids"]) <= 400
        assert d["answer"] in d["prompt"]


def test_missing_local_dataset_names_make_data(tmp_path, monkeypatch):
    from hybridgen.errors import MissingDataError
    from hybridgen.eval.tasks_data import load_bigbench, load_ppl

    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    with pytest.raises(MissingDataError, match="make data"):
        load_bigbench("winowhy")
    with pytest.raises(MissingDataError, match="make data"):
        load_ppl("pg-text")
    assert len(load_ppl("pydoc", ppl_max_docs=3)["test"]) == 3   # pydoc needs no preparation


def test_lm_eval_end_to_end_through_the_adapter(fixture_cache, task_manager, tiny):
    import lm_eval

    from hybridgen.eval.lm_eval_model import HybridGenLM
    from hybridgen.eval.tasks_data import needle_cells

    lm = HybridGenLM(engine=tiny[0], method="h2o", budget=0.5, fidelity=True, progress=False, max_gen_toks=8,
                     rolling_prefill=0.95)
    res = lm_eval.simple_evaluate(model=lm, tasks=["hg_bigbench_social_iqa", "hg_needle", "hg_ppl_pydoc"],
                                  limit=2, task_manager=task_manager, log_samples=True, bootstrap_iters=0)
    r = res["results"]
    assert 0.0 <= r["hg_bigbench_social_iqa"]["acc,none"] <= 1.0
    assert r["hg_ppl_pydoc"]["word_perplexity,none"] > 1.0
    assert "exact_match,first-number" in r["hg_needle"]
    cells = needle_cells(res["samples"]["hg_needle"])
    assert [(c["length"], c["depth"]) for c in cells] == [(400, 0.0), (400, 100.0)]
    assert lm.requests_scored["generate_until"] == 2 and lm.fidelity_summary["tokens"] > 0


FIXTURES = {
    "piqa": ({"goal": "To open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0},
             "validation", "Question: To open a jar\nAnswer:", 2),
    "openbookqa": ({"id": "1", "question_stem": "The sun is a", "choices": {"text": ["star", "moon", "rock", "cloud"],
                    "label": ["A", "B", "C", "D"]}, "answerKey": "A"}, "test", "The sun is a", 4),
    "winogrande": ({"sentence": "The trophy did not fit in the case because _ was big.", "option1": "the trophy",
                    "option2": "the case", "answer": "1"}, "validation", None, 2),
    "copa": ({"premise": "The man broke his toe.", "choice1": "He dropped a hammer on his foot.",
              "choice2": "He got a hole in his sock.", "question": "cause", "label": 0, "idx": 0},
             "validation", None, 2),
    "rte": ({"sentence1": "A cat sleeps.", "sentence2": "An animal sleeps.", "label": 0, "idx": 0},
            "validation", "A cat sleeps.\nQuestion: An animal sleeps. True or False?\nAnswer:", 2),
}


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_hub_task_loaders_on_local_fixtures(name, task_manager, tiny, tmp_path):
    from hybridgen.eval.hub_tasks import load_local
    from hybridgen.eval.lm_eval_model import HybridGenLM

    doc, split, text, n_choices = FIXTURES[name]
    f = tmp_path / f"{name}.jsonl"
    f.write_text(json.dumps(doc) + "\n" + json.dumps(doc) + "\n")
    task = load_local(task_manager, name, {"train": str(f), "validation": str(f), "test": str(f)})
    docs = list(task.test_docs() if split == "test" else task.validation_docs())
    assert len(docs) == 2
    if text is not None:
        assert task.doc_to_text(docs[0]) == text
    choices = task.doc_to_choice(docs[0])
    assert len(choices) == n_choices
    task.build_all_requests(limit=1, rank=0, world_size=1)
    reqs = task.instances
    assert len(reqs) == n_choices and all(r.request_type == "loglikelihood" for r in reqs)
    scores = HybridGenLM(engine=tiny[0], method="full", progress=False).loglikelihood(reqs)
    assert all(s[0] < 0 for s in scores)


def test_wikitext_loader_on_a_local_fixture(task_manager, tiny, tmp_path):
    from hybridgen.eval.hub_tasks import load_local
    from hybridgen.eval.lm_eval_model import HybridGenLM

    f = tmp_path / "wikitext.jsonl"
    f.write_text(json.dumps({"page": " = Title = \n Some text @-@ here . \n"}) + "\n")
    task = load_local(task_manager, "wikitext", {"train": str(f), "validation": str(f), "test": str(f)})
    task.build_all_requests(limit=1, rank=0, world_size=1)
    reqs = task.instances
    assert reqs[0].request_type == "loglikelihood_rolling" and "Some text-here." in reqs[0].args[0]
    (ll,) = HybridGenLM(engine=tiny[0], method="full", progress=False).loglikelihood_rolling(reqs)
    assert ll < 0
