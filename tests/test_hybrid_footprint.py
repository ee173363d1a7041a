"""`hybridgen` and `hybrid-exact` state their memory once (hybridgen.hybrid.memory): after a real
run of the tiny model, placed under budgets of 1.2x .. 0.03x of the full KV, the store ledger's
peak per tier equals ``footprint(shape).tier_bytes``; the placement fits the budget and the
cost's gpu_tokens / staging_tokens are the footprint's."""
import dataclasses

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.hybrid import HybridExact, HybridGen
from hybridgen.hybrid.memory import ship_staging_bytes, window_capacity
from hybridgen.kv import TieredStore
from hybridgen.methods import Budget, build_method
from hybridgen.methods.footprint import KVShape
from hybridgen.methods.placement import place
from hybridgen.model import load_model
from hybridgen.perf import Workload
from hybridgen.perf.context import CostContext
from hybridgen.perf.profiles import load_profile
from hybridgen.shapes import as_model_shape

B, T, N = 2, 150, 6
VARIANTS = [
    ("hybridgen", {}),
    ("hybridgen", {"ship": "partial", "topk_ratio": 0.2}),
    ("hybridgen", {"three_way": True}),                      # the scheduler's stream fraction: its bound
    ("hybridgen", {"three_way": True, "stream_ratio": 0.3, "ship": "partial"}),
    ("hybridgen", {"key_sketch": "int4", "mapping": "interleaved"}),
    ("hybridgen", {"key_sketch": "int8", "adapt_split": True, "sched_interval": 1, "per_head": True}),
    ("hybrid-exact", {}),
    ("hybrid-exact", {"key_tier": "cxl"}),
]


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def _shape(tiny):
    sp = tiny.spec
    return KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N)


def _prompt():
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :11] = 0  # padded rows: the masks the footprint counts are allocated
    return ids, mask


@pytest.mark.parametrize("share", [1.2, 0.3, 0.1, 0.03])
@pytest.mark.parametrize("name,params", VARIANTS)
def test_ledger_peak_equals_the_footprint(tiny, share, name, params):
    shape = _shape(tiny)
    G = int(shape.full_bytes * share)
    try:
        placed = place(name, G, shape, params)
    except ConfigError as err:  # three-way's stream slots (both, at their largest) do not fit at all
        smallest = build_method(name, **params, gpu_budget=0.0).footprint(shape)
        assert build_method(name, **params).three_way and not smallest.fits(G) and "\n" not in str(err)
        return
    m = build_method(name, **placed)
    fp = m.footprint(shape)
    assert fp.gpu_bytes <= G
    ids, mask = _prompt()
    store = TieredStore(gpu=G)
    res = tiny.generate(ids, m, max_new_tokens=N, attention_mask=mask, store=store)
    assert res.tokens.shape == (B, N)
    peak = {t: n for t, n in store.peak_by_tier().items() if n}
    assert peak == dict(fp.tier_bytes), (name, params, placed)
    assert store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}  # all returned


def test_placement_takes_the_largest_share_that_fits(tiny):
    """One byte less than the footprint of the placed share moves the share down."""
    shape = _shape(tiny)
    for m in (HybridGen(topk_ratio=0.1, three_way=False), HybridExact()):
        G = int(shape.full_bytes * 0.3)
        got = m.placement_for(G, shape)
        placed = dataclasses.replace(m, **got)
        need = placed.footprint(shape).gpu_bytes
        if isinstance(m, HybridGen):
            need += ship_staging_bytes(dataclasses.replace(m, gpu_budget=Budget(ratio=0.0)), shape)
        tight = dataclasses.replace(m, **m.placement_for(need, shape))
        assert tight.gpu_budget == placed.gpu_budget
        less = dataclasses.replace(m, **m.placement_for(need - 1, shape))
        assert less.gpu_budget.resolve(shape.prompt) < placed.gpu_budget.resolve(shape.prompt)


