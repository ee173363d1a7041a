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

:func:`conformance` is what every method must satisfy, for a method author's own tests (equal
to ``full`` where it keeps everything, the store ledger equal to its footprint, offloaded equal
to resident, bad parameters refused); it returns a :class:`Conformance` report.
"""
from __future__ import annotations

import random
import time
import typing
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.errors import ConfigError
from hybridgen.kv import TieredStore
from hybridgen.methods import Budget, KVMethod, MethodContext, build_method
from hybridgen.methods.footprint import KVShape
from hybridgen.methods.params import field_types

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
                         store=store if store is not None else TieredStore(**(tiers or {}), gpu_device=device),
                         pool=pool,
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
    mask = None if rec.valid is None else rec.valid[:, None, :].to(rec.q.device)
    return dense_attention_reference(rec.q, rec.k, rec.v, scale, mask)


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 / 0 = 0)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den or 1.0)


# ---------------------------------------------------------------------------------------------
# Conformance: what every method must satisfy, callable from an outside package's own tests.
# ---------------------------------------------------------------------------------------------

@dataclass
class Conformance:
    """What :func:`conformance` checked (``passed``) and what it could not, with why (``skipped``);
    ``footprint``/``ledger``: the stated footprint's tier bytes and the store's peak per tier."""

    method: str
    passed: List[str] = field(default_factory=list)
    skipped: Dict[str, str] = field(default_factory=dict)
    footprint: Optional[Dict[str, int]] = None
    ledger: Optional[Dict[str, int]] = None


def _peak_and_outputs(method: KVMethod, shape: Shape, steps: int, layers: int, seed: int, valid: Tensor, pool):
    run = drive(method, shape, steps, seed=seed, valid=valid, layers=layers, pool=pool)
    peak = {t: n for t, n in run.ctx.store.peak_by_tier().items() if n}
    method.release()
    return run, peak


def _stated(method: KVMethod, shape: Shape, steps: int, layers: int) -> Optional[Dict[str, int]]:
    kv = KVShape(layers, shape.kv_heads, shape.head_dim, 4, shape.batch, shape.prompt_len + steps, steps)
    fp = method.footprint(kv)
    return None if fp is None else {t: int(n) for t, n in fp.tier_bytes.items() if n}


def bad_values(method: KVMethod) -> List[Dict[str, object]]:
    """One wrongly typed value per checked parameter (numbers, booleans, budgets, choices)."""
    out: List[Dict[str, object]] = []
    for name, tp in field_types(type(method)).items():
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        if isinstance(getattr(method, name), (bool, int, float, Budget)) or typing.get_origin(tp) is typing.Literal:
            out.append({name: "no-such-value-42"})
    return out


def conformance(factory: Callable[..., KVMethod], lossless_params: Optional[Dict[str, object]] = None, *,
                params: Optional[Dict[str, object]] = None, bad_params: Optional[Sequence[Dict[str, object]]] = None,
                shape: Union[Shape, Sequence[int]] = (2, 4, 2, 8, 40), steps: int = 4, layers: int = 2,
                seed: int = 0, tol: float = 1e-5, offload_modes: Sequence[str] = ("stream", "cpu")) -> Conformance:
    """Check a method against what every method must satisfy; raise AssertionError on a failure.

    factory(**params) builds the method (a class, or ``functools.partial(build_method, name)``);
    runs use seeded random q/k/v of ``shape`` (B, Hq, Hkv, D, T) in float32, ``layers`` layers,
    ``steps`` decode steps, left padding in every row but the first. Checks:

    - 'lossless': with ``lossless_params`` (where it keeps everything) every output equals
      ``full``'s and the float64 dense reference within ``tol`` (relative); None = skipped;
    - 'ledger': with ``params`` (default: its defaults) the store's peak bytes per tier equal
      ``footprint(shape).tier_bytes`` (skipped when the method states no footprint);
    - 'offloaded': for a method with an ``offload`` parameter, each of ``offload_modes``
      returns the resident outputs (to 1e-6) and its ledger equals its own footprint;
    - 'bad_params': each of ``bad_params`` (default: a wrongly typed value per number, boolean,
      budget or choice parameter) is refused with a one-line ConfigError when built.

    A method with ``projected_only`` (never run) is checked for its bad params and for refusing
    ``bind`` in one line. Returns the :class:`Conformance` report.
    """
    s, params = Shape.of(shape), dict(params or {})
    base = factory(**params)
    report = Conformance(base.name)
    for bad in (bad_values(base) if bad_params is None else bad_params):
        try:
            factory(**{**params, **bad})
        except ConfigError as err:
            assert "\n" not in str(err), f"{base.name}: the refusal of {bad} is not one line: {err}"
            continue
        raise AssertionError(f"{base.name}: bad parameters {bad} were accepted")
    report.passed.append("bad_params")
    valid = left_padding(random.Random(seed), s.batch, s.prompt_len, min_real=s.prompt_len // 2)
    if getattr(base, "projected_only", None):
        try:
            drive(base, s, 1, layers=layers, valid=valid)
        except ConfigError as err:
            assert "\n" not in str(err), f"{base.name}: bind's refusal is not one line"
            report.passed.append("refuses_to_run")
            report.skipped.update(lossless="projected only", ledger="projected only", offloaded="projected only")
            return report
        raise AssertionError(f"{base.name} is projected_only but ran")
    pool = CPUAttentionPool(workers=1)
    try:
        if lossless_params is None:
            report.skipped["lossless"] = "no lossless parameters given"
        else:
            got, _ = _peak_and_outputs(factory(**lossless_params), s, steps, layers, seed, valid, pool)
            ref, _ = _peak_and_outputs(build_method("full"), s, steps, layers, seed, valid, pool)
            for a, b in zip(got.records, ref.records):
                e_full, e_dense = rel_err(a.out, b.out), rel_err(a.out, dense_reference(a, got.ctx.scale))
                assert e_full <= tol and e_dense <= tol, (
                    f"{base.name}{lossless_params}: layer {a.layer} step {a.step} differs from full "
                    f"(rel err {e_full:.2e}) / the dense reference ({e_dense:.2e}), tol {tol:g}")
            report.passed.append("lossless")
        resident, peak = _peak_and_outputs(factory(**params), s, steps, layers, seed, valid, pool)
        report.ledger, report.footprint = peak, _stated(base, s, steps, layers)
        if report.footprint is None:
            report.skipped["ledger"] = "footprint not stated"
        else:
            assert peak == report.footprint, f"{base.name}: ledger peak {peak} != footprint {report.footprint}"
            report.passed.append("ledger")
        if "offload" not in {f for f in getattr(base, "__dataclass_fields__", {})}:
            report.skipped["offloaded"] = "no offload parameter"
            return report
        for mode in offload_modes:
            m = factory(**{**params, "offload": mode})
            run, peak = _peak_and_outputs(m, s, steps, layers, seed, valid, pool)
            for a, b in zip(run.records, resident.records):
                assert torch.allclose(a.out, b.out, rtol=1e-6, atol=1e-6), f"{base.name} offload={mode} != resident"
            stated = _stated(m, s, steps, layers)
            assert stated is None or peak == stated, f"{base.name} offload={mode}: ledger {peak} != footprint {stated}"
        report.passed.append("offloaded")
    finally:
        pool.shutdown()
    return report
