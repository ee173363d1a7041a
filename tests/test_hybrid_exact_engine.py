"""`hybrid-exact` equals `full` through the decoder engine (random-weight models; real SmolLM2 when slow)."""
import pytest
import torch

from hybridgen.errors import MissingDataError
from hybridgen.eval.generation import teacher_forced_logits
from hybridgen.methods import Budget, build_method

pytest.importorskip("hybridgen.model")
from hybridgen.model import load_model  # noqa: E402

STEPS = 5


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=["smollm2-135m", "qwen2.5-0.5b", "opt-125m"])
def engine_and_prompt(request):
    engine = load_model(request.param, weights="random", num_layers=2, tokenizer=False, seed=1)
    g = torch.Generator().manual_seed(0)
    B, T = 2, 19
    ids = torch.randint(0, engine.spec.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :6] = 0  # left padding
    ref = engine.generate(ids, "full", max_new_tokens=STEPS, attention_mask=mask, return_logits=True)
    return engine, ids, mask, ref


@pytest.mark.parametrize("budget,sinks", [(Budget(tokens=0), 4), (Budget(tokens=5), 0), (Budget(tokens=5), 9),
                                          (Budget(ratio=0.5), 4), (Budget(ratio=1.0), 4), (Budget(tokens=100), 2)])
def test_engine_logits_equal_full(engine_and_prompt, budget, sinks):
    engine, ids, mask, ref = engine_and_prompt
    method = build_method("hybrid-exact", gpu_budget=budget, sinks=sinks)
    logits = teacher_forced_logits(engine, method, ids, mask, ref.tokens)
    assert _rel(logits, ref.logits) < 1e-5
    assert torch.equal(logits.argmax(-1), ref.tokens)


def test_engine_bf16_logits_close_to_full():
    engine = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, dtype=torch.bfloat16)
    ids = torch.randint(0, engine.spec.vocab_size, (1, 33), generator=torch.Generator().manual_seed(1))
    ref = engine.generate(ids, "full", max_new_tokens=STEPS, return_logits=True)
    for ratio in (0.0, 0.3, 1.0):
        method = build_method("hybrid-exact", gpu_budget=Budget(ratio=ratio))
        logits = teacher_forced_logits(engine, method, ids, None, ref.tokens)
        assert _rel(logits, ref.logits) < 1e-2


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_identical():
    try:
        engine = load_model("smollm2-135m")
    except MissingDataError as err:
        pytest.skip(str(err))
    ids, mask = engine.encode(["The capital of France is", "Once upon a time, in a small village by the sea,"])
    ref = engine.generate(ids, "full", max_new_tokens=64, attention_mask=mask)
    for budget in ("25%", "90%", 0, 16):
        res = engine.generate(ids, build_method("hybrid-exact", gpu_budget=budget), max_new_tokens=64,
                              attention_mask=mask)
        assert torch.equal(res.tokens, ref.tokens), budget
