"""Asynchronous host->device copies for layer-ahead prefetching (FlexGen-style overlap).

On CUDA, copies run on a dedicated ``torch.cuda.Stream`` from pinned host buffers into
preallocated device buffers; an event recorded after the copies is waited on by the
compute stream right before the buffers are used, so layer l+1's transfer overlaps layer
l's compute. Without CUDA (or when the destination is on the CPU) the copy is a plain
synchronous ``copy_`` into the same preallocated buffers: identical results, no overlap.

Usage:
    pf = Prefetcher(device)
    pf.start(key, [(dst, src), ...])     # enqueue copies (dst, src same shape)
    pf.wait(key)                         # before reading dst on the compute stream
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional, Sequence, Tuple

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


class Prefetcher:
    """Copies keyed by e.g. layer index; at most one copy batch in flight per key.

    device: the destination (compute) device. force_sync: use the plain-copy path even on
    CUDA (for testing and ablation). ``bytes_started`` counts bytes enqueued.
    """

    def __init__(self, device: torch.device, force_sync: bool = False):
        self.device = torch.device(device)
        self.async_mode = cuda_streams_available(self.device) and not force_sync
        self.stream = torch.cuda.Stream(device=self.device) if self.async_mode else None
        self._events: Dict[Hashable, Optional[object]] = {}
        self._buffer_events: Dict[Hashable, object] = {}
        self.bytes_started = 0

    def start(self, key: Hashable, pairs: Sequence[Tuple[Tensor, Tensor]], buffer: Hashable = None) -> int:
        """Enqueue dst.copy_(src) for every pair; returns the bytes copied.

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
