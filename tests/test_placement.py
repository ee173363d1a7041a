"""One GPU memory budget drives every method's placement (hybridgen.methods.placement).

- on the tiny model, each method placed under budgets from "everything fits" to "almost
  nothing" runs with the gpu tier's capacity set to the budget and its ledger peak within it;
- at the paper's shapes (OPT-13B, Llama-3.1-8B), the performance model's GPU memory of every
  placed method stays within the budget;
- the budget is the only knob: every method is placed from it alone (or refused in one line);
- bad budgets are refused in one line before any model loads.
"""
import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.kv import TieredStore
from hybridgen.methods import build_method
from hybridgen.methods.placement import KVShape, derive_params, gpu_kv_bytes, place
from hybridgen.model import load_model
from hybridgen.perf import Workload, predict_step

PLACEABLE = ["full", "hybrid-exact", "hybridgen", "flexgen", "infinigen", "h2o", "snapkv", "streamingllm", "quest",
             "pyramidkv", "shadowkv", "magicpig"]
# methods whose GPU part is fixed by their design: placed as they are, or refused in one line
REFUSABLE = ("full", "infinigen", "shadowkv", "magicpig")


@pytest.fixture(scope="module")
def tiny():
    return load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)


@pytest.mark.parametrize("share", [1.2, 0.15, 0.03])
def test_placed_runs_stay_within_the_budget(tiny, share):
    sp, B, T, N = tiny.spec, 2, 64, 5
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N)
    G = int(shape.full_bytes * share)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :9] = 0
    ran = 0
    for name in PLACEABLE:
        try:
            params = place(name, G, shape)
        except ConfigError as err:  # cannot fit at all: refused, in one line, naming the budget
            assert "memory.gpu_kv" in str(err) and "\n" not in str(err), name
            assert name in REFUSABLE and share < 1, name
            continue
        store = TieredStore(gpu=G)  # a CapacityError here would mean the placement overflowed
        res = tiny.generate(ids, build_method(name, **params), max_new_tokens=N, attention_mask=mask, store=store)
        assert res.tokens.shape == (B, N)
        assert 0 <= store.peak_by_tier()["gpu"] <= G, (name, params)
        ran += 1
    assert ran >= 7
    if share > 1:
        assert place("h2o", G, shape) == {"offload": "none"} and place("flexgen", G, shape) == {"gpu_budget": f"{T + N}t"}
    if share < 0.1:
        assert place("h2o", G, shape)["offload"] == "cpu" and place("quest", G, shape)["offload"] == "cpu"


@pytest.mark.parametrize("name", ["shadowkv", "magicpig", "pyramidkv"])
def test_peers_place_exactly_what_the_ledger_holds(tiny, name):
    """ShadowKV (low-rank keys, landmarks, outliers, local window on the GPU; values on the host)
    and MagicPIG (sinks + window + generated tokens and the hyperplanes on the GPU; KV and hash
    tables on the host) fit a budget of exactly their GPU bytes and are refused one byte below;
    PyramidKV is resident at exactly the sum of its layer budgets. A run under that budget holds
    exactly it (padded rows: the masks are allocated, as the placement counts them)."""
    sp, B, T, N = tiny.spec, 2, 160, 4  # longer than MagicPIG's sinks + window: a host part exists
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N)
    m = build_method(name)
    if name == "pyramidkv":
        G = sum(n + N for n in m.prompt_keeps(T, sp.num_layers)) * B * (shape.token_bytes + shape.mask_bytes)
        assert place(name, G, shape) == {"offload": "none"} and place(name, G - 1, shape)["offload"] != "none"
    else:
        G = m.gpu_bytes(sp.num_layers, B, sp.num_kv_heads, sp.head_dim, 4, T, N, masked=True)
        assert place(name, G, shape) == {}
        with pytest.raises(ConfigError, match="memory.gpu_kv gives") as err:
            place(name, G - 1, shape)
        assert "\n" not in str(err.value)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :7] = 0
    store = TieredStore(gpu=G)
    res = tiny.generate(ids, build_method(name, **place(name, G, shape)), max_new_tokens=N, attention_mask=mask,
                        store=store)
    assert res.tokens.shape == (B, N) and store.peak_by_tier()["gpu"] == G
    if name != "pyramidkv":
        assert store.peak_by_tier()["dram"] > 0  # values (ShadowKV) / KV and tables (MagicPIG) on the host


