"""`hybridgen` at the method level: top-k 1.0 equals `full`; a partial selection equals a
dense softmax over exactly the selected set; knobs, split moves, three-way and stats."""
import math
import random

import pytest
import torch

from hybridgen.methods.full import Full
from hybridgen.attention import dense_attention_reference
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.errors import ConfigError
from hybridgen.hybrid import HybridGen
from hybridgen.methods import Budget, build_method
from hybridgen.testing import drive, left_padding, method_context

POOL = CPUAttentionPool(workers=1)


def _ctx(shape, steps, dtype, layers=2):
    return method_context(shape, steps, dtype=dtype, layers=layers, pool=POOL)


def _run(method, shape, dtype, seed, steps, valid=None, between_steps=None):
    """Prefill + decode steps over 2 layers with seeded random q/k/v (hybridgen.testing).

    Returns [(layer, step, q, out, k_hist, v_hist)] where the histories hold every token
    the layer saw (prompt + decoded, in order).
    """
    run = drive(method, shape, steps, seed=seed, valid=valid, dtype=dtype, pool=POOL, after_step=between_steps)
    return [(r.layer, r.step, r.q, r.out, r.k, r.v) for r in run.records], run.ctx


def _max_rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_head", [False, True])
def test_topk_ratio_one_equals_full(seed, per_head):
    """Selecting every host token makes HybridGen exact, for any split, padding, backend and GQA shape."""
    gen = random.Random(seed)
    Hkv = gen.randint(1, 3)
    shape = (gen.randint(1, 3), Hkv * gen.choice((1, 2, 4)), Hkv, gen.choice((8, 16)), gen.randint(3, 40))
    B, Hq, _, D, T = shape
    steps = 5
    valid = left_padding(gen, B, T) if seed % 2 else None
    ref, _ = _run(Full(), shape, torch.float32, seed, steps, valid)
    for budget in (Budget(tokens=0), Budget(tokens=3), Budget(ratio=0.1), Budget(ratio=0.5)):
        for backend in ("torch", "numba"):
            m = HybridGen(gpu_budget=budget, sinks=gen.choice((0, 2)), topk_ratio=1.0, per_head=per_head,
                          scan_backend=backend, min_topk=0)
            outs, ctx = _run(m, shape, torch.float32, seed, steps, valid)
            for (_, _, _, out, _, _), (_, _, _, r, _, _) in zip(outs, ref):
                assert out.shape == (B, Hq, 1, D)
                assert _max_rel(out, r) < 1e-4, (budget, backend)
            assert m.stats["bytes_h2d"] > 0 or T - budget.resolve(T) <= 0
            m.release()
            assert ctx.store.bytes_by_tier() == {"gpu": 0, "dram": 0, "cxl": 0}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_topk_ratio_one_equals_full_low_precision(dtype):
    shape = (2, 8, 2, 16, 40)
    ref, _ = _run(Full(), shape, dtype, 3, 4)
    outs, _ = _run(HybridGen(gpu_budget=Budget(tokens=8), topk_ratio=1.0), shape, dtype, 3, 4)
    for (_, _, _, out, _, _), (_, _, _, r, _, _) in zip(outs, ref):
        assert out.dtype == dtype
        assert _max_rel(out, r) < 3e-2


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_partial_selection_equals_dense_softmax_over_selected_set(seed, per_head):
    """With a partial top-k the output is exactly softmax attention over {selected host} + GPU + new token."""
    gen = random.Random(100 + seed)
    shape = (2, 8, 2, 16, 60)
    B, Hq, Hkv, D, T = shape
    G = Hq // Hkv
    valid = left_padding(gen, B, T) if seed % 2 else None
    checked = []
    m2 = HybridGen(three_way=False, gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=0.2, per_head=per_head, min_topk=0)
    ctx = _ctx(shape, 3, torch.float32)
    m2.bind(ctx)
    g = torch.Generator().manual_seed(seed)
    rnd = (lambda *s: torch.randn(*s, generator=g))
    hist = []
    for layer in range(2):
        q, k, v = rnd(B, Hq, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D)
        m2.prefill(layer, q, k, v, valid)
        hist.append([k, v, valid if valid is not None else torch.ones(B, T, dtype=torch.bool)])
    for step in range(3):
        for layer in range(2):
            host = m2.host[layer]
            # token positions of the host segment: [sinks, sinks + host_len) in history order
            n_host = host.length
            host_pos = torch.cat([torch.arange(2, 2 + n_host - step), torch.arange(T - 8, T - 8 + step)]) \
                if step else torch.arange(2, 2 + n_host)
            q, k, v = rnd(B, Hq, 1, D), rnd(B, Hkv, 1, D), rnd(B, Hkv, 1, D)
            out = m2.decode(layer, q, k, v)
            off, idx = m2.last_selection[layer]
            kh = torch.cat([hist[layer][0], k], 2)
            vh = torch.cat([hist[layer][1], v], 2)
            vm = torch.cat([hist[layer][2], torch.ones(B, 1, dtype=torch.bool)], 1)
            Ttot = kh.shape[2]
            # allowed[b, h, t]: per query head when per_head, else per KV head broadcast to its group
            allowed = torch.zeros(B, Hq, Ttot, dtype=torch.bool)
            gpu_pos = [p for p in range(Ttot) if p not in set(host_pos.tolist())]
            allowed[:, :, gpu_pos] = True
            sel_pos = host_pos[off + idx]  # [B, Hsel, k]
            if not per_head:
                sel_pos = sel_pos.repeat_interleave(G, dim=1)
            allowed.scatter_(2, sel_pos, True)
            allowed &= vm[:, None, :]
            # reference per query head, computed with K/V repeated per head
            qh = q.reshape(B * Hq, 1, 1, D)
            kk = kh.repeat_interleave(G, dim=1).reshape(B * Hq, 1, Ttot, D)
            vv = vh.repeat_interleave(G, dim=1).reshape(B * Hq, 1, Ttot, D)
            r = dense_attention_reference(qh, kk, vv, D ** -0.5, allowed.reshape(B * Hq, 1, Ttot))
            assert _max_rel(out, r.reshape(B, Hq, 1, D)) < 1e-4
            checked.append(1)
            hist[layer][0], hist[layer][1], hist[layer][2] = kh, vh, vm
        m2.end_step()
    assert len(checked) == 6
    m2.release()


