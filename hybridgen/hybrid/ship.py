"""What HybridGen's CPU branch sends to the GPU per layer, and the CPU's [out, lse] partial.

Two modes (``HybridGen.ship``); shapes: B batch, Hq query heads, Hsel = Hq (per-head
selection) or Hkv (shared), k selected rows, D head dim, b bytes per KV element:

- ``'logits'``: 'logits' [B, Hq, k] float32 + 'v' [B, Hsel, k, D] (KV dtype):
  B*Hq*k*4 + B*Hsel*k*D*b bytes; the GPU's one softmax takes the k entries per head.
- ``'partial'``: 'out' [B, Hq, D] (KV dtype) + 'lse' [B, Hq] float32 (:func:`selected_partial`):
  B*Hq*(D*b + 4) bytes; exp(lse) * out is the host's unnormalised sum, so the GPU merges it
  exactly (the LSE merge of :func:`hybridgen.attention.merge_partials`) as ONE softmax entry
  per head with logit lse and value out.

:class:`ShipPacker` (one subclass per mode, :func:`ship_packer`) packs a layer's tensors into
ONE pinned staging buffer (64-byte aligned parts), sent with one non-blocking copy, and
unpacks views of the device copy; off the async path (no CUDA) the tensors go as they are.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Hashable, List, Tuple

import torch
from torch import Tensor

from hybridgen.kv.transfer import HostToDevice

ALIGN = 64
Layout = Dict[str, Tuple[int, int, Tuple[int, ...], torch.dtype]]  # name -> (offset, bytes, shape, dtype)
Spec = Tuple[str, Tuple[int, ...], torch.dtype]  # name, shape, dtype of one shipped tensor


def selected_partial(logits: Tensor, v_rows: Tensor) -> Tuple[Tensor, Tensor]:
    """The CPU's partial attention over its selected rows (``ship='partial'``).

    logits [B, Hq, k] float32 (-inf where masked); v_rows [B, Hsel, k, D] with Hsel = Hq
    (per-head selection) or Hkv (shared: the G heads of a group read the same rows).
    Returns (out [B, Hq, D] in v_rows' dtype, lse [B, Hq] float32); a head with no finite
    logit has lse = -inf and out = 0 (it vanishes in the merge). Sums run in float32.
    """
    B, Hq, k = logits.shape
    Hsel, D = v_rows.shape[1], v_rows.shape[-1]
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.matmul(p.view(B, Hsel, Hq // Hsel, k), v_rows.float())  # [B, Hsel, G, D]
    return out.view(B, Hq, D).to(v_rows.dtype), lse


class ShipPacker:
    """One pinned staging buffer per key (e.g. (layer, 'ship')) holding everything a layer ships;
    what that is comes from the mode's subclass (:class:`LogitsShip`, :class:`PartialShip`,
    built by :func:`ship_packer`).

    stager: the method's :class:`~hybridgen.kv.transfer.HostToDevice`.
    """

    mode = ""

    def __init__(self, stager: HostToDevice):
        self.stager = stager

    def specs(self, B: int, Hq: int, Hsel: int, k: int, D: int, vdtype: torch.dtype) -> List[Spec]:
        """(name, shape, dtype) of each tensor this mode ships."""
        raise NotImplementedError

    def views(self, key: Hashable, B: int, Hq: int, Hsel: int, k: int, D: int, vdtype: torch.dtype) -> Dict[str, Any]:
        """Host views (by name, see the module docstring) into ``key``'s staging buffer, free to
        write; empty off the async path (nothing to stage)."""
        if not self.stager.async_mode:
            return {}
        layout: Layout = {}
        off = 0
        for name, shape, dt in self.specs(B, Hq, Hsel, k, D, vdtype):
            n = math.prod(shape) * dt.itemsize
            layout[name] = (off, n, shape, dt)
            off += -(-n // ALIGN) * ALIGN
        buf = self.stager.staging(key, off, torch.uint8)
        out: Dict[str, Any] = {name: buf[o:o + n].view(dt).view(shape) for name, (o, n, shape, dt) in layout.items()}
        out["_buf"], out["_layout"] = buf, layout
        return out

    def ship(self, key: Hashable, logits: Tensor, v_rows: Tensor, views: Dict[str, Any]
             ) -> Tuple[Dict[str, Tensor], Any]:
        """Send what this mode ships for the selected rows' logits [B, Hq, k] (float32, -inf
        where masked) and V rows [B, Hsel, k, D]. Returns (name -> device tensor, copy event or None)."""
        raise NotImplementedError

    def softmax_part(self, shipped: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """The shipped tensors as one part of the GPU's single softmax
        (:func:`hybridgen.attention.softmax_over_parts`): (logits [B, Hq, 1, m], values [B, H, m, D])."""
        raise NotImplementedError

    def send(self, key: Hashable, host: Dict[str, Tensor], views: Dict[str, Any]) -> Tuple[Dict[str, Tensor], Any]:
        """Ship ``host`` (name -> tensor; written into ``views`` unless already there) with one
        copy. Returns (name -> device tensor, the copy's event or None)."""
        if not views:  # sync path: nothing staged
            return {name: t.to(self.stager.device) for name, t in host.items()}, None
        for name, t in host.items():
            if views[name].data_ptr() != t.data_ptr():
                views[name].copy_(t)
        dev, ev = self.stager.send(key, views["_buf"])
        return {name: dev[o:o + n].view(dt).view(shape) for name, (o, n, shape, dt) in views["_layout"].items()}, ev


class LogitsShip(ShipPacker):
    """``ship='logits'``: the selected rows' logits and V rows as they are; the GPU's softmax
    takes the k entries per head ((logits [B, Hq, 1, k], values [B, Hsel, k, D]))."""

    mode = "logits"

    def specs(self, B: int, Hq: int, Hsel: int, k: int, D: int, vdtype: torch.dtype) -> List[Spec]:
        return [("logits", (B, Hq, k), torch.float32), ("v", (B, Hsel, k, D), vdtype)]

    def ship(self, key: Hashable, logits: Tensor, v_rows: Tensor, views: Dict[str, Any]
             ) -> Tuple[Dict[str, Tensor], Any]:
        return self.send(key, {"logits": logits, "v": v_rows}, views)

    def softmax_part(self, shipped: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        return shipped["logits"][:, :, None, :], shipped["v"]


class PartialShip(ShipPacker):
    """``ship='partial'``: the CPU's [out, lse] over its selection (:func:`selected_partial`); the
    GPU's softmax takes one entry per head with logit lse and value out ([B, Hq, 1, 1],
    [B, Hq, 1, D])."""

    mode = "partial"

    def specs(self, B: int, Hq: int, Hsel: int, k: int, D: int, vdtype: torch.dtype) -> List[Spec]:
        return [("out", (B, Hq, D), vdtype), ("lse", (B, Hq), torch.float32)]

    def ship(self, key: Hashable, logits: Tensor, v_rows: Tensor, views: Dict[str, Any]
             ) -> Tuple[Dict[str, Tensor], Any]:
        out, lse = selected_partial(logits, v_rows)
        return self.send(key, {"out": out, "lse": lse}, views)

    def softmax_part(self, shipped: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        return shipped["lse"][:, :, None, None], shipped["out"][:, :, None, :]


def ship_packer(stager: HostToDevice, mode: str) -> ShipPacker:
    """The packer of ``mode`` ('logits' or 'partial', checked by HybridGen's ``ship`` field)."""
    return {"logits": LogitsShip, "partial": PartialShip}[mode](stager)
