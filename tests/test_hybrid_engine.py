"""`hybridgen` through the engine (tiny random Llama with GQA): top-k 1.0 equals `full` with
and without cross-layer pipelining; speculation runs, records cosines, and is exact-logit."""
import pytest
import torch

from hybridgen.hybrid import HybridGen
from hybridgen.methods import Budget
from hybridgen.eval.generation import teacher_forced_logits
from tests._tiny_llama import prompt as _prompt, tiny_llama

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_engine_topk_one_equals_full(engine, pipeline, per_head):
    ids, mask = _prompt()
    ref = engine.generate(ids, "full", max_new_tokens=12, attention_mask=mask, return_logits=True)
    m = HybridGen(gpu_budget=Budget(ratio=0.2), topk_ratio=1.0, pipeline=pipeline, per_head=per_head, min_topk=0,
                  min_stand_in_cos=0.0)
    lg = teacher_forced_logits(engine, m, ids, mask, ref.tokens)
    err = float((lg - ref.logits).abs().max() / ref.logits.abs().max())
    assert err < 1e-4
    if pipeline:
        assert m.stats["speculative_scans"] == 11 * 2  # layers 1 and 2 at each of 11 decode steps
        assert m.stats["exact_logit_recomputes"] >= 11 * 2
        cos = m.quality.by_layer()
        assert set(cos) == {1, 2} and all(-1.0 <= c <= 1.0 for c in cos.values())
        assert 0 not in cos  # layer 0 is not speculated
    else:
        assert m.stats["speculative_scans"] == 0


def test_engine_speculative_logits_run_and_stay_close(engine):
    ids, mask = _prompt(seed=1)
    ref = engine.generate(ids, "full", max_new_tokens=8, attention_mask=mask, return_logits=True)
    m = HybridGen(gpu_budget=Budget(ratio=0.2), topk_ratio=1.0, speculative_logits=True, min_topk=0,
                  min_stand_in_cos=0.0)
    lg = teacher_forced_logits(engine, m, ids, mask, ref.tokens)
    assert torch.isfinite(lg).all()
    assert m.stats["exact_logit_recomputes"] == 0 and m.stats["speculative_scans"] > 0
    # stand-in logits differ from the true ones, so the output differs from full (but is no garbage)
    assert not torch.allclose(lg[:, 1:], ref.logits[:, 1:], atol=1e-5)
    assert (lg.argmax(-1) == ref.logits.argmax(-1)).float().mean() > 0.5


def test_engine_default_settings_generate(engine):
    ids, mask = _prompt(seed=2)
    res = engine.generate(ids, HybridGen(), max_new_tokens=10, attention_mask=mask)
    assert res.tokens.shape == (2, 10)
    st = res.method_stats
    assert st["bytes_h2d"] > 0 and st["speculative_scans"] > 0 and st["cpu_branch_s"] > 0
    trace = st["trace"]["scheduler"]
    assert {d["step"] for d in trace} == {4, 8}  # decisions every 4 steps (9 decode steps)
    # the default's scheduler owns the top-k ratio and the three-way streamed fraction
    assert {d["knob"] for d in trace} == {"topk_ratio", "stream_ratio"} and st["streamed_tokens"] > 0
    assert 0 < st["stand_in_cos_mean"] <= 1.0


def test_poor_stand_in_layers_fall_back_to_the_true_query(engine):
    """A layer whose measured cosine is below min_stand_in_cos is scanned with the true query
    from then on (still exact with top-k 1.0), and its cosine keeps being recorded."""
    ids, mask = _prompt(seed=3)
    ref = engine.generate(ids, "full", max_new_tokens=6, attention_mask=mask, return_logits=True)
    m = HybridGen(gpu_budget=Budget(ratio=0.2), topk_ratio=1.0, min_topk=0, min_stand_in_cos=1.0)
    lg = teacher_forced_logits(engine, m, ids, mask, ref.tokens)
    assert m.stats["speculative_scans"] == 2  # layers 1 and 2 at the first decode step only
    assert all(len(v) == 5 for v in m.trace["cosine"].values())  # still measured at all 5 steps
    assert float((lg - ref.logits).abs().max() / ref.logits.abs().max()) < 1e-4