def test_selection_size_follows_ratio_and_min_topk():
    shape = (1, 4, 2, 8, 200)
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=20), sinks=4, topk_ratio=0.1, min_topk=0)
    _run(m, shape, torch.float32, 0, 1)
    off, idx = m.last_selection[0]
    assert off == 0 and idx.shape == (1, 2, 18)  # ceil(0.1 * 180)
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=20), sinks=4, topk_ratio=0.01, min_topk=16)
    _run(m, shape, torch.float32, 0, 1)
    assert m.last_selection[0][1].shape[-1] == 16
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=20), sinks=4, topk_ratio=0.1, per_head=True, min_topk=0)
    _run(m, shape, torch.float32, 0, 1)
    assert m.last_selection[0][1].shape == (1, 4, 18)


def test_bytes_h2d_counts_logits_and_rows():
    shape = (2, 8, 2, 16, 120)
    B, Hq, Hkv, D, T = shape
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=20), sinks=4, topk_ratio=0.1, min_topk=0)
    _run(m, shape, torch.float32, 0, 1)
    k = 10  # ceil(0.1 * 100)
    per_layer = B * Hq * k * 4 + B * Hkv * k * D * 4  # fp32 logits + V rows
    assert m.stats["bytes_h2d"] == 2 * per_layer
    assert m.stats["topk_selected"] == 2 * k


def test_scheduler_moves_ratio_and_trace_is_exposed():
    shape = (1, 4, 2, 8, 64)
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=8), sched_interval=2)
    _run(m, shape, torch.float32, 0, 6)
    trace = m.stats["trace"]["scheduler"]
    assert len(trace) == 3  # one decision every 2 steps, one unit ('all')
    for d in trace:
        assert d["knob"] == "topk_ratio" and d["layer"] == "all"
        assert 0.01 <= d["new"] <= 0.5 and d["new"] != d["old"]
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=8), topk_ratio=0.3, sched_interval=2)
    _run(m, shape, torch.float32, 0, 6)
    assert m.stats["trace"]["scheduler"] == []  # a pinned ratio is not scheduled


