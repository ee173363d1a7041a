"""`hybridgen`: HybridGen's attention logit parallelism with cross-layer pipelining, the
feedback scheduler and semantic-aware KV mapping.

Per layer the KV is split by token: the gpu tier holds ``sinks`` + a recent window
(``gpu_budget`` tokens, a ring: :mod:`hybridgen.hybrid.window`), the host every older token.
At each decode step and layer the CPU scans the host keys with the (stand-in) query, takes
the top-k and ships logits + V rows (``ship='logits'``) or its own [out, lse]
(``ship='partial'``, :mod:`hybridgen.hybrid.ship`); the GPU attends its window with a fused
partial that returns the LSE and joins the shipped part by the exact LSE merge, in ONE
softmax (:mod:`hybridgen.hybrid.gpu_share`); a layer with nothing on the host runs ``full``'s
own attention. The CPU branch (:mod:`hybridgen.hybrid.host_branch`) runs a layer ahead with a
stand-in query (:mod:`hybridgen.hybrid.speculation`), the feedback scheduler
(:mod:`hybridgen.hybrid.scheduler`) moves the top-k ratio from measured branch times
(:mod:`hybridgen.hybrid.timing`), and ``three_way`` (default) also streams the oldest host slice
over PCIe (:mod:`hybridgen.hybrid.stream_slice`), the scheduler balancing it against the CPU scan.
Each option is read once, at bind time, into the step's parts (:mod:`hybridgen.hybrid.parts`);
what the method allocates per tier is stated once in :mod:`hybridgen.hybrid.memory`.

Shapes: prefill q [B, Hq, T, D], k/v [B, Hkv, T, D]; decode q [B, Hq, 1, D] -> out
[B, Hq, 1, D]. The full design, every choice where the paper is silent and the measurements
behind them: ``docs/hybridgen.md``.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Dict, FrozenSet, List, Literal, Optional, Tuple

from torch import Tensor

from hybridgen.attention import attention_logits
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.attention.cpu_scan import resolve_backend, rows_logits, scan_is_exact
from hybridgen.hybrid.gpu_share import dense_decode, gpu_share_partial, merge_with_host
from hybridgen.hybrid.host_branch import HostSelection, masked_heads, pipelined_host_branch, topk_count
from hybridgen.hybrid.memory import (gpu_share_tokens, host_capacity, hybridgen_footprint, hybridgen_placement,
                                    window_capacity)
from hybridgen.hybrid.parts import compose
from hybridgen.hybrid.scheduler import FeedbackScheduler, SchedulerConfig
from hybridgen.hybrid.speculation import DecodePositions, StandInQuality
from hybridgen.hybrid.stream_slice import StreamSlices
from hybridgen.hybrid.timing import BranchTimer
from hybridgen.hybrid.window import RingWindow
from hybridgen.kv.mapping import parse_mapping
from hybridgen.kv.segment import KVSegment, split_prompt
from hybridgen.kv.transfer import DeviceToHost, HostToDevice, wait_host
from hybridgen.methods import Budget, Fraction, KVMethod, MethodContext, NonNegInt, PositiveInt, Range
from hybridgen.methods.footprint import Footprint, KVShape


@dataclass
class HybridGen(KVMethod):
    """HybridGen: CPU top-k logits + V rows and GPU window attention under one softmax.

    gpu_budget: tokens per layer on the gpu tier (sinks + recent window); one that covers the
        prompt covers the context: new tokens stay on the GPU (hybrid.memory.gpu_share_tokens).
    sinks: leading tokens pinned on the gpu tier.
    topk_ratio: fraction of the scanned host tokens selected; None = the scheduler owns it
        (start 0.05, x1.2 / x0.8 every ``sched_interval`` steps within [0.01, 0.5]); a number
        pins it (e.g. 1.0 selects every host token: equal to full attention).
    min_topk: smallest selection per (batch, head) when the host has that many tokens.
    per_head: select per query head (True) or once per KV group (False).
    group_score: shared-selection score, 'max' (max host log-prob over the group) or 'sum'.
    mapping: KV mapping policy ('semantic', 'dram', 'cxl', 'interleaved').
    pipeline: cross-layer pipelining with stand-in queries (needs an engine).
    speculative_logits: use the stand-in query's logits in the softmax (no exact recompute).
    min_stand_in_cos: a layer whose stand-in query's mean cosine similarity to the true one
        (measured so far) is below this is scanned with the true query instead (0 = always speculate).
    three_way / stream_ratio: also stream the oldest share of the host tokens to the GPU, a
        layer ahead (default; the placement turns it off where its GPU slots do not fit); stream_ratio
        None = the scheduler balances it (CPU scan vs PCIe copy, start 0.1), a number pins it.
    ship: what the CPU branch sends over PCIe: 'logits' (the selected rows' fp32 logits + V
        rows, one softmax on the GPU) or 'partial' (the CPU's softmax over its selected rows:
        [out, lse] per query head, merged exactly on the GPU); hybridgen.perf.fastest_setting prices both.
    scan_backend / topk_backend: CPU kernels (see hybridgen.attention.cpu_scan).
    scan / scan_oversample: the selection scan of bf16 host keys: 'bf16dot' (bf16 x bf16 products, fp32
        sums; ceil(scan_oversample * k) candidates re-ranked by exact fp32 logits) or 'exact'; keys of
        other dtypes are scanned exactly (hybrid.host_branch.scan_precision).
    branch_pieces: the CPU branch over this many batch slices, pipelined on the pool's threads (the
        serial branch's selection; hybrid.host_branch.pipelined_host_branch; docs/hybridgen.md); 1: serial.
    key_sketch / sketch_oversample: scan an int8/int4 sketch of the host keys (its tail as ``scan``
        says), take ceil(sketch_oversample * k) candidates and keep the k best by exact logits
        (hybridgen.attention.key_sketch; recall on SmolLM2's keys: results/hybridgen_fidelity).
    sched_interval, sched_per_layer, adapt_window, adapt_split, split_step: scheduler knobs.
    """

    name: ClassVar[str] = "hybridgen"
    placement_params: ClassVar[FrozenSet[str]] = frozenset({"mapping", "branch_pieces"})
    gpu_budget: Budget = Budget(ratio=0.1)
    sinks: NonNegInt = 4
    topk_ratio: Optional[Annotated[float, Range(0.0, 1.0, lo_open=True)]] = None
    min_topk: NonNegInt = 16
    per_head: bool = False
    group_score: Literal["max", "sum"] = "max"
    mapping: Literal["semantic", "dram", "cxl", "interleaved"] = "semantic"
    pipeline: bool = True
    speculative_logits: bool = False
    min_stand_in_cos: Annotated[float, Range(-1.0, 1.0)] = 0.8
    three_way: bool = True
    stream_ratio: Optional[Fraction] = None
    ship: Literal["logits", "partial"] = "logits"
    scan_backend: Literal["auto", "torch", "numba", "native"] = "auto"
    topk_backend: Literal["auto", "native", "torch", "numba"] = "auto"
    scan: Literal["bf16dot", "exact"] = "bf16dot"
    scan_oversample: Annotated[float, Range(1.0, 16.0)] = 1.25
    branch_pieces: PositiveInt = 1
    key_sketch: Literal["none", "int8", "int4"] = "int4"
    sketch_oversample: Annotated[float, Range(1.0, 16.0)] = 1.5
    sched_interval: PositiveInt = 4
    sched_per_layer: bool = False
    adapt_window: bool = False
    adapt_split: bool = False
    split_step: PositiveInt = 64

    # ------------------------------------------------------------------ lifecycle
    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.policy = parse_mapping(self.mapping)
        kernel = resolve_backend(self.scan_backend, ctx.dtype)  # validates the name
        self.pool = ctx.pool or default_pool()
        self.stager = HostToDevice(ctx.compute_device)
        self.q_down = DeviceToHost(ctx.compute_device)  # queries -> pinned per-layer buffers + events
        self.streams = StreamSlices(self.stager, ctx.store["gpu"])  # three-way: streamed prefixes
        self.parts = compose(self, scan_is_exact(kernel, ctx.dtype))  # the step's variants, chosen once
        self.packer = self.parts.packer  # what a layer ships: one pinned buffer, one copy
        L = ctx.num_layers
        self.gpu: List[Optional[KVSegment]] = [None] * L
        self.host: List[Optional[KVSegment]] = [None] * L
        self.windows: List[Optional[RingWindow]] = [None] * L
        self.n_sinks = 0
        self.scheduler: Optional[FeedbackScheduler] = None
        self._pending: Dict[int, Tuple[Future, Optional[Tensor]]] = {}
        self._plans: Dict[int, Tuple[int, int, int]] = {}  # layer -> this step's (stream_end, scan_lo, scan_hi)
        self._flows: List[List[int]] = [[0, 0] for _ in range(L)]  # this step's (scanned, streamed) per layer
        self.timer = BranchTimer(L, cuda=self.stager.async_mode)
        self.positions = DecodePositions()
        self.trace: Dict[str, Any] = {"scheduler": [], "cosine": {}}
        self.quality = StandInQuality(self.trace["cosine"], self.min_stand_in_cos)
        # layer -> (first scanned host token, selected indices [B, Hsel, k] relative to it)
        self.last_selection: Dict[int, Tuple[int, Tensor]] = {}
        self.stats.update({"host_tokens_scanned": 0, "topk_selected": 0, "exact_logit_recomputes": 0, "speculative_scans": 0,
                           "cpu_branch_s": 0.0, "gpu_branch_s": 0.0, "cpu_scan_s": 0.0, "cpu_topk_s": 0.0, "cpu_gather_s": 0.0,
                           "streamed_tokens": 0, "ship_bytes": 0, "decode_steps": 0, "trace": self.trace})

    def _make_scheduler(self, window: int, host_tokens: int) -> FeedbackScheduler:
        cfg = SchedulerConfig(interval=self.sched_interval, per_layer=self.sched_per_layer,
                              adapt_ratio=self.topk_ratio is None, adapt_window=self.adapt_window,
                              adapt_split=self.adapt_split, split_step=self.split_step,
                              adapt_stream=self.parts.split.adapts_stream)
        return FeedbackScheduler(cfg, self.ctx.num_layers, gpu_window=window, host_tokens=host_tokens)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        gpu_tokens = gpu_share_tokens(self.gpu_budget, T, ctx.max_len)  # > T: new tokens stay too
        self.n_sinks = min(self.sinks, gpu_tokens, T)
        s, w = self.n_sinks, gpu_tokens - self.n_sinks
        host_end = T - min(w, T - s)  # the window's prompt tokens stay on the gpu tier
        with_mask = valid is not None and not bool(valid.all())
        place = self.policy.placement(layer)
        gpu = KVSegment(ctx.store["gpu"], B, H, D, k.dtype, f"layer{layer}/gpu",
                        capacity=window_capacity(gpu_tokens, self.sinks, self.adapt_split), with_mask=with_mask)
        # pageable host KV (the CPU scans it; only staging buffers are pinned: docs/design.md, placement)
        host = KVSegment(ctx.store[place.key_tier].view(pinned=False), B, H, D, k.dtype, f"layer{layer}/host",
                         capacity=host_capacity(ctx.max_len, gpu_tokens),
                         value_tier=ctx.store[place.value_tier].view(pinned=False), with_mask=with_mask)
        self.count("bytes_d2h", split_prompt(gpu, host, k, v, valid, s, host_end))
        self.gpu[layer], self.host[layer] = gpu, host
        self.parts.scan.on_prefill(layer, host)
        self.parts.split.on_prefill(layer, k, with_mask)
        self.windows[layer] = RingWindow(s, w)
        if layer == 0:
            self.positions.start(valid, B, T, k.device)
        if self.scheduler is None:
            self.scheduler = self._make_scheduler(w, host_end - s)

    def release(self) -> None:
        self._drain()
        for part in (getattr(self, "streams", None), getattr(getattr(self, "parts", None), "scan", None)):
            if part is not None:
                part.release()
        for seg in [*getattr(self, "gpu", []), *getattr(self, "host", [])]:
            if seg is not None:
                seg.release()
        self.gpu, self.host = [], []

    def _drain(self) -> None:
        for fut, _ in getattr(self, "_pending", {}).values():
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a failed speculative scan is simply dropped
                pass
        self._pending = {}
        if getattr(self, "parts", None) is not None:
            self.parts.lookahead.reset()
        self._plans = {}
        if getattr(self, "streams", None) is not None:
            self.streams.drop_pending()  # a copy planned for a layer that was not decoded

    # ------------------------------------------------------------------ knobs
    def _ratio(self, layer: int) -> float:
        return self.topk_ratio if self.topk_ratio is not None else self.scheduler.ratio(layer)

    def scan_range(self, layer: int) -> Tuple[int, int, int]:
        """(stream_end, scan_lo, scan_hi): host tokens [0, stream_end) are streamed (three-way),
        [scan_lo, scan_hi) are scanned by the CPU. Fixed at its first use in a step (a prefetch
        or a scan started a layer ahead) until the layer's decode ends, so both agree."""
        plan = self._plans.get(layer)
        if plan is None:
            n = self.host[layer].length
            n_stream = int(math.floor(self.parts.split.fraction(layer) * n))
            lo = n_stream
            win = self.scheduler.scan_window(layer) if self.scheduler is not None else None
            if win is not None:
                lo = max(lo, n - win)
            plan = self._plans[layer] = (n_stream, lo, n)
        return plan

    # ------------------------------------------------------------------ CPU branch
    def _finish(self, layer: int, sel: HostSelection, q_true: Optional[Tensor],
                views: Dict[str, Any]) -> Tuple[Dict[str, Tensor], Any]:
        """The CPU branch's last step, then the send: exact logits of the selected rows from the
        true query ``q_true`` [B, Hq, 1, D] (host) when key rows were kept, then the logits + V rows
        or the [out, lse] partial over them. Returns (shipped tensors on the device, copy event)."""
        logits = sel.logits
        if q_true is not None and sel.k_rows is not None:
            logits = masked_heads(rows_logits(q_true, sel.k_rows, self.ctx.scale), sel.mask)
            self.count("exact_logit_recomputes", 1)
        return self.packer.ship((layer, "ship"), logits, sel.v_rows, views)

    def _cpu_task(self, layer: int, q_host: Tensor, q_ready: Any, keep_keys: bool, lo: int, hi: int, k: int,
                  true_query: bool) -> Tuple[HostSelection, float, Optional[Dict[str, Tensor]], Any, Dict[str, Any]]:
        """Runs on the pool: scan + top-k (k rows) + gather of ``layer``'s host tokens [lo, hi); with the
        true query also the last step and the send (:meth:`_finish`).

        q_host [B, Hq, 1, D]: the query on the host; q_ready: the event of its device->host copy
        (None without CUDA), waited on before q_host is read. Returns (selection, seconds,
        shipped device tensors or None, their copy event, the staging views).
        """
        wait_host(q_ready)
        t0 = time.perf_counter()
        host = self.host[layer]
        mask = host.mask[:, :, lo:hi] if host.mask is not None else None
        B, Hq, D = q_host.shape[0], q_host.shape[1], q_host.shape[-1]
        Hsel = Hq if self.per_head else self.ctx.num_kv_heads
        views = self.packer.views((layer, "ship"), B, Hq, Hsel, k, D, host.v.dtype)
        sketch = self.parts.scan.sketch(layer, host)
        sel = pipelined_host_branch(
            q_host, host.k[:, :, lo:hi], host.v[:, :, lo:hi], self.ctx.scale, k, self.per_head, self.branch_pieces,
            mask=mask, keep_keys=keep_keys, backend=self.scan_backend, topk_backend=self.topk_backend,
            group_score=self.group_score, v_out=views.get("v"), pool=self.pool, sketch=sketch, sketch_offset=lo,
            precision=self.parts.scan.precision,
            oversample=self.sketch_oversample if sketch is not None else self.scan_oversample)
        sel.offset = lo
        shipped, ev = self._finish(layer, sel, q_host, views) if true_query else (None, None)
        return sel, time.perf_counter() - t0, shipped, ev, views

    def submit(self, layer: int, q: Tensor, speculative: bool) -> None:
        # key rows are kept when the softmax logits must be recomputed from the true query
        keep_keys = self.parts.logits.keep_keys if speculative else not self.parts.scan.exact
        self.count("bytes_d2h", q.numel() * q.element_size())
        q_host, q_ready = self.q_down.send(layer, q)  # preallocated pinned buffer + event on CUDA
        n_stream, lo, hi = self.scan_range(layer)
        k = topk_count(self._ratio(layer), hi - lo, self.min_topk, streamed=n_stream)
        fut = self.pool.submit(self._cpu_task, layer, q_host, q_ready, keep_keys, lo, hi, k, not speculative)
        self._pending[layer] = (fut, q if speculative else None)
        if speculative:
            self.count("speculative_scans", 1)

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self.timer.close_layer()
        if hidden.shape[1] == 1:  # three-way: this layer's slice (if not yet) and the next one's
            self.parts.split.prefetch(layer)
            self.parts.split.prefetch(layer + 1)
        self.parts.lookahead.on_layer_input(layer, hidden)

    # ------------------------------------------------------------------ decode
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        gpu, host, win = self.gpu[layer], self.host[layer], self.windows[layer]
        scale = self.ctx.scale
        t_start = self.timer.clock()
        has_host = host.length > 0
        q_true = self._start_host_branch(layer, q) if has_host else None
        self.parts.lookahead.at_layer(layer, q)  # the next layer's deferred scan; stand-in measures
        # GPU branch (hybridgen.hybrid.gpu_share): the streamed slice (three-way), the new token
        # placed in the window first (False with no window: attended as its own part)
        streamed = self.parts.split.streamed_parts(layer, q) if has_host else []
        in_gpu = win.place_new(gpu, k, v)
        if not has_host and in_gpu:  # nothing on the host: full's own attention, bit for bit
            out = dense_decode(q, gpu.k, gpu.v, scale, gpu.mask)
            t_gpu = self.timer.clock()
        else:  # the fused partial with its LSE, before the wait; the LSE merge after it
            own = [] if in_gpu else [(attention_logits(q, k, scale), v)]
            share = gpu_share_partial(q, gpu, scale)
            t_gpu = self.timer.clock()
            host_part = self._host_part(layer, q, q_true) if has_host else None
            out = merge_with_host(host_part, streamed + own, share, self.ctx.num_kv_heads, q.dtype)
        self._plans.pop(layer, None)
        moved = win.settle(gpu, host) if in_gpu else win.place(gpu, host, k, v)
        if moved:
            self.count("bytes_d2h", moved)
        end = self.timer.clock()
        self.timer.add_gpu(layer, t_start, t_gpu)
        self.timer.layer_done(layer, end)
        return out

    def _start_host_branch(self, layer: int, q: Tensor) -> Tuple[Optional[Tensor], Any]:
        """Start ``layer``'s CPU branch with the true query q, or, when a scan with a stand-in
        query is already running, send q down for its exact logits. Returns (q on the host or
        None, its copy event)."""
        if layer in self._pending:  # read after the GPU branch
            return self.parts.logits.send(layer, q)
        self.submit(layer, q, speculative=False)
        return None, None

    def _host_part(self, layer: int, q: Tensor, q_true: Tuple[Optional[Tensor], Any]) -> Tuple[Tensor, Tensor]:
        """Wait for ``layer``'s CPU branch (finishing a speculative scan with the true query
        ``q_true`` = (host tensor, copy event)) and return its shipped softmax part."""
        host = self.host[layer]
        fut, stand_in = self._pending.pop(layer)
        sel, task_s, shipped, ev, views = fut.result()
        self.last_selection[layer] = (sel.offset, sel.idx)
        t_exact = time.perf_counter()
        if shipped is None:  # a speculative scan: finish it with the true query here
            self.quality.record(layer, stand_in, q)
            wait_host(q_true[1])
            shipped, ev = self._finish(layer, sel, q_true[0], views)
        exact_s = time.perf_counter() - t_exact
        self.stager.wait_event(ev)
        nbytes = sum(t.numel() * t.element_size() for t in shipped.values())
        self.count("bytes_h2d", nbytes)
        self.count("ship_bytes", nbytes)
        self.count("topk_selected", sel.idx.shape[-1])
        for part in ("scan", "topk", "gather"):  # the CPU branch's own split (seconds, all layers)
            self.count(f"cpu_{part}_s", getattr(sel, f"{part}_s"))
        self.count("host_tokens_scanned", host.length)
        self.timer.add_cpu(layer, task_s + exact_s)
        flow = self._flows[layer]
        flow[0] += host.length - sel.offset
        flow[1] += self.scan_range(layer)[0]
        return self.packer.softmax_part(shipped)

    def ship_bytes_per_step(self) -> float:
        """Mean PCIe bytes shipped by the CPU branch per decode step (all layers; see ``ship``)."""
        return self.stats["ship_bytes"] / max(1, self.stats["decode_steps"])

    # ------------------------------------------------------------------ step end, scheduler
    def end_step(self) -> None:
        self.timer.close_layer()
        self._drain()
        self.timer.resolve()
        self.stats["decode_steps"] += 1
        self.quality.flush()
        self.positions.advance()
        sched = self.scheduler
        if sched is None:
            return
        L = self.ctx.num_layers
        cpu_s, gpu_s = self.timer.take()
        copy_s = self.streams.take_copy_seconds(L)
        for l in range(L):
            sched.record(l, cpu_s[l], gpu_s[l])
            sched.record_stream(l, cpu_s[l], self._flows[l][0], copy_s[l], self._flows[l][1])
        self.stats["cpu_branch_s"] += sum(cpu_s)
        self.stats["gpu_branch_s"] += sum(gpu_s)
        self._flows = [[0, 0] for _ in range(L)]
        if (cos_mean := self.quality.mean()) is not None:
            self.stats["stand_in_cos_mean"] = cos_mean
        if self.host[0] is not None:
            sched.set_host_tokens(self.host[0].length)
        decisions = sched.end_step()
        self.trace["scheduler"].extend(decisions)
        for d in (d for d in decisions if d["knob"] == "gpu_window"):
            for l in (range(L) if d["layer"] == "all" else [d["layer"]]):
                self._resize_window(l, d["new"])

    def _resize_window(self, layer: int, new_window: int) -> None:
        """Move the GPU/host split: the GPU's recent window becomes ``new_window`` tokens."""
        self.count("bytes_d2h", self.windows[layer].resize(self.gpu[layer], self.host[layer], new_window))

    # ------------------------------------------------------------------ memory, performance model
    def footprint(self, shape: "KVShape") -> Footprint:
        """What this method allocates per tier on ``shape`` (:func:`hybridgen.hybrid.memory.hybridgen_footprint`)."""
        return hybridgen_footprint(self, shape)

    def placement_for(self, gpu_kv_bytes: int, shape: "KVShape") -> "Optional[dict]":
        """The largest GPU share that fits (:func:`hybridgen.hybrid.memory.hybridgen_placement`)."""
        return hybridgen_placement(self, gpu_kv_bytes, shape)

    def layer_cost(self, c: "CostContext") -> "Optional[LayerCost]":
        """PROJECTED layer cost (:func:`hybridgen.hybrid.cost.hybridgen_layer_cost`)."""
        from hybridgen.hybrid.cost import hybridgen_layer_cost  # lazy: the cost needs the perf package
        return hybridgen_layer_cost(self, c)

    def scheduled_params(self) -> Tuple[str, ...]:
        """The knobs the scheduler owns (priced where it settles: :func:`hybridgen.hybrid.cost.settled_knobs`)."""
        owned = {"topk_ratio": self.topk_ratio is None, "stream_ratio": self.three_way and self.stream_ratio is None}
        return tuple(k for k, yes in owned.items() if yes)
