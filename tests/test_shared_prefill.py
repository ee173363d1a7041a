"""Shared prefill: every method started from one recorded dense prefill gives what its own prefill gives."""
import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.methods import available_methods, build_method
from hybridgen.model import load_model
from hybridgen.model.shared_prefill import record_prefill

# the scheduler's default top-k and streamed fraction follow measured branch times: fixed here so two runs are comparable
DETERMINISTIC = {"hybridgen": {"topk_ratio": 0.2, "stream_ratio": 0.3}}


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def _inputs(B=2, T=72):
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :13] = 0
    return ids, mask


def _snapshot(shared):
    return [tuple(t.clone() for t in layer) for layer in shared.layers], shared.logits.clone()


def _every_method_equals_its_own_prefill(engine, ids, mask, new=6):
    shared = record_prefill(engine, ids, mask, max_new_tokens=new)
    before_layers, before_logits = _snapshot(shared)
    checked = []
    for name in available_methods():
        params = DETERMINISTIC.get(name, {})
        if getattr(build_method(name, **params), "projected_only", None):
            continue
        own = engine.generate(ids, build_method(name, **params), max_new_tokens=new, attention_mask=mask,
                              return_logits=True)
        from_shared = engine.generate(ids, build_method(name, **params), max_new_tokens=new, attention_mask=mask,
                                      return_logits=True, shared_prefill=shared)
        assert torch.equal(own.tokens, from_shared.tokens), name
        assert torch.equal(own.logits, from_shared.logits), name
        assert own.peak_bytes_by_tier == from_shared.peak_bytes_by_tier, name
        checked.append(name)
    # no method wrote into the record it was handed (the next method must see the same tensors)
    for layer, old in zip(shared.layers, before_layers):
        for t, o in zip(layer, old):
            assert torch.equal(t, o)
    assert torch.equal(shared.logits, before_logits)
    assert {"full", "flexgen", "h2o", "snapkv", "streamingllm", "quest", "infinigen", "hybridgen"} <= set(checked)
    return shared


def test_every_method_from_a_shared_prefill_equals_its_own_prefill(tiny):
    _every_method_equals_its_own_prefill(tiny, *_inputs())


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_every_method_shares_a_prefill_on_the_transformers_backend(arch):
    """Gemma 3 has sliding-window layers whose KV lives in transformers' cache: each replay starts
    from a copy of the recorded one, and no decode writes into the record's cache."""
    from hybridgen.hf import HFEngine
    from tests._hf_tiny import prompts, tiny_pair

    engine = HFEngine(tiny_pair(arch, dtype=torch.float32)[0], name=arch)
    ids, mask = prompts(length=40)
    shared = _every_method_equals_its_own_prefill(engine, ids, mask)
    assert len(shared.layers) == len(engine.spec.method_layers)
    assert all(layer.seen == ids.shape[1] for layer in shared.model_cache.layers if hasattr(layer, "seen"))
    with pytest.raises(ConfigError, match="another engine"):
        HFEngine(tiny_pair(arch, dtype=torch.float32)[0]).generate(ids, "full", max_new_tokens=2,
                                                                   attention_mask=mask, shared_prefill=shared)


def test_the_record_is_the_dense_prefill(tiny):
    ids, mask = _inputs()
    shared = record_prefill(tiny, ids, mask, max_new_tokens=2)
    assert torch.equal(shared.logits, tiny.prefill(ids, mask, "full", max_new_tokens=2))
    tiny.release()
    dense = tiny.forward(ids, mask)[:, -1]  # all positions' logits at once: same up to BLAS blocking
    assert torch.allclose(shared.logits, dense, rtol=0, atol=1e-5 * float(dense.abs().max()))
    sp = tiny.spec
    assert len(shared.layers) == sp.num_layers
    q, k, v = shared.layers[0]
    assert q.shape == (2, sp.num_heads, 72, sp.head_dim) and k.shape == v.shape == (2, sp.num_kv_heads, 72, sp.head_dim)
    assert shared.nbytes == sp.num_layers * 2 * 72 * (sp.num_heads + 2 * sp.num_kv_heads) * sp.head_dim * 4


def test_a_record_of_other_inputs_is_refused_in_one_line(tiny):
    ids, mask = _inputs()
    shared = record_prefill(tiny, ids, mask, max_new_tokens=3)
    other = ids.clone()
    other[0, -1] += 1
    with pytest.raises(ConfigError, match="other input_ids"):
        tiny.generate(other, "full", max_new_tokens=2, attention_mask=mask, shared_prefill=shared)
    with pytest.raises(ConfigError, match="attention_mask"):
        tiny.generate(ids, "full", max_new_tokens=2, shared_prefill=shared)
    with pytest.raises(ConfigError, match="max_new_tokens >= 5"):
        tiny.generate(ids, "full", max_new_tokens=5, attention_mask=mask, shared_prefill=shared)
    twin = load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)
    with pytest.raises(ConfigError, match="another engine"):
        twin.generate(ids, "full", max_new_tokens=2, attention_mask=mask, shared_prefill=shared)