@pytest.mark.parametrize("new_windows", [(3, 9, 0, 12), (20, 1)])
def test_split_moves_keep_topk_one_exact(new_windows):
    """Moving the GPU/host split between steps (scheduler's split knob) loses no token."""
    shape = (2, 4, 2, 8, 30)
    valid = left_padding(random.Random(0), 2, 30)
    ref, _ = _run(Full(), shape, torch.float32, 5, 6, valid)

    def move(method, step):
        if step < len(new_windows):
            for layer in range(2):
                method._resize_window(layer, new_windows[step])

    m = HybridGen(gpu_budget=Budget(tokens=8), sinks=2, topk_ratio=1.0, min_topk=0)
    outs, ctx = _run(m, shape, torch.float32, 5, 6, valid, between_steps=move)
    for (_, _, _, out, _, _), (_, _, _, r, _, _) in zip(outs, ref):
        assert _max_rel(out, r) < 1e-4
    total = sum(m.gpu[l].length + m.host[l].length for l in range(2))
    assert total == 2 * (30 + 6)


def test_scan_window_limits_the_scan():
    shape = (1, 4, 2, 8, 300)
    m = HybridGen(three_way=False, gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=0.5, min_topk=0)
    _run(m, shape, torch.float32, 0, 1)
    m.scheduler.knobs["all"].window = 40
    before = m.stats["host_tokens_scanned"]
    g = torch.Generator().manual_seed(1)
    m.decode(0, torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g),
             torch.randn(1, 2, 1, 8, generator=g))
    off, idx = m.last_selection[0]
    host_len = m.host[0].length - 1  # the decode placed one more token
    assert off == host_len - 40 and idx.shape[-1] == 20 and int(idx.max()) < 40
    assert m.stats["host_tokens_scanned"] > before


def test_three_way_selects_a_share_of_every_host_token_beside_the_streamed_ones():
    """The top-k counts the streamed tokens too: streaming adds exact tokens to what the plain split
    attends and never shrinks its selection."""
    shape = (1, 4, 2, 8, 300)
    m = HybridGen(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=0.1, min_topk=0, three_way=True,
                  stream_ratio=0.3)
    _run(m, shape, torch.float32, 0, 2)
    n = m.host[0].length - 1  # host tokens when the last step scanned (it placed one more)
    n_stream = int(math.floor(0.3 * n))
    off, idx = m.last_selection[0]
    assert off == n_stream and int(idx.max()) < n - n_stream
    assert idx.shape[-1] == math.ceil(0.1 * n)  # not ceil(0.1 * (n - n_stream))


def test_three_way_topk_one_equals_full_and_counts_streamed_bytes():
    shape = (2, 8, 2, 16, 50)
    ref, _ = _run(Full(), shape, torch.float32, 2, 4)
    m = HybridGen(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=1.0, three_way=True, stream_ratio=0.25,
                  min_topk=0)
    outs, _ = _run(m, shape, torch.float32, 2, 4)
    for (_, _, _, out, _, _), (_, _, _, r, _, _) in zip(outs, ref):
        assert _max_rel(out, r) < 1e-4
    assert m.stats["streamed_tokens"] > 0
    off, _ = m.last_selection[0]
    host_before_last_decode = m.host[0].length - 1
    assert off == int(0.25 * host_before_last_decode)  # the scan starts after the streamed slice
    m2 = HybridGen(gpu_budget=Budget(tokens=10), sinks=2, topk_ratio=1.0, min_topk=0)
    _run(m2, shape, torch.float32, 2, 4)
    # a streamed token costs its K and V rows; a selected one its V row and G logits
    assert m.stats["bytes_h2d"] > m2.stats["bytes_h2d"]


def test_build_and_config_errors():
    m = build_method("hybridgen", gpu_budget="20%", per_head=True)
    assert m.gpu_budget == Budget(ratio=0.2) and m.config()["per_head"] is True
    shape = (1, 2, 1, 8, 10)
    for bad in (dict(topk_ratio=1.5), dict(mapping="nvme"), dict(group_score="mean"), dict(scan_backend="x"),
                dict(stream_ratio=2.0), dict(sinks=-1)):
        with pytest.raises(ConfigError):
            HybridGen(**bad).bind(_ctx(shape, 1, torch.float32))


def test_no_engine_means_no_speculation():
    m = HybridGen(gpu_budget=Budget(tokens=4), topk_ratio=0.5)
    _run(m, (1, 4, 2, 8, 20), torch.float32, 0, 2)
    assert m.stats["speculative_scans"] == 0 and m.trace["cosine"] == {}
