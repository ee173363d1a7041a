"""The lm-eval adapter on a tiny random Llama with a byte-level tokenizer: scores match a direct
computation, KV methods act through decode steps, rolling perplexity and generation work."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="</s>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridgen.model import load_model

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(d)
    _byte_tokenizer().save_pretrained(d)
    return load_model(str(d), weights="real", dtype="float32")


class Req:
    def __init__(self, *args):
        self.args = args


def _lm(engine, **kw):
    """The adapter with a BOS before every context (the direct computations below assume it; the
    default, as lm-eval's HF backend, is tested in test_reliability_lm_eval.py)."""
    from hybridgen.eval.lm_eval_model import HybridGenLM

    kw.setdefault("add_bos", True)
    return HybridGenLM(engine=engine, progress=False, **kw)


def _direct(engine, context, continuation):
    """log p(continuation | BOS + context) by one dense pass (context's trailing spaces move to
    the continuation, as lm-eval's HF model does)."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    tok = engine.tokenizer
    ctx = [256] + tok(context, add_special_tokens=False)["input_ids"]
    whole = [256] + tok(context + continuation, add_special_tokens=False)["input_ids"]
    cont = whole[len(ctx):]
    logp = F.log_softmax(engine.forward(torch.tensor([whole]))[0].float(), -1)
    lp = sum(float(logp[len(ctx) - 1 + j, t]) for j, t in enumerate(cont))
    greedy = all(int(logp[len(ctx) - 1 + j].argmax()) == t for j, t in enumerate(cont))
    return lp, greedy


REQS = [("The cat sat on the", " mat"), ("The cat sat on the", " hat, then left"), ("Q: 2+2?\nA:", " 4"),
        ("", "Empty context"), ("Trailing space ", "moves")]


def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    import hybridgen.eval.lm_eval_model as m

    assert get_model("hybridgen") is m.HybridGenLM


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_loglikelihood_matches_direct_computation_for_full(engine, mode):
    lm = _lm(engine, method="full", score_mode=mode, batch_size=2)
    got = lm.loglikelihood([Req(c, x) for c, x in REQS])
    for (c, x), (lp, greedy) in zip(REQS, got):
        ref_lp, ref_greedy = _direct(engine, c, x)
        assert lp == pytest.approx(ref_lp, rel=1e-4, abs=1e-4), (c, x)
        assert greedy == ref_greedy


def test_lossless_split_method_matches_full_and_fidelity_is_perfect(engine):
    lm = _lm(engine, method="hybrid-exact", gpu_budget=0.25, fidelity=True)
    got = lm.loglikelihood([Req(c, x) for c, x in REQS])
    for (c, x), (lp, _) in zip(REQS, got):
        assert lp == pytest.approx(_direct(engine, c, x)[0], rel=1e-4, abs=1e-4)
    fid = lm.fidelity_summary
    assert fid["tokens"] > 0 and fid["top1_agreement"] == pytest.approx(1.0) and abs(fid["mean_kl"]) < 1e-6


def test_a_compressing_method_changes_scores_through_decode_steps(engine):
    ctx = "A long context about cats and dogs and birds. " * 3
    reqs = [Req(ctx, " cats"), Req(ctx, " birds")]
    full = _lm(engine, method="full").loglikelihood(reqs)
    lm = _lm(engine, method="streamingllm", budget=8, fidelity=True)
    tight = lm.loglikelihood(reqs)
    assert any(abs(a[0] - b[0]) > 1e-4 for a, b in zip(full, tight))   # the budget matters, even for
    assert lm.fidelity_summary["mean_kl"] > 0                          # short continuations
    prefill_only = _lm(engine, method="streamingllm", budget=8, score_mode="prefill").loglikelihood(reqs)
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(full, prefill_only))


def test_rolling_loglikelihood_matches_direct_sum(engine):
    text = "Some text to score with a rolling window. " * 4
    lm = _lm(engine, method="full", rolling_prefill=0.5)
    (got,) = lm.loglikelihood_rolling([Req(text)])
    ids = [256] + engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    logp = F.log_softmax(engine.forward(torch.tensor([ids]))[0].float(), -1)
    ref = sum(float(logp[j, ids[j + 1]]) for j in range(len(ids) - 1))
    assert got == pytest.approx(ref, rel=1e-4)
    small = _lm(engine, method="full", max_length=50)          # several windows
    (windowed,) = small.loglikelihood_rolling([Req(text)])
    assert windowed < 0 and windowed != pytest.approx(got, rel=1e-6)


def test_generate_until_stops_at_until_and_matches_engine(engine):
    lm = _lm(engine, method="full")
    ctx = "Hello there"
    (text,) = lm.generate_until([Req(ctx, {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})])
    ids = torch.tensor([[256] + engine.tokenizer(ctx, add_special_tokens=False)["input_ids"]])
    res = engine.generate(ids, "full", max_new_tokens=6, eos_token_id=257)
    ref = engine.tokenizer.decode(res.tokens[0].tolist(), skip_special_tokens=True).split("\n")[0]
    assert text == ref and "\n" not in text


def test_bad_model_args_fail_in_one_line(engine):
    from hybridgen.errors import ConfigError

    with pytest.raises(ConfigError) as ei:
        _lm(engine, method="h2o", budgte=0.2)
    assert "budgte" in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="unknown method"):
        _lm(engine, method="nope")
    with pytest.raises(ConfigError, match="score_mode"):
        _lm(engine, score_mode="fast")


def test_cli_wrapper_adds_our_task_dir_to_the_include_path(tmp_path):
    import os

    from hybridgen.eval.lm_eval_cli import include_paths

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert include_paths(None, "/t") == ["/t"]
    assert include_paths(str(a), "/t") == [str(a), "/t"]                  # a list: lm-eval reads a str as ONE path
    assert include_paths(f"{a}{os.pathsep}{b}", "/t") == [str(a), str(b), "/t"]


def test_each_distinct_context_is_prefilled_once_with_the_scores_of_a_prefill_per_row(engine, monkeypatch):
    """Multiple-choice rows share their context: one dense prefill for all of them, and the same
    scores and fidelity as a prefill per row."""
    import hybridgen.model.shared_prefill as sp

    ctx = "A long context about cats and dogs and birds. " * 3
    reqs = [Req(ctx, " cats"), Req(ctx, " birds"), Req(ctx, " dogs and more"), Req("Other context", " here")]
    recorded = []
    real = sp.record_prefill
    monkeypatch.setattr(sp, "record_prefill", lambda e, ids, *a, **k: recorded.append(ids.shape[0]) or real(e, ids, *a, **k))
    shared = _lm(engine, method="streamingllm", budget=8, fidelity=True)
    got = shared.loglikelihood(reqs)
    assert recorded == [2]  # one batch, two distinct contexts: two rows prefilled, not four
    per_row = _lm(engine, method="streamingllm", budget=8, fidelity=True)
    per_row.share_prefill = False
    want = per_row.loglikelihood(reqs)
    assert recorded == [2]  # the per-row path records nothing
    for (a, ga), (b, gb) in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5) and ga == gb
    assert shared.fidelity_summary["tokens"] == per_row.fidelity_summary["tokens"] > 0
    assert shared.fidelity_summary["mean_kl"] == pytest.approx(per_row.fidelity_summary["mean_kl"], rel=1e-4, abs=1e-7)
