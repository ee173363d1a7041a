"""Section 1: per-layer decode attention of each method on one Llama-3.1-8B-shaped layer.

Every method is built from the registry and driven through its own prefill/decode/end_step on
one layer by :class:`hybridgen.testing.MethodDriver`, on the same random KV and decode inputs;
the error of its first output is taken against dense float32 attention over the same KV.
Single-layer runs cannot hide the CPU branch under other layers (no cross-layer pipelining),
so they show the within-layer overlap only.
"""
from __future__ import annotations

import statistics
import traceback
from typing import Any, Dict, List, Optional, Tuple

import torch

from benchmarks.gpu.config import AT_TOPK, FITS_METHODS, HOST_METHODS, METHODS, BenchConfig, Clock, Emit, error_row, \
    free, make_method, rel_err, sync
from hybridgen.attention.partial import partial_attention
from hybridgen.testing import MethodDriver, Shape

Point = Tuple[int, float, str]  # (context, host share, method)


class LayerInputs:
    """Random KV [B, Hkv, max context, D] on the compute device, sliced per context, and the
    decode-step inputs q [B, Hq, 1, D], k and v [B, Hkv, 1, D] of each step (the same for every method)."""

    def __init__(self, cfg: BenchConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self._kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._ref: Dict[int, torch.Tensor] = {}
        g = torch.Generator(device="cpu").manual_seed(1)
        B, Hq, Hkv, D = cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.steps = [(torch.randn(B, Hq, 1, D, generator=g).to(device, cfg.dtype),
                       torch.randn(B, Hkv, 1, D, generator=g).to(device, cfg.dtype),
                       torch.randn(B, Hkv, 1, D, generator=g).to(device, cfg.dtype))
                      for _ in range(cfg.steps + cfg.warmup)]

    def kv(self, context: int) -> Tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self._kv is None:
            shape = (cfg.batch, cfg.kv_heads, max(cfg.contexts), cfg.head_dim)
            gen = torch.Generator(device=self.device).manual_seed(0)
            self._kv = tuple(torch.randn(shape, generator=gen, device=self.device, dtype=torch.float32).to(cfg.dtype)
                             for _ in range(2))
        k, v = self._kv
        return k[:, :, :context], v[:, :, :context]

    def reference(self, context: int) -> torch.Tensor:
        """Dense attention [B, Hq, 1, D] of step 0's query over the context + step 0's token (float32)."""
        if context not in self._ref:
            k, v = self.kv(context)
            q1, k1, v1 = self.steps[0]
            kk = torch.cat([k, k1], dim=2).float()
            vv = torch.cat([v, v1], dim=2).float()
            self._ref[context] = partial_attention(q1.float(), kk, vv, self.cfg.scale)[0]
            del kk, vv
        return self._ref[context]


def run_layer(cfg: BenchConfig, inputs: LayerInputs, name: str, context: int, share: float) -> Dict[str, Any]:
    """One method at one (context, host share): median decode time, branch times, bytes moved."""
    device = inputs.device
    method = make_method(name, share, cfg.topk_ratio if name in AT_TOPK else None)
    n_steps = cfg.steps + cfg.warmup
    row: Dict[str, Any] = {"section": "layer", "context": context, "host_share": share, "method": name}
    try:
        driver = MethodDriver(method, Shape(cfg.batch, cfg.heads, cfg.kv_heads, cfg.head_dim, context), n_steps + 1,
                              layers=1, dtype=cfg.dtype, device=device, history=False, sync=lambda: sync(device))
        k, v = inputs.kv(context)
        q_prefill = inputs.steps[0][0].expand(-1, -1, context, -1)  # no memory: these methods ignore it
        driver.prefill(qkv=[(q_prefill, k, v)])
        sync(device)
        cpu_b, gpu_b, h2d = [], [], []
        err = None
        for i, qkv in enumerate(inputs.steps):
            before = dict(method.stats)
            out = driver.step([qkv], end_step=False)[0]
            method.end_step()  # outside the timed decode; the branch stats land here
            if i == 0:
                err = rel_err(out, inputs.reference(context))
            if i >= cfg.warmup:
                delta = {key: method.stats.get(key, 0) - before.get(key, 0)
                         for key in ("cpu_branch_s", "gpu_branch_s", "bytes_h2d")}
                cpu_b.append(delta["cpu_branch_s"])
                gpu_b.append(delta["gpu_branch_s"])
                h2d.append(delta["bytes_h2d"])
        ms = statistics.median(driver.run.step_s[cfg.warmup:]) * 1e3
        kv_bytes = 2 * cfg.batch * cfg.kv_heads * context * cfg.head_dim * torch.tensor([], dtype=cfg.dtype).element_size()
        row.update(ms=ms, kv_gbps=kv_bytes / (ms / 1e3) / 1e9, rel_err=err, h2d_mb=statistics.median(h2d) / 1e6,
                   status="ok")
        if name in AT_TOPK:
            row.update(cpu_branch_ms=statistics.median(cpu_b) * 1e3, gpu_branch_ms=statistics.median(gpu_b) * 1e3)
    finally:
        method.release()
        del method
        free(device)
    return row


def grid(cfg: BenchConfig) -> List[Point]:
    """Every (context, host share, method) to run: the target point first, then the split methods
    with nothing on the host (share 0) beside ``full`` at every context (cheap: no host copy), then
    by context (``full`` once per context: it does not depend on the host share)."""
    order: List[Point] = [(cfg.target[0], cfg.target[1], m) for m in METHODS]
    for c in cfg.contexts:
        order += [(c, 0.0, m) for m in FITS_METHODS]
        if not any(o[0] == c and o[2] == "full" for o in order):
            order.append((c, cfg.shares[0], "full"))
    for c in cfg.contexts:
        order += [(c, s, m) for s in cfg.shares for m in HOST_METHODS if (c, s, m) not in order]
    return order


class LayerGrid:
    """Runs points of the grid on shared inputs, each in its own try/except, while the clock
    leaves ``reserve_s`` for what comes after."""

    def __init__(self, cfg: BenchConfig, device: torch.device, clock: Clock, emit: Emit, reserve_s: float):
        self.cfg, self.device, self.clock, self.emit, self.reserve_s = cfg, device, clock, emit, reserve_s
        self.inputs: Optional[LayerInputs] = None

    def run(self, points: List[Point]) -> None:
        if self.inputs is None:
            self.inputs = LayerInputs(self.cfg, self.device)
        for c, s, m in points:
            row = {"section": "layer", "context": c, "host_share": s, "method": m}
            if self.clock.expired(self.reserve_s):
                self.emit(dict(row, status="skipped (time guard)"))
                continue
            try:
                self.emit(run_layer(self.cfg, self.inputs, m, c, s))
            except Exception as err:  # noqa: BLE001 - one failure is one error row
                self.emit(error_row(row, err))
                traceback.print_exc(limit=3)
                free(self.device)

    def close(self) -> None:
        self.inputs = None
        free(self.device)