def test_derived_shares_shrink_with_the_budget():
    shape = KVShape(40, 40, 128, 2, 20, 2048, 128)  # OPT-13B, prompt 1920 + 128, batch 20
    got = [place("flexgen", int(shape.full_bytes * s), shape)["gpu_budget"] for s in (0.9, 0.5, 0.1)]
    tokens = [int(g[:-1]) for g in got]
    assert tokens[0] > tokens[1] > tokens[2] > 0
    assert place("h2o", int(shape.full_bytes * 0.3), shape) == {"offload": "none"}      # 20% kept fits
    assert place("h2o", int(shape.full_bytes * 0.1), shape) == {"offload": "stream"}    # it does not
    assert place("quest", int(shape.full_bytes * 0.5), shape) == {"offload": "stream"}  # Quest keeps all


@pytest.mark.parametrize("model,gpu,batch,prompt", [("opt-13b", "a100-80gb", 20, 1920),
                                                    ("llama-3.1-8b", "rtx5090", 4, 32768)])
def test_projected_gpu_memory_within_the_budget(model, gpu, batch, prompt):
    shape = KVShape.of_model(model, batch, prompt, 128, dtype="fp16")
    w = Workload(batch=batch, context=prompt + 128, dtype="fp16")
    for share in (0.6, 0.2, 0.05):
        G = int(shape.full_bytes * share)
        for name in PLACEABLE + ["uvm", "uvm-h2o"]:
            try:
                params = place(name, G, shape)
            except ConfigError:
                assert name in REFUSABLE, name
                continue
            p = predict_step(build_method(name, **params), model, w, gpu)
            from hybridgen.perf.context import CostContext
            from hybridgen.perf.profiles import load_profile
            from hybridgen.shapes import as_model_shape

            weights = CostContext(as_model_shape(model), w, load_profile(gpu)).weights_bytes
            kv_on_gpu = p.breakdown["gpu_resident_bytes"] - weights
            assert kv_on_gpu <= G * 1.001, (name, params, kv_on_gpu, G)


def test_budget_is_the_only_knob():
    shape = KVShape.of_model("llama-3.1-8b", 8, 32768, 128)
    G = gpu_kv_bytes("20GiB")
    placed = {name: place(name, G, shape) for name in PLACEABLE + ["uvm", "uvm-h2o"] if name not in ("full",)}
    assert placed["hybridgen"]["gpu_budget"].endswith("t") and placed["hybrid-exact"]["gpu_budget"].endswith("t")
    assert placed["h2o"]["offload"] in ("none", "stream", "cpu")
    # an explicit knob wins over the derived one
    assert place("flexgen", G, shape, {"gpu_budget": 0.5})["gpu_budget"] == 0.5
    assert place("h2o", G, shape, {"offload": "cpu"})["offload"] == "cpu"
    with pytest.raises(ConfigError, match="needs .* memory.gpu_kv gives"):
        place("full", G, shape)


@pytest.mark.parametrize("bad", ["0", "-1GB", "lots", "0GiB", None, True])
def test_bad_budgets_refused_in_one_line(bad):
    with pytest.raises(ConfigError) as err:
        gpu_kv_bytes(bad)
    assert "\n" not in str(err.value)


def test_auto_budget_from_hardware():
    hw = {"name": "a100", "gpu_memory": "80GB", "gpu_kv_fraction": 0.9}
    assert gpu_kv_bytes("auto", hw, 26 * 10**9) == int(72e9) - 26 * 10**9
    with pytest.raises(ConfigError, match="gpu_memory"):
        gpu_kv_bytes("auto", {"name": "cpu-emulated"})
    with pytest.raises(ConfigError, match="leave no KV"):
        gpu_kv_bytes("auto", hw, 80 * 10**9)
    params = derive_params("hybridgen", {}, "auto", hw, {"name": "opt-13b", "dtype": "float16"},
                           {"batch": 20, "prompt_len": 1920, "gen_len": 128})
    assert params["gpu_budget"] == "2048t"  # OPT-13B's 20 x 2K KV (~34 GB) fits next to its weights


def test_uvm_is_projected_only():
    m = build_method("uvm")
    with pytest.raises(ConfigError, match="projected only"):
        m.bind(None)
    w = Workload(batch=20, context=2048, dtype="fp16")
    fits = predict_step(build_method("uvm"), "opt-13b", w, "a100-80gb")
    tight = predict_step(build_method("uvm", gpu_kv="4GB"), "opt-13b", w, "a100-80gb")
    h2o = predict_step(build_method("uvm-h2o", gpu_kv="4GB"), "opt-13b", w, "a100-80gb")
    assert fits.breakdown["migrated_bytes"] == 0 and tight.breakdown["migrated_bytes"] > 0
    assert tight.total_s > h2o.total_s > fits.total_s * 0.1 and tight.total_s > fits.total_s


