"""Attention primitives: dense reference, partial attention + LSE merge, one-softmax merge,
and the CPU attention pool that computes the host half concurrently."""
from hybridgen.attention.partial import (
    attention_logits,
    merge_partials,
    partial_attention,
    softmax_over_parts,
    topk_per_group,
)
from hybridgen.attention.reference import dense_attention_reference

__all__ = [
    "attention_logits",
    "dense_attention_reference",
    "merge_partials",
    "partial_attention",
    "softmax_over_parts",
    "topk_per_group",
]
