"""`hybridgen`: HybridGen's attention logit parallelism with cross-layer pipelining, the
feedback scheduler and semantic-aware KV mapping.

Per layer the KV is split by token. The gpu tier holds the first ``sinks`` tokens and a
recent window (``gpu_budget`` tokens in all, a ring buffer whose evicted token moves to the
host); the host holds every older token, keys on ``mapping``'s key tier and values on its
value tier. At each decode step and layer:

1. CPU branch (on ``ctx.pool``): scan the host keys with a query (GQA-aware kernels of
   :mod:`hybridgen.attention.cpu_scan`), take the top-k per (batch, KV head) (``per_head``:
   per query head instead), gather the selected V rows (and K rows when exact logits are to
   be recomputed), stage them (pinned buffer + non-blocking copy on CUDA).
2. GPU branch: logits of the true query over the GPU segment and the new token.
3. ONE softmax over ``[host top-k logits ; (streamed slice logits) ; GPU logits ; new token]``
   and one weighted sum (:func:`hybridgen.attention.softmax_over_parts`).

Bytes over PCIe per layer and step: the selected logits (fp32) and V rows (``bytes_h2d``),
the query going to the host (``bytes_d2h``), plus the streamed slice in three-way mode.

**Cross-layer pipelining** (``pipeline=True``, needs ``ctx.engine``): at
``on_layer_input(l, hidden)`` the CPU starts layer l+1's scan with the stand-in query
``engine.stand_in_query(l+1, hidden_l, positions)`` (layer l's input through layer l+1's
norm, q projection and rotary), so the scan overlaps layer l's GPU work. At ``decode(l+1)``
the logits of the selected tokens are recomputed exactly from the true query on the CPU
(``k`` key rows x D per head: small) before the softmax; ``speculative_logits=True`` uses
the stand-in logits as they are. The cosine similarity of stand-in and true query is
recorded per layer (``stats['trace']['cosine']``). Layer 0, and every layer when
``ctx.engine`` is None or ``pipeline=False``, is not speculated: its scan starts at
``decode`` with the true query and runs while the GPU branch computes. A layer whose
stand-in has proven a poor proxy (mean cosine so far below ``min_stand_in_cos``, 0.8) is
not speculated either (our addition: on SmolLM2 layer 1's stand-in, built from the
embeddings, has cosine ~0.2 while layers >= 3 reach ~0.95); its stand-in is still computed
so the cosine keeps being measured and speculation resumes if it recovers.

**Feedback scheduler** (:mod:`hybridgen.scheduler`): every step each layer's CPU branch time
(scan + top-k + gather + staging, + exact-logit recompute) and GPU branch time (GPU
attention + the rest of the layer, i.e. from the end of this layer's ``decode`` to the next
layer's ``on_layer_input``) are fed to it; it moves the top-k ratio (when ``topk_ratio`` is
None), and optionally the host scan window and the GPU/host split point. Its decisions are
in ``stats['trace']['scheduler']``. On a machine without CUDA both branches run on the CPU,
so the times (and decisions) say nothing about a real GPU host.

Choices where the paper is silent (all flags):
- ``gpu_budget`` default 10% of the prompt (a 90% host share, the issue's headline point);
  sinks (4) count inside it; the window stays fixed unless ``adapt_split`` moves it.
  Growing the window takes the next new tokens (no host->GPU traffic); shrinking it moves
  the oldest window tokens to the host.
- top-k counts ``ceil(ratio * scanned host tokens)``, at least ``min_topk`` (16).
- shared selection (``per_head=False``, default: the top-k per (batch, KV head) as the
  issue reads the paper) ranks a token by the max over the group's heads of its
  host-normalised log-probability (``group_score='max'``), one V row serving the whole
  group; ``per_head=True`` selects per query head (G times the V rows over PCIe). On
  SmolLM2 at 4K context (top-k 0.05, 128 teacher-forced steps) 'max' gave a lower mean KL
  to full attention than 'sum', and per-head a slightly lower one than shared.
- speculative selection, exact logits (``speculative_logits=False``), see above. In the
  same SmolLM2 run pipelining with exact logits matched the non-pipelined KL, while fully
  speculative logits raised it by an order of magnitude.
- the new token's own K/V is attended from the GPU side before it is placed, so a
  speculative scan started before ``decode`` always sees a consistent host segment.
- ``three_way`` (our extension): the oldest ``stream_ratio`` of the host tokens is copied
  over PCIe every step and attended densely with exact logits on the GPU, and the CPU scans
  only the rest. The copy is issued before waiting on the CPU branch, on a side stream on
  CUDA (a plain copy on CPU). Whether it pays depends on spare PCIe time and is only
  measurable on a GPU host; it is off by default.
- the scan window (scheduler) keeps the newest host tokens; tokens outside it and outside
  the streamed slice are skipped for that step (lossy; off by default).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgen.attention import attention_logits
from hybridgen.attention.cuda_kernels import softmax_over_parts  # CuPy on CUDA, torch otherwise
from hybridgen.attention.cpu_pool import default_pool
from hybridgen.attention.cpu_scan import (HostSelection, host_branch, resolve_backend, rows_logits,
                                          topk_count)
from hybridgen.attention.partial import _mask_logits
from hybridgen.errors import ConfigError
from hybridgen.kv import KVSegment
from hybridgen.kv.segment import split_prompt
from hybridgen.kv.mapping import parse_mapping
from hybridgen.methods import Budget, KVMethod, MethodContext, register
from hybridgen.scheduler import FeedbackScheduler, SchedulerConfig

NEG_INF = float("-inf")


class _Stager:
    """Host -> compute-device shipping of the CPU branch's results.

    On CUDA: tensors are copied into a per-(layer, name) pinned buffer, then sent with a
    non-blocking copy on a side stream; the consumer stream waits on the copy's event. The
    pinned buffer is reused once its previous copy has finished. Elsewhere (the CPU
    fallback) the tensors are already where the compute runs and are passed through.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pinned: Dict[Tuple[int, str], Tensor] = {}
        self._done: Dict[Tuple[int, str], Any] = {}

    def buffer(self, layer: int, name: str, numel: int, dtype: torch.dtype) -> Optional[Tensor]:
        """The pinned staging buffer for (layer, name), free to overwrite (None without CUDA)."""
        if not self.cuda:
            return None
        key = (layer, name)
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        prev = self._done.pop(key, None)
        if prev is not None:
            prev.synchronize()  # the previous copy out of this buffer has finished
        return buf[:numel]

    def send(self, layer: int, name: str, t: Tensor, copy: bool = False) -> Tuple[Tensor, Any]:
        """Start moving ``t`` (CPU) to the device. Returns (device tensor, event or None).

        A tensor already gathered into this (layer, name)'s pinned buffer is sent as it is.
        copy: on the CPU fallback, return a copy (emulates a transfer that really moves bytes).
        """
        if not self.cuda:
            return (t.clone() if copy else t.to(self.device)), None
        key = (layer, name)
        buf = self._pinned.get(key)
        if t.is_pinned() and t.is_contiguous():
            staged = t  # already page-locked (e.g. a pinned host tier): no staging copy
        elif buf is not None and t.data_ptr() == buf.data_ptr() and key not in self._done:
            staged = t
        else:
            staged = self.buffer(layer, name, t.numel(), t.dtype).view(t.shape)
            staged.copy_(t)
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = staged.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        out.record_stream(consumer)  # the allocator must not reuse it before the consumer is done
        if staged is not t or buf is not None and t.data_ptr() == buf.data_ptr():
            self._done[key] = ev
        return out, ev

    def wait(self, event: Any) -> None:
        """Make the current stream wait for a send (no-op on the CPU fallback)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


@register("hybridgen")
@dataclass
class HybridGen(KVMethod):
    """HybridGen: CPU top-k logits + V rows and GPU window attention under one softmax.

    gpu_budget: tokens per layer on the gpu tier (sinks + recent window).
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
    three_way / stream_ratio: also stream the oldest stream_ratio of host tokens to the GPU.
    scan_backend / topk_backend: CPU kernels (see hybridgen.attention.cpu_scan).
    sched_interval, sched_per_layer, adapt_window, adapt_split, split_step: scheduler knobs.
    """

    gpu_budget: Budget = Budget(ratio=0.1)
    sinks: int = 4
    topk_ratio: Optional[float] = None
    min_topk: int = 16
    per_head: bool = False
    group_score: str = "max"
    mapping: str = "semantic"
    pipeline: bool = True
    speculative_logits: bool = False
    min_stand_in_cos: float = 0.8
    three_way: bool = False
    stream_ratio: float = 0.1
    scan_backend: str = "auto"
    topk_backend: str = "torch"
    sched_interval: int = 4
    sched_per_layer: bool = False
    adapt_window: bool = False
    adapt_split: bool = False
    split_step: int = 64

    # ------------------------------------------------------------------ lifecycle
    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        if self.sinks < 0 or self.min_topk < 0:
            raise ConfigError("hybridgen: sinks and min_topk must be >= 0")
        if self.topk_ratio is not None and not (0 < self.topk_ratio <= 1):
            raise ConfigError(f"hybridgen: topk_ratio must be in (0, 1] or None (scheduled), got {self.topk_ratio}")
        if not (0 <= self.stream_ratio <= 1):
            raise ConfigError(f"hybridgen: stream_ratio must be in [0, 1], got {self.stream_ratio}")
        if self.group_score not in ("max", "sum"):
            raise ConfigError(f"hybridgen: group_score must be 'max' or 'sum', got {self.group_score!r}")
        if self.topk_backend not in ("torch", "numba"):
            raise ConfigError(f"hybridgen: topk_backend must be 'torch' or 'numba', got {self.topk_backend!r}")
        self.policy = parse_mapping(self.mapping)
        kernel = resolve_backend(self.scan_backend, ctx.dtype)  # validates the name
        self._exact_scan = kernel == "numba" or ctx.dtype in (torch.float32, torch.float64)
        self.pool = ctx.pool or default_pool()
        self.stager = _Stager(ctx.compute_device)
        L = ctx.num_layers
        self.gpu: List[Optional[KVSegment]] = [None] * L
        self.host: List[Optional[KVSegment]] = [None] * L
        self.ring = [0] * L
        self.window = [0] * L
        self.n_sinks = 0
        self.scheduler: Optional[FeedbackScheduler] = None
        self._pending: Dict[int, Tuple[Future, Optional[Tensor]]] = {}
        self._deferred: Optional[Tuple[int, Tensor]] = None
        self._measure_only: Dict[int, Tensor] = {}
        self._cos_pending: List[Tuple[int, Tensor]] = []
        self._cpu_s = [0.0] * L
        self._gpu_s = [0.0] * L
        self._layer_end: Optional[Tuple[int, Any]] = None
        self._gpu_marks: List[Tuple[int, Any, Any]] = []  # (layer, start, end): resolved at end_step
        self.trace: Dict[str, Any] = {"scheduler": [], "cosine": {}}
        # layer -> (first scanned host token, selected indices [B, Hsel, k] relative to it)
        self.last_selection: Dict[int, Tuple[int, Tensor]] = {}
        self.stats.update({"host_tokens_scanned": 0, "topk_selected": 0, "exact_logit_recomputes": 0,
                           "speculative_scans": 0, "cpu_branch_s": 0.0, "gpu_branch_s": 0.0,
                           "cpu_scan_s": 0.0, "cpu_topk_s": 0.0, "cpu_gather_s": 0.0,
                           "streamed_tokens": 0, "trace": self.trace})

    def _make_scheduler(self, window: int, host_tokens: int) -> FeedbackScheduler:
        cfg = SchedulerConfig(interval=self.sched_interval, per_layer=self.sched_per_layer,
                              adapt_ratio=self.topk_ratio is None, adapt_window=self.adapt_window,
                              adapt_split=self.adapt_split, split_step=self.split_step)
        return FeedbackScheduler(cfg, self.ctx.num_layers, gpu_window=window, host_tokens=host_tokens)

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        ctx = self.ctx
        B, H, T, D = k.shape
        gpu_tokens = self.gpu_budget.resolve(T)
        self.n_sinks = min(self.sinks, gpu_tokens)
        s, w = self.n_sinks, gpu_tokens - self.n_sinks
        host_end = T - w
        with_mask = valid is not None and not bool(valid.all())
        place = self.policy.placement(layer)
        max_gpu = gpu_tokens + (w if self.adapt_split else 0)
        gpu = KVSegment(ctx.store["gpu"], B, H, D, k.dtype, f"layer{layer}/gpu", capacity=max_gpu,
                        with_mask=with_mask)
        host = KVSegment(ctx.store[place.key_tier], B, H, D, k.dtype, f"layer{layer}/host",
                         capacity=max(ctx.max_len - gpu_tokens, 1), value_tier=ctx.store[place.value_tier],
                         with_mask=with_mask)
        self.count("bytes_d2h", split_prompt(gpu, host, k, v, valid, s, host_end))
        self.gpu[layer], self.host[layer] = gpu, host
        self.window[layer] = w
        if self.scheduler is None:
            self.scheduler = self._make_scheduler(w, host_end - s)

    def release(self) -> None:
        self._drain()
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
        self._deferred = None
        self._measure_only = {}

    # ------------------------------------------------------------------ knobs
    def _ratio(self, layer: int) -> float:
        return self.topk_ratio if self.topk_ratio is not None else self.scheduler.ratio(layer)

    def _scan_range(self, layer: int) -> Tuple[int, int, int]:
        """(stream_end, scan_lo, scan_hi): host tokens [0, stream_end) are streamed (three-way),
        [scan_lo, scan_hi) are scanned by the CPU."""
        n = self.host[layer].length
        n_stream = int(math.floor(self.stream_ratio * n)) if self.three_way else 0
        lo = n_stream
        win = self.scheduler.scan_window(layer) if self.scheduler is not None else None
        if win is not None:
            lo = max(lo, n - win)
        return n_stream, lo, n

    # ------------------------------------------------------------------ CPU branch
    def _cpu_task(self, layer: int, q_host: Tensor, q_ready: Any, keep_keys: bool) -> Tuple[HostSelection, float, Any]:
        """Runs on the pool: scan + top-k + gather of ``layer``'s host part, then ships the V rows.

        q_ready: CUDA event of the query's device->host copy (None on the CPU fallback).
        """
        if q_ready is not None:
            q_ready.synchronize()
        t0 = time.perf_counter()
        host = self.host[layer]
        _, lo, hi = self._scan_range(layer)
        k = topk_count(self._ratio(layer), hi - lo, self.min_topk)
        mask = host.mask[:, :, lo:hi] if host.mask is not None else None
        B, Hq, D = q_host.shape[0], q_host.shape[1], q_host.shape[-1]
        rows = B * (Hq if self.per_head else self.ctx.num_kv_heads) * min(k, hi - lo) * D
        v_out = self.stager.buffer(layer, "v", rows, host.v.dtype)  # pinned on CUDA, else None
        sel = host_branch(q_host, host.k[:, :, lo:hi], host.v[:, :, lo:hi], self.ctx.scale, k, self.per_head,
                          mask=mask, keep_keys=keep_keys, backend=self.scan_backend,
                          topk_backend=self.topk_backend, group_score=self.group_score, v_out=v_out)
        sel.offset = lo
        v_dev, ev = self.stager.send(layer, "v", sel.v_rows)
        sel.v_rows = v_dev
        return sel, time.perf_counter() - t0, ev

    def _to_host(self, t: Tensor) -> Tensor:
        self.count("bytes_d2h", t.numel() * t.element_size())
        return t.to("cpu")

    def _submit(self, layer: int, q: Tensor, speculative: bool) -> None:
        # key rows are kept when the softmax logits must be recomputed from the true query
        keep_keys = (not self.speculative_logits) if speculative else not self._exact_scan
        self.count("bytes_d2h", q.numel() * q.element_size())
        if self.stager.cuda:  # non-blocking copy into pinned memory; the worker waits on its event
            q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            q_host.copy_(q, non_blocking=True)
            q_ready = torch.cuda.Event()
            q_ready.record()
        else:
            q_host, q_ready = q, None
        fut = self.pool.submit(self._cpu_task, layer, q_host, q_ready, keep_keys)
        self._pending[layer] = (fut, q if speculative else None)
        if speculative:
            self.count("speculative_scans", 1)

    def on_layer_input(self, layer: int, hidden: Tensor) -> None:
        self._close_gpu_interval(layer)
        ctx = self.ctx
        nxt = layer + 1
        if (not self.pipeline or ctx.engine is None or nxt >= ctx.num_layers or hidden.shape[1] != 1
                or self.host[nxt] is None or self.host[nxt].length == 0):
            return
        q_s = ctx.engine.stand_in_query(nxt, hidden, ctx.engine.current_positions)
        if not self._speculate(nxt):
            self._measure_only[nxt] = q_s  # keep measuring the cosine; scan with the true query
        elif layer == 0:
            self._deferred = (nxt, q_s)  # submitted after layer 0's own (true-query) scan
        else:
            self._submit(nxt, q_s, speculative=True)

    def _speculate(self, layer: int) -> bool:
        """Speculate ``layer`` unless its stand-in query has proven a poor proxy (mean cosine so far)."""
        seen = self.trace["cosine"].get(str(layer))
        return not seen or sum(seen) / len(seen) >= self.min_stand_in_cos

    # ------------------------------------------------------------------ timing
    def _clock(self) -> Any:
        if self.stager.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _elapsed(self, a: Any, b: Any) -> float:
        if self.stager.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    def _close_gpu_interval(self, layer: int) -> None:
        """The GPU time from the end of the previous layer's decode to now (rest of that layer)."""
        if self._layer_end is not None:
            prev, mark = self._layer_end
            self._gpu_marks.append((prev, mark, self._clock()))
            self._layer_end = None

    # ------------------------------------------------------------------ decode
    def decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        ctx = self.ctx
        gpu, host = self.gpu[layer], self.host[layer]
        Hkv, scale = ctx.num_kv_heads, ctx.scale
        t_start = self._clock()
        has_host = host.length > 0
        stand_in = None
        if has_host:
            if layer in self._pending:
                stand_in = self._pending[layer][1]
            else:
                self._submit(layer, q, speculative=False)
        if self._deferred is not None:
            self._submit(self._deferred[0], self._deferred[1], speculative=True)
            self._deferred = None
        measured = self._measure_only.pop(layer, None)
        if measured is not None:
            self._record_cosine(layer, measured, q)

        # GPU branch: window + sinks, the new token, the streamed slice (three-way)
        parts = []
        if self.three_way and has_host:
            n_stream, _, _ = self._scan_range(layer)
            if n_stream:
                ks, ev_k = self.stager.send(layer, "stream_k", host.k[:, :, :n_stream], copy=True)
                vs, ev_v = self.stager.send(layer, "stream_v", host.v[:, :, :n_stream], copy=True)
                self.stager.wait(ev_k)
                self.stager.wait(ev_v)
                ms = host.mask[:, :, :n_stream].to(q.device) if host.mask is not None else None
                parts.append((_mask_logits(attention_logits(q, ks, scale), ms, Hkv), vs))
                self.count("bytes_h2d", 2 * ks.numel() * ks.element_size())
                self.count("streamed_tokens", n_stream)
        parts.append((_mask_logits(attention_logits(q, gpu.k, scale), gpu.mask, Hkv), gpu.v))
        parts.append((attention_logits(q, k, scale), v))
        t_gpu = self._clock()

        if has_host:
            fut, _ = self._pending.pop(layer)
            sel, task_s, ev = fut.result()
            self.last_selection[layer] = (sel.offset, sel.idx)
            t_exact = time.perf_counter()
            logits = sel.logits
            if stand_in is not None:
                self._record_cosine(layer, stand_in, q)
            if sel.k_rows is not None and (stand_in is not None or not sel.exact):
                logits = rows_logits(self._to_host(q) if stand_in is not None else q.to("cpu"), sel.k_rows, scale)
                if sel.mask is not None:
                    m = sel.mask if sel.mask.shape[1] == logits.shape[1] else \
                        sel.mask.repeat_interleave(logits.shape[1] // sel.mask.shape[1], dim=1)
                    logits = logits.masked_fill(~m, NEG_INF)
                self.count("exact_logit_recomputes", 1)
            lg_dev, ev_l = self.stager.send(layer, "logits", logits)
            exact_s = time.perf_counter() - t_exact
            self.stager.wait(ev)
            self.stager.wait(ev_l)
            parts.insert(0, (lg_dev[:, :, None, :], sel.v_rows))
            self.count("bytes_h2d", logits.numel() * 4 + sel.v_rows.numel() * sel.v_rows.element_size())
            self.count("topk_selected", logits.shape[-1])
            for part in ("scan", "topk", "gather"):  # the CPU branch's own split (seconds, all layers)
                self.count(f"cpu_{part}_s", getattr(sel, f"{part}_s"))
            self.count("host_tokens_scanned", host.length)
            self._cpu_s[layer] += task_s + exact_s
        out = softmax_over_parts(parts, Hkv).to(q.dtype)
        self._place_new_token(layer, k, v)
        end = self._clock()
        self._gpu_marks.append((layer, t_start, t_gpu))
        self._layer_end = (layer, end)
        return out

    def _record_cosine(self, layer: int, stand_in: Tensor, q: Tensor) -> None:
        """Mean over (batch, head) of cos(stand-in, true query); read back at end_step (no mid-layer sync)."""
        cos = F.cosine_similarity(stand_in.float().flatten(2), q.float().flatten(2), dim=-1).mean()
        self._cos_pending.append((layer, cos))

    def _place_new_token(self, layer: int, k: Tensor, v: Tensor) -> None:
        gpu, host = self.gpu[layer], self.host[layer]
        w = self.window[layer]
        if w == 0:
            host.append(k.to(host.device), v.to(host.device))
            self.count("bytes_d2h", k.numel() * k.element_size() * 2)
            return
        if gpu.length < self.n_sinks + w:
            gpu.append(k, v)
            return
        slot = self.n_sinks + self.ring[layer]
        old_mask = gpu.mask[:, :, slot:slot + 1] if gpu.mask is not None else None
        host.append(gpu.k[:, :, slot:slot + 1], gpu.v[:, :, slot:slot + 1], old_mask)
        self.count("bytes_d2h", k.numel() * k.element_size() * 2)
        gpu.write(slot, k, v)
        self.ring[layer] = (self.ring[layer] + 1) % w

    # ------------------------------------------------------------------ step end, scheduler
    def end_step(self) -> None:
        self._close_gpu_interval(-1)
        self._drain()
        for l, a, b in self._gpu_marks:
            self._gpu_s[l] += self._elapsed(a, b)
        self._gpu_marks = []
        for l, cos in self._cos_pending:
            self.trace["cosine"].setdefault(str(l), []).append(float(cos))
        self._cos_pending = []
        sched = self.scheduler
        if sched is None:
            return
        L = self.ctx.num_layers
        for l in range(L):
            sched.record(l, self._cpu_s[l], self._gpu_s[l])
            self.stats["cpu_branch_s"] += self._cpu_s[l]
            self.stats["gpu_branch_s"] += self._gpu_s[l]
        self._cpu_s, self._gpu_s = [0.0] * L, [0.0] * L
        cos = [c for v in self.trace["cosine"].values() for c in v]
        if cos:
            self.stats["stand_in_cos_mean"] = sum(cos) / len(cos)
        if self.host[0] is not None:
            sched.set_host_tokens(self.host[0].length)
        decisions = sched.end_step()
        self.trace["scheduler"].extend(decisions)
        for d in decisions:
            if d["knob"] == "gpu_window":
                layers = range(L) if d["layer"] == "all" else [d["layer"]]
                for l in layers:
                    self._resize_window(l, d["new"])

    def _resize_window(self, layer: int, new_window: int) -> None:
        """Move the GPU/host split: the GPU's recent window becomes ``new_window`` tokens."""
        gpu, host = self.gpu[layer], self.host[layer]
        s, w = self.n_sinks, self.window[layer]
        held = gpu.length - s
        if held == w and w > 0:  # full ring: oldest token sits at slot s + ring
            order = [s + (self.ring[layer] + j) % w for j in range(w)]
        else:
            order = list(range(s, gpu.length))
        drop = max(0, held - new_window)
        if drop:
            old = torch.tensor(order[:drop], device=gpu.device)
            m = gpu.mask[:, :, old] if gpu.mask is not None else None
            host.append(gpu.k[:, :, old], gpu.v[:, :, old], m)
            self.count("bytes_d2h", 2 * gpu.k[:, :, old].numel() * gpu.k.element_size())
        keep = list(range(s)) + order[drop:]
        B, H = gpu.shape[0], gpu.shape[1]
        gpu.keep(torch.tensor(keep, device=gpu.device).expand(B, H, len(keep)))
        gpu.reserve(s + new_window)
        self.window[layer] = new_window
        self.ring[layer] = 0

    # ------------------------------------------------------------------ reporting
    def cosine_by_layer(self) -> Dict[int, float]:
        """Mean cosine similarity of stand-in vs true query per speculated layer."""
        return {int(l): sum(v) / len(v) for l, v in self.trace["cosine"].items() if v}
