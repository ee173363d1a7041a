"""The transformers backend (hybridgen.hf) on four small random architectures (no hub).

The reference is transformers' own model (sdpa attention) with the same weights, in float64:
``full`` through the backend gives its greedy tokens and logits; lossless splits (hybrid-exact,
FlexGen at half the KV on the GPU) give ``full``'s; methods act only on the globally attending
layers; the decode-step pre-hook hands a method each global layer's input, from which the
backend's stand-in query equals the query the layer computes.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from hybridgen.hf import HFEngine
from hybridgen.methods import build_method
from hybridgen.methods.full import Full
from tests._hf_tiny import ARCHS, prompts, tiny_pair

NEW = 6
TOL = 1e-9
DECODE_TOL = 1e-5  # relative to the largest logit; a wrong position or window is off by > 1e-2


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    ours, ref = tiny_pair(request.param)
    return request.param, HFEngine(ours, name=request.param), ref


def reference(ref, ids, mask, new=NEW):
    with torch.no_grad():
        g = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return g.sequences[:, ids.shape[1]:], torch.stack(g.logits, 1)


def test_full_equals_transformers(pair):
    arch, engine, ref = pair
    ids, mask = prompts()
    tokens, logits = reference(ref, ids, mask)
    res = engine.generate(ids, "full", max_new_tokens=NEW, attention_mask=mask, return_logits=True)
    assert torch.equal(res.tokens, tokens)
    # the prefill is transformers' own attention: equal; decode steps run the method's attention
    # (float32 softmax statistics) and the logits come back in float32, as from transformers
    assert torch.equal(res.logits[:, 0], logits[:, 0].float())
    assert (res.logits.double() - logits.double()).abs().max() < DECODE_TOL * logits.abs().max()
    dense = engine.forward(ids, mask)
    assert torch.equal(dense[:, -1], logits[:, 0].float())


def test_blocked_prefill_equals_transformers(pair, monkeypatch):
    """A prompt of 18 tokens in query blocks of 4 (gemma3: window 6, left padding) gives
    transformers' tokens and, up to float64 rounding, its logits."""
    from hybridgen.hf import blocked_attention

    arch, engine, ref = pair
    ids, mask = prompts()
    tokens, logits = reference(ref, ids, mask)
    monkeypatch.setattr(blocked_attention, "PREFILL_BLOCK", 4)
    with mock.patch.object(blocked_attention, "sdpa_attention_forward",
                           wraps=blocked_attention.sdpa_attention_forward) as spy:
        res = engine.generate(ids, "full", max_new_tokens=NEW, attention_mask=mask, return_logits=True)
    assert any(1 < c.args[1].shape[2] <= 4 for c in spy.call_args_list)  # the prefill did run in blocks
    assert torch.equal(res.tokens, tokens)
    assert (res.logits[:, 0].double() - logits[:, 0]).abs().max() < 1e-6 * logits.abs().max()
    assert (res.logits.double() - logits.double()).abs().max() < DECODE_TOL * logits.abs().max()


@pytest.mark.parametrize("method,params", [("hybrid-exact", {}), ("flexgen", {"gpu_budget": 0.5})])
def test_lossless_split_equals_full(pair, method, params):
    arch, engine, _ = pair
    ids, mask = prompts()
    full = engine.generate(ids, "full", max_new_tokens=NEW, attention_mask=mask, return_logits=True)
    split = engine.generate(ids, build_method(method, **params), max_new_tokens=NEW, attention_mask=mask,
                            return_logits=True)
    assert split.peak_bytes_by_tier["dram"] > 0  # the KV really is split across tiers
    assert torch.equal(split.tokens, full.tokens)
    assert (split.logits - full.logits).abs().max() < DECODE_TOL * full.logits.abs().max()


def test_methods_hold_only_the_global_layers(pair):
    arch, engine, _ = pair
    ids = prompts(batch=1)[0]
    res = engine.generate(ids, "full", max_new_tokens=NEW)
    s = engine.spec
    per_layer = 2 * s.num_kv_heads * s.head_dim * (ids.shape[1] + NEW) * 8  # float64 K and V
    assert res.peak_bytes_by_tier["gpu"] == len(s.method_layers) * per_layer
    expected = {"gemma3": [1, 3, 4]}.get(arch, list(range(s.num_layers)))
    assert s.method_layers == expected


