"""One driver for a KV method on given or random q/k/v, shared by the tests and the benchmarks.

Instead of building a :class:`~hybridgen.methods.MethodContext` by hand::

    run = drive(method, Shape(B, Hq, Hkv, D, T), steps=3, valid=mask, pool=pool)
    for rec in run.records:
        assert rel_err(rec.out, dense_reference(rec, run.ctx.scale)) < tol

Shapes (B batch, Hq query heads, Hkv KV heads with Hq = G * Hkv, D head dim, T prompt length,
s the decode step counted from 0):

- prefill of one layer: q [B, Hq, T, D], k and v [B, Hkv, T, D]; ``valid`` [B, T] bool
  (True = real token; left padding is False at the start of a row) or None;
- decode step of one layer: q [B, Hq, 1, D], k and v [B, Hkv, 1, D]; output [B, Hq, 1, D];
- a :class:`Record` keeps the step's q and output and, with ``history=True``, every key and
  value the layer has seen [B, Hkv, T + s + 1, D] and the validity of each [B, T + s + 1].

Random tensors are drawn from one ``torch.Generator(seed)`` on the CPU in a fixed order
(prefill: q, k, v of layer 0, 1, ...; then per step, per layer: q, k, v) in float32, cast to
``dtype`` and moved to ``device``, so two methods driven with the same seed see the same
inputs. :func:`dense_reference` is the float64 dense attention over a record's history.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from hybridgen.kv import TieredStore
from hybridgen.methods import KVMethod, MethodContext

QKV = Tuple[Tensor, Tensor, Tensor]
#: kv_fn(layer, positions [n], q, k) -> (q, k): e.g. rotate q and k to their positions
KVFn = Callable[[int, Tensor, Tensor, Tensor], Tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Shape:
    """Attention shape of a run: batch, query heads, KV heads, head dim, prompt length."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    prompt_len: int

    @classmethod
    def of(cls, shape: Union["Shape", Sequence[int]]) -> "Shape":
        """A Shape, or the tuple (B, Hq, Hkv, D, T) the tests write."""
        return shape if isinstance(shape, Shape) else cls(*(int(x) for x in shape))


def method_context(shape: Union[Shape, Sequence[int]], steps: int, *, layers: int = 2,
                   dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                   tiers: Optional[Dict[str, Optional[int]]] = None, store: Optional[TieredStore] = None,
                   pool=None, rotary=None, engine=None) -> MethodContext:
    """The MethodContext of ``layers`` layers of ``shape`` with room for ``steps`` decode steps.

    tiers: byte capacities of a fresh :class:`TieredStore`, e.g. {"gpu": 1 << 20, "dram": None}
    (None = unlimited); or pass ``store`` to share one. Softmax scale 1/sqrt(D).
    """
    s = Shape.of(shape)
    return MethodContext(num_layers=layers, num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                         scale=s.head_dim ** -0.5, batch_size=s.batch, prompt_len=s.prompt_len,
                         max_new_tokens=steps, dtype=dtype, compute_device=torch.device(device),
                         store=store if store is not None else TieredStore(**(tiers or {})), pool=pool,
                         rotary=rotary, engine=engine)


@dataclass
class Record:
    """One decode output of one layer (k, v, valid: the layer's history, None without history)."""

    layer: int
    step: int
    q: Tensor                 # [B, Hq, 1, D]
    out: Tensor               # [B, Hq, 1, D]
    k: Optional[Tensor]       # [B, Hkv, T + step + 1, D], the new token last
    v: Optional[Tensor]
    valid: Optional[Tensor]   # [B, T + step + 1] bool, or None when the prompt had no padding


@dataclass
class Run:
    """What :func:`drive` did: the bound context, every decode record (step-major, then layer),
    the prompt of each layer and each step's decode time in seconds (end_step excluded)."""

    ctx: MethodContext
    records: List[Record] = field(default_factory=list)
    prompt: List[QKV] = field(default_factory=list)
    step_s: List[float] = field(default_factory=list)


