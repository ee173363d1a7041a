"""The Hugging Face parameter layout of a model: every parameter's name, shape and kind.

One statement of the checkpoint naming per architecture family, read by the weight assembler
(:mod:`hybridgen.model.weights`) and by :meth:`ModelSpec.param_shapes` (parameter counts);
torch-free, it depends on nothing but the spec's fields.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Dict, Tuple

if TYPE_CHECKING:
    from hybridgen.model.spec import ModelSpec


def layer_names(spec: ModelSpec, i: int) -> Dict[str, str]:
    """HF names of layer ``i``'s parameters by role (q, k, v, o, norms, MLP matrices)."""
    if spec.family == "opt":
        p = f"model.decoder.layers.{i}."
        return {"q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
                "o": p + "self_attn.out_proj", "attn_norm": p + "self_attn_layer_norm",
                "mlp_norm": p + "final_layer_norm", "fc1": p + "fc1", "fc2": p + "fc2"}
    p = f"model.layers.{i}."
    return {"q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
            "o": p + "self_attn.o_proj", "attn_norm": p + "input_layernorm",
            "mlp_norm": p + "post_attention_layernorm", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
            "down": p + "mlp.down_proj"}


def top_names(spec: ModelSpec) -> Dict[str, str]:
    """HF names of the parameters outside the layers (embeddings, final norm, lm_head) by role."""
    if spec.family == "opt":
        p = "model.decoder."
        return {"embed": p + "embed_tokens", "pos": p + "embed_positions", "final_norm": p + "final_layer_norm",
                "project_in": p + "project_in", "project_out": p + "project_out", "lm_head": "lm_head"}
    return {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}


def hf_param_shapes(spec: ModelSpec) -> "OrderedDict[str, Tuple[Tuple[int, ...], str]]":
    """Ordered {HF name: (shape, kind)} of every parameter the model needs (tied lm_head omitted)."""
    h, E, V, D, I = spec.hidden_size, spec.embed_dim, spec.vocab_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * D, spec.num_kv_heads * D
    out: "OrderedDict[str, Tuple[Tuple[int, ...], str]]" = OrderedDict()
    top = top_names(spec)
    out[top["embed"] + ".weight"] = ((V, E), "embed")
    if spec.learned_positions:
        out[top["pos"] + ".weight"] = ((spec.max_positions + spec.position_offset, h), "embed")
    if E != h:
        out[top["project_in"] + ".weight"] = ((h, E), "matrix")
        out[top["project_out"] + ".weight"] = ((E, h), "matrix")
    for i in range(spec.num_layers):
        n = layer_names(spec, i)
        _add_norm(out, spec, n["attn_norm"], h)
        for key, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            out[n[key] + ".weight"] = ((rows, h), "matrix")
            if spec.qkv_bias:
                out[n[key] + ".bias"] = ((rows,), "bias")
        out[n["o"] + ".weight"] = ((h, q_out), "matrix")
        if spec.o_bias:
            out[n["o"] + ".bias"] = ((h,), "bias")
        _add_norm(out, spec, n["mlp_norm"], h)
        if spec.gated_mlp:
            mats = (("gate", (I, h), I), ("up", (I, h), I), ("down", (h, I), h))
        else:
            mats = (("fc1", (I, h), I), ("fc2", (h, I), h))
        for key, shape, bias_len in mats:
            out[n[key] + ".weight"] = (shape, "matrix")
            if spec.mlp_bias:
                out[n[key] + ".bias"] = ((bias_len,), "bias")
    if spec.final_norm:
        _add_norm(out, spec, top["final_norm"], h)  # applied before project_out
    if not spec.tie_embeddings:
        out[top["lm_head"] + ".weight"] = ((V, E), "embed")
    return out


def _add_norm(out, spec: ModelSpec, name: str, dim: int) -> None:
    out[name + ".weight"] = ((dim,), "norm")
    if spec.norm_bias:
        out[name + ".bias"] = ((dim,), "bias")
