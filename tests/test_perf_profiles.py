"""hybridgen.perf.profiles: shipped profiles, extends, validation, file round trip."""
from __future__ import annotations

import json

import pytest

from hybridgen import perf as pm
from hybridgen.errors import ConfigError, HybridGenError
from hybridgen.perf.profiles import _read_raw

PAPER_PROFILES = ("a100-80gb", "h100-80gb", "rtx5090")


def test_all_shipped_profiles_load_and_validate():
    names = pm.available_profiles()
    expected = {p + s for p in (*PAPER_PROFILES, "h200-host") for s in ("", "-cxl")}
    assert expected <= set(names)
    assert not any(n.startswith("_") for n in names)
    for name in names:
        prof = pm.load_profile(name)
        assert prof.name == name and prof.measured is False
        assert prof.gpu.hbm_gbps > prof.gpu.attention_gbps > 0
        assert prof.link.h2d_pinned_gbps > prof.link.h2d_pageable_gbps > 0
        assert prof.host.dram_read_gbps > 0 and prof.host.cores > 0
        assert (prof.cxl is not None) == name.endswith("-cxl")
        kinds = [n.kind for n in prof.host.numa_nodes]
        assert kinds.count("dram") == 1 and kinds.count("cxl") == (1 if prof.cxl else 0)
        if prof.cxl:
            assert prof.cxl.read_gbps < prof.host.dram_read_gbps
            assert 100 <= prof.cxl.added_latency_ns <= 200
            assert any("CXL" in s or "cxl" in k for k, s in prof.sources.items())


def test_h200_profile_carries_the_measured_host_numbers():
    prof = pm.load_profile("h200-host")
    assert prof.link.h2d_pinned_gbps == 55 and prof.link.h2d_pageable_gbps == 18.6
    assert prof.host.dram_read_gbps == 152
    assert 60 <= prof.host.cpu_attention_gbps["bf16"] <= 76


def test_cxl_variant_extends_its_base():
    base, cxl = pm.load_profile("a100-80gb"), pm.load_profile("a100-80gb-cxl")
    assert cxl.gpu == base.gpu and cxl.link == base.link
    assert cxl.host.dram_read_gbps == base.host.dram_read_gbps
    assert "cxl.read_gbps" in cxl.sources and "gpu.hbm_gbps" in cxl.sources


def test_bad_profile_name_lists_choices():
    with pytest.raises(ConfigError) as err:
        pm.load_profile("a100-40gb")
    msg = str(err.value)
    assert "a100-40gb" in msg and "a100-80gb" in msg and "h200-host" in msg
    assert "\n" not in msg


def _h200_raw():
    return _read_raw("h200-host")


def test_profile_without_a_source_is_rejected(tmp_path):
    raw = _h200_raw()
    del raw["sources"]["gpu.hbm_gbps"]
    with pytest.raises(ConfigError, match="gpu.hbm_gbps"):
        pm.profile_from_dict(raw)


@pytest.mark.parametrize("mutate,needle", [
    (lambda r: r["link"].__setitem__("h2d_pinned_gbps", -1), "h2d_pinned_gbps"),
    (lambda r: r["gpu"].__setitem__("hbm_tbps", 4.8), "unknown keys"),
    (lambda r: r["host"].pop("cores"), "lacks cores"),
    (lambda r: r.pop("sources"), "lacks sources"),
])
def test_profile_validation_errors(mutate, needle):
    raw = _h200_raw()
    mutate(raw)
    with pytest.raises(ConfigError, match=needle):
        pm.profile_from_dict(raw)


def test_profile_file_roundtrip(tmp_path):
    prof = pm.load_profile("h100-80gb-cxl")
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof.to_dict()))
    again = pm.load_profile(str(path))
    assert again == prof


def test_missing_profile_file_is_a_user_error(tmp_path):
    with pytest.raises(HybridGenError, match="hybridgen_harness.profile"):
        pm.load_profile(str(tmp_path / "nope.json"))


NEW_FIGURES = ("gpu.gqa_attention_gbps", "host.key_scan_pinned_gbps", "host.cpu_attention_pinned_gbps",
               "host.topk_gbps", "host.group_score_gbps", "host.op_us")


@pytest.mark.parametrize("path", NEW_FIGURES)
def test_every_new_model_figure_cites_its_source(path):
    raw = _h200_raw()
    section, key = path.split(".")
    assert raw[section][key] is not None and path in raw["sources"]
    del raw["sources"][path]
    with pytest.raises(ConfigError, match=path):
        pm.profile_from_dict(raw)
    raw[section][key] = None if not isinstance(raw[section][key], dict) else {}
    pm.profile_from_dict(raw)  # a figure left out (null / empty) needs no source


def test_every_shipped_profile_has_the_new_figures_with_sources():
    for name in pm.available_profiles():
        prof = pm.load_profile(name)
        assert prof.gpu.gqa_attention_gbps and prof.gpu.gqa_attention_gbps < prof.gpu.attention_gbps
        assert prof.host.key_scan_pinned_gbps["bf16"] < prof.host.key_scan_gbps["bf16"]  # the pinned penalty
        assert prof.host.topk_gbps and prof.host.group_score_gbps and prof.host.op_us
        assert prof.gpu.emulated_on_host is False


def test_h200_profile_has_no_transposed_layout_rate():
    """fp32 key scan: the row-major torch matmul (61.5 GB/s), not the transposed-key 100 GB/s."""
    prof = pm.load_profile("h200-host")
    assert prof.host.key_scan_gbps["fp32"] == 61.5
    assert "transposed" in prof.sources["host.key_scan_gbps"] and "not in the code" in prof.sources["host.key_scan_gbps"]


def test_emulated_flag_must_be_a_bool():
    raw = _h200_raw()
    raw["gpu"]["emulated_on_host"] = "yes"
    with pytest.raises(ConfigError, match="emulated_on_host"):
        pm.profile_from_dict(raw)
