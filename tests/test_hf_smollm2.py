"""On the real SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised): the transformers backend and the
lean engine run the same methods to the same result.

Identical greedy tokens for the lossless methods (full, hybrid-exact, FlexGen with all KV on
the host and at half), and identical kept sets for the evicting ones at a 20% budget (H2O's
kept positions per KV head after decoding; SnapKV's kept prompt keys per layer).
"""
from __future__ import annotations

import pytest
import torch

from hybridgen.methods import build_method
from hybridgen.model import load_model, smollm2

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
          "Within a few decades printers worked in more than two hundred European cities, and the price "
          "of a book fell so far that ordinary merchants could own")
NEW = 8


@pytest.fixture(scope="module")
def engines():
    path = smollm2.ensure_smollm2()
    lean = load_model("smollm2-135m", weights="real", dtype=torch.float32, device="cpu")
    hf = load_model(str(path), weights="real", dtype=torch.float32, device="cpu", backend="transformers")
    assert type(hf).__name__ == "HFEngine" and type(lean).__name__ == "Engine"
    ids, mask = lean.encode([PROMPT, PROMPT[40:]])  # a ragged, left-padded batch
    return lean, hf, ids, mask


@pytest.mark.parametrize("method,params", [("full", {}), ("hybrid-exact", {}), ("flexgen", {}),
                                           ("flexgen", {"gpu_budget": 0.5})])
def test_lossless_methods_give_the_lean_engines_tokens(engines, method, params):
    lean, hf, ids, mask = engines
    a = lean.generate(ids, build_method(method, **params), max_new_tokens=NEW, attention_mask=mask)
    b = hf.generate(ids, build_method(method, **params), max_new_tokens=NEW, attention_mask=mask)
    assert torch.equal(a.tokens, b.tokens)
    assert a.peak_bytes_by_tier == b.peak_bytes_by_tier  # the same ledger: same bytes per tier


def _kept(engine, method, ids, mask):
    m = build_method(method, budget=0.2)
    engine.generate(ids, m, max_new_tokens=NEW, attention_mask=mask, keep=True)
    try:
        if method == "h2o":  # kept prompt/decode positions per (row, KV head), as sets
            return [torch.sort(p.t, -1).values.clone() for p in m.pos]
        return [seg.k.clone() for seg in m.cache]  # SnapKV: the kept prompt keys (+ the new ones)
    finally:
        engine.release()


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_evicting_methods_keep_the_same_tokens(engines, method):
    lean, hf, ids, mask = engines
    a, b = _kept(lean, method, ids, mask), _kept(hf, method, ids, mask)
    assert len(a) == len(b) == 30
    for x, y in zip(a, b):
        if method == "h2o":
            assert torch.equal(x, y)
        else:
            assert x.shape == y.shape and (x - y).abs().max() < 1e-3 * x.abs().max()
