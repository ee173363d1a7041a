"""The lm-eval adapter scores like lm-eval's own HF backend: ``method=full`` with default arguments
gives the same log-likelihood and the same greedy flag on every item, for a tokenizer that adds
no BOS (SmolLM2-like) and for one that does (Llama-like); a one-token context no longer makes
the whole batch skip the method; boolean arguments parse from strings; and
``hybridgen-lm-eval --include_path DIR --tasks TASK_IN_DIR`` finds the task."""
from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from test_eval_lm_adapter import _byte_tokenizer  # noqa: E402

REQS = [("The cat sat on the", " mat"), ("The cat sat on the", " hat, then left"), ("Q: 2+2?\nA:", " 4"),
        ("", "Empty context"), ("Trailing space ", "moves"), ("Q", " one token of context"),
        ("A much longer context about cats, dogs and birds that sing in the morning.", " birds"),
        ("<s>Already starts with BOS", " yes")]


def _tokenizer(adds_bos: bool):
    tok = _byte_tokenizer()
    if adds_bos:  # as Llama's: the tokenizer itself puts <s> before every text
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        inner = tok.backend_tokenizer
        inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 256)])
        tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="</s>")
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["tokenizer-without-bos", "tokenizer-adding-bos"])
def model_dir(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok = _tokenizer(request.param)
    assert (tok("x")["input_ids"][0] == 256) == request.param
    tok.save_pretrained(d)
    return d


class Req:
    def __init__(self, *args):
        self.args = args


def _ours(model_dir, **kw):
    from hybridgen.eval.lm_eval_model import HybridGenLM
    from hybridgen.model import load_model

    return HybridGenLM(engine=load_model(str(model_dir), device="cpu"), progress=False, **kw)


def _hf(model_dir):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", batch_size=3, dtype="float32")


def test_full_with_defaults_scores_every_item_as_lm_evals_hf_backend(model_dir):
    reqs = [Req(c, x) for c, x in REQS]
    ref = _hf(model_dir).loglikelihood(reqs, disable_tqdm=True)
    for mode in ("decode", "prefill"):
        got = _ours(model_dir, method="full", score_mode=mode, batch_size=3).loglikelihood(reqs)
        for (c, x), (lp, greedy), (ref_lp, ref_greedy) in zip(REQS, got, ref):
            assert lp == pytest.approx(ref_lp, rel=1e-4, abs=1e-4), (mode, c, x)
            assert greedy == ref_greedy, (mode, c, x)


def test_same_items_through_simple_evaluate_give_the_same_answers(model_dir, tmp_path):
    """Both models on one local multiple-choice task through lm-eval itself: per-item answers equal."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_dir = _write_task(tmp_path)
    results = {}
    for key, model in (("hf", _hf(model_dir)), ("hybridgen", _ours(model_dir, method="full"))):
        tm = TaskManager(include_path=str(task_dir), include_defaults=False)
        res = lm_eval.simple_evaluate(model=model, tasks=["rel_mc"], task_manager=tm, log_samples=True,
                                      bootstrap_iters=0)
        results[key] = {s["doc_id"]: s for s in res["samples"]["rel_mc"]}
    assert len(results["hf"]) == 8
    for doc_id, s in results["hf"].items():
        mine = results["hybridgen"][doc_id]
        assert mine["acc"] == s["acc"], doc_id
        assert _numbers(mine["filtered_resps"]) == pytest.approx(_numbers(s["filtered_resps"]), rel=1e-4, abs=1e-4)


def _numbers(x):
    """Every number in a nested response structure, in order (booleans as 0/1)."""
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _numbers(item)]
    return [float(x)]


def test_a_one_token_context_does_not_make_the_batch_skip_the_method(model_dir):
    ctx = "A long context about cats and dogs and birds and the morning songs they sing. " * 2
    reqs = [Req(ctx, " cats"), Req(ctx + "Again,", " birds"), Req("Q", " one token of context")]
    tight = dict(method="streamingllm", budget=8, add_bos=False)   # 'Q' is then ONE token of context
    batched = _ours(model_dir, batch_size=3, **tight)
    together = batched.loglikelihood(reqs)
    apart = [_ours(model_dir, batch_size=1, **tight).loglikelihood([r])[0] for r in reqs]
    full = _ours(model_dir, method="full", add_bos=False).loglikelihood(reqs)
    for (a, _), (b, _) in zip(together, apart):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-4)                 # a batch scores like single rows
    assert abs(together[0][0] - full[0][0]) > 1e-4                      # the method acted on the long rows
    assert batched.requests_scored["one_token_context"] == 1


@pytest.mark.parametrize("text, value", [("false", False), ("False", False), ("0", False), ("no", False),
                                         ("true", True), ("1", True), (True, True), (None, None)])
def test_add_bos_parses_strings(model_dir, text, value):
    lm = _ours(model_dir, add_bos=text, fidelity="false")
    assert lm.add_bos is value and lm.fidelity is False


def _write_task(tmp_path: Path) -> Path:
    d = tmp_path / "tasks"
    d.mkdir()
    docs = [{"q": f"Is {i} even?" if i % 3 else f"{i}", "choices": [" yes", " no", " maybe"], "label": i % 2}
            for i in range(8)]
    (d / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "rel_mc.yaml").write_text(
        "task: rel_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {d / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: choices\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n")
    return d


def test_cli_include_path_finds_a_task_in_that_directory(model_dir, tmp_path, request):
    """Must-show: `hybridgen-lm-eval --model hybridgen --model_args model=DIR --include_path TASKS
    --tasks rel_mc` runs the task (lm-eval 0.4.13 read our joined path as one directory before)."""
    if "tokenizer-adding-bos" in request.node.name:
        pytest.skip("one tokenizer is enough for the command line")
    from hybridgen.eval import lm_eval_cli

    task_dir = _write_task(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = lm_eval_cli.main(["--model", "hybridgen", "--model_args", f"model={model_dir}",
                               "--include_path", str(task_dir), "--tasks", "rel_mc", "--limit", "4"])
    assert rc == 0, err.getvalue()[-3000:]
    rows = [ln for ln in out.getvalue().splitlines() if ln.startswith("|rel_mc")]
    assert rows and "acc" in rows[0], out.getvalue()[-2000:]


def _pydoc_task(tmp_path: Path, n: int = 60) -> Path:
    """A multiple-choice task from CPython's pydoc text: the start of a sentence, its true ending
    and the endings of two other sentences (always present: no `make data` needed)."""
    import random
    import re

    from hybridgen.data import sources

    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", sources.corpus("pydoc")[:400000])
             if 12 <= len(s.split()) <= 40]
    rng = random.Random(0)
    rng.shuffle(sents)
    items = []
    for i, s in enumerate(sents[:n]):
        w = s.split()
        k = int(len(w) * 0.6)
        others = [x.split() for x in sents[n + 2 * i: n + 2 * i + 2]]
        choices = [" " + " ".join(w[k:])] + [" " + " ".join(o[int(len(o) * 0.6):]) for o in others]
        order = list(range(3))
        rng.shuffle(order)
        items.append({"q": " ".join(w[:k]), "choices": [choices[j] for j in order], "label": order.index(0)})
    d = tmp_path / "pydoc_task"
    d.mkdir()
    (d / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    (d / "pydoc_mc.yaml").write_text(
        "task: pydoc_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {d / 'data.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n')
    return d


@pytest.mark.slow
def test_real_smollm2_full_with_defaults_answers_every_item_as_hf(tmp_path):
    """The real model (3-15 min on 2 shared cores): 60 pydoc items, lm-eval's HF backend vs the adapter."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from hybridgen.eval.lm_eval_model import HybridGenLM
    from hybridgen.model import load_model, smollm2

    task_dir = _pydoc_task(tmp_path)
    ckpt = smollm2.ensure_smollm2()
    samples = {}
    for key, model in (("hf", HFLM(pretrained=str(ckpt), device="cpu", batch_size=8, dtype="float32")),
                       ("ours", HybridGenLM(engine=load_model("smollm2-135m", device="cpu"), method="full",
                                            progress=False))):
        res = lm_eval.simple_evaluate(model=model, tasks=["pydoc_mc"], log_samples=True, bootstrap_iters=0,
                                      task_manager=TaskManager(include_path=str(task_dir), include_defaults=False))
        samples[key] = {s["doc_id"]: s for s in res["samples"]["pydoc_mc"]}
    assert len(samples["hf"]) == 60
    for doc_id, s in samples["hf"].items():
        mine = samples["ours"][doc_id]
        assert mine["acc"] == s["acc"], doc_id
        assert _numbers(mine["filtered_resps"]) == pytest.approx(_numbers(s["filtered_resps"]), rel=1e-4, abs=1e-3)
