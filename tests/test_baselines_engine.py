"""Baselines through the engine: tiny random Llama (GQA, RoPE) and OPT (learned positions)."""
import math

import pytest
import torch

from hybridgen.methods import build_method
from hybridgen.model import load_model

FULL_BUDGET = {
    "flexgen": {}, "flexgen-cpu": {"attention_on": "cpu"},
    "infinigen": {"budget": 1.0, "alpha": math.inf},
    "h2o": {"budget": 1.0}, "snapkv": {"budget": 1.0}, "streamingllm": {"budget": 1.0},
    "quest": {"budget": 1.0},
}
TWENTY = {"flexgen": {}, "flexgen-int4": {"compress_kv": True}, "infinigen": {}, "h2o": {}, "snapkv": {"window": 8},
          "streamingllm": {}, "quest": {"dense_layers": 1}}


@pytest.fixture(scope="module")
def llama():
    return load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, seed=0)


@pytest.fixture(scope="module")
def opt():
    return load_model("opt-125m", weights="random", num_layers=2, tokenizer=False, seed=0)


def _inputs(T=48, B=2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :11] = 0
    return ids, mask


@pytest.mark.parametrize("model", ["llama", "opt"])
def test_full_budget_through_engine_equals_full(model, request):
    engine = request.getfixturevalue(model)
    ids, mask = _inputs()
    ref = engine.generate(ids, "full", max_new_tokens=6, attention_mask=mask, return_logits=True)
    for key, params in FULL_BUDGET.items():
        res = engine.generate(ids, build_method(key.split("-")[0], **params), max_new_tokens=6,
                              attention_mask=mask, return_logits=True)
        assert torch.equal(res.tokens, ref.tokens), key
        assert float((res.logits - ref.logits).abs().max()) < 1e-3 * float(ref.logits.abs().max()), key


@pytest.mark.parametrize("model", ["llama", "opt"])
def test_twenty_percent_through_engine(model, request):
    engine = request.getfixturevalue(model)
    ids, mask = _inputs(T=80)
    ref = engine.generate(ids, "full", max_new_tokens=5, attention_mask=mask)
    for key, params in TWENTY.items():
        method = build_method(key.split("-")[0], **params)
        res = engine.generate(ids, method, max_new_tokens=5, attention_mask=mask, return_logits=True)
        assert res.tokens.shape == (2, 5) and bool(torch.isfinite(res.logits).all()), key
        assert res.method_stats["steps"] == 4
        held, full_held = sum(res.bytes_by_tier.values()), sum(ref.bytes_by_tier.values())
        if key in ("h2o", "snapkv", "streamingllm"):
            assert held < full_held, key
        if key.startswith("flexgen") or key == "infinigen":
            assert res.bytes_by_tier["dram"] > 0 and res.method_stats["bytes_h2d"] > 0, key
        if key == "flexgen":
            assert res.method_stats["prefetched_ahead"] == 4 * (engine.spec.num_layers - 1)
        if key == "infinigen":  # layer 1 selected from layer 0's input at every step
            assert res.method_stats["speculated"] == 4 * (engine.spec.num_layers - 1)
        if key == "streamingllm":
            assert res.method_stats["position_shift"] == (1 if model == "llama" else 0)
