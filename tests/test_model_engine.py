"""Engine numerics against transformers (tiny random models, fp32), padding, sampling, hooks."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hybridgen.methods.full import Full  # noqa: E402
from hybridgen.model import Engine, load_model  # noqa: E402

TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Make norms and biases non-trivial so they are tested (HF init sets them to 1 / 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


TINY = {
    "opt": ("OPTConfig", dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, ffn_dim=96,
                              num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                              init_std=0.1)),
    "opt-postnorm-proj": ("OPTConfig", dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                                            num_attention_heads=4, max_position_embeddings=128,
                                            word_embed_proj_dim=32, do_layer_norm_before=False, init_std=0.1)),
    "llama-gqa": ("LlamaConfig", dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                                      rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1)),
    "llama3-rope": ("LlamaConfig", dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        rope_theta=500000.0, initializer_range=0.1,
                                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, intermediate_size=96,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True, initializer_range=0.1)),
}


def make_checkpoint(kind: str, path, seed: int = 0, **save_kw):
    """A tiny random HF model of ``kind`` saved as safetensors in ``path``; returns the HF model (eval)."""
    cls_name, kwargs = TINY[kind]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(str(path), **save_kw)
    return model


@pytest.fixture(scope="module", params=list(TINY))
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    engine = load_model(str(path), weights="real", dtype=torch.float32, device="cpu")
    return request.param, hf, engine


def test_prefill_and_decode_logits_match_transformers(pair):
    kind, hf, engine = pair
    g = torch.Generator().manual_seed(1)
    T, steps = 21, 5
    seq = torch.randint(0, 300, (2, T + steps), generator=g)
    with torch.no_grad():
        ref = hf(seq).logits  # [B, T+steps, V]
    assert rel_err(engine.forward(seq), ref) < TOL, kind
    method = Full()
    first = engine.prefill(seq[:, :T], None, method, max_new_tokens=steps)
    assert rel_err(first, ref[:, T - 1]) < TOL, kind
    for i in range(steps):
        logits = engine.decode_step(seq[:, T + i], method)
        assert rel_err(logits, ref[:, T + i]) < TOL, (kind, i)
    engine.release()


def test_left_padded_batch_matches_unpadded_rows(pair):
    kind, _, engine = pair
    g = torch.Generator().manual_seed(2)
    lengths = [9, 17, 13]
    T = max(lengths)
    rows = [torch.randint(0, 300, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = r
        mask[b, T - len(r):] = 1
    batch = engine.generate(ids, "full", 6, attention_mask=mask, return_logits=True)
    for b, r in enumerate(rows):
        single = engine.generate(r[None], "full", 6, return_logits=True)
        assert torch.equal(batch.tokens[b], single.tokens[0]), (kind, b)
        assert rel_err(batch.logits[b], single.logits[0]) < TOL, (kind, b)
    # a split method sees the same padded batch through the same engine path
    from hybridgen.methods import build_method
    split = engine.generate(ids, build_method("hybrid-exact", gpu_budget=4, sinks=1), 6, attention_mask=mask,
                            return_logits=True)
    assert torch.equal(split.tokens, batch.tokens)
    assert rel_err(split.logits, batch.logits) < TOL
    # the dense reference path agrees on the padded batch's real positions too
    dense = engine.forward(ids, mask)
    assert rel_err(dense[:, -1], batch.logits[:, 0]) < TOL


def test_greedy_generation_matches_transformers(pair):
    kind, hf, engine = pair
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(3))
    ours = engine.generate(ids, "full", 8).tokens
    ref = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, 12:]
    assert torch.equal(ours, ref), kind


def test_attention_weights_are_hf_projections(pair):
    kind, hf, engine = pair
    sd = hf.state_dict()
    prefix = "model.decoder.layers.1.self_attn." if kind.startswith("opt") else "model.layers.1.self_attn."
    w = engine.attention_weights(1)
    assert torch.equal(w.wq, sd[prefix + "q_proj.weight"])
    assert torch.equal(w.wk, sd[prefix + "k_proj.weight"])
    assert torch.equal(w.wv, sd[prefix + "v_proj.weight"])
    assert torch.equal(w.wo, sd[prefix + ("out_proj" if kind.startswith("opt") else "o_proj") + ".weight"])
    if kind == "qwen2" or kind.startswith("opt"):
        assert torch.equal(w.bk, sd[prefix + "k_proj.bias"])
    else:
        assert w.bq is None and w.bo is None


class _Probe(Full):
    """Full attention that records, per layer, the stand-in query computed from the layer input
    in on_layer_input and the real query passed to decode."""

    def bind(self, ctx):
        super().bind(ctx)
        self.stand_in, self.real = {}, {}

    def on_layer_input(self, layer, hidden):
        eng = self.ctx.engine
        self.stand_in[layer] = eng.stand_in_query(layer, hidden, eng.current_positions)

    def decode(self, layer, q, k, v):
        self.real[layer] = q
        return super().decode(layer, q, k, v)


def test_stand_in_query_equals_layer_query(pair):
    kind, _, engine = pair
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: positions differ per row
    probe = _Probe()
    engine.generate(ids, probe, 3, attention_mask=mask, keep=True)
    for layer in range(engine.spec.num_layers):
        assert probe.real[layer].shape == (2, engine.spec.num_heads, 1, engine.spec.head_dim)
        assert rel_err(probe.stand_in[layer], probe.real[layer]) < 1e-6
    engine.release()


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tmp_path):
    make_checkpoint("llama-gqa", tmp_path, seed=5)
    engine = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=12, greedy=False, temperature=1.5)
    a = engine.generate(ids, "full", seed=11, **kw).tokens
    b = engine.generate(ids, "full", seed=11, **kw).tokens
    c = engine.generate(ids, "full", seed=12, **kw).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = engine.generate(ids, "full", 12).tokens
    nucleus = engine.generate(ids, "full", 12, greedy=False, top_p=1e-6, seed=3).tokens
    assert torch.equal(greedy, nucleus)


def test_sharded_checkpoint_and_truncated_layers(tmp_path):
    hf = make_checkpoint("qwen2", tmp_path, seed=7, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = load_model(str(tmp_path), dtype=torch.float32, device="cpu", num_layers=1)
    assert engine.spec.num_layers == 1 and len(engine.weights.layers) == 1
    d = {k: v for k, v in hf.config.to_dict().items() if k != "layer_types"}
    cfg = hf.config.__class__(**{**d, "num_hidden_layers": 1})
    small = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    small.load_state_dict(hf.state_dict(), strict=False)
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = small(ids).logits
    assert rel_err(engine.forward(ids), ref) < TOL


def test_generation_result_reports_phases_and_memory(tmp_path):
    make_checkpoint("llama-gqa", tmp_path, seed=9)
    engine = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 300, (2, 10), generator=torch.Generator().manual_seed(10))
    res = engine.generate(ids, "full", 5)
    assert res.tokens.shape == (2, 5) and res.logits is None
    assert len(res.step_s) == 4 and res.prefill_s > 0 and res.decode_s == pytest.approx(sum(res.step_s))
    s = engine.spec
    # full holds prompt + new tokens for K and V of every layer on the gpu tier
    expected = s.num_layers * 2 * 2 * s.num_kv_heads * (10 + 5) * s.head_dim * 4
    assert res.bytes_by_tier["gpu"] == expected
    assert res.peak_bytes_by_tier["gpu"] >= expected
    assert "gpu" in res.store_description or res.store_description
    assert engine._run is None  # released


def test_engine_is_importable_without_harness_extras():
    import subprocess
    import sys

    code = ("import sys; sys.modules['hydra'] = None; sys.modules['lm_eval'] = None; sys.modules['omegaconf'] = None\n"
            "import hybridgen.model as m; e = m.load_model('opt-125m', weights='dummy', num_layers=1, device='cpu')\n"
            "print(type(e).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == Engine.__name__


def test_chunked_prefill_is_exact(pair):
    kind, _, engine = pair
    ids = torch.randint(0, 300, (2, 23), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    whole = [engine.forward(ids), engine.forward(ids, mask)]
    engine.attn_chunk, engine.mlp_chunk = 5, 7
    try:
        chunked = [engine.forward(ids), engine.forward(ids, mask)]
        first = engine.generate(ids, "full", 1, attention_mask=mask, return_logits=True).logits[:, 0]
    finally:
        engine.attn_chunk, engine.mlp_chunk = 4096, 8192
    for a, b in zip(chunked, whole):
        assert rel_err(a, b) < 1e-5
    assert rel_err(first, whole[1][:, -1]) < 1e-5


def test_eos_stops_and_progress_bar(tmp_path, capsys):
    make_checkpoint("llama-gqa", tmp_path, seed=13)
    engine = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(14))
    free = engine.generate(ids, "full", 10, progress=True)
    assert "decode [full]" in capsys.readouterr().err
    eos = int(free.tokens[0, 2])  # row 0 emits it at step 2
    stopped = engine.generate(ids, "full", 10, eos_token_id=eos)
    n = stopped.tokens.shape[1]
    assert n <= 10 and torch.equal(stopped.tokens[0, :3], free.tokens[0, :3])
    assert (stopped.tokens[0, 3:] == eos).all()  # finished rows keep emitting eos
    if n < 10:
        assert (stopped.tokens[:, -1] == eos).all()  # stopped only once every row finished
    first1 = [i for i, t in enumerate(free.tokens[1].tolist()) if t == eos]
    upto = first1[0] + 1 if first1 else n
    assert torch.equal(stopped.tokens[1, :upto], free.tokens[1, :upto])


def test_bfloat16_close_to_transformers_bfloat16(tmp_path):
    hf = make_checkpoint("qwen2", tmp_path, seed=15).to(torch.bfloat16)
    engine = load_model(str(tmp_path), dtype=torch.bfloat16, device="cpu")
    assert engine.weights.layers[0].qkv.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(16))
    with torch.no_grad():
        ref = hf(ids).logits
    assert rel_err(engine.forward(ids), ref) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_cpu(tmp_path):
    make_checkpoint("llama-gqa", tmp_path, seed=17)
    cpu = load_model(str(tmp_path), dtype=torch.float32, device="cpu")
    gpu = load_model(str(tmp_path), dtype=torch.float32, device="cuda")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(18))
    a = cpu.generate(ids, "full", 6, return_logits=True)
    b = gpu.generate(ids, "hybrid-exact", 6, return_logits=True)
    assert torch.equal(a.tokens, b.tokens.cpu())
    assert rel_err(b.logits.cpu(), a.logits) < 1e-3  # TF32 / kernel differences
