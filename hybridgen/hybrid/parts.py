"""The variants of HybridGen's decode step as composed parts, chosen once at bind time.

:class:`~hybridgen.hybrid.method.HybridGen` reads each option once, in :func:`compose`, and
its step calls the parts without testing a flag:

- the host split (``three_way``): :class:`PlainSplit` (the CPU scans every host token) or
  :class:`ThreeWaySplit` (the oldest share is streamed to the GPU a layer ahead,
  :mod:`hybridgen.hybrid.stream_slice`, and attended there as one more softmax part);
- the scan (``key_sketch``): :class:`KeyScan` (the host keys) or :class:`SketchScan` (an
  int8/int4 sketch per host segment, :class:`~hybridgen.attention.key_sketch.KeySketch`),
  either reading the keys at the precision of ``scan`` for the KV dtype
  (:func:`~hybridgen.hybrid.host_branch.scan_precision`: 'bf16dot' for bf16 keys by default);
- the logits a speculative scan ships (``speculative_logits``): :class:`TrueQueryLogits` (the
  true query goes down at the layer and the selected rows' logits are recomputed from it)
  or :class:`StandInLogits` (the stand-in query's logits are used as they are);
- the lookahead (``pipeline``): :class:`Lookahead` (the next layer's scan starts a layer
  ahead with a stand-in query) or :class:`NoLookahead`;
- the ship (``ship``): :class:`~hybridgen.hybrid.ship.LogitsShip` or :class:`~hybridgen.hybrid.ship.PartialShip`.

Shapes: q [B, Hq, 1, D]; host K/V [B, Hkv, n, D]; a softmax part is (logits [B, Hq, 1, m],
values [B, H, m, D]) as :func:`hybridgen.attention.softmax_over_parts` takes it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor

from hybridgen.attention import attention_logits
from hybridgen.attention.key_sketch import KeySketch, check_head_dim
from hybridgen.attention.partial import _mask_logits
from hybridgen.hybrid.host_branch import scan_precision
from hybridgen.hybrid.memory import gpu_share_tokens, host_capacity, max_stream_fraction, stream_capacity
from hybridgen.hybrid.scheduler import SchedulerConfig
from hybridgen.hybrid.ship import ShipPacker, ship_packer
from hybridgen.hybrid.speculation import next_layer, stand_in_query
from hybridgen.kv import KVSegment

Part = Tuple[Tensor, Tensor]


# ---------------------------------------------------------------------- host split
class PlainSplit:
    """Every host token is scanned by the CPU; nothing is streamed."""

    adapts_stream = False

    def __init__(self, method: Any):
        self.m = method

    def fraction(self, layer: int) -> float:
        """Share of ``layer``'s host tokens streamed to the GPU."""
        return 0.0

    def on_prefill(self, layer: int, k: Tensor, with_mask: bool) -> None:
        """Called after ``layer``'s segments are allocated (k [B, Hkv, T, D]: the prompt's keys)."""

    def prefetch(self, layer: int) -> None:
        """Start ``layer``'s streamed copy, if any (called a layer ahead)."""

    def streamed_parts(self, layer: int, q: Tensor) -> List[Part]:
        """The softmax parts of ``layer``'s streamed slice (none here)."""
        return []


class ThreeWaySplit(PlainSplit):
    """The oldest ``fraction`` of a layer's host tokens is copied to the GPU a layer ahead and
    attended there with exact logits; the CPU scans the rest. The fraction is ``stream_ratio``,
    or the scheduler's (which balances the CPU scan against the PCIe copy)."""

    def __init__(self, method: Any):
        super().__init__(method)
        self.adapts_stream = method.stream_ratio is None

    def fraction(self, layer: int) -> float:
        m = self.m
        if m.stream_ratio is not None:
            return m.stream_ratio
        return m.scheduler.stream_fraction(layer) if m.scheduler is not None else SchedulerConfig().start_stream

    def on_prefill(self, layer: int, k: Tensor, with_mask: bool) -> None:
        """Layer 0 reserves the device slots at their largest size (:mod:`hybridgen.hybrid.memory`)."""
        m = self.m
        if layer != 0:
            return
        B, H, T, D = k.shape
        tokens = stream_capacity(host_capacity(m.ctx.max_len, gpu_share_tokens(m.gpu_budget, T, m.ctx.max_len)),
                                 max_stream_fraction(m.stream_ratio))
        if tokens:
            m.streams.reserve(min(m.ctx.num_layers, 2), B, H, D, k.dtype, tokens, with_mask)

    def prefetch(self, layer: int) -> None:
        m = self.m
        if layer >= m.ctx.num_layers or m.host[layer] is None:
            return
        n_stream = m.scan_range(layer)[0]
        if n_stream and not m.streams.pending(layer):
            m.count("bytes_h2d", m.streams.start(layer, m.host[layer], n_stream))

    def streamed_parts(self, layer: int, q: Tensor) -> List[Part]:
        m = self.m
        self.prefetch(layer)  # no-op when on_layer_input started it a layer ahead
        n_stream = m.scan_range(layer)[0]
        if not n_stream:
            return []
        ks, vs, ms = m.streams.get(layer)
        m.count("streamed_tokens", n_stream)
        return [(_mask_logits(attention_logits(q, ks, m.ctx.scale), ms, m.ctx.num_kv_heads), vs)]


