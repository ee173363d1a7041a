"""Model specs: shipped configs agree with transformers, rotary rules, config errors."""
from __future__ import annotations

import pytest
import torch

from hybridgen.errors import ConfigError
from hybridgen.model import ModelSpec, list_models
from hybridgen.model.rotary import rope_inv_freq
from hybridgen.model.spec import shipped_config

transformers = pytest.importorskip("transformers")

EXPECTED = {"smollm2-135m", "opt-125m", "opt-1.3b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "llama-2-7b",
            "llama-2-13b", "llama-3.1-8b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-14b"}


def test_all_shipped_models_listed():
    assert EXPECTED <= set(list_models())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_config_matches_transformers_shapes(name):
    cfg = shipped_config(name)
    spec = ModelSpec.from_hf_config(cfg, name)
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    hf_params = sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once
    assert spec.param_count() == hf_params
    hf_names = set(model.state_dict())
    ours = set(spec.param_shapes())
    assert ours <= hf_names  # every tensor we read exists under that name in an HF checkpoint
    assert spec.num_kv_heads == getattr(hf_cfg, "num_key_value_heads", hf_cfg.num_attention_heads)
    assert spec.head_dim * spec.num_heads == model.get_decoder().layers[0].self_attn.q_proj.out_features


def test_llama31_rope_matches_transformers():
    cfg = shipped_config("llama-3.1-8b")
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.rope_type == "llama3" and spec.rope_params["factor"] == 8.0
    assert spec.max_positions == 131072 and spec.num_kv_heads == 8
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig(**cfg), "cpu")
    ours = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_type, spec.rope_params)
    assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0)
    plain = rope_inv_freq(spec.head_dim, spec.rope_theta)
    assert not torch.allclose(ours, plain)  # scaling changed the low frequencies


def test_rope_parameters_and_legacy_style_agree():
    legacy = dict(shipped_config("llama-3.1-8b"))
    new = {k: v for k, v in legacy.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**legacy["rope_scaling"], "rope_theta": legacy["rope_theta"]}
    a, b = ModelSpec.from_hf_config(legacy), ModelSpec.from_hf_config(new)
    assert (a.rope_theta, a.rope_type, a.rope_params) == (b.rope_theta, b.rope_type, b.rope_params)


def test_families_and_flags():
    opt = ModelSpec.from_hf_config(shipped_config("opt-13b"))
    assert (opt.family, opt.norm, opt.gated_mlp, opt.learned_positions, opt.position_offset) == ("opt", "layer", False, True, 2)
    assert opt.qkv_bias and opt.tie_embeddings and opt.num_kv_heads == opt.num_heads == 40
    qwen = ModelSpec.from_hf_config(shipped_config("qwen2.5-7b"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.group_size == 7
    smol = ModelSpec.from_hf_config(shipped_config("smollm2-135m"))
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads, smol.head_dim) == (30, 576, 9, 3, 64)
    assert smol.tie_embeddings and smol.rope_theta == 100000
    assert smol.with_layers(4).num_layers == 4 and smol.num_layers == 30
    # OPT-13B's KV per token: 2 x 40 layers x 5120 x 2 bytes (PAPER_NOTES' running example)
    assert opt.kv_bytes_per_token(2) == 2 * 40 * 5120 * 2


@pytest.mark.parametrize("cfg, needle", [
    ({"model_type": "gpt_neox", "hidden_size": 8}, "unsupported model_type"),
    ({"model_type": "llama", "vocab_size": 10}, "lacks 'hidden_size'"),
    ({**shipped_config("llama-2-7b"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type"),
    ({**shipped_config("qwen2.5-7b"), "use_sliding_window": True}, "sliding-window"),
    ({**shipped_config("llama-2-7b"), "num_key_value_heads": 5}, "multiple"),
    ({**shipped_config("llama-2-7b"), "hidden_act": "gelu"}, "only silu"),
])
def test_bad_configs_are_one_line_errors(cfg, needle):
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_hf_config(cfg, "x")
    assert needle in str(info.value) and "\n" not in str(info.value)
