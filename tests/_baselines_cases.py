"""Method-level harness shared by the baseline tests (not a test module).

``run_method`` binds a method to a hand-built MethodContext, prefills every layer with seeded
random q/k/v and runs decode steps, recording every output with the full K/V history so a
test can compare against a dense reference or check an invariant after each step.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from hybridgen.attention.cpu_pool import CPUAttentionPool
from hybridgen.kv import TieredStore
from hybridgen.methods import MethodContext

POOL = CPUAttentionPool(workers=1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    return (out - ref).norm().item() / (den or 1.0)


def make_ctx(B, Hq, Hkv, D, T, steps, dtype=torch.float32, layers=2, rotary=None, engine=None):
    return MethodContext(num_layers=layers, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, scale=D ** -0.5,
                         batch_size=B, prompt_len=T, max_new_tokens=steps, dtype=dtype,
                         compute_device=torch.device("cpu"), store=TieredStore(), pool=POOL, rotary=rotary,
                         engine=engine)


def left_padding(gen: random.Random, B: int, T: int, min_real: int = 1) -> torch.Tensor:
    """[B, T] bool: row 0 unpadded, the others with random left padding (>= min_real real tokens)."""
    valid = torch.ones(B, T, dtype=torch.bool)
    for b in range(1, B):
        valid[b, : gen.randint(0, T - min_real)] = False
    return valid


@dataclass
class Record:
    layer: int
    step: int
    q: torch.Tensor
    out: torch.Tensor
    k: torch.Tensor  # full history incl. the new token [B, Hkv, T + step + 1, D]
    v: torch.Tensor
    valid: Optional[torch.Tensor]  # [B, T + step + 1] or None


@dataclass
class Run:
    ctx: MethodContext
    records: List[Record] = field(default_factory=list)
    prompt: list = field(default_factory=list)  # per layer (q, k, v)


def run_method(method, shape, steps, seed=0, valid=None, dtype=torch.float32, layers=2, rotary=None,
               after_step: Optional[Callable[[object, int], None]] = None, kv_fn=None, release=False) -> Run:
    """Prefill ``layers`` layers and run ``steps`` decode steps with seeded random tensors.

    shape: (B, Hq, Hkv, D, T). kv_fn(layer, t_positions, k) may transform keys (e.g. rotate).
    after_step(method, step) runs after every step's end_step().
    """
    B, Hq, Hkv, D, T = shape
    ctx = make_ctx(B, Hq, Hkv, D, T, steps, dtype, layers, rotary)
    method.bind(ctx)
    g = torch.Generator().manual_seed(seed)
    rnd = (lambda *s: torch.randn(*s, generator=g).to(dtype))
    run = Run(ctx)
    hist = []
    for layer in range(layers):
        q, k, v = rnd(B, Hq, T, D), rnd(B, Hkv, T, D), rnd(B, Hkv, T, D)
        if kv_fn is not None:
            q, k = kv_fn(layer, torch.arange(T), q, k)
        method.prefill(layer, q, k, v, valid)
        run.prompt.append((q, k, v))
        hist.append([k, v])
    vhist = valid
    for step in range(steps):
        if vhist is not None:
            vhist = torch.cat([vhist, torch.ones(B, 1, dtype=torch.bool)], 1)
        for layer in range(layers):
            q, k, v = rnd(B, Hq, 1, D), rnd(B, Hkv, 1, D), rnd(B, Hkv, 1, D)
            if kv_fn is not None:
                q, k = kv_fn(layer, torch.tensor([T + step]), q, k)
            out = method.decode(layer, q, k, v)
            hist[layer][0] = torch.cat([hist[layer][0], k], 2)
            hist[layer][1] = torch.cat([hist[layer][1], v], 2)
            run.records.append(Record(layer, step, q, out, hist[layer][0], hist[layer][1], vhist))
        method.end_step()
        if after_step is not None:
            after_step(method, step)
    if release:
        method.release()
    return run


def dense_ref(rec: Record, scale: float) -> torch.Tensor:
    """Float64 dense attention of the record's query over its full history."""
    from hybridgen.attention import dense_attention_reference
    mask = None if rec.valid is None else rec.valid[:, None, :]
    return dense_attention_reference(rec.q, rec.k, rec.v, scale, mask)
