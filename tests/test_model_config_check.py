"""A checkpoint's config.json checked before any arithmetic: one line naming the file and the key (issue 25, item 3)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _reliability_models as rm  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402
from hybridgen.model import model_spec  # noqa: E402


def _damaged(tmp_path: Path, **changes) -> Path:
    path = rm.write_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


_DROP = object()


@pytest.mark.parametrize("key, value", [
    ("num_attention_heads", 0), ("num_attention_heads", "4"), ("num_attention_heads", -2), ("num_attention_heads", 2.5),
    ("num_key_value_heads", 0), ("num_hidden_layers", "two"), ("hidden_size", True), ("vocab_size", 0),
    ("intermediate_size", []), ("max_position_embeddings", 1e9), ("head_dim", 0),
    ("rope_theta", "10000"), ("rope_theta", 0), ("rope_theta", float("inf")), ("rms_norm_eps", -1e-6),
    ("rope_scaling", "linear"), ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
    ("rope_scaling", {"rope_type": "linear", "factor": 0}), ("eos_token_id", "2"), ("eos_token_id", [2, -1]),
    ("bos_token_id", 1.5),
])
def test_a_bad_config_key_is_one_line_naming_file_and_key(key, value, tmp_path):
    path = _damaged(tmp_path, **{key: value})
    with pytest.raises(ConfigError) as err:
        model_spec(str(path))
    msg = str(err.value)
    assert str(path / "config.json") in msg and f"key '{key}" in msg
    assert "\n" not in msg


def test_heads_not_dividing_and_a_list_config(tmp_path):
    cfg = json.loads((rm.write_checkpoint(tmp_path / "a") / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    with pytest.raises(ConfigError, match="must be a multiple of 'num_key_value_heads'"):
        model_spec(str(_damaged(tmp_path / "b", num_key_value_heads=heads + 1)))
    with pytest.raises(ConfigError, match="multiple of 'num_attention_heads'"):
        model_spec(str(_damaged(tmp_path / "c", head_dim=_DROP, hidden_size=cfg["hidden_size"] + 1)))
    p = rm.write_checkpoint(tmp_path / "d")
    (p / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a list, not a JSON object"):
        model_spec(str(p))


def test_a_good_config_still_loads(tmp_path):
    spec = model_spec(str(rm.write_checkpoint(tmp_path / "ok")))
    assert spec.num_heads > 0 and spec.head_dim > 0


def test_the_run_entry_point_names_the_key_before_loading(tmp_path):
    import contextlib
    import io

    from experiments import run

    path = _damaged(tmp_path, num_attention_heads=0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = run.main([f"model.name={path}", "model.weights=real", "workload.source=random", "workload.prompt_len=8",
                       "workload.gen_len=2", f"results_dir={tmp_path}/r"])
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "'num_attention_heads'" in lines[0] and "config.json" in lines[0]
    assert not (tmp_path / "r").exists()
