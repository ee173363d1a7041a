"""`hybridgen`'s [out, lse] option and scheduled three-way split, at the method level and
through the engine: ship='partial' equals the one-softmax path on the same selection; the
three-way split equals `full` when everything is selected, with the streamed fraction chosen
by the scheduler and the copy started a layer ahead; bytes shipped per step per mode."""
import random

import pytest
import torch

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.hybrid.ship import selected_partial
from hybridgen.hybrid import HybridGen
from hybridgen.methods import Budget
from hybridgen.methods.full import Full
from hybridgen.eval.generation import teacher_forced_logits
from hybridgen.hybrid.scheduler import FeedbackScheduler, SchedulerConfig
from hybridgen.testing import MethodDriver, drive, left_padding
from tests._tiny_llama import prompt, tiny_llama

POOL = CPUAttentionPool(workers=1)


def _max_rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


def _outs(method, shape, steps, seed, valid=None, dtype=torch.float32, layers=2):
    run = drive(method, shape, steps, seed=seed, valid=valid, dtype=dtype, pool=POOL, layers=layers)
    return [r.out for r in run.records]


# ---------------------------------------------------------------- [out, lse]
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("per_head", [False, True])
def test_partial_ship_equals_one_softmax_on_same_selection(seed, per_head):
    gen = random.Random(seed)
    shape = (2, 8, 2, 16, gen.randint(40, 90))
    valid = left_padding(gen, 2, shape[-1]) if seed % 2 else None
    kw = dict(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=0.2, per_head=per_head, min_topk=0)
    a, b = HybridGen(ship="logits", **kw), HybridGen(ship="partial", **kw)
    out_a, out_b = _outs(a, shape, 4, seed, valid), _outs(b, shape, 4, seed, valid)
    for layer in range(2):  # both saw the same selection
        assert torch.equal(a.last_selection[layer][1], b.last_selection[layer][1])
    for x, y in zip(out_a, out_b):
        assert _max_rel(y, x) < 1e-5


def test_partial_ship_low_precision_and_topk_one_equals_full():
    shape = (2, 8, 2, 16, 48)
    ref = _outs(Full(), shape, 3, 1, dtype=torch.bfloat16)
    one = _outs(HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=1.0, ship="partial", min_topk=0), shape, 3, 1,
                dtype=torch.bfloat16)
    for x, r in zip(one, ref):
        assert x.dtype == torch.bfloat16 and _max_rel(x, r) < 3e-2


def test_selected_partial_handles_masked_heads():
    logits = torch.tensor([[[0.5, float("-inf")], [float("-inf"), float("-inf")]]])  # [1, 2, 2]
    v = torch.randn(1, 1, 2, 4)  # shared rows (Hsel=1, G=2)
    out, lse = selected_partial(logits, v)
    assert torch.allclose(out[0, 0], v[0, 0, 0]) and float(lse[0, 0]) == pytest.approx(0.5)
    assert torch.all(out[0, 1] == 0) and lse[0, 1] == float("-inf")


def test_ship_bytes_per_step_both_modes():
    B, Hq, Hkv, D, T = shape = (2, 8, 2, 16, 120)
    k = 10  # ceil(0.1 * (120 - 20))
    per_layer = {"logits": B * Hq * k * 4 + B * Hkv * k * D * 4, "partial": B * Hq * D * 4 + B * Hq * 4}
    for ship, nbytes in per_layer.items():
        m = HybridGen(three_way=False, gpu_budget=Budget(tokens=20), sinks=4, topk_ratio=0.1, min_topk=0, ship=ship)
        _outs(m, shape, 1, 0)
        assert m.stats["decode_steps"] == 1
        assert m.ship_bytes_per_step() == 2 * nbytes  # two layers
        assert m.stats["bytes_h2d"] == 2 * nbytes


