"""What ``hybridgen`` and ``hybrid-exact`` hold where, stated once.

The capacity helpers below size every allocation the two methods make (the methods call
them at prefill), and :func:`hybridgen_footprint` / :func:`hybrid_exact_footprint` add the
same capacities up per tier, so a run's ledger peak (``store.peak_by_tier()``) equals
``footprint(shape).tier_bytes``; their ``placement_for`` and ``layer_cost`` read it too.

Shapes (a :class:`~hybridgen.methods.footprint.KVShape`): L layers, B rows, Hkv KV heads, D
head dim, b bytes per element, C = prompt + new tokens; n = :func:`gpu_share_tokens`
GPU tokens per layer (sinks s + window w): ``gpu_budget.resolve(prompt)``, or, when that is
the whole prompt, ``gpu_budget.resolve(C)`` (a budget that covers the context keeps the new
tokens on the GPU too: the host stays empty). Validity masks (one byte per KV head and token)
are counted: the statement is that of a left-padded batch (a batch without padding
allocates no mask and holds less).

hybridgen, per layer: a gpu segment of :func:`window_capacity` tokens (sinks + window +
the spare slot new tokens land in before the window settles, + w more when the split
adapts); a host segment of :func:`host_capacity` tokens (keys + mask on the layer's key
tier, values on its value tier, :mod:`hybridgen.kv.mapping`); with ``key_sketch`` its
sketch on the key tier (codes + per-block parameters, whole blocks). Model-wide, three-way:
two device slots of :func:`stream_capacity` tokens (K, V, mask) on the gpu tier, as
``staging_tokens`` / ``shared_gpu_bytes``. Not on the ledger nor in the footprint (pinned
host buffers and their device copies): two layers' shipped rows at the largest selection
(:func:`ship_tokens`), which :func:`hybridgen_placement` sets aside.

hybrid-exact, per layer: ``gpu_budget.resolve(C)`` tokens on the gpu tier, the rest of C on
its key / value tiers.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Dict

from hybridgen.attention.key_sketch import _BITS, SKETCH_BLOCK, TILE
from hybridgen.hybrid.host_branch import topk_count
from hybridgen.hybrid.scheduler import SchedulerConfig
from hybridgen.kv.mapping import parse_mapping
from hybridgen.methods.footprint import Footprint, KVShape, add_bytes, fit_share
from hybridgen.methods.placement import as_budget

log = logging.getLogger(__name__)

SHIP_LAYERS = 2  # shipped rows of two layers may be alive at once (one consumed, the next landing)


# ---------------------------------------------------------------------- capacities (tokens)
def gpu_share_tokens(budget: Any, prompt: int, context: int) -> int:
    """Tokens per layer the gpu tier holds (sinks + window): ``budget`` of the prompt; when that
    is the whole prompt, ``budget`` of the context (prompt + new tokens), so a budget that
    covers the context (1.0, or a token count >= it) never moves a token to the host."""
    n = budget.resolve(prompt)
    return budget.resolve(context) if n >= prompt else n


def window_capacity(gpu_tokens: int, sinks: int, adapt_split: bool) -> int:
    """Slots of a layer's gpu segment: sinks + window + the spare slot of
    :meth:`~hybridgen.hybrid.window.RingWindow.place_new` (+ the window again when the split
    adapts: the scheduler may double it)."""
    window = gpu_tokens - min(sinks, gpu_tokens)
    return gpu_tokens + 1 + (window if adapt_split else 0)


def host_capacity(max_len: int, gpu_tokens: int) -> int:
    """Slots of a layer's host segment: every token the GPU part does not hold (at least 1)."""
    return max(max_len - gpu_tokens, 1)


def stream_capacity(host_tokens: int, max_fraction: float) -> int:
    """Tokens of a three-way stream slot: the largest streamed prefix, floor(f * host)."""
    return int(math.floor(max_fraction * host_tokens))


def max_stream_fraction(stream_ratio: Any) -> float:
    """The largest share of the host tokens three-way may stream: the pinned ratio, or the
    scheduler's bound."""
    return float(stream_ratio) if stream_ratio is not None else SchedulerConfig().max_stream


def max_topk_ratio(topk_ratio: Any) -> float:
    """The largest top-k ratio: the pinned one, or the scheduler's bound."""
    return float(topk_ratio) if topk_ratio is not None else SchedulerConfig().max_ratio


# ---------------------------------------------------------------------- bytes
def segment_bytes(shape: KVShape, tokens: int, key_tier: str, value_tier: str) -> Dict[str, int]:
    """One layer's segment of ``tokens`` slots: K + mask on ``key_tier``, V on ``value_tier``."""
    half = shape.batch * tokens * shape.token_bytes // 2
    return add_bytes({key_tier: half + shape.batch * tokens * shape.mask_bytes}, {value_tier: half})


