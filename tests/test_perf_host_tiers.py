"""Host capacity and CXL spill in the performance model (issue 23, item 2): a method's host
bytes (its footprint's) on DRAM first, the rest on CXL, beyond both "does not fit host
memory"; the CXL share read at the CXL rate; the hardware configs state their profiles'
capacities."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from hybridgen.kv import parse_bytes
from hybridgen.perf.host_tiers import host_capacities, place_host_bytes
from hybridgen.perf.predict import predict_step
from hybridgen.perf.profiles import load_profile
from hybridgen.shapes import Workload

ROOT = Path(__file__).resolve().parents[1]
GiB = 2 ** 30
BIG = Workload(batch=32, context=131072)  # Llama-3.1-8B: 550 GB of KV


def with_capacities(profile, dram_gb="keep", cxl_gb="keep"):
    """``profile`` with another DRAM and/or CXL capacity (GB; None = unlimited)."""
    hw = load_profile(profile)
    if dram_gb != "keep":
        hw = dataclasses.replace(hw, host=dataclasses.replace(hw.host, dram_gb=dram_gb))
    if cxl_gb != "keep":
        hw = dataclasses.replace(hw, cxl=dataclasses.replace(hw.cxl, capacity_gb=cxl_gb))
    return hw


# -- capacities: one fact, the profile; the hardware configs state the same --------------------
def test_h200_host_states_the_measured_128_gib_of_dram():
    dram, cxl = host_capacities(load_profile("h200-host"))
    assert dram == 128 * GiB and cxl == 0.0
    dram, cxl = host_capacities(load_profile("h200-host-cxl"))
    assert dram == 128 * GiB and cxl == load_profile("h200-host-cxl").cxl.capacity_gb * 1e9 > 0


def _hardware_config(name: str) -> dict:
    """conf/hardware/<name>.yaml with the configs its defaults list names merged under it (as Hydra does)."""
    raw = yaml.safe_load((ROOT / "conf" / "hardware" / f"{name}.yaml").read_text())
    merged: dict = {}
    for parent in raw.pop("defaults", []):
        if parent != "_self_":
            merged.update(_hardware_config(parent))
    return {**merged, **raw}


@pytest.mark.parametrize("config", sorted(p.stem for p in (ROOT / "conf" / "hardware").glob("*.yaml")))
def test_hardware_config_capacities_are_its_profiles(config):
    hw = _hardware_config(config)
    if hw.get("profile") is None:
        assert hw["dram_capacity"] is None and hw["cxl_capacity"] is None
        return
    dram, cxl = host_capacities(load_profile(hw["profile"]))
    assert parse_bytes(hw["dram_capacity"]) == pytest.approx(dram, abs=1), "hardware.dram_capacity != profile host.dram_gb"
    assert parse_bytes(hw["cxl_capacity"]) == pytest.approx(cxl, abs=1), "hardware.cxl_capacity != profile cxl.capacity_gb"


# -- the split rule ----------------------------------------------------------------------------
def test_split_dram_first_then_cxl_then_does_not_fit():
    hw = with_capacities("h200-host-cxl", dram_gb=100, cxl_gb=50)
    below = place_host_bytes({"gpu": 7, "dram": 80e9}, hw)
    assert (below.dram_bytes, below.cxl_bytes, below.fits, below.spill_fraction) == (80e9, 0.0, True, 0.0)
    spill = place_host_bytes({"dram": 120e9, "cxl": 10e9}, hw)  # own CXL bytes stay there, + the spill
    assert (spill.dram_bytes, spill.cxl_bytes, spill.fits) == (100e9, 30e9, True)
    assert spill.spill_fraction == pytest.approx(20 / 120)
    over = place_host_bytes({"dram": 120e9, "cxl": 40e9}, hw)
    assert not over.fits and over.dram_bytes + over.cxl_bytes == 160e9
    no_cxl = place_host_bytes({"dram": 120e9, "cxl": 10e9}, load_profile("h200-host"))
    assert (no_cxl.dram_bytes, no_cxl.cxl_bytes, no_cxl.spill_fraction) == (130e9, 0.0, 0.0) and no_cxl.fits
    assert not place_host_bytes({"dram": 140e9}, load_profile("h200-host")).fits


# -- predict_step: fits_host, host_bytes, CXL priced --------------------------------------------
def test_flexgen_550_gb_does_not_fit_the_h200_host():
    p = predict_step("flexgen", "llama-3.1-8b", BIG, "h200-host")
    assert not p.fits_host and "[does not fit host memory]" in str(p)
    assert sum(p.host_bytes.values()) > 500e9 and set(p.host_bytes) == {"dram", "cxl"}


def test_flexgen_spills_to_cxl_exactly_and_is_priced_at_the_cxl_rate():
    hw = with_capacities("h200-host-cxl", cxl_gb=1000)
    p = predict_step("flexgen", "llama-3.1-8b", BIG, hw)
    from hybridgen.methods.registry import build_method
    from hybridgen.perf.context import CostContext
    from hybridgen.shapes import as_model_shape

    shape = CostContext(as_model_shape("llama-3.1-8b"), BIG, hw).kv_shape()
    host_kv = build_method("flexgen").footprint(shape).host_bytes
    assert p.fits_host and p.host_bytes == {"dram": 128 * GiB, "cxl": host_kv - 128 * GiB}
    assert p.breakdown["host_cxl_bytes"] == p.host_bytes["cxl"] and p.breakdown["cxl_gbps"] == hw.cxl.read_gbps
    assert p.breakdown["cxl_spill_fraction"] == pytest.approx(p.host_bytes["cxl"] / host_kv)
    unlimited = predict_step("flexgen", "llama-3.1-8b", BIG, with_capacities(hw, dram_gb=None))
    assert unlimited.host_bytes["cxl"] == 0 and unlimited.breakdown["cxl_spill_fraction"] == 0
    assert p.total_s > 1.2 * unlimited.total_s  # 3/4 of the stream at 28 GB/s instead of 55
    # the transfer is exactly the two shares at their own rates
    f, link = p.breakdown["cxl_spill_fraction"], hw.link.h2d_pinned_gbps
    per_layer = p.breakdown["h2d_bytes"] * ((1 - f) / min(link, hw.host.dram_read_gbps) + f / min(link, hw.cxl.read_gbps)) / 1e9
    assert p.breakdown["transfer_s"] == pytest.approx(per_layer + 2 * hw.link.latency_us * 1e-6, rel=1e-9)


# -- every host-KV method: the projected split is its footprint's, DRAM first --------------------
SPLIT_METHODS = [("flexgen", {}), ("flexgen", {"compress_kv": True}), ("hybridgen", {}),
                 ("h2o", {"offload": "stream"}), ("h2o", {"offload": "cpu"}), ("infinigen", {})]


@pytest.mark.parametrize("name,params", SPLIT_METHODS, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in SPLIT_METHODS])
@pytest.mark.parametrize("profile", ["h200-host", "h200-host-cxl"])
def test_projected_host_bytes_split_as_the_footprint_says(name, params, profile):
    from hybridgen.methods.registry import build_method
    from hybridgen.perf.context import CostContext
    from hybridgen.shapes import as_model_shape

    w = Workload(batch=8, context=131072)
    method = build_method(name, **params)
    fp_hw = load_profile(profile)
    fp = method.footprint(CostContext(as_model_shape("llama-3.1-8b"), w, fp_hw).kv_shape())
    assert fp.host_bytes > 0, "a host part exists"
    # a DRAM of a third of the host bytes: the rest spills (CXL unlimited where there is CXL)
    hw = with_capacities(profile, dram_gb=fp.host_bytes / 3e9, **({"cxl_gb": None} if fp_hw.cxl else {}))
    p = predict_step(method, "llama-3.1-8b", w, hw)
    assert sum(p.host_bytes.values()) == pytest.approx(fp.host_bytes, rel=1e-12)
    assert p.host_bytes == {"dram": p.breakdown["host_dram_bytes"], "cxl": p.breakdown["host_cxl_bytes"]}
    if fp_hw.cxl is None:  # no CXL node: all on DRAM, which is too small
        assert p.host_bytes["cxl"] == 0 and not p.fits_host and p.breakdown["cxl_spill_fraction"] == 0
        return
    assert p.fits_host and p.host_bytes["dram"] == pytest.approx(fp.host_bytes / 3, rel=1e-9)
    own_cxl = fp.tier_bytes.get("cxl", 0)  # HybridGen's semantic mapping: its values stay on CXL
    assert p.host_bytes["cxl"] == pytest.approx(fp.host_bytes - fp.host_bytes / 3, rel=1e-9) and p.host_bytes["cxl"] >= own_cxl
    wanted_dram = fp.tier_bytes.get("dram", 0)
    assert p.breakdown["cxl_spill_fraction"] == pytest.approx((wanted_dram - fp.host_bytes / 3) / wanted_dram, rel=1e-9)
    roomy = predict_step(method, "llama-3.1-8b", w, with_capacities(hw, dram_gb=None))
    assert roomy.host_bytes == {"dram": wanted_dram, "cxl": own_cxl}
    assert p.total_s > roomy.total_s, "the spilled share is read at the CXL rate"


# -- emulated runs: the same rule through the tier ledger --------------------------------------
def test_store_spills_dram_past_its_capacity_to_cxl():
    import torch

    from hybridgen.errors import CapacityError
    from hybridgen.kv import TieredStore

    store = TieredStore(dram=1024, cxl=2048, spill=True)
    a = store["dram"].allocate((200,), torch.float32, "a")  # 800 B on DRAM
    b = store["dram"].allocate((200,), torch.float32, "b")  # past DRAM: on CXL
    assert store.bytes_by_tier() == {"gpu": 0, "dram": 800, "cxl": 800}
    store["dram"].release(b)  # forgotten by the tier that holds it
    store["dram"].release(a)
    assert store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}
    with pytest.raises(CapacityError, match="cxl"):
        store["dram"].allocate((1000,), torch.float32, "c")  # 4000 B: beyond DRAM + CXL
    with pytest.raises(CapacityError, match="dram"):  # without spill the DRAM tier refuses
        TieredStore(dram=1024)["dram"].allocate((300,), torch.float32, "d")


def test_emulated_run_spills_as_the_projection_places_it():
    import torch

    from hybridgen.kv import TieredStore
    from hybridgen.methods.footprint import KVShape
    from hybridgen.methods.registry import build_method
    from hybridgen.model import load_model
    from hybridgen.perf.host_tiers import split_host_bytes

    tiny = load_model("smollm2-135m", weights="random", num_layers=2, tokenizer=False, seed=0)
    sp, B, T, N = tiny.spec, 2, 60, 3
    shape = KVShape(sp.num_layers, sp.num_kv_heads, sp.head_dim, 4, B, T + N, N, masked=False)
    method = build_method("flexgen", gpu_budget="20t")
    fp = method.footprint(shape)
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(1))
    ref = tiny.generate(ids, method, max_new_tokens=N, store=TieredStore()).tokens
    dram_cap = fp.host_bytes // 2
    store = TieredStore(dram=dram_cap, spill=True)
    out = tiny.generate(ids, build_method("flexgen", gpu_budget="20t"), max_new_tokens=N, store=store).tokens
    assert torch.equal(out, ref)
    peak = store.peak_by_tier()
    assert peak["gpu"] == fp.gpu_bytes and peak["dram"] <= dram_cap < fp.host_bytes
    assert peak["dram"] + peak["cxl"] == fp.host_bytes and peak["cxl"] > 0
    want = split_host_bytes(fp.tier_bytes.get("dram", 0), 0, dram_cap, None)
    per_layer = fp.host_bytes // shape.layers  # the store spills whole allocations (one layer's host KV)
    assert abs(peak["cxl"] - want.cxl_bytes) <= per_layer


def test_emulated_run_over_host_capacity_is_refused_before_any_model_loads(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "results"
    argv = ["exp.kind=generate", "method=flexgen", "hardware.dram_capacity=1KiB", "hardware.cxl_capacity=2KiB",
            f"results_dir={out}"]
    # a subprocess, as a user runs it (Hydra's logging set-up stays out of this test process)
    p = subprocess.run([sys.executable, "experiments/run.py", *argv], cwd=ROOT, env={**os.environ},
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "flexgen" in err[0]
    assert "hardware.dram_capacity" in err[0] and "hardware.cxl_capacity" in err[0] and "raise" in err[0]
    assert not out.exists(), "refused before any directory (or model) was made"
    # a DRAM too small but a CXL that holds the rest passes the preflight (the store spills)
    from experiments.preflight import compose
    from experiments.validate import validate

    validate(compose(["exp.kind=generate", "method=flexgen", "hardware.dram_capacity=1KiB",
                      "hardware.cxl_capacity=null"]))


# -- baselines priced as they run (issue 23, item 3) --------------------------------------------
def test_infinigen_priced_at_the_fetch_fraction_its_run_measured():
    import torch

    from baselines.infinigen import measured_fetch_fraction
    from hybridgen.kv import TieredStore
    from hybridgen.methods.registry import build_method
    from hybridgen.model import load_model

    tiny = load_model("smollm2-135m", weights="random", num_layers=3, tokenizer=False, seed=0)
    B, T, N = 2, 80, 4
    ids = torch.randint(3, 1000, (B, T), generator=torch.Generator().manual_seed(2))
    method = build_method("infinigen", budget=0.1)  # run at a tenth: priced below the default 20% cap
    res = tiny.generate(ids, method, max_new_tokens=N, store=TieredStore())
    stats = res.method_stats
    frac = measured_fetch_fraction(stats)
    sp = tiny.spec
    # the counter is what was copied: fetched rows x (K + V) bytes of every KV head (fp32, unpadded)
    assert stats["bytes_h2d"] == stats["fetched_tokens"] * B * sp.num_kv_heads * 2 * sp.head_dim * 4
    assert 0 < frac <= 0.1
    assert measured_fetch_fraction({}) is None
    w = Workload(batch=8, context=131072)
    at_cap = predict_step("infinigen", "llama-3.1-8b", w, "a100-80gb")
    at_run = predict_step("infinigen", "llama-3.1-8b", w, "a100-80gb", measured={"fetch_fraction": frac})
    assert at_cap.breakdown["fetch_measured"] == 0 and at_cap.breakdown["fetch_fraction"] == at_cap.breakdown["fetch_cap"] == 0.2
    assert at_run.breakdown["fetch_measured"] == 1 and at_run.breakdown["fetch_fraction"] == pytest.approx(frac)
    assert at_run.breakdown["h2d_bytes"] == pytest.approx(at_cap.breakdown["h2d_bytes"] * frac / 0.2)
    assert at_run.total_s < at_cap.total_s
    over = predict_step("infinigen", "llama-3.1-8b", w, "a100-80gb", measured={"fetch_fraction": 0.9})
    assert over.breakdown["fetch_fraction"] == 0.2, "never more than its cap"


def test_offloaded_evicting_methods_priced_with_their_overlap():
    w = Workload(batch=8, context=131072)
    stream = predict_step(build("h2o", offload="stream"), "llama-3.1-8b", w, "h200-host")
    bd = stream.breakdown
    assert bd["overlapped"] == 1 and bd["streamed_tokens"] > 0
    gpu_per_layer = (stream.gpu_branch_s - bd["lm_head_s"]) / bd["layers"]  # rest + the resident attention
    assert stream.layer_s == pytest.approx(max(bd["transfer_s"], gpu_per_layer))
    assert stream.layer_s < bd["transfer_s"] + bd["rest_s"] + bd["gpu_attn_s"], "the copy hides behind the compute"
    cpu = predict_step(build("h2o", offload="cpu"), "llama-3.1-8b", w, "h200-host")
    assert cpu.breakdown["overlapped"] == 0 and cpu.breakdown["read_tokens"] > 0


def build(name, **params):
    from hybridgen.methods.registry import build_method

    return build_method(name, **params)
