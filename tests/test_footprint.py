"""One footprint per method: what a method says it holds where (``footprint(shape)``) is what the
store's ledger holds after a real run, what its placement fits into ``memory.gpu_kv`` and what
its projected cost reports as GPU memory.

The methods here: full, UVM / UVM + H2O (projected only: cost and placement), FlexGen in its
three modes (attention on the GPU with staging slots, on the CPU, INT4 compression), InfiniGen,
ShadowKV and MagicPIG, on the tiny model at budgets from 1.2x to 0.03x of the full KV.
"""
import dataclasses

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.kv import TieredStore
from hybridgen.methods import build_method
from hybridgen.methods.footprint import KVShape
from hybridgen.methods.placement import place
from hybridgen.model import load_model
from hybridgen.perf import CostContext, Workload, as_model_shape, load_profile, predict_step

# (case, registered method, explicit parameters): each mode of FlexGen is its own case
RUN = [("full", "full", {}), ("flexgen-gpu", "flexgen", {}), ("flexgen-cpu", "flexgen", {"attention_on": "cpu"}),
       ("flexgen-int4", "flexgen", {"compress_kv": True, "group_size": 32}), ("infinigen", "infinigen", {}),
       ("shadowkv", "shadowkv", {"budget": "16t", "rank": 24}), ("magicpig", "magicpig", {"bits": 6, "tables": 12}),
       ("magicpig-dense", "magicpig", {"bits": 6, "tables": 12, "dense_layers": 1})]
# whose GPU part is fixed by their design: placed as they are, or refused in one line
FIXED = ("full", "infinigen", "shadowkv", "magicpig")
SHARES = [1.2, 0.9, 0.5, 0.15, 0.03]
B, T, N = 2, 100, 4  # longer than MagicPIG's sinks + window: a host part exists


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


def _shape(tiny, masked=True):
    sp = tiny.spec
    return KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N, masked=masked)


def _nonzero(d):
    return {t: int(n) for t, n in d.items() if n}


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("case,name,explicit", RUN, ids=[c for c, _, _ in RUN])
def test_ledger_peak_equals_the_footprint(tiny, case, name, explicit, share):
    shape = _shape(tiny)
    G = int(shape.full_bytes * share)
    try:
        params = place(name, G, shape, explicit)
    except ConfigError as err:  # cannot fit at all: refused in one line, naming the budget
        assert "memory.gpu_kv" in str(err) and "\n" not in str(err), case
        assert name in FIXED and share < 1, case
        return
    method = build_method(name, **params)
    fp = method.footprint(shape)
    assert fp.fits(G), (case, params)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0  # a padded row: the masks are allocated, as the footprint counts them
    store = TieredStore(gpu=G)  # the ledger enforces the budget
    res = tiny.generate(ids, method, max_new_tokens=N, attention_mask=mask, store=store)
    assert res.tokens.shape == (B, N)
    assert _nonzero(store.peak_by_tier()) == _nonzero(fp.tier_bytes), (case, params)
    if name == "flexgen":
        assert params["gpu_budget"] == (f"{T + N}t" if share > 1 else params["gpu_budget"])
        if share < 0.1:  # two layer-sized staging slots no longer fit: the host part on the CPU
            assert params["attention_on"] == "cpu" and fp.shared_gpu_bytes == 0


@pytest.mark.parametrize("case,name,explicit", RUN[:4] + RUN[5:6], ids=[c for c, _, _ in RUN[:4] + RUN[5:6]])
def test_unpadded_runs_hold_no_masks(tiny, case, name, explicit):
    """Without padding no mask is allocated: the footprint of the unpadded shape is the ledger."""
    shape = _shape(tiny, masked=False)
    params = {"gpu_budget": "40t", **explicit} if name == "flexgen" else explicit
    method = build_method(name, **params)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(4))
    store = TieredStore()
    tiny.generate(ids, method, max_new_tokens=N, store=store)
    assert _nonzero(store.peak_by_tier()) == _nonzero(method.footprint(shape).tier_bytes), case
    assert method.footprint(shape).gpu_bytes < method.footprint(_shape(tiny)).gpu_bytes  # masks counted when padded


@pytest.mark.parametrize("case,name,explicit", RUN + [("uvm", "uvm", {"gpu_kv": "2GB"}), ("uvm-h2o", "uvm-h2o", {})],
                         ids=[c for c, _, _ in RUN] + ["uvm", "uvm-h2o"])
def test_projected_gpu_memory_is_the_footprint(case, name, explicit):
    """The cost states no memory of its own: predict_step's GPU bytes beyond the weights are the
    footprint's gpu bytes on the prediction's (unpadded) shape, exactly."""
    model, hw, w = "llama-3.1-8b", "h200-host", Workload(batch=4, context=8192)
    method = build_method(name, **explicit)
    c = CostContext(as_model_shape(model), w, load_profile(hw))
    p = predict_step(method, model, w, hw)
    shape = c.kv_shape()
    if name.startswith("uvm") and method.gpu_kv is None:  # the GPU's room: its memory minus the weights
        fp = method.footprint(shape, c.hw.gpu.memory_gb * 1e9 - c.weights_bytes)
    else:
        fp = method.footprint(shape)
    assert p.breakdown["gpu_resident_bytes"] - c.weights_bytes == pytest.approx(fp.gpu_bytes, rel=1e-9, abs=1)
    lay = method.layer_cost(c)
    assert lay.gpu_tokens * shape.layers * shape.batch * shape.token_bytes == pytest.approx(
        fp.gpu_bytes - fp.shared_gpu_bytes, rel=1e-9, abs=1)


def test_flexgen_placement_is_the_largest_share_that_fits(tiny):
    """The derived gpu share fits and one token more does not (with its staging slots when the
    attention stays on the GPU; the slots of 3 layers' host part take 2/3 of the KV, so below
    that the host part is attended on the CPU)."""
    shape = _shape(tiny)
    modes = []
    for share in (0.9, 0.5, 0.2):
        G = int(shape.full_bytes * share)
        params = place("flexgen", G, shape)
        m, n = build_method("flexgen", **params), int(params["gpu_budget"][:-1])
        assert m.footprint(shape).fits(G)
        assert not dataclasses.replace(m, gpu_budget=f"{n + 1}t").footprint(shape).fits(G)
        modes.append(m.attention_on)
    assert modes == ["gpu", "cpu", "cpu"]


def test_uvm_footprint_spills_what_does_not_fit():
    shape = KVShape.of_model("opt-13b", 20, 1920, 128, dtype="fp16")
    total = shape.layers * shape.batch * shape.context * shape.token_bytes
    fp = build_method("uvm", gpu_kv="4GB").footprint(shape)
    assert fp.tier_bytes == {"gpu": 4 * 10**9, "dram": total - 4 * 10**9}
    h2o = build_method("uvm-h2o", gpu_kv="400GB").footprint(shape)
    assert h2o.host_bytes == 0 and h2o.gpu_bytes == pytest.approx(0.2 * total, abs=1)
