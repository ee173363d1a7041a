"""No "ok" from broken inputs: a damaged checkpoint or model cache is refused in one line naming
the directory, NaN weights are refused at load, non-finite logits stop a generation, and bad
devices or empty prompts are one-line errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import _reliability_models as rm  # noqa: E402
from hybridgen.errors import MissingDataError, NumericalError  # noqa: E402
from hybridgen.model import load_model, smollm2  # noqa: E402
from hybridgen.model.weights import checkpoint_problem, safetensors_problem  # noqa: E402


@pytest.mark.parametrize("damage, needle", [(rm.make_empty, "too short"), (rm.make_truncated, "truncated")])
def test_header_and_size_check_finds_empty_and_truncated_files(tmp_path, damage, needle):
    p = rm.write_checkpoint(tmp_path / "ckpt")
    assert checkpoint_problem(p) is None and safetensors_problem(p / "model.safetensors") is None
    damage(p)
    assert needle in checkpoint_problem(p)
    with pytest.raises(MissingDataError) as info:
        load_model(str(p), device="cpu")
    msg = str(info.value)
    assert "\n" not in msg and "damaged" in msg and str(p) in msg


def test_a_damaged_cache_is_not_prepared_and_names_the_directory_to_delete(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    path = rm.fake_smollm2_cache(tmp_path)
    assert smollm2.is_prepared(path)
    rm.make_truncated(path)
    assert not smollm2.is_prepared(path)                       # was: config.json + any *.safetensors
    with pytest.raises(MissingDataError) as info:
        load_model("smollm2-135m", device="cpu")
    msg = str(info.value)
    assert "\n" not in msg and f"rm -r {path}" in msg and "prepared again" in msg


def test_nan_weights_are_refused_at_load(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    path = rm.fake_smollm2_cache(tmp_path, rm.make_nan_bytes)
    assert smollm2.is_prepared(path)                           # the header is fine: only the values are not
    with pytest.raises(MissingDataError) as info:
        load_model("smollm2-135m", device="cpu")
    assert "NaN or inf" in str(info.value) and f"delete {path}" in str(info.value)


def test_non_finite_logits_stop_generation(tmp_path):
    engine = load_model(str(rm.write_checkpoint(tmp_path / "huge", lm_head_value=3e38)), device="cpu")
    for call in (lambda: engine.generate(torch.tensor([[1, 2, 3]]), "full", 3),
                 lambda: engine.prefill(torch.tensor([[1, 2, 3]]), method="full")):
        with pytest.raises(NumericalError) as info:
            call()
        assert "non-finite logits" in str(info.value) and "\n" not in str(info.value)
    engine.release()
    ok = load_model(str(rm.write_checkpoint(tmp_path / "ok")), device="cpu")
    assert ok.generate(torch.tensor([[1, 2, 3]]), "full", 3).tokens.shape == (1, 3)


@pytest.mark.parametrize("device, needle", [("tpu", "unknown device 'tpu'"), ("xla", "not supported"),
                                            ("meta", "not supported")])
def test_unsupported_devices_are_one_line(device, needle):
    from hybridgen.errors import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_model("opt-125m", weights="dummy", num_layers=1, device=device)