# ---------------------------------------------------------------------- scan
class KeyScan:
    """The CPU scans the host keys themselves at ``precision`` ('exact' or 'bf16dot': the
    bf16-dot scan's ceil(oversample * k) candidates re-ranked by exact logits). exact: the
    selection's logits are exact (those of a kernel computing in the KV dtype are not: the
    selected rows' logits are then recomputed); a bf16-dot scan's are, after the re-rank."""

    def __init__(self, exact: bool, precision: str = "exact"):
        self.precision = precision
        self.exact = exact or precision == "bf16dot"

    def on_prefill(self, layer: int, host: KVSegment) -> None:
        """Called when ``layer``'s host segment is allocated."""

    def sketch(self, layer: int, host: KVSegment) -> Optional[KeySketch]:
        """The sketch the scan reads for ``layer`` (brought up to date), or None."""
        return None

    def release(self) -> None:
        """Return what the scan allocated."""


class SketchScan(KeyScan):
    """The CPU scans an int8/int4 sketch of the host keys (one per host segment, on its key
    tier) and re-ranks its candidates by exact logits. Built at bind time: a head dim the sketch
    cannot hold is a ConfigError naming the fix (``key_sketch='none'``) before any KV exists."""

    def __init__(self, kind: str, num_layers: int, head_dim: int, precision: str = "exact"):
        check_head_dim(kind, head_dim)
        super().__init__(exact=True, precision=precision)
        self.kind = kind
        self.sketches: List[Optional[KeySketch]] = [None] * num_layers

    def on_prefill(self, layer: int, host: KVSegment) -> None:
        B, H, D = host.shape
        self.sketches[layer] = KeySketch(host.key_tier, self.kind, B, H, D, host.capacity,
                                         f"layer{layer}/host/sketch")

    def sketch(self, layer: int, host: KVSegment) -> Optional[KeySketch]:
        sk = self.sketches[layer]
        sk.sync(host.k)
        return sk

    def release(self) -> None:
        for sk in self.sketches:
            if sk is not None:
                sk.release()
        self.sketches = [None] * len(self.sketches)


# ---------------------------------------------------------------------- a speculative scan's logits
class TrueQueryLogits:
    """A scan started a layer ahead with a stand-in query keeps its key rows; at the layer the
    true query goes down and the selected rows' logits are recomputed from it."""

    keep_keys = True

    def __init__(self, method: Any):
        self.m = method

    def send(self, layer: int, q: Tensor) -> Tuple[Optional[Tensor], Any]:
        """The true query q on the host (read after its copy event) for ``layer``."""
        q_true, ready = self.m.q_down.send((layer, "true"), q)
        self.m.count("bytes_d2h", q.numel() * q.element_size())
        return q_true, ready


class StandInLogits:
    """A speculative scan's logits (from the stand-in query) enter the softmax as they are."""

    keep_keys = False

    def send(self, layer: int, q: Tensor) -> Tuple[Optional[Tensor], Any]:
        return None, None


# ---------------------------------------------------------------------- cross-layer lookahead
class NoLookahead:
    """Every layer's CPU branch starts at the layer, with the true query."""

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        """At layer ``layer``'s input (hidden [B, 1, hidden] while decoding)."""

    def at_layer(self, layer: int, q: Tensor) -> None:
        """At ``layer``'s decode, once its own branch has started (q: its true query)."""

    def reset(self) -> None:
        """Forget what was planned for this step."""


class Lookahead(NoLookahead):
    """Cross-layer pipelining (``pipeline``): at layer l's input, layer l + 1's scan starts with
    a stand-in query (:mod:`hybridgen.hybrid.speculation`); a layer whose stand-in is not
    trusted yet is only measured (and scanned with the true query); layer 0's lookahead
    starts after layer 0's own scan."""

    def __init__(self, method: Any):
        self.m = method
        self.reset()

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        m = self.m
        nxt = next_layer(m.ctx, layer)
        if nxt is None or hidden.shape[1] != 1 or m.host[nxt] is None or m.host[nxt].length == 0:
            return
        q_s = stand_in_query(m.ctx, nxt, hidden, m.positions.current())
        if not m.quality.trusted(nxt):
            self.measure_only[nxt] = q_s  # keep measuring the cosine; scan with the true query
        elif layer == 0:
            self.deferred = (nxt, q_s)  # submitted after layer 0's own (true-query) scan
        else:
            m.submit(nxt, q_s, speculative=True)

    def at_layer(self, layer: int, q: Tensor) -> None:
        if self.deferred is not None:
            self.m.submit(self.deferred[0], self.deferred[1], speculative=True)
            self.deferred = None
        measured = self.measure_only.pop(layer, None)
        if measured is not None:
            self.m.quality.record(layer, measured, q)

    def reset(self) -> None:
        self.deferred: Optional[Tuple[int, Tensor]] = None
        self.measure_only: Dict[int, Tensor] = {}


# ---------------------------------------------------------------------- composition
@dataclass
class StepParts:
    """The parts one HybridGen instance's step is made of (module docstring)."""

    split: PlainSplit
    scan: KeyScan
    logits: Any  # TrueQueryLogits | StandInLogits
    lookahead: NoLookahead
    packer: ShipPacker


def compose(method: Any, scan_exact: bool) -> StepParts:
    """The parts of ``method``'s step, from its options (read here, once, at bind time).
    scan_exact: the scan kernel computes exact logits in the KV dtype."""
    split = ThreeWaySplit(method) if method.three_way else PlainSplit(method)
    precision = scan_precision(method.scan, method.ctx.dtype)
    scan = (SketchScan(method.key_sketch, method.ctx.num_layers, method.ctx.head_dim, precision)
            if method.key_sketch != "none" else KeyScan(scan_exact, precision))
    logits = StandInLogits() if method.speculative_logits else TrueQueryLogits(method)
    lookahead = Lookahead(method) if method.pipeline else NoLookahead()
    return StepParts(split, scan, logits, lookahead, ship_packer(method.stager, method.ship))

