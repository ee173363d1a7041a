"""Staged host -> compute-device copies: pinned staging buffers, one copy stream, events.

The one transfer path of every method that moves KV (or results computed next to it) from
host memory to the GPU while the GPU keeps computing:

- into preallocated destinations (FlexGen's double-buffered staging slots, InfiniGen's fetch
  buffers)::

      xfer = HostToDevice(device)
      xfer.start(key, [(dst, src), ...], buffer=slot)  # enqueue dst.copy_(src) for each pair
      xfer.wait(key)                                   # before the compute stream reads dst
      xfer.reuse(slot)                                 # before the CPU rewrites host buffer slot

- shipping a fresh CPU result (HybridGen's selected logits [B, Hq, k] and V rows
  [B, Hsel, k, D])::

      buf = xfer.staging(key, numel, dtype)   # a pinned buffer to gather into (None off CUDA)
      dev, ev = xfer.send(key, t)             # device tensor + the copy's event
      xfer.wait_event(ev)                     # before the compute stream reads dev

On CUDA the copies run on a dedicated ``torch.cuda.Stream`` from page-locked memory (a
pageable source is first copied into a per-key pinned staging buffer, reused once its previous
copy has finished) and the compute stream waits on the copy's event, so a transfer overlaps
compute. Without CUDA (or with ``force_sync``) a copy is a plain synchronous ``copy_`` into
the same destinations and :meth:`send` passes the tensor through: identical results, no overlap.

The other direction, a small device tensor (a query) handed to a host worker, goes through
:class:`DeviceToHost` (pinned staging buffer + event) and :func:`after_copy` (the worker waits
on the event before it reads): hybrid-exact, FlexGen's CPU attention and hybridgen.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Sequence, Tuple

import torch
from torch import Tensor


def cuda_streams_available(device: torch.device) -> bool:
    """True when ``device`` is a CUDA device and CUDA streams can be created."""
    return device.type == "cuda" and torch.cuda.is_available()


def _async_copy(dst: Tensor, src: Tensor) -> None:
    """Non-blocking copy. A strided source (e.g. the first n tokens of a [B, H, cap, D]
    buffer) would make torch stage it through a pageable temporary, which blocks; we copy
    row by row over the leading dimensions instead, each row contiguous in pinned memory."""
    if src.is_contiguous() or src.dim() < 2:
        dst.copy_(src, non_blocking=True)
        return
    for i in range(src.shape[0]):
        _async_copy(dst[i], src[i])


class HostToDevice:
    """Host -> ``device`` copies keyed by the caller (e.g. a layer index); one copy stream.

    device: the destination (compute) device. force_sync: use the plain-copy path even on
    CUDA (for testing and ablation). ``async_mode`` says which path runs;
    ``bytes_started`` counts the bytes enqueued by :meth:`start`.
    """

    def __init__(self, device: torch.device, force_sync: bool = False):
        self.device = torch.device(device)
        self.async_mode = cuda_streams_available(self.device) and not force_sync
        self.stream = torch.cuda.Stream(device=self.device) if self.async_mode else None
        self._events: Dict[Hashable, Optional[Any]] = {}         # key -> event of its copies in flight
        self._buffer_events: Dict[Hashable, Any] = {}            # host buffer -> last copy out of it
        self._pinned: Dict[Hashable, Tensor] = {}                # key -> pinned staging buffer (send)
        self.bytes_started = 0

    # ------------------------------------------------------------------ into preallocated destinations
    def start(self, key: Hashable, pairs: Sequence[Tuple[Tensor, Tensor]], buffer: Hashable = None) -> int:
        """Enqueue dst.copy_(src) for every pair (same shapes); returns the bytes copied.

        buffer: names the host staging buffer the sources live in, when the CPU will rewrite
        it later (see :meth:`reuse`)."""
        nbytes = sum(src.numel() * src.element_size() for _, src in pairs)
        if self.async_mode:
            stream = self.stream
            # The destination may still be read by earlier work on the compute stream.
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for dst, src in pairs:
                    _async_copy(dst, src)
                ev = torch.cuda.Event()
                ev.record(stream)
            self._events[key] = ev
            if buffer is not None:
                self._buffer_events[buffer] = ev
        else:
            for dst, src in pairs:
                dst.copy_(src)
            self._events[key] = None
        self.bytes_started += nbytes
        return nbytes

    def pending(self, key: Hashable) -> bool:
        """True when a copy for ``key`` was started and not yet waited on."""
        return key in self._events

    def wait(self, key: Hashable) -> None:
        """Make the compute stream wait for ``key``'s copies (no-op on the sync path)."""
        ev = self._events.pop(key, None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def reuse(self, buffer: Hashable) -> None:
        """Block the host until the last copy out of host staging ``buffer`` has finished,
        so the CPU may overwrite it (no-op on the sync path)."""
        ev = self._buffer_events.pop(buffer, None)
        if ev is not None:
            ev.synchronize()

    def drain(self) -> None:
        """Wait for every outstanding copy."""
        for key in list(self._events):
            self.wait(key)
        for buf in list(self._buffer_events):
            self.reuse(buf)

    # ------------------------------------------------------------------ shipping CPU results
    def staging(self, key: Hashable, numel: int, dtype: torch.dtype) -> Optional[Tensor]:
        """The pinned staging buffer of ``key`` ([numel] of ``dtype``), free to overwrite
        (its previous copy has finished); None off the async path (nothing to stage)."""
        if not self.async_mode:
            return None
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(max(numel, 1), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        self.reuse(key)  # the previous copy out of this buffer has finished
        return buf[:numel]

    def send(self, key: Hashable, t: Tensor, copy: bool = False) -> Tuple[Tensor, Any]:
        """Start moving ``t`` (host) to the device. Returns (device tensor, event or None).

        A tensor already gathered into ``key``'s staging buffer (or already page-locked) is
        sent as it is; any other is first copied into that buffer.
        copy: on the sync path, return a copy (emulates a transfer that really moves bytes).
        """
        if not self.async_mode:
            return (t.clone() if copy else t.to(self.device)), None
        buf = self._pinned.get(key)
        in_buffer = buf is not None and t.data_ptr() == buf.data_ptr()
        if t.is_pinned() and t.is_contiguous():
            staged = t  # already page-locked (e.g. a pinned host tier): no staging copy
        elif in_buffer and key not in self._buffer_events:
            staged = t
        else:
            staged = self.staging(key, t.numel(), t.dtype).view(t.shape)
            staged.copy_(t)
        consumer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            out = staged.to(self.device, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        out.record_stream(consumer)  # the allocator must not reuse it before the consumer is done
        if staged is not t or in_buffer:
            self._buffer_events[key] = ev
        return out, ev

    def wait_event(self, event: Any) -> None:
        """Make the compute stream wait for one :meth:`send` (no-op for None: the sync path)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


# ---------------------------------------------------------------------- device -> host (a query)
class DeviceToHost:
    """Device -> host copies of small tensors (a query [B, Hq, 1, D] going to the CPU branch).

    The one way a method hands a device tensor to a host worker::

        d2h = DeviceToHost(device)
        q_host, ready = d2h.send(key, q)                  # pinned buffer of ``key`` + the copy's event
        fut = pool.submit(after_copy, ready, fn, q_host)  # the worker waits on ``ready``, then reads

    On CUDA the copy is a non-blocking copy into ``key``'s preallocated page-locked staging
    buffer (allocated once per key and shape, reused every step) followed by a CUDA event on
    the compute stream; the host thread that reads the buffer must wait on that event first
    (:func:`after_copy`, :func:`wait_host`). The event also orders every earlier copy the
    compute stream made into host memory (e.g. a window token evicted to a pinned host tier).
    Without CUDA (or with ``force_sync``) a CPU tensor passes through (no copy, event None).

    Reuse: ``send(key, ...)`` overwrites the buffer the previous ``send(key, ...)`` returned,
    so the caller must have consumed that one (waited on the task that read it).
    ``bytes_sent`` counts the bytes copied.
    """

    def __init__(self, device: torch.device, force_sync: bool = False):
        self.device = torch.device(device)
        self.async_mode = cuda_streams_available(self.device) and not force_sync
        self._pinned: Dict[Hashable, Tensor] = {}
        self.bytes_sent = 0

    def send(self, key: Hashable, t: Tensor) -> Tuple[Tensor, Any]:
        """Start copying ``t`` to the host. Returns (host tensor, event or None)."""
        self.bytes_sent += t.numel() * t.element_size()
        if t.device.type == "cpu":
            return t, None
        if not self.async_mode:
            return t.to("cpu"), None
        buf = self._pinned.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._pinned[key] = buf
        buf.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(t.device))
        return buf, ev


def wait_host(event: Any) -> None:
    """Block the calling host thread until a :meth:`DeviceToHost.send` copy has landed (None: no-op)."""
    if event is not None:
        event.synchronize()


def after_copy(event: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` once ``event`` (a device -> host copy) has completed: the
    task a host worker runs on a query that :meth:`DeviceToHost.send` staged."""
    wait_host(event)
    return fn(*args, **kwargs)
