"""Random and dummy weights: determinism, statistics, finite activations, non-degenerate top-k."""
from __future__ import annotations

import pytest
import torch

from hybridgen.methods.full import Full
from hybridgen.attention import attention_logits
from hybridgen.model import load_model
from hybridgen.model.weights import _tile_fill


def test_tile_fill_is_periodic_with_offset():
    block = torch.arange(7, dtype=torch.float32)
    out = _tile_fill(torch.empty(5, 9), block, offset=3)
    assert torch.equal(out.flatten(), (torch.arange(45) + 3).remainder(7).float())
    small = _tile_fill(torch.empty(4), block, offset=5)
    assert small.tolist() == [5, 6, 0, 1]


@pytest.mark.parametrize("kind", ["random", "dummy"])
def test_weights_are_seeded_with_hf_like_statistics(kind):
    a = load_model("opt-125m", weights=kind, num_layers=2, device="cpu", seed=1)
    b = load_model("opt-125m", weights=kind, num_layers=2, device="cpu", seed=1)
    c = load_model("opt-125m", weights=kind, num_layers=2, device="cpu", seed=2)
    wa, wb, wc = (e.weights.layers[1].w_in for e in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert wa.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(a.weights.layers[0].attn_norm, torch.ones(768))
    assert torch.equal(a.weights.layers[0].qkv_b, torch.zeros(3 * 768))
    # layers and tensors differ from each other (no shared pattern)
    assert not torch.equal(a.weights.layers[0].w_in, a.weights.layers[1].w_in)
    assert a.weights.lm_head is a.weights.embed  # OPT ties embeddings


def test_dummy_rows_are_distinct():
    e = load_model("qwen2.5-0.5b", weights="dummy", num_layers=1, device="cpu")
    emb = e.weights.embed  # [151936, 896]: more rows than any short period would allow
    rows = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(0))[:3000]
    assert torch.unique(emb[rows], dim=0).shape[0] == 3000
    assert torch.linalg.matrix_rank(e.weights.layers[0].qkv[:64, :64].float()).item() == 64


class _Probe(Full):
    """Full attention recording the last prompt query and keys per layer, and layer-input maxima."""

    def bind(self, ctx):
        super().bind(ctx)
        self.qk, self.hidden_max = {}, []

    def prefill(self, layer, q, k, v, valid):
        super().prefill(layer, q, k, v, valid)
        self.qk[layer] = (q[:, :, -1:].float(), k.float())

    def on_layer_input(self, layer, hidden):
        self.hidden_max.append(float(hidden.float().abs().max()))


@pytest.mark.parametrize("name, num_layers, dtype", [
    ("opt-125m", None, torch.float32),        # all 12 layers
    ("qwen2.5-0.5b", None, torch.float32),    # all 24 layers, GQA 7:1
    ("llama-2-7b", 2, torch.bfloat16),        # a real 7B shape, truncated
])
def test_dummy_weights_finite_and_topk_non_degenerate(name, num_layers, dtype):
    e = load_model(name, weights="dummy", num_layers=num_layers, dtype=dtype, device="cpu")
    T = 32
    ids = torch.randint(0, e.spec.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    probe = _Probe()
    res = e.generate(ids, probe, 3, return_logits=True)
    L = e.spec.num_layers
    assert torch.isfinite(res.logits).all()
    assert len(probe.hidden_max) == 2 * L
    assert all(0 < h < 1e3 for h in probe.hidden_max)  # finite and far from fp16 overflow
    assert res.logits.std() > 0.01
    k = 4
    chosen = []
    for layer in (0, L - 1):
        q, keys = probe.qk[layer]
        logits = attention_logits(q, keys, e.spec.scale)[0, :, 0]  # [Hq, T]
        assert logits.std(-1).min() > 0.05  # spread, not flat
        top = logits.topk(k, -1).indices.sort(-1).values
        distinct = {tuple(t.tolist()) for t in top}
        assert len(distinct) >= e.spec.num_heads // 2  # heads choose differently
        assert distinct != {tuple(range(T - k, T))} and distinct != {tuple(range(k))}
        chosen.append(distinct)
    if L > 1:
        assert chosen[0] != chosen[1]  # layers choose differently