def test_footprint_counts_the_spare_slot_the_split_and_the_stream():
    shape = KVShape(2, 2, 8, 2, 1, 100, 10)
    base = HybridGen(gpu_budget=Budget(tokens=20), sinks=4, three_way=False, key_sketch="none")
    assert base.footprint(shape).gpu_tokens == window_capacity(20, 4, False) == 21
    assert base.footprint(shape).gpu_bytes == shape.kv_bytes(21)
    split = dataclasses.replace(base, adapt_split=True)
    assert split.footprint(shape).gpu_bytes == shape.kv_bytes(21 + 16)  # the window may double
    three = dataclasses.replace(base, three_way=True, stream_ratio=0.5)
    host = 100 - 20
    assert three.footprint(shape).gpu_bytes == shape.kv_bytes(21) + 2 * shape.kv_bytes(host // 2, layers=1)
    # the default streams a scheduler-owned share: its two slots at the scheduler's bound, 0.9
    default = HybridGen(gpu_budget=Budget(tokens=20), sinks=4)
    assert default.footprint(shape).gpu_bytes == shape.kv_bytes(21) + 2 * shape.kv_bytes(int(0.9 * host), layers=1)
    sketch = dataclasses.replace(base, key_sketch="int4", mapping="dram")
    assert sketch.footprint(shape).tier_bytes["dram"] > base.footprint(shape).host_bytes


def test_cost_gpu_tokens_come_from_the_footprint():
    """The cost's GPU memory, (L * gpu_tokens + staging_tokens) * B * kv_tok, is the footprint's
    gpu bytes (masks and three-way slots included)."""
    c = CostContext(as_model_shape("llama-3.1-8b"), Workload(batch=4, context=8192), load_profile("h200-host"))
    shape = c.kv_shape()
    for m in (HybridGen(topk_ratio=0.05, gpu_budget=Budget(tokens=512)),
              HybridGen(topk_ratio=0.05, three_way=True, stream_ratio=0.2), HybridExact(gpu_budget=Budget(ratio=0.3))):
        cost, fp = m.layer_cost(c), m.footprint(shape)
        projected = (shape.layers * cost.gpu_tokens + cost.staging_tokens) * shape.batch * shape.token_bytes
        assert projected == pytest.approx(fp.gpu_bytes, rel=1e-12)
        assert (cost.gpu_tokens, cost.staging_tokens) == fp.cost_tokens(shape)
        if isinstance(m, HybridGen):
            assert fp.gpu_tokens == m.gpu_budget.resolve(8192) + 1
            assert (cost.staging_tokens > 0) == m.three_way


def test_a_budget_below_the_smallest_footprint_is_refused(tiny):
    shape = _shape(tiny)
    with pytest.raises(ConfigError, match="memory.gpu_kv gives") as err:
        HybridGen().placement_for(shape.kv_bytes(1) - 1, shape)  # not even the spare slot per layer
    assert "\n" not in str(err.value)


def test_placement_turns_the_scheduled_stream_off_where_its_slots_do_not_fit():
    """The default's three-way slots (two, at the scheduler's bound) do not fit a budget its plain split
    fits: the placement runs it without the stream; a stream asked for explicitly is refused instead."""
    shape = KVShape(32, 8, 128, 2, 4, 32768, 128)
    plain = HybridGen(three_way=False)
    smallest_plain = dataclasses.replace(plain, gpu_budget=Budget(tokens=0)).footprint(shape).gpu_bytes
    smallest_default = HybridGen(gpu_budget=Budget(tokens=0)).footprint(shape).gpu_bytes
    G = (smallest_plain + smallest_default) // 2
    got = HybridGen().placement_for(G, shape)
    assert got["three_way"] is False
    placed = dataclasses.replace(HybridGen(), **got)
    assert placed.footprint(shape).fits(G) and got == {**plain.placement_for(G, shape), "three_way": False}
    # slots that fit but leave no room for two layers of shipped rows: the stream goes, not the share
    tight = smallest_default + ship_staging_bytes(HybridGen(gpu_budget=Budget(tokens=0)), shape) // 2
    got = HybridGen().placement_for(tight, shape)
    assert got["three_way"] is False and got["gpu_budget"] != 0.0
    # with room for the slots the stream stays (and the share is what the slots leave)
    roomy = HybridGen().placement_for(4 * smallest_default, shape)
    assert "three_way" not in roomy
    with pytest.raises(ConfigError, match="three_way=True") as err:
        place("hybridgen", G, shape, {"three_way": True})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="its smallest gpu share"):
        place("hybridgen", G, shape, {"stream_ratio": 0.9})  # a pinned stream is never turned off
