"""What the backend reads from a transformers causal LM: its decoder layers, which of them
attend globally, the attention shape, the rotary embedding and a layer's stand-in query.

Layer types come from transformers itself (``cache_utils.get_layer_types_and_kwargs``): the
``full_attention`` layers are the ones a KV method acts on; sliding-window, chunked or
KV-sharing layers keep transformers' own cache and attention.

Shapes: hidden [B, T, hidden_size]; positions [B, T] int64; queries [B, Hq, T, D];
cos/sin [B, 1, T, D] float32.
"""
from __future__ import annotations

import inspect
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError

GLOBAL_LAYER_TYPE = "full_attention"


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class HFRotary:
    """The model's own rotary embedding (its ``rotary_emb`` module) behind the interface methods
    use (``cos_sin``, ``apply``, ``rotate``; the lean engine's :class:`~hybridgen.model.rotary.RotaryEmbedding`).

    Only a "rotate half" rotary over the whole head dim with no attention scaling composes like
    a rotation (StreamingLLM re-rotates keys, ShadowKV un-rotates them); for any other kind
    (partial rotary, YaRN/LongRoPE scaling) every call raises a one-line ConfigError.
    """

    def __init__(self, module: torch.nn.Module, layer_type: Optional[str], head_dim: int, model_name: str):
        self.module = module
        self.layer_type = layer_type
        self.head_dim = head_dim
        self.model_name = model_name
        self._with_type = "layer_type" in inspect.signature(module.forward).parameters
        probe = self._raw(torch.zeros(1, 2, dtype=torch.long, device=self._device()))
        scale = float(getattr(module, f"{layer_type}_attention_scaling", getattr(module, "attention_scaling", 1.0))
                      if self._with_type else getattr(module, "attention_scaling", 1.0))
        self.problem = None
        if probe[0].shape[-1] != head_dim:
            self.problem = f"its rotary covers {probe[0].shape[-1]} of {head_dim} head dims (partial rotary)"
        elif abs(scale - 1.0) > 0:
            self.problem = f"its rotary scales attention by {scale} (a YaRN/LongRoPE-type rope)"

    def _device(self) -> torch.device:
        buf = next(iter(self.module.buffers()), None)
        return buf.device if buf is not None else torch.device("cpu")

    def _raw(self, positions: Tensor) -> Tuple[Tensor, Tensor]:
        x = torch.zeros((), dtype=torch.float32, device=self._device())
        args = (x, positions.to(x.device)) + ((self.layer_type,) if self._with_type else ())
        return self.module(*args)

    def cos_sin(self, positions: Tensor) -> Tuple[Tensor, Tensor]:
        """positions [B, T] -> (cos, sin) each [B, 1, T, D] float32."""
        if self.problem:
            raise ConfigError(f"{self.model_name}: this method re-rotates cached keys, but {self.problem}; run it "
                              "on the lean engine (a Llama/Qwen2 checkpoint) or pick a method that does not")
        cos, sin = self._raw(positions)
        return cos.float()[:, None], sin.float()[:, None]

    @staticmethod
    def apply(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, H, T, D] with cos/sin [B, 1, T, D] (transformers' apply_rotary_pos_emb)."""
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return x * cos + rotate_half(x) * sin

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        cos, sin = self.cos_sin(positions)
        return self.apply(x, cos.to(x.device), sin.to(x.device))


def global_layers(config) -> List[int]:
    """Indices of the globally attending (``full_attention``) layers of a transformers text config."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return [i for i, t in enumerate(get_layer_types_and_kwargs(config)[0]) if t == GLOBAL_LAYER_TYPE]


class ModelView:
    """Read-only structure of ``model`` (an ``AutoModelForCausalLM``) that the backend needs.

    decoder_layers: the model's decoder layer modules in order; method_layers: the indices of
    the globally attending ones (a method's layer j is model layer ``method_layers[j]``).
    """

    def __init__(self, model: torch.nn.Module, name: str):
        self.model, self.name = model, name
        self.config = model.config.get_text_config(decoder=True)
        base = getattr(model, "model", None)
        layers = getattr(base, "layers", None)
        if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
            raise ConfigError(f"{name} ({type(model).__name__}) has no model.layers[i].self_attn; the transformers "
                              "backend needs a decoder-only causal LM of the usual layout")
        self.decoder_layers: List[torch.nn.Module] = list(layers)
        self.method_layers = global_layers(self.config)
        if not self.method_layers:
            raise ConfigError(f"{name} has no globally attending layer (all attend within a window); a KV "
                              "method has nothing to act on")
        attn = self.attention(0)
        c = self.config
        self.num_heads = int(c.num_attention_heads)
        self.num_kv_heads = int(getattr(c, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or c.hidden_size // self.num_heads)
        scales = {float(getattr(self.attention(j), "scaling", self.head_dim ** -0.5))
                  for j in range(len(self.method_layers))}
        if len(scales) != 1:
            raise ConfigError(f"{name}: its global layers use different softmax scales {sorted(scales)}; "
                              "methods take one scale")
        self.scale = scales.pop()
        softcap = getattr(c, "attn_logit_softcapping", None)
        if softcap is not None:
            raise ConfigError(f"{name} soft-caps attention logits ({softcap}); the methods' attention does not; "
                              "set config.attn_logit_softcapping=None only if the model was trained without it")
        rot = getattr(base, "rotary_emb", None)
        self.rotary = None if rot is None else HFRotary(rot, GLOBAL_LAYER_TYPE, self.head_dim, name)

    def attention(self, j: int) -> torch.nn.Module:
        """The attention module of method layer ``j``."""
        return self.decoder_layers[self.method_layers[j]].self_attn

    def attention_weights(self, j: int):
        """Method layer ``j``'s projections as the lean engine's ``AttnWeights`` ([out, in] like
        nn.Linear; views of the model's parameters, the q/k/v rows of a fused qkv). Refused for
        models that normalise q/k after the projection (Qwen3, Gemma 3): the weights alone would
        not give their queries (use :meth:`stand_in_query`)."""
        from hybridgen.model.engine import AttnWeights

        attn = self.attention(j)
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            raise ConfigError(f"{self.name} normalises q/k after the projection; the raw projection weights do not "
                              "give its queries and keys (use stand_in_query)")
        if hasattr(attn, "qkv_proj"):
            hq, hkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            wq, wk, wv = w.split((hq, hkv, hkv), 0)
            bq, bk, bv = (None, None, None) if b is None else b.split((hq, hkv, hkv), 0)
        else:
            wq, wk, wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
            bq, bk, bv = attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias
        return AttnWeights(wq, bq, wk, bk, wv, bv, attn.o_proj.weight, attn.o_proj.bias)

    def stand_in_query(self, j: int, hidden: Tensor, positions: Tensor) -> Tensor:
        """Method layer ``j``'s query [B, Hq, T, D] from ``hidden`` [B, T, h] at ``positions`` [B, T]:
        the layer's input norm, q projection (+ bias; the q rows of a fused qkv), q norm when the
        model has one, and rotary."""
        layer = self.decoder_layers[self.method_layers[j]]
        attn = layer.self_attn
        norm = getattr(layer, "input_layernorm", None)
        if norm is None:
            raise ConfigError(f"{self.name}: its decoder layer has no input_layernorm; speculating methods "
                              "(hybridgen, infinigen) need the lean engine for it")
        x = norm(hidden)
        if hasattr(attn, "q_proj"):
            q = attn.q_proj(x)
        elif hasattr(attn, "qkv_proj"):
            w = attn.qkv_proj
            rows = self.num_heads * self.head_dim
            q = torch.nn.functional.linear(x, w.weight[:rows], None if w.bias is None else w.bias[:rows])
        else:
            raise ConfigError(f"{self.name}: its attention has neither q_proj nor qkv_proj; speculating methods "
                              "(hybridgen, infinigen) need the lean engine for it")
        B, T = hidden.shape[:2]
        q = q.view(B, T, -1, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):
            q = attn.q_norm(q)
        if self.rotary is not None:
            cos, sin = self.rotary._raw(positions)
            q = HFRotary.apply(q, cos[:, None].to(q.device), sin[:, None].to(q.device))
        return q.contiguous()
