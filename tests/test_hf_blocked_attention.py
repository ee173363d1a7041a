"""hybridgen.hf.blocked_attention: a long prompt's attention in query blocks equals the dense
float64 reference (sliding windows, left padding, causal calls without a mask, GQA, keys past the
queries, lengths that are no multiple of the block), and each block reads only its visible keys."""
from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hybridgen.hf import blocked_attention
from hybridgen.hf.blocked_attention import key_span, prefill_attention


def reference(q, k, v, allowed, scale):
    """Dense float64 attention: q [B, Hq, T, D], k/v [B, Hkv, S, D], allowed [B|1, 1, T, S] bool
    -> [B, T, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    logits = (q.double() @ k.transpose(-1, -2)) * scale
    w = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    return (w @ v).transpose(1, 2)


def mask_of(batch, t, s, window=None, pad=()):
    """[B, 1, T, S] bool: causal with the last query at key s-1, an optional window, left padding
    pad[b] keys of row b."""
    qpos = torch.arange(s - t, s)[:, None]
    kpos = torch.arange(s)[None, :]
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    m = m.expand(batch, 1, t, s).clone()
    for b, p in enumerate(pad):
        m[b, :, :, :p] = False
    return m


def tensors(batch, hq, hkv, t, s, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, hkv, s, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hkv, s, d, generator=g, dtype=torch.float64)
    return q, k, v, SimpleNamespace(num_key_value_groups=hq // hkv, is_causal=True)


@pytest.mark.parametrize("t,s,window,hq,hkv,block,pad", [
    (37, 37, 6, 4, 1, 8, (0, 4)),     # a sliding window, GQA 4:1, 37 = 4 blocks of 8 + 5
    (37, 37, 6, 4, 1, 8, (4, 0)),     # the padded row first (a span from row 0 alone fails)
    (37, 37, None, 4, 2, 8, (0, 4)),  # causal with a mask
    (29, 41, 9, 2, 2, 5, (3, 0)),     # 12 past keys before the prompt
    (50, 50, 3, 6, 3, 16, (0, 7)),
])
def test_blocks_equal_the_float64_reference(t, s, window, hq, hkv, block, pad):
    q, k, v, module = tensors(2, hq, hkv, t, s)
    mask = mask_of(2, t, s, window, pad=pad)
    out, _ = prefill_attention(module, q, k, v, mask, scaling=0.3, block=block)
    want = reference(q, k, v, mask, 0.3)
    valid = mask.any(-1)[:, 0]  # [B, T] rows with a visible key (a fully padded row is undefined)
    assert (out - want)[valid].abs().max() < 1e-12
    one, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert (out - one)[valid].abs().max() < 1e-12


@pytest.mark.parametrize("s", [23, 64])
def test_causal_call_without_a_mask_is_blocked_causally(s):
    """No mask: upper-left causal as sdpa's is_causal, also with more keys than queries (a
    StaticCache prefill, whose keys past the prompt are empty slots)."""
    q, k, v, module = tensors(1, 4, 2, 23, s)
    out, _ = prefill_attention(module, q, k, v, None, scaling=0.5, block=4)
    allowed = torch.arange(s)[None, :] <= torch.arange(23)[:, None]
    assert (out - reference(q, k, v, allowed[None, None], 0.5)).abs().max() < 1e-12
    one, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.5)
    assert (out - one).abs().max() < 1e-12


def test_each_block_reads_only_its_visible_keys():
    """37 queries in blocks of 8 with a window of 6: five calls, each over at most 8 + 5 keys (a
    one-call implementation, or a span taken from one row, fails this or the reference test)."""
    q, k, v, module = tensors(2, 4, 1, 37, 37)
    mask = mask_of(2, 37, 37, window=6, pad=(0, 4))
    with mock.patch.object(blocked_attention, "sdpa_attention_forward", wraps=sdpa_attention_forward) as spy:
        prefill_attention(module, q, k, v, mask, scaling=0.3, block=8)
    spans = [c.args[2].shape[2] for c in spy.call_args_list]
    assert len(spans) == 5 and max(spans) <= 8 + 5 and spans[0] == 8


@pytest.mark.parametrize("why", ["short", "float mask", "not causal", "position bias"])
def test_calls_it_cannot_block_run_transformers_call_unchanged(why):
    t = 4 if why == "short" else 20
    q, k, v, module = tensors(1, 2, 2, t, t)
    mask, kwargs = mask_of(1, t, t), {}
    if why == "float mask":
        mask = torch.zeros(1, 1, t, t, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    if why == "not causal":
        mask, kwargs = None, {"is_causal": False}
    if why == "position bias":
        kwargs = {"position_bias": torch.zeros(1, 2, t, t, dtype=torch.float64)}
    with mock.patch.object(blocked_attention, "sdpa_attention_forward", wraps=sdpa_attention_forward) as spy:
        prefill_attention(module, q, k, v, mask, block=8, **kwargs)
    assert spy.call_count == 1 and spy.call_args.args[1].shape[2] == t


def test_key_span():
    rows = torch.zeros(2, 1, 3, 10, dtype=torch.bool)
    assert key_span(rows) is None
    rows[0, 0, 1, 4] = rows[1, 0, 2, 7] = True
    assert key_span(rows) == slice(4, 8)