class MethodDriver:
    """Binds a method to a fresh context and feeds it prefill and decode steps.

    Each input is given or drawn at random (see the module docstring). ``history=False`` keeps
    no K/V history (benchmarks at long contexts); ``sync`` (e.g. ``torch.cuda.synchronize``)
    runs around each timed decode step.
    """

    def __init__(self, method: KVMethod, shape: Union[Shape, Sequence[int]], steps: int, *, seed: int = 0,
                 history: bool = True, kv_fn: Optional[KVFn] = None, sync: Optional[Callable[[], None]] = None,
                 **context) -> None:
        self.method, self.shape, self.history, self.kv_fn = method, Shape.of(shape), history, kv_fn
        self.sync = sync or (lambda: None)
        self.run = Run(method_context(self.shape, steps, **context))
        self.gen = torch.Generator().manual_seed(seed)
        self._hist: List[List[Optional[Tensor]]] = []
        self._valid: Optional[Tensor] = None
        self._step = 0
        method.bind(self.ctx)

    @property
    def ctx(self) -> MethodContext:
        return self.run.ctx

    def _rand(self, *size: int) -> Tensor:
        return torch.randn(*size, generator=self.gen).to(self.ctx.dtype).to(self.ctx.compute_device)

    def _qkv(self, n: int) -> QKV:
        s = self.shape
        return (self._rand(s.batch, s.heads, n, s.head_dim), self._rand(s.batch, s.kv_heads, n, s.head_dim),
                self._rand(s.batch, s.kv_heads, n, s.head_dim))

    def prefill(self, valid: Optional[Tensor] = None, qkv: Optional[Sequence[QKV]] = None) -> None:
        """Prefill every layer: ``qkv[layer]`` = (q [B,Hq,T,D], k, v [B,Hkv,T,D]), else random."""
        T = self.shape.prompt_len
        for layer in range(self.ctx.num_layers):
            q, k, v = qkv[layer] if qkv is not None else self._qkv(T)
            if self.kv_fn is not None:
                q, k = self.kv_fn(layer, torch.arange(T), q, k)
            self.method.prefill(layer, q, k, v, valid)
            self.run.prompt.append((q, k, v))
            self._hist.append([k, v] if self.history else [None, None])
        self._valid = valid

    def step(self, qkv: Optional[Sequence[QKV]] = None, end_step: bool = True) -> List[Tensor]:
        """One decode step of every layer (``qkv[layer]``: q [B,Hq,1,D], k, v [B,Hkv,1,D], else
        random), timed into ``run.step_s``, then ``end_step()``; returns the outputs per layer."""
        pos = self.shape.prompt_len + self._step
        if self._valid is not None and self.history:
            self._valid = torch.cat([self._valid, self._valid.new_ones(self._valid.shape[0], 1)], 1)
        inputs = [qkv[layer] if qkv is not None else self._qkv(1) for layer in range(self.ctx.num_layers)]
        if self.kv_fn is not None:
            inputs = [(*self.kv_fn(layer, torch.tensor([pos]), q, k), v) for layer, (q, k, v) in enumerate(inputs)]
        outs = []
        self.sync()
        t0 = time.perf_counter()
        for layer, (q, k, v) in enumerate(inputs):
            outs.append(self.method.decode(layer, q, k, v))
        self.sync()
        self.run.step_s.append(time.perf_counter() - t0)
        for layer, ((q, k, v), out) in enumerate(zip(inputs, outs)):
            hist = self._hist[layer]
            if self.history:
                hist[0], hist[1] = torch.cat([hist[0], k], 2), torch.cat([hist[1], v], 2)
            self.run.records.append(Record(layer, self._step, q, out, hist[0], hist[1],
                                           self._valid if self.history else None))
        if end_step:
            self.method.end_step()
        self._step += 1
        return outs


def drive(method: KVMethod, shape: Union[Shape, Sequence[int]], steps: int, *, seed: int = 0,
          valid: Optional[Tensor] = None, kv_fn: Optional[KVFn] = None,
          after_step: Optional[Callable[[KVMethod, int], None]] = None, release: bool = False,
          **context) -> Run:
    """Bind ``method``, prefill every layer and run ``steps`` decode steps on seeded random q/k/v.

    context: :func:`method_context`'s keywords (layers=2, dtype, device, tiers, store, pool,
    rotary, engine). after_step(method, step) runs after each step's end_step(); release=True
    calls ``method.release()`` at the end.
    """
    driver = MethodDriver(method, shape, steps, seed=seed, kv_fn=kv_fn, **context)
    driver.prefill(valid)
    for step in range(steps):
        driver.step()
        if after_step is not None:
            after_step(method, step)
    if release:
        method.release()
    return driver.run


def left_padding(gen: random.Random, batch: int, prompt_len: int, min_real: int = 1) -> Tensor:
    """valid [B, T] bool: row 0 unpadded, the others with random left padding (>= min_real real tokens)."""
    valid = torch.ones(batch, prompt_len, dtype=torch.bool)
    for b in range(1, batch):
        valid[b, : gen.randint(0, prompt_len - min_real)] = False
    return valid


def dense_reference(rec: Record, scale: float) -> Tensor:
    """Float64 dense attention of the record's query over its whole history [B, Hq, 1, D]."""
    from hybridgen.attention import dense_attention_reference

    if rec.k is None or rec.v is None:
        raise ValueError("the run kept no K/V history (MethodDriver(history=False))")
    mask = None if rec.valid is None else rec.valid[:, None, :]
    return dense_attention_reference(rec.q, rec.k, rec.v, scale, mask)