class _Recorder(Full):
    """Full attention that records each decode step's layer inputs and queries."""

    name = "full"

    def bind(self, ctx):
        super().bind(ctx)
        self.inputs, self.queries = {}, {}

    def on_layer_input(self, layer, hidden):
        self.inputs[layer] = hidden.clone()

    def decode(self, layer, q, k, v):
        self.queries[layer] = q.clone()
        return super().decode(layer, q, k, v)


def test_layer_input_hook_and_stand_in_query(pair):
    arch, engine, _ = pair
    ids, mask = prompts()
    rec = _Recorder()
    engine.generate(ids, rec, max_new_tokens=3, attention_mask=mask, keep=True)
    pos = (mask.sum(-1) + 1)[:, None]  # the last decode step fed the token at prompt length + 1
    try:
        assert sorted(rec.inputs) == list(range(len(engine.spec.method_layers)))
        for j, hidden in rec.inputs.items():
            q = engine.stand_in_query(j, hidden, pos)
            assert (q - rec.queries[j]).abs().max() < TOL * rec.queries[j].abs().max()
        # a stand-in from another layer's input is a different query: the check can fail
        other = engine.stand_in_query(0, rec.inputs[1], pos)
        assert (other - rec.queries[0]).abs().max() > 1e-3
    finally:
        engine.release()


def test_attention_weights_give_the_layers_projections(pair):
    from hybridgen.errors import ConfigError

    arch, engine, _ = pair
    if arch in ("qwen3", "gemma3"):  # q/k norms after the projection: refused, not silently wrong
        with pytest.raises(ConfigError, match="normalises q/k"):
            engine.attention_weights(0)
        return
    w = engine.attention_weights(1)
    x = torch.randn(2, 3, engine.spec.hidden_size, dtype=torch.float64)
    q = torch.nn.functional.linear(x, w.wq, w.bq)
    k = torch.nn.functional.linear(x, w.wk, w.bk)
    attn = engine.view.attention(1)
    if hasattr(attn, "qkv_proj"):
        ref_q, ref_k, _ = attn.qkv_proj(x).split((w.wq.shape[0], w.wk.shape[0], w.wv.shape[0]), -1)
    else:
        ref_q, ref_k = attn.q_proj(x), attn.k_proj(x)
    assert torch.allclose(q, ref_q) and torch.allclose(k, ref_k) and w.wk.shape[0] < w.wq.shape[0]


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streamingllm", "quest", "infinigen", "hybridgen",
                                    "shadowkv", "pyramidkv", "magicpig"])
def test_every_method_runs(pair, method):
    arch, engine, _ = pair
    ids, mask = prompts(length=40)
    res = engine.generate(ids, build_method(method), max_new_tokens=4, attention_mask=mask, return_logits=True)
    assert torch.isfinite(res.logits).all() and res.tokens.shape == (2, 4)


def test_rotary_adapter_is_the_models_rotation(pair):
    arch, engine, _ = pair
    if engine.rotary is None or engine.rotary.problem:
        pytest.skip("no full-dim rotary")
    pos = torch.arange(7)[None]
    x = torch.randn(1, 2, 7, engine.spec.head_dim, dtype=torch.float64)
    twice = engine.rotary.rotate(engine.rotary.rotate(x, pos), pos)
    assert (twice - engine.rotary.rotate(x, 2 * pos)).abs().max() < 1e-6  # a rotation composes
    assert (engine.rotary.rotate(x, pos) - x).abs().max() > 1e-2


def test_load_model_picks_the_backend_for_a_local_checkpoint(tmp_path):
    from hybridgen.errors import ConfigError
    from hybridgen.hf import HFModelSpec
    from hybridgen.model import load_model, model_spec

    ours, _ = tiny_pair("qwen3", dtype=torch.float32)
    ours.save_pretrained(str(tmp_path))
    engine = load_model(str(tmp_path), device="cpu")  # auto: Qwen3 is not a lean-engine family
    assert isinstance(engine, HFEngine) and isinstance(model_spec(str(tmp_path)), HFModelSpec)
    ids = prompts(batch=1)[0]
    direct = HFEngine(ours, name="direct").generate(ids, "full", max_new_tokens=3, return_logits=True)
    loaded = engine.generate(ids, "full", max_new_tokens=3, return_logits=True)
    assert torch.equal(loaded.tokens, direct.tokens) and torch.equal(loaded.logits, direct.logits)
    with pytest.raises(ConfigError) as info:
        load_model(str(tmp_path), device="cpu", backend="lean")
    assert "qwen3" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="backend"):
        load_model(str(tmp_path), device="cpu", backend="hf")
