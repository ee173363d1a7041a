"""Cross-layer speculation helpers (hybridgen.hybrid.speculation): the positions a method keeps match
the engine's at every decode step (padded and unpadded prompts), so the stand-in query it
computes is the engine's; the stand-in quality tracker's trust rule."""
import json

import pytest
import torch

from hybridgen.methods.full import Full
from hybridgen.model import load_model
from hybridgen.hybrid.speculation import DecodePositions, StandInQuality, next_layer, stand_in_query

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=32,
                  num_hidden_layers=2, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=False)


class _Probe(Full):
    """Full attention that keeps DecodePositions and checks them, and the stand-in query built
    from them, against the engine's own positions at every layer input."""

    def bind(self, ctx):
        super().bind(ctx)
        self.positions = DecodePositions()
        self.checked = 0

    def prefill(self, layer, q, k, v, valid):
        if layer == 0:
            self.positions.start(valid, k.shape[0], k.shape[2], k.device)
        super().prefill(layer, q, k, v, valid)

    def on_layer_input(self, layer, hidden):
        eng = self.ctx.engine
        assert torch.equal(self.positions.current(), eng.current_positions)
        nxt = next_layer(self.ctx, layer)
        if nxt is not None:
            ours = stand_in_query(self.ctx, nxt, hidden, self.positions.current())
            assert torch.equal(ours, eng.stand_in_query(nxt, hidden, eng.current_positions))
        else:
            assert layer == self.ctx.num_layers - 1
        self.checked += 1

    def end_step(self):
        super().end_step()
        self.positions.advance()


@pytest.mark.parametrize("padded", [False, True])
def test_decode_positions_follow_the_engine(tmp_path, padded):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = load_model(str(tmp_path), weights="random", seed=1, tokenizer=False)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.long)
    if padded:
        mask[1, :5] = 0
    probe = _Probe()
    engine.generate(ids, probe, 4, attention_mask=mask)
    assert probe.checked == 3 * 2  # 3 decode steps (the first token comes from prefill) x 2 layers


def test_stand_in_quality_trusts_until_the_mean_cosine_drops():
    trace = {}
    q = StandInQuality(trace, min_cos=0.5)
    assert q.trusted(1) and q.mean() is None
    x = torch.randn(2, 4, 1, 8)
    q.record(1, x, x)    # cosine 1
    q.record(2, x, -x)   # cosine -1
    q.flush()
    assert trace == {"1": [pytest.approx(1.0)], "2": [pytest.approx(-1.0)]}
    assert q.trusted(1) and not q.trusted(2) and q.mean() == pytest.approx(0.0)
    assert q.by_layer() == {1: pytest.approx(1.0), 2: pytest.approx(-1.0)}