# ---------------------------------------------------------------- three-way
def test_scheduled_three_way_topk_one_equals_full():
    shape = (2, 8, 2, 16, 60)
    valid = left_padding(random.Random(3), 2, 60)
    ref = _outs(Full(), shape, 9, 4, valid)
    for ship in ("logits", "partial"):
        m = HybridGen(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=1.0, three_way=True, min_topk=0,
                      sched_interval=2, ship=ship)
        outs = _outs(m, shape, 9, 4, valid)
        for x, r in zip(outs, ref):
            assert _max_rel(x, r) < 1e-4
        assert m.stats["streamed_tokens"] > 0
        moves = [d for d in m.trace["scheduler"] if d["knob"] == "stream_ratio"]
        assert moves and all(0.0 <= d["new"] <= 0.9 for d in moves)  # the scheduler owns the fraction
        assert m.scheduler.stream_fraction(0) == moves[-1]["new"]
        m.release()


def test_three_way_prefetch_a_layer_ahead_equals_full():
    """on_layer_input(l) starts layer l + 1's copy; decode(l + 1) only waits for it."""
    B, Hq, Hkv, D, T = shape = (1, 4, 2, 8, 50)
    layers, steps = 3, 4
    ref = _outs(Full(), shape, steps, 7, layers=layers)
    m = HybridGen(gpu_budget=Budget(tokens=8), sinks=2, topk_ratio=1.0, three_way=True, stream_ratio=0.3,
                  pipeline=False, min_topk=0)
    driver = MethodDriver(m, shape, steps, seed=7, layers=layers, pool=POOL)
    driver.prefill()
    hidden = torch.zeros(B, 1, 16)
    outs = []
    for _ in range(steps):
        inputs = [driver._qkv(1) for _ in range(layers)]
        for layer, (q, k, v) in enumerate(inputs):
            m.on_layer_input(layer, hidden)
            if layer + 1 < layers:
                assert m.streams.pending(layer + 1)  # started a layer ahead
            outs.append(m.decode(layer, q, k, v))
        m.end_step()
    for x, r in zip(outs, ref):
        assert _max_rel(x, r) < 1e-4
    n_host = m.host[0].length - 1
    assert m.last_selection[0][0] == int(0.3 * n_host)
    m.release()
    assert m.ctx.store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


def test_scheduler_balances_scan_and_copy():
    cfg = SchedulerConfig(interval=1, adapt_ratio=False, adapt_stream=True, start_stream=0.1, stream_damping=0.5)
    s = FeedbackScheduler(cfg, num_layers=2)
    n = 1000
    for _ in range(12):  # CPU: 2 us per scanned token; PCIe: 1 us per streamed token -> f* = 2/3
        f = s.stream_fraction(0)
        for layer in range(2):
            s.record(layer, 2e-6 * (1 - f) * n, 1e-3)
            s.record_stream(layer, 2e-6 * (1 - f) * n, int((1 - f) * n), 1e-6 * f * n, max(1, int(f * n)))
        s.end_step()
    assert s.stream_fraction(1) == pytest.approx(2 / 3, abs=0.01)
    assert [d["knob"] for d in s.trace] and all(d["knob"] == "stream_ratio" for d in s.trace)
    pinned = FeedbackScheduler(SchedulerConfig(interval=1, adapt_stream=False), 1)
    pinned.record_stream(0, 1.0, 10, 1.0, 10)
    pinned.end_step()
    assert pinned.stream_fraction(0) == SchedulerConfig().start_stream


