"""Offloaded kept KV of the evicting baselines ("H2O on FlexGen"): the same outputs as GPU-resident.

Each of H2O, SnapKV, StreamingLLM and Quest runs with offload='stream' (kept KV on the host,
streamed per layer) and offload='cpu' (the step on the CPU next to it) on the same seeded
inputs as offload='none'; outputs must match the resident method's (and, at a full budget,
the float64 dense reference), the kept KV must sit in the host tier's ledger and the streamed
bytes must be counted.
"""
import random

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.methods import build_method
from hybridgen.model import load_model
from hybridgen.testing import dense_reference, drive, left_padding

EVICTING = {"h2o": {}, "snapkv": {"window": 4}, "streamingllm": {}, "quest": {"dense_layers": 1, "page_size": 4}}
SHAPE = (2, 4, 2, 8, 40)  # B, Hq, Hkv, D, T


def _run(name, steps=6, **params):
    valid = left_padding(random.Random(1), SHAPE[0], SHAPE[-1])
    m = build_method(name, **{**EVICTING[name], **params})
    return m, drive(m, SHAPE, steps, valid=valid, seed=3)


@pytest.mark.parametrize("name", sorted(EVICTING))
@pytest.mark.parametrize("mode", ["stream", "cpu"])
def test_offloaded_equals_resident(name, mode):
    ref_m, ref = _run(name, budget=0.3)
    m, run = _run(name, budget=0.3, offload=mode)
    assert len(ref.records) == len(run.records)
    for a, b in zip(ref.records, run.records):
        torch.testing.assert_close(b.out, a.out, rtol=1e-6, atol=1e-6)
    assert ref_m.stats.get("evicted", 0) == m.stats.get("evicted", 0)
    # the kept KV lives on the host tier; the gpu tier holds only staging/metadata ('stream') or nothing ('cpu')
    by_tier = run.ctx.store.bytes_by_tier()
    assert by_tier["dram"] > 0
    held = m.held_bytes()
    assert all(held.get(t, 0) == n for t, n in by_tier.items()), (held, by_tier)
    kv_owned = sum(n for o, n in run.ctx.store["dram"].bytes_by_owner().items() if o.startswith("layer"))
    assert kv_owned > 0 and not any(o.endswith("/kv") or o.endswith("/window")
                                    for o in run.ctx.store["gpu"].bytes_by_owner())
    if mode == "stream":
        assert m.stats["bytes_h2d"] >= 6 * 2 * sum(
            n for o, n in run.ctx.store["dram"].bytes_by_owner().items() if o.startswith("layer0/")) // 2
        assert m.stats["bytes_d2h"] > 0
    else:
        assert by_tier["gpu"] == 0
        assert m.stats["bytes_h2d"] == 6 * 2 * SHAPE[0] * SHAPE[1] * SHAPE[3] * 4  # one output per layer-step


@pytest.mark.parametrize("name", sorted(EVICTING))
@pytest.mark.parametrize("mode", ["stream", "cpu"])
def test_offloaded_full_budget_is_dense(name, mode):
    m, run = _run(name, budget=1.0, offload=mode)
    for rec in run.records:
        torch.testing.assert_close(rec.out.double(), dense_reference(rec, run.ctx.scale), rtol=1e-5, atol=1e-5)


def test_offload_with_a_host_tier_param_is_refused():
    with pytest.raises(ConfigError, match="host_tier"):
        build_method("h2o", offload="stream", tier="dram")
    with pytest.raises(ConfigError, match="offload"):
        build_method("snapkv", offload="disk")


@pytest.fixture(scope="module")
def llama():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def test_offloaded_engine_tokens_identical(llama):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (2, 64), generator=g)
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[1, :9] = 0
    for name, extra in EVICTING.items():
        ref = llama.generate(ids, build_method(name, budget=0.25, **extra), max_new_tokens=6,
                             attention_mask=mask, return_logits=True)
        for mode in ("stream", "cpu"):
            m = build_method(name, budget=0.25, offload=mode, **extra)
            res = llama.generate(ids, m, max_new_tokens=6, attention_mask=mask, return_logits=True)
            assert torch.equal(res.tokens, ref.tokens), (name, mode)
            torch.testing.assert_close(res.logits, ref.logits, rtol=1e-5, atol=1e-5)
            assert res.method_stats["bytes_h2d"] > 0 and res.bytes_by_tier["dram"] > 0, (name, mode)
            if mode == "stream":  # the engine's hook started every later layer's copy a layer ahead
                assert res.method_stats["prefetched_ahead"] == 5 * (llama.spec.num_layers - 1), name


def test_offload_is_a_wrapper_selected_by_the_parameter():
    """build_method's `offload` builds Offloaded(inner resident, mode, host_tier): same name and
    config (run identities unchanged), the inner keeps no offload of its own; composing by hand
    gives the same outputs; what it cannot wrap is refused in one line."""
    from baselines.h2o import H2O
    from hybridgen.methods.offloaded import Offloaded

    m = build_method("h2o", budget=0.3, offload="cpu", host_tier="cxl")
    assert isinstance(m, Offloaded) and m.name == "h2o" and m.inner.offload == "none"
    assert m.config() == {**build_method("h2o", budget=0.3).config(), "offload": "cpu", "host_tier": "cxl"}
    assert not isinstance(build_method("h2o", budget=0.3), Offloaded)
    by_hand = drive(Offloaded(H2O(budget=0.3), "cpu", "cxl"), SHAPE, 3, seed=3, tiers={"gpu": None, "cxl": None})
    built = drive(m, SHAPE, 3, seed=3, tiers={"gpu": None, "cxl": None})
    for a, b in zip(by_hand.records, built.records):
        assert torch.equal(a.out, b.out)
    assert built.ctx.store.bytes_by_tier().get("cxl", 0) > 0
    for bad in (lambda: Offloaded(build_method("full"), "stream"), lambda: Offloaded(H2O(offload="cpu"), "stream"),
                lambda: Offloaded(H2O(), "disk")):
        with pytest.raises(ConfigError) as err:
            bad()
        assert "\n" not in str(err.value)