def sketch_bytes(shape: KVShape, kind: str, tokens: int) -> int:
    """A key sketch of a ``tokens``-slot segment (:class:`~hybridgen.attention.key_sketch.KeySketch`):
    whole blocks of codes + two float32 parameters per channel per block."""
    cap = -(-max(tokens, 1) // SKETCH_BLOCK) * SKETCH_BLOCK
    codes = (cap // TILE) * (TILE * shape.head_dim * _BITS[kind] // 8)
    params = (cap // SKETCH_BLOCK) * 2 * shape.head_dim * 4
    return shape.batch * shape.kv_heads * (codes + params)


def ship_tokens(k: int, per_head: bool, group: int) -> int:
    """One layer's shipped rows for a selection of k, in K+V tokens of one row: k per selection
    group (shared: the V rows are half a token, the fp32 logits of the group's G query heads at
    most the other half when G * 4 <= D * b, as in every shipped model); per head, G times that.
    ``ship='partial'`` ships far less ([out, lse] per query head) and is counted the same, as
    the bound of the worst mode. group: query heads per KV head (1 where unknown)."""
    return k * (group if per_head else 1)


# ---------------------------------------------------------------------- footprints
def hybridgen_footprint(m: Any, shape: KVShape) -> Footprint:
    """:class:`~hybridgen.hybrid.method.HybridGen` ``m`` on ``shape`` (module docstring)."""
    n = gpu_share_tokens(m.gpu_budget, shape.prompt, shape.context)
    win, host = window_capacity(n, m.sinks, m.adapt_split), host_capacity(shape.context, n)
    policy = parse_mapping(m.mapping)
    parts = [{"gpu": shape.kv_bytes(win)}]
    for layer in range(shape.layers):
        place = policy.placement(layer)
        parts.append(segment_bytes(shape, host, place.key_tier, place.value_tier))
        if m.key_sketch != "none":
            parts.append({place.key_tier: sketch_bytes(shape, m.key_sketch, host)})
    streamed = stream_capacity(host, max_stream_fraction(m.stream_ratio)) if m.three_way else 0
    slots = min(shape.layers, 2) * shape.kv_bytes(streamed, layers=1) if streamed else 0
    parts.append({"gpu": slots})
    return Footprint(gpu_tokens=win, host_tokens=host, staging_tokens=min(shape.layers, 2) * streamed,
                     tier_bytes=add_bytes(*parts), shared_gpu_bytes=slots)


def ship_staging_bytes(m: Any, shape: KVShape, group: int = 1) -> int:
    """GPU bytes of the shipped rows of :data:`SHIP_LAYERS` layers at the largest selection
    (the pinned top-k ratio or the scheduler's bound, of every host token): device copies
    outside the store's ledger (:func:`ship_tokens`; group: query heads per KV head, which
    KVShape does not carry: 1 where unknown)."""
    host = host_capacity(shape.context, gpu_share_tokens(m.gpu_budget, shape.prompt, shape.context))
    k = topk_count(max_topk_ratio(m.topk_ratio), host, m.min_topk)
    return SHIP_LAYERS * ship_tokens(k, m.per_head, group) * shape.batch * shape.token_bytes


def hybridgen_placement(m: Any, gpu_kv_bytes: int, shape: KVShape) -> Dict[str, Any]:
    """``m``'s largest GPU share (tokens per layer) whose footprint fits ``gpu_kv_bytes`` once
    two layers of shipped rows at the largest selection are set aside (:func:`ship_staging_bytes`,
    at share 0: the most host tokens); when those rows leave no room, the smallest share
    (sinks and window 0) if its footprint alone fits; else refused in one line. A scheduler-owned
    three-way stream (``stream_ratio`` None) whose two slots do not fit beside the smallest share and
    the shipped rows is turned off (``three_way: False`` in the overrides, logged): the stream is an option of the
    scheduler, a pinned ``stream_ratio`` is refused instead."""
    make = lambda n: {"gpu_budget": as_budget(n)}  # noqa: E731
    smallest = dataclasses.replace(m, **make(0))
    room = gpu_kv_bytes - ship_staging_bytes(smallest, shape)
    if m.three_way and m.stream_ratio is None and not smallest.footprint(shape).fits(room):
        plain = dataclasses.replace(m, three_way=False)
        placed = {**hybridgen_placement(plain, gpu_kv_bytes, shape), "three_way": False}
        log.info("hybridgen: the three-way stream's GPU slots (%d tokens each) do not fit memory.gpu_kv; "
                 "running without the stream", stream_capacity(host_capacity(shape.context, 0), max_stream_fraction(None)))
        return placed
    if smallest.footprint(shape).fits(room):
        return fit_share(m, room, shape, make)
    return fit_share(m, gpu_kv_bytes, shape, make, hi=0)


def hybrid_exact_footprint(m: Any, shape: KVShape) -> Footprint:
    """:class:`~hybridgen.hybrid.exact.HybridExact` ``m`` on ``shape`` (module docstring)."""
    gpu = m.gpu_budget.resolve(shape.context)
    host = shape.context - gpu
    per_layer = add_bytes({"gpu": shape.kv_bytes(gpu, layers=1)},
                          segment_bytes(shape, host, m.key_tier, m.value_tier))
    return Footprint(gpu_tokens=gpu, host_tokens=host,
                     tier_bytes={t: n * shape.layers for t, n in per_layer.items()})