def test_three_way_layer_cost_is_modelled():
    from hybridgen.perf import Workload, fastest_setting, predict_step

    m = HybridGen(topk_ratio=0.05, three_way=True)
    p = predict_step(m, "llama-3.1-8b", Workload(), "h200-host")
    m2 = HybridGen(topk_ratio=0.05, three_way=True, stream_ratio=0.0)
    p2 = predict_step(m2, "llama-3.1-8b", Workload(), "h200-host")
    assert p.cost == "hybridgen-three-way" and p2.cost == "hybridgen-three-way"
    assert p.total_s <= p2.total_s  # the balanced split is never worse than streaming nothing
    assert p.breakdown["stream_ratio"] > 0 and p2.breakdown["stream_ratio"] == 0
    partial = predict_step(HybridGen(topk_ratio=0.05, ship="partial"), "llama-3.1-8b", Workload(), "h200-host")
    logits = predict_step(HybridGen(topk_ratio=0.05, ship="logits"), "llama-3.1-8b", Workload(), "h200-host")
    assert partial.breakdown["h2d_bytes"] < logits.breakdown["h2d_bytes"]
    assert fastest_setting(HybridGen(topk_ratio=0.05), "ship", ("logits", "partial"), "llama-3.1-8b", Workload(),
                           "h200-host") in ("logits", "partial")


# ---------------------------------------------------------------- through the engine (pipelined)
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama-ship"))


def test_engine_pipelined_partial_equals_logits_and_three_way_equals_full(engine):
    ids, mask = prompt()
    ref = engine.generate(ids, "full", max_new_tokens=8, attention_mask=mask, return_logits=True)
    kw = dict(gpu_budget=Budget(ratio=0.2), topk_ratio=0.1, three_way=False, min_topk=0, min_stand_in_cos=0.0)
    a = teacher_forced_logits(engine, HybridGen(ship="logits", **kw), ids, mask, ref.tokens)
    mb = HybridGen(ship="partial", **kw)
    b = teacher_forced_logits(engine, mb, ids, mask, ref.tokens)
    assert mb.stats["speculative_scans"] > 0 and mb.stats["exact_logit_recomputes"] > 0
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    m3 = HybridGen(gpu_budget=Budget(ratio=0.2), topk_ratio=1.0, three_way=True, min_topk=0, min_stand_in_cos=0.0,
                   ship="partial", sched_interval=2)
    c = teacher_forced_logits(engine, m3, ids, mask, ref.tokens)
    assert float((c - ref.logits).abs().max() / ref.logits.abs().max()) < 1e-4
    assert m3.stats["streamed_tokens"] > 0


class PackedStager:
    """Stands in for HostToDevice's async path on the CPU: staging buffers are plain memory and a
    send copies (so the packed ship buffer, its views and their unpacking on the 'device' run)."""

    def __init__(self):
        self.async_mode = True
        self.device = torch.device("cpu")
        self.sends = []

    def staging(self, key, numel, dtype):
        return torch.empty(max(numel, 1), dtype=dtype)[:numel]

    def send(self, key, t, copy=False):
        self.sends.append((key, t.dtype, t.numel()))
        return t.clone(), None

    def wait_event(self, event):
        assert event is None


@pytest.mark.parametrize("ship", ["logits", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_ship_buffer_equals_unpacked(ship, dtype):
    """The async path packs what a layer ships into ONE staging buffer (one copy per layer)."""
    shape = (2, 8, 2, 16, 70)
    kw = dict(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=0.2, min_topk=0, ship=ship)
    ref = _outs(HybridGen(**kw), shape, 3, 5, dtype=dtype)
    m = HybridGen(**kw)
    driver = MethodDriver(m, shape, 3, seed=5, dtype=dtype, pool=POOL)
    m.stager = m.packer.stager = PackedStager()  # this instance only
    driver.prefill()
    outs = [o for _ in range(3) for o in driver.step()]
    for x, r in zip(outs, ref):
        assert torch.equal(x, r)
    assert len(m.stager.sends) == 3 * 2 and all(dt == torch.uint8 for _, dt, _ in m.stager.sends)
    m.release()


def test_ship_and_stream_ratio_are_typed():
    from hybridgen.errors import ConfigError
    from hybridgen.methods import build_method

    assert build_method("hybridgen", ship="partial", stream_ratio="0.25").stream_ratio == 0.25
    assert HybridGen().ship == "logits" and HybridGen().stream_ratio is None
    for bad in (dict(ship="bytes"), dict(stream_ratio=1.5)):
        with pytest.raises(ConfigError):
            build_method("hybridgen", **bad)
