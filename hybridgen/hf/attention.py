"""Transformers' extension points through which a KV method runs inside any causal LM.

- :func:`method_attention` is registered as the attention implementation ``"hybridgen"`` in
  transformers' ``AttentionInterface`` (and transformers' sdpa mask builder is registered under
  the same name in ``AttentionMaskInterface``), so a model loaded with
  ``attn_implementation="hybridgen"`` calls it at every attention layer. It receives the
  layer's post-rotary q [B, Hq, T, D] and k, v [B, Hkv, T, D] and returns [B, T, Hq, D].
- :class:`MethodLayer` is the cache layer of a globally attending layer: it stores nothing
  (the bound method holds that layer's KV in the tier ledger) and only counts tokens, so
  transformers builds masks and positions as for a dynamic cache. :func:`method_cache` is a
  ``DynamicCache`` whose globally attending layers are MethodLayers; sliding-window layers
  keep transformers' own sliding-window cache and attention.

Which layer does what is decided by the :class:`BackendRun` passed as the ``hybridgen``
keyword of the model's forward (transformers hands extra keywords down to the attention
function): without one the function is transformers' sdpa attention, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
from torch import Tensor
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from hybridgen.hf.blocked_attention import prefill_attention
from hybridgen.methods import KVMethod

#: the ``attn_implementation`` name under which the backend's attention is registered
ATTN_IMPLEMENTATION = "hybridgen"
PREFILL, DECODE = "prefill", "decode"


@dataclass
class BackendRun:
    """One generation's state as the attention function sees it.

    method: the bound KV method; method_layer: model layer index -> method layer index (the
    globally attending layers, numbered 0..n-1 in model order); valid: [B, T] bool prompt mask
    (None when unpadded); phase: 'prefill' or 'decode'; store: the run's TieredStore; cache:
    the model's :func:`method_cache`; attention_mask [B, T + steps so far] long (None unpadded);
    next_pos [B]: position of the next decoded token; steps_left: decode steps still allowed.
    """

    method: KVMethod
    method_layer: Dict[int, int]
    valid: Optional[Tensor]
    phase: str = PREFILL
    store: object = None
    cache: object = None
    attention_mask: Optional[Tensor] = None   # [B, T + steps] long, None when unpadded
    next_pos: Optional[Tensor] = None         # [B] position of the next decoded token
    steps_left: int = 0


def method_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                     attention_mask: Optional[Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                     hybridgen: Optional[BackendRun] = None, **kwargs):
    """The ``"hybridgen"`` attention implementation: returns (out [B, T, Hq, D], None).

    Prefill of a globally attending layer: transformers' sdpa attention (dense, causal, with
    its padding mask; a long prompt in query blocks, :mod:`hybridgen.hf.blocked_attention`), then
    ``method.prefill(layer, q, k, v, valid)``. Decode: ``method.decode`` over the KV the method
    kept. Sliding-window layers and calls without a run: sdpa (blocked likewise).
    """
    layer = None if hybridgen is None else hybridgen.method_layer.get(getattr(module, "layer_idx", -1))
    if layer is None:
        return prefill_attention(module, query, key, value, attention_mask, dropout=dropout,
                                 scaling=scaling, **kwargs)
    method = hybridgen.method
    q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
    if hybridgen.phase == PREFILL:
        out, _ = prefill_attention(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        method.prefill(layer, q, k, v, hybridgen.valid)
        return out, None
    out = method.decode(layer, q, k, v)              # [B, Hq, 1, D]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, method_attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


class MethodLayer(CacheLayerMixin):
    """Cache layer of a globally attending layer whose KV a method holds: counts tokens only.

    ``update`` returns the new k/v unchanged (the attention function hands them to the method).
    """

    is_sliding = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.seen = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int):
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self.is_initialized = False

    def offload(self):  # nothing held here: the method's tiers decide where the KV lives
        pass

    def prefetch(self):
        pass


def method_cache(config, method_layers) -> DynamicCache:
    """transformers' DynamicCache for ``config`` with a :class:`MethodLayer` at every layer index
    in ``method_layers`` (the globally attending ones; the others keep their own cache layer)."""
    cache = DynamicCache(config=config)
    if not cache.layers:  # a config transformers does not type per layer: all layers dynamic
        n = config.get_text_config(decoder=True).num_hidden_layers
        from transformers.cache_utils import DynamicLayer

        cache.layers = [DynamicLayer() for _ in range(n)]
        cache.layer_class_to_replicate = None
    for i in method_layers:
        cache.layers[i] = MethodLayer()
    return cache