def test_memory_gpu_kv_config_key_drives_method_params():
    from omegaconf import OmegaConf

    from experiments import point
    from experiments.schema import RunConfig

    cfg = OmegaConf.structured(RunConfig)
    cfg.model.num_layers = 2
    cfg.workload.prompt_len, cfg.workload.gen_len = 256, 4
    cfg.method.name = "h2o"
    assert point.method_params(cfg) == {}  # no budget: each method's own knobs
    cfg.memory.gpu_kv = "50KB"
    assert point.method_params(cfg) == {"offload": "cpu"}
    assert point.store_capacities(cfg)["gpu"] == 50_000  # the ledger enforces the budget
    cfg.memory.gpu_kv = "200KB"
    assert point.method_params(cfg) == {"offload": "none"}
    cfg.method.params = {"offload": "stream"}
    assert point.method_params(cfg) == {"offload": "stream"}  # explicit wins
    cfg.method.name, cfg.method.params = "flexgen", {}
    assert point.method_params(cfg)["gpu_budget"].endswith("t")
    cfg.memory.gpu_kv = "lots"
    with pytest.raises(ConfigError, match="memory.gpu_kv") as err:
        point.method_params(cfg)
    assert "\n" not in str(err.value)


def test_memory_gpu_kv_is_resolved_once_per_point(monkeypatch):
    """One Placement per point: the method's parameters, the refusal check, the store's
    capacities and the built method all read it; the budget is parsed and placed once."""
    from omegaconf import OmegaConf

    from experiments import point
    from experiments.schema import RunConfig
    from hybridgen.methods import placement

    calls = []
    real = placement.budget_and_shape
    monkeypatch.setattr(placement, "budget_and_shape", lambda *a: calls.append(a) or real(*a))
    point._placement.cache_clear()
    cfg = OmegaConf.structured(RunConfig)
    cfg.model.num_layers = 2
    cfg.workload.prompt_len, cfg.workload.gen_len = 256, 4
    cfg.method.name, cfg.memory.gpu_kv = "flexgen", "120KB"
    cfg.hardware.dram_capacity = "1GiB"
    p = point.placement(cfg)
    assert point.method_params(cfg) == dict(p.params) and point.placement_refusal(cfg) is None
    assert point.store_capacities(cfg) == {"gpu": 120_000, "dram": 2**30, "cxl": None} == dict(p.capacities)
    assert point.build(cfg).config()["gpu_budget"] == p.params["gpu_budget"]
    assert len(calls) == 1 and p.gpu_kv_bytes == 120_000 and p.shape.context == 260
    assert build_method("flexgen", **p.params).footprint(p.shape).fits(p.gpu_kv_bytes)
    cfg.exp.kind = "project"  # a projection records a method that cannot fit instead of refusing
    cfg.method.name = "full"
    assert "memory.gpu_kv gives" in point.placement_refusal(cfg) and point.method_params(cfg) == {}
    cfg.exp.kind = "generate"
    with pytest.raises(ConfigError, match="memory.gpu_kv gives"):
        point.method_params(cfg)


def test_one_auto_formula_and_one_weight_estimate():
    """'auto' is one formula (placement.auto_gpu_kv) for memory.gpu_kv and hardware.gpu_capacity;
    the weights of a named model are one estimate (ModelShape.weights_bytes), the projection's."""
    from hybridgen.eval.generation import resolve_capacities
    from hybridgen.methods.placement import auto_gpu_kv, budget_and_shape
    from hybridgen.perf.context import CostContext
    from hybridgen.perf.profiles import load_profile
    from hybridgen.shapes import ModelShape

    hw = {"name": "a100", "gpu_memory": "80GB", "gpu_kv_fraction": 0.9}
    ms = ModelShape.named("opt-13b", weight_bytes=2)
    g, _ = budget_and_shape("auto", hw, {"name": "opt-13b", "dtype": "float16"},
                            {"batch": 1, "prompt_len": 8, "gen_len": 2})
    assert g == auto_gpu_kv(hw, ms.weights_bytes()) == int(72e9) - ms.weights_bytes()
    assert CostContext(ms, Workload(batch=1, context=10), load_profile("a100-80gb")).weights_bytes == ms.weights_bytes()
    with pytest.raises(ConfigError, match="hardware.gpu_capacity=auto needs hardware.gpu_memory"):
        resolve_capacities({"gpu_capacity": "auto"})
