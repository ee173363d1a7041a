"""hybridgen.shapes: model shapes from specs and names; workload checks."""
from __future__ import annotations

import pytest

from hybridgen import perf as pm
from hybridgen.errors import ConfigError


def test_model_shape_from_spec_and_names():
    spec = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
            "intermediate_size": 128, "vocab_size": 100, "gated_mlp": False}
    shape = pm.ModelShape.from_spec(spec, "tiny")
    assert shape.mlp_matrices == 2 and shape.layer_params == 64 * 64 * 2 + 64 * 32 * 2 + 2 * 64 * 128
    named = pm.ModelShape.named("llama-3.1-8b")
    assert (named.num_layers, named.num_heads, named.num_kv_heads, named.head_dim) == (32, 32, 8, 128)
    with pytest.raises(ConfigError, match="llama-3.1-8b"):
        pm.ModelShape.named("llama-9")


def test_bad_workload_is_a_config_error():
    with pytest.raises(ConfigError):
        pm.Workload(batch=0)
    with pytest.raises(ConfigError):
        pm.Workload(dtype="int3")
    with pytest.raises(ConfigError, match="semantic"):
        pm.Workload(mapping="numa")
    with pytest.raises(TypeError):
        pm.Workload(host_share=0.9)  # the GPU share is the method's gpu_budget, not the workload's
