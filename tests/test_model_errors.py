"""Bad input to the engine gives one-line HybridGenErrors that name the fix."""
from __future__ import annotations

import json

import pytest
import torch

from hybridgen.errors import ConfigError, HybridGenError, MissingDataError
from hybridgen.model import load_model


def _one_line(info) -> str:
    msg = str(info.value)
    assert msg and "\n" not in msg
    return msg


@pytest.fixture(scope="module")
def tiny():
    return load_model("opt-125m", weights="dummy", num_layers=1, device="cpu")


def test_unknown_model_lists_choices():
    with pytest.raises(ConfigError) as info:
        load_model("gpt-5-mega", weights="dummy")
    msg = _one_line(info)
    assert "unknown model 'gpt-5-mega'" in msg and "opt-125m" in msg and "checkpoint directory" in msg


def test_missing_checkpoint_dir(tmp_path):
    with pytest.raises(MissingDataError) as info:
        load_model(str(tmp_path / "no-such-model"))
    assert "does not exist" in _one_line(info)


def test_checkpoint_dir_without_config(tmp_path):
    with pytest.raises(MissingDataError) as info:
        load_model(str(tmp_path))
    assert "config.json" in _one_line(info)


def test_checkpoint_dir_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 16, "num_attention_heads": 2,
                                                      "num_hidden_layers": 1, "ffn_dim": 32, "vocab_size": 50,
                                                      "max_position_embeddings": 32}))
    with pytest.raises(MissingDataError) as info:
        load_model(str(tmp_path))
    assert "safetensors" in _one_line(info)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MissingDataError) as info:
        load_model(str(tmp_path))
    assert "convert" in _one_line(info)
    # random weights need only the config
    assert load_model(str(tmp_path), weights="random", device="cpu").spec.hidden_size == 16


def test_bad_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError) as info:
        load_model(str(tmp_path), weights="random")
    assert "not valid JSON" in _one_line(info)


def test_shipped_name_without_offline_weights():
    with pytest.raises(MissingDataError) as info:
        load_model("opt-13b")
    assert "weights='dummy'" in _one_line(info)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(weights="fake"), "unknown weights"),
    (dict(weights="dummy", dtype="int8"), "dtype"),
    (dict(weights="dummy", num_layers=99), "num_layers"),
    (dict(weights="dummy", num_layers=0), "num_layers"),
])
def test_bad_load_arguments(kwargs, needle):
    with pytest.raises(ConfigError) as info:
        load_model("opt-125m", device="cpu", **kwargs)
    assert needle in _one_line(info)


def test_prompt_longer_than_positions(tiny):
    ids = torch.zeros(1, 2040, dtype=torch.long)
    with pytest.raises(ConfigError) as info:
        tiny.generate(ids, "full", max_new_tokens=16)
    msg = _one_line(info)
    assert "2048 positions" in msg and "shorten the prompt" in msg
    with pytest.raises(ConfigError):
        tiny.forward(torch.zeros(1, 2049, dtype=torch.long))


@pytest.mark.parametrize("call, needle", [
    (lambda e: e.generate(torch.tensor([[1, 2, 60000]]), "full", 2), "outside the vocabulary"),
    (lambda e: e.generate(torch.tensor([[1, 2, 3]]), "full", 2, attention_mask=torch.tensor([[1, 1, 0]])), "left-padded"),
    (lambda e: e.generate(torch.tensor([[1, 2, 3]]), "full", 2, attention_mask=torch.tensor([[1, 1]])), "shape"),
    (lambda e: e.generate(torch.zeros(1, 0, dtype=torch.long), "full", 2), "non-empty"),
    (lambda e: e.generate(torch.tensor([[1.0, 2.0]]), "full", 2), "integer"),
    (lambda e: e.generate([[1, 2]], "full", 2), "LongTensor"),
    (lambda e: e.generate(torch.tensor([[1, 2]]), "full", 0), "max_new_tokens"),
    (lambda e: e.generate(torch.tensor([[1, 2]]), "full", 2, greedy=False, temperature=0.0), "temperature"),
    (lambda e: e.generate(torch.tensor([[1, 2]]), "full", 2, greedy=False, top_p=1.5), "top_p"),
    (lambda e: e.generate(torch.tensor([[1, 2]]), "no-such-method", 2), "unknown method"),
    (lambda e: e.encode(["hello"]), "no tokenizer"),
    (lambda e: e.decode_step(torch.tensor([1])), "prefill first"),
])
def test_bad_engine_inputs(tiny, call, needle):
    with pytest.raises(HybridGenError) as info:
        call(tiny)
    assert needle in _one_line(info)


def test_decode_past_max_new_tokens(tiny):
    tiny.prefill(torch.tensor([[1, 2, 3]]), method="full", max_new_tokens=1)
    tiny.decode_step(torch.tensor([4]))
    with pytest.raises(ConfigError) as info:
        tiny.decode_step(torch.tensor([5]))
    assert "raise max_new_tokens" in _one_line(info)
    tiny.release()


def test_capacity_error_mid_prefill_frees_the_store():
    from hybridgen.errors import CapacityError
    from hybridgen.kv import TieredStore

    two = load_model("opt-125m", weights="dummy", num_layers=2, device="cpu")
    per_layer = 2 * 12 * (4 + 4) * 64 * 4  # K and V of 4 prompt + 4 new tokens, fp32
    for run in (lambda st: two.generate(torch.tensor([[1, 2, 3, 4]]), "full", 4, store=st),
                lambda st: two.prefill(torch.tensor([[1, 2, 3, 4]]), method="full", store=st, max_new_tokens=4)):
        store = TieredStore(gpu=per_layer + per_layer // 2)  # layer 0 fits, layer 1 does not
        with pytest.raises(CapacityError) as info:
            run(store)
        assert "capacity" in _one_line(info)
        assert store["gpu"].peak >= per_layer  # layer 0 was really allocated ...
        assert store.bytes_by_tier()["gpu"] == 0  # ... and freed
