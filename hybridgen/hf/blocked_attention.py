"""A long prompt's attention in query blocks, each against only the keys its mask lets it see.

transformers hands a sliding-window layer the full [T, S] mask of a prompt and its sdpa attention
computes every query against every key, masked or not (and the causal half above the diagonal
of the global layers too): on Gemma-3-270m (window 512 on 15 of its 18 layers) an 8K-token
prefill spent 68% of its time in attention, most of it on logits the mask then discarded.
:func:`prefill_attention` splits the queries into blocks of :data:`PREFILL_BLOCK` and attends
each block to the span of keys from its first to its last visible key (taken from the mask
itself, so padding, sliding windows and any other mask pattern keep their meaning), through
transformers' own ``sdpa_attention_forward`` (on the CPU the same flash kernel on a smaller
problem). Causal calls without a mask get the causal block mask. Each query's attention is the
same sum over the same visible keys; only the kernel's blocking (float rounding) differs from
one call.

Prompts of at most :data:`PREFILL_BLOCK` tokens, decode steps, float (additive) masks, masks
whose last two dimensions are not (T, S), position biases, soft-capping and non-causal calls
without a mask run transformers' call unchanged; so does a causal call without a mask off the
CPU (on CUDA one ``is_causal`` call is a flash kernel that already skips the upper half, which an
explicit mask per block would rule out).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.integrations.sdpa_attention import sdpa_attention_forward

#: queries per block; a prompt of at most this many tokens runs as one call
PREFILL_BLOCK = 512


def key_span(rows: Tensor) -> Optional[slice]:
    """The columns from the first to the last True of ``rows`` [..., Q, S] (bool) over every
    leading index; None when no entry is True."""
    seen = rows.reshape(-1, rows.shape[-1]).any(0).nonzero()
    if seen.numel() == 0:
        return None
    return slice(int(seen[0]), int(seen[-1]) + 1)


def _blockable(query: Tensor, key: Tensor, attention_mask: Optional[Tensor], module, kwargs, block: int) -> bool:
    """Whether :func:`prefill_attention` may split this call into query blocks (see the module's
    docstring for the calls it leaves whole)."""
    if query.shape[2] <= block or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        return False
    if attention_mask is None:  # sdpa would run upper-left causal: only when the call is causal
        causal = kwargs.get("is_causal")
        causal = causal if causal is not None else getattr(module, "is_causal", True)
        return bool(causal) and query.device.type == "cpu"
    return attention_mask.dtype == torch.bool and attention_mask.shape[-2:] == (query.shape[2], key.shape[2])


def prefill_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], block: Optional[int] = None, **kwargs):
    """transformers' sdpa attention (same arguments, same result up to float rounding), in query
    blocks of ``block`` (default :data:`PREFILL_BLOCK`) when the prompt is longer: query
    [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B or 1, 1, T, S] bool (True =
    attend) or None (causal); returns (out [B, T, Hq, D], None)."""
    block = PREFILL_BLOCK if block is None else block
    if not _blockable(query, key, attention_mask, module, kwargs, block):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)  # every block gets an explicit mask
    t = query.shape[2]
    positions = torch.arange(t, device=query.device)
    outs = []
    for start in range(0, t, block):
        stop = min(t, start + block)
        if attention_mask is None:  # upper-left causal, as sdpa's is_causal: query i sees keys 0..i
            span = slice(0, stop)
            block_mask = (positions[start:stop, None] >= positions[None, :stop])[None, None]
        else:
            block_rows = attention_mask[..., start:stop, :]
            span = key_span(block_rows) or slice(0, key.shape[2])  # a fully masked block: as the one call
            block_mask = block_rows[..., span]
        out, _ = sdpa_attention_forward(module, query[:, :, start:stop], key[:, :, span], value[:, :, span],
                                        block_mask, **kwargs)
        outs.append(out)
    return torch.cat(outs, 1), None
