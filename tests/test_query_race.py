"""The query race: a host worker reads a query only after its device->host copy has landed.

On CUDA, ``q.to('cpu', non_blocking=True)`` returns before the bytes arrive; a worker that
reads it at once can see stale memory. Every method hands its query over through
:class:`hybridgen.kv.transfer.DeviceToHost` (pinned buffer + event) and the worker waits on
the event. Here a fake copier emulates a copy still in flight on the CPU: the staged buffer
holds NaN until the fake event's ``synchronize()`` "lands" the copy, so a worker that read
before waiting would produce NaN, and the event records which thread waited."""
import threading

import pytest
import torch

from baselines.flexgen import FlexGen
from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.hybrid import HybridGen
from hybridgen.hybrid.exact import HybridExact
from hybridgen.kv.transfer import DeviceToHost, after_copy, wait_host
from hybridgen.methods import Budget
from hybridgen.testing import MethodDriver, dense_reference

POOL = CPUAttentionPool(workers=1)


class FakeEvent:
    """A copy in flight: ``synchronize()`` lands ``src`` into ``dst`` and logs the waiting thread."""

    def __init__(self, dst, src, log):
        self.dst, self.src, self.log = dst, src, log

    def synchronize(self):
        self.log.append(threading.current_thread().name)
        self.dst.copy_(self.src)


class InFlightCopier(DeviceToHost):
    """DeviceToHost whose copies have not landed until their event is waited on."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.log = []
        self.sent = 0

    def send(self, key, t):
        self.sent += 1
        staged = torch.full_like(t, float("nan"))
        return staged, FakeEvent(staged, t.clone(), self.log)


def test_device_to_host_on_cpu_passes_through():
    d2h = DeviceToHost(torch.device("cpu"))
    q = torch.randn(2, 4, 1, 8)
    out, ev = d2h.send(0, q)
    assert out is q and ev is None and d2h.bytes_sent == q.numel() * 4
    wait_host(None)
    assert after_copy(None, torch.add, q, 1).equal(q + 1)


def test_after_copy_waits_before_reading():
    log = []
    dst, src = torch.full((3,), float("nan")), torch.arange(3.0)
    assert after_copy(FakeEvent(dst, src, log), torch.sum, dst).item() == 3.0
    assert log == [threading.current_thread().name]


@pytest.mark.parametrize("make", [
    lambda: HybridExact(gpu_budget=Budget(tokens=6)),
    lambda: FlexGen(gpu_budget=Budget(tokens=6), attention_on="cpu"),
    lambda: HybridGen(gpu_budget=Budget(tokens=6), topk_ratio=1.0, min_topk=0, ship="logits"),
    lambda: HybridGen(gpu_budget=Budget(tokens=6), topk_ratio=1.0, min_topk=0, ship="partial"),
])
def test_worker_waits_on_the_query_copy_event(make):
    method = make()
    driver = MethodDriver(method, (2, 8, 2, 16, 40), 3, seed=1, pool=POOL)
    copier = InFlightCopier()
    method.q_down = copier  # the method's query copier, replaced on this instance only
    driver.prefill()
    for _ in range(3):
        driver.step()
    assert copier.sent == 3 * 2  # one query per layer and step went through the copier
    assert len(copier.log) == copier.sent
    assert all(name.startswith("hg-cpu-attn") for name in copier.log)  # waited on by the pool's worker
    for rec in driver.run.records:
        ref = dense_reference(rec, driver.ctx.scale)
        assert torch.isfinite(rec.out).all()
        assert float((rec.out - ref).abs().max() / ref.abs().max()) < 1e-4
    method.release()
