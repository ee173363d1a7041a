"""Foundation benchmark (a script, not a test): `full` vs `hybrid-exact` decode steps on SmolLM2,
and the CPU attention pool's KV bandwidth against torch's CPU SDPA.

    .venv/bin/python benchmarks/bench_foundation.py
        [--ctx 2048] [--steps 4] [--host-shares 0,0.5,0.9,1] [--separate]
        [--pool-tokens 8192,32768] [--pool-batch 1,4] [--threads N]

(a) decode-step time of `full` and of `hybrid-exact` at several host shares (the share of the
    context whose KV lives in host memory; gpu_budget = 1 - share). Default ("shared") mode:
    ONE prefill, then every decode step feeds the same q/k/v of every layer to all methods
    (a side-by-side wrapper method; the model runs on `full`'s output), timing each method's
    own attention inside the same steps. A method's step time is reported as
    (engine step time - all methods' attention time) + its own attention time, and its
    outputs are checked against `full` at every layer (max relative error). This keeps a 2K
    context affordable on a 2-core machine (a 2K prefill takes ~10-30 s there).
    ``--separate`` instead runs a real ``engine.generate`` per method (one prefill each) and
    reports its measured median step time and whether greedy tokens equal `full`'s.
(b) the pool's achieved KV bytes/s: host partial attention (``partial_attention`` submitted
    to :class:`CPUAttentionPool`, result awaited) over K+V of one SmolLM2-shaped layer,
    against ``F.scaled_dot_product_attention`` (``enable_gqa=True``: same K/V tensors, no
    repeat by us) on the caller thread; "inline" is partial_attention on the caller thread
    (pool overhead = inline vs pool). GB/s = (K + V bytes) / median time, calls interleaved.

Without CUDA the gpu tier is emulated on the CPU: the numbers show the harness's overheads
and the CPU kernels, not GPU speed. The machine load is printed: on a shared box, compare
columns of one run only.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # thread/env settings before torch loads (docs/design.md, thread runtime)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hybridgen.attention import partial_attention  # noqa: E402
from hybridgen.attention.cpu_pool import CPUAttentionPool  # noqa: E402
from hybridgen.errors import cli_errors  # noqa: E402
from hybridgen.kv import TieredStore  # noqa: E402
from hybridgen.methods import Budget, KVMethod, MethodContext, build_method  # noqa: E402
from hybridgen_harness.result_tables import format_table  # noqa: E402
from hybridgen.timing import measure_interleaved  # noqa: E402
from hybridgen.validation.cli import parse_checked  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    return (a - b).norm().item() / den if den else (a - b).norm().item()


# ----------------------------------------------------------------------- (a) side by side
@dataclass
class SideBySide(KVMethod):
    """Feeds every call to several methods; returns the first method's output.

    Each child gets its own TieredStore (so bytes per tier are per method) and the same
    context otherwise. attn_s[name]: seconds spent in the child's decode; max_err[name]: max
    relative error of its decode outputs against the first child's. The children run one
    after the other, in an order rotated every step.
    """

    children: Dict[str, KVMethod] = field(default_factory=dict)

    def bind(self, ctx: MethodContext) -> None:
        super().bind(ctx)
        self.stores = {n: TieredStore(gpu_device=ctx.compute_device) for n in self.children}
        for n, m in self.children.items():
            m.bind(dataclasses.replace(ctx, store=self.stores[n]))
        self.attn_s = {n: 0.0 for n in self.children}
        self.max_err = {n: 0.0 for n in self.children}
        self._step = 0

    def prefill(self, layer, q, k, v, valid):
        for m in self.children.values():
            m.prefill(layer, q, k, v, valid)

    def on_layer_input(self, layer, hidden):
        for m in self.children.values():
            m.on_layer_input(layer, hidden)

    def decode(self, layer, q, k, v):
        outs = {}
        names = list(self.children)
        r = self._step % len(names)  # rotate the order per step: no method always runs first
        for n in names[r:] + names[:r]:
            m = self.children[n]
            _sync(q.device)
            t = time.perf_counter()
            out = m.decode(layer, q, k, v)
            _sync(q.device)
            self.attn_s[n] += time.perf_counter() - t
            outs[n] = out
        ref = outs[names[0]]
        for n in names[1:]:
            self.max_err[n] = max(self.max_err[n], _rel_err(outs[n], ref))
        return ref

    def end_step(self):
        self._step += 1
        for m in self.children.values():
            m.end_step()

    def release(self):
        for m in self.children.values():
            m.release()


def _methods(shares: List[float], sinks: int) -> Dict[str, KVMethod]:
    out: Dict[str, KVMethod] = {"full": build_method("full")}
    for s in shares:
        out[f"hybrid-exact host {s:.0%}"] = build_method("hybrid-exact", gpu_budget=Budget(ratio=round(1 - s, 6)),
                                                         sinks=sinks)
    return out


def _tier_mib(store: TieredStore) -> Dict[str, float]:
    b = store.bytes_by_tier()
    return {"gpu MiB": round(b["gpu"] / 2**20, 1), "host MiB": round((b["dram"] + b["cxl"]) / 2**20, 1)}


def bench_shared(engine, ids, args, pool) -> List[dict]:
    fan = SideBySide(children=_methods(args.host_shares, args.sinks))
    t0 = time.perf_counter()
    logits = engine.prefill(ids, None, fan, max_new_tokens=args.steps + 1, pool=pool)
    prefill_s = time.perf_counter() - t0
    print(f"  prefill (once, all methods): {prefill_s:.1f} s")
    tok = logits.argmax(-1)
    step_s = []
    attn_before = dict(fan.attn_s)
    per_step = {n: [] for n in fan.children}
    for _ in range(args.steps):
        _sync(engine.device)
        t = time.perf_counter()
        logits = engine.decode_step(tok, fan)
        _sync(engine.device)
        step_s.append(time.perf_counter() - t)
        for n in fan.children:
            per_step[n].append(fan.attn_s[n] - attn_before[n])
        attn_before = dict(fan.attn_s)
        tok = logits.argmax(-1)
    rows = []
    rest = [s - sum(per_step[n][i] for n in fan.children) for i, s in enumerate(step_s)]
    for n, m in fan.children.items():
        own = per_step[n]
        rows.append({"method": n,
                     "step ms": round(statistics.median(r + a for r, a in zip(rest, own)) * 1e3, 1),
                     "attention ms": round(statistics.median(own) * 1e3, 2),
                     "max rel err vs full": f"{fan.max_err[n]:.1e}" if n != "full" else "-",
                     **_tier_mib(fan.stores[n]),
                     "H2D MiB": round(m.stats.get("bytes_h2d", 0) / 2**20, 2)})
    engine.release()
    print(f"  non-attention part of a step (shared by all): {statistics.median(rest) * 1e3:.1f} ms")
    return rows


def bench_separate(engine, ids, args, pool) -> List[dict]:
    rows, ref_tokens = [], None
    for n, m in _methods(args.host_shares, args.sinks).items():
        store = TieredStore(gpu_device=engine.device)
        res = engine.generate(ids, m, max_new_tokens=args.steps + 1, store=store, pool=pool)
        if ref_tokens is None:
            ref_tokens = res.tokens
        rows.append({"method": n, "prefill s": round(res.prefill_s, 1),
                     "step ms": round(statistics.median(res.step_s) * 1e3, 1),
                     "tokens == full": bool(torch.equal(res.tokens, ref_tokens)),
                     "gpu MiB": round(res.bytes_by_tier["gpu"] / 2**20, 1),
                     "host MiB": round((res.bytes_by_tier["dram"] + res.bytes_by_tier["cxl"]) / 2**20, 1),
                     "H2D MiB": round(res.method_stats.get("bytes_h2d", 0) / 2**20, 2)})
    return rows


# ----------------------------------------------------------------------- (b) pool bandwidth
def _sdpa(q, k, v, scale):
    try:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    except TypeError:  # torch without enable_gqa: expand K/V (more bytes read than ours)
        g = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), scale=scale)


def bench_pool(args, spec, pool) -> List[dict]:
    Hq, Hkv, D = spec
    scale = D ** -0.5
    dtype = getattr(torch, args.dtype)
    rows = []
    for B in args.pool_batch:
        for T in args.pool_tokens:
            torch.manual_seed(0)
            q = torch.randn(B, Hq, 1, D).to(dtype)
            k = torch.randn(B, Hkv, T, D).to(dtype)
            v = torch.randn(B, Hkv, T, D).to(dtype)
            nbytes = 2 * k.numel() * k.element_size()
            out_p, _ = pool.submit(partial_attention, q, k, v, scale).result()
            assert _rel_err(out_p, _sdpa(q, k, v, scale)) < (1e-4 if dtype == torch.float32 else 2e-2)
            fns = {"pool": lambda: pool.submit(partial_attention, q, k, v, scale).result(),
                   "inline": lambda: partial_attention(q, k, v, scale),
                   "sdpa": lambda: _sdpa(q, k, v, scale)}
            timed = measure_interleaved(fns, args.reps)
            t = {name: x.median for name, x in timed.items()}
            rows.append({"batch": B, "host tokens": T, "KV MB": round(nbytes / 1e6, 1),
                         "pool ms": round(t["pool"] * 1e3, 2), "pool IQR ms": round(timed["pool"].iqr * 1e3, 2), "pool GB/s": round(nbytes / t["pool"] / 1e9, 2),
                         "inline GB/s": round(nbytes / t["inline"] / 1e9, 2),
                         "sdpa ms": round(t["sdpa"] * 1e3, 2), "sdpa IQR ms": round(timed["sdpa"].iqr * 1e3, 2),
                         "sdpa GB/s": round(nbytes / t["sdpa"] / 1e9, 2),
                         "pool/sdpa": round(t["sdpa"] / t["pool"], 2)})
    return rows


@cli_errors
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    floats = (lambda s: [float(x) for x in s.split(",")])
    ints = (lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--weights", default="real", help="real | random | dummy")
    ap.add_argument("--ctx", type=int, default=2048, help="prompt tokens (random ids)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="decode steps per method")
    ap.add_argument("--host-shares", type=floats, default=[0.0, 0.5, 0.9, 1.0])
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--separate", action="store_true", help="one real generate per method (slower)")
    ap.add_argument("--skip-model", action="store_true", help="only part (b)")
    ap.add_argument("--pool-tokens", type=ints, default=[8192, 32768])
    ap.add_argument("--pool-batch", type=ints, default=[1, 4])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="part (b) KV dtype")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parse_checked(ap, argv)
    if args.threads:
        runtime.apply(torch_threads=args.threads)
    pool = CPUAttentionPool(workers=1)
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__} | {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads | "
          f"CUDA {'yes' if torch.cuda.is_available() else 'no (gpu tier emulated on the CPU)'} | "
          f"load average {load:.2f}")
    if load > 0.5 * (os.cpu_count() or 1):
        print("  warning: the machine is busy; timings are noisy (compare within this run only)")
    spec = (9, 3, 64)
    if not args.skip_model:
        from hybridgen.model import load_model
        engine = load_model(args.model, weights=args.weights)
        s = engine.spec
        spec = (s.num_heads, s.num_kv_heads, s.head_dim)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, s.vocab_size, (args.batch, args.ctx), generator=g)
        mode = "separate generate per method" if args.separate else "shared steps, one prefill"
        print(f"\n(a) decode step, {args.model} ({s.num_layers} layers, Hq={s.num_heads}, Hkv={s.num_kv_heads}, "
              f"D={s.head_dim}, {engine.dtype}), context {args.ctx}, batch {args.batch}, {args.steps} steps [{mode}]")
        rows = (bench_separate if args.separate else bench_shared)(engine, ids, args, pool)
        print(format_table(rows))
    print(f"\n(b) host partial attention: CPU pool vs torch CPU SDPA, Hq={spec[0]} Hkv={spec[1]} D={spec[2]}, "
          f"{args.dtype}, median of {args.reps} with its interquartile range (IQR)")
    print(format_table(bench_pool(args, spec, pool)))
    pool.shutdown()
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
