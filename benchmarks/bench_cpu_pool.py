"""Threads or processes for the CPU attention pool? (a benchmark script, not a test)

Runs the host partial attention (hybridgen.attention.partial_attention over host KV) at decode
shapes concurrently with "other work" on the calling thread, in three ways:

  seq      no pool: host partial, then the other work, one after the other
  thread   CPUAttentionPool (a worker thread; torch ops release the GIL)
  process  a worker process over shared-memory KV (torch.multiprocessing, spawn); q goes
           in and (out, lse) come back through preallocated shared tensors, a pipe signals

and three kinds of other work standing in for the GPU half / the engine:

  wait     the caller blocks without using a core (like waiting on a CUDA event)
  python   the caller spins in pure Python holding the GIL (engine-side Python overhead)
  torch    the caller runs torch compute (a GPU-window partial attention on the CPU)

Each kind runs for about as long as the host partial alone, so perfect overlap halves the
sequential time. Also reported: the host partial's round-trip latency through each pool
with nothing else running ("alone").

    .venv/bin/python benchmarks/bench_cpu_pool.py [--tokens 4096,16384,32768] [--batch 1,4]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # thread/env settings before torch loads (docs/design.md, thread runtime)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from hybridgen.attention import partial_attention  # noqa: E402
from hybridgen.attention.cpu_pool import CPUAttentionPool  # noqa: E402
from hybridgen.timing import median_interleaved, median_time  # noqa: E402
from hybridgen.validation.cli import parse_checked  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- process pool
def _proc_worker(conn, k, v, q_buf, out_buf, lse_buf, scale, threads):
    torch.set_num_threads(threads)
    conn.send("ready")
    while True:
        n = conn.recv()
        if n is None:
            break
        out, lse = partial_attention(q_buf, k[:, :, :n], v[:, :, :n], scale)
        out_buf.copy_(out)
        lse_buf.copy_(lse)
        conn.send(1)


class SharedMemoryPool:
    """One worker process holding the host KV in shared memory (no copy per call).

    k, v: [B, Hkv, T, D] shared tensors; q_shape: [B, Hq, 1, D]. submit(q, n) copies q into
    the shared query buffer and asks for attention over the first n tokens; result() waits.
    """

    def __init__(self, k, v, q_shape, scale, threads):
        ctx = mp.get_context("spawn")
        for t in (k, v):
            t.share_memory_()
        self.q_buf = torch.zeros(q_shape, dtype=k.dtype).share_memory_()
        self.out_buf = torch.zeros(q_shape, dtype=k.dtype).share_memory_()
        self.lse_buf = torch.zeros(q_shape[:3], dtype=torch.float32).share_memory_()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proc_worker, daemon=True,
                                args=(child, k, v, self.q_buf, self.out_buf, self.lse_buf, scale, threads))
        self.proc.start()
        if self.conn.recv() != "ready":  # wait until the worker imported torch: no start-up noise
            raise RuntimeError("process pool worker failed to start")

    def submit(self, q, n):
        self.q_buf.copy_(q)
        self.conn.send(n)
        return self

    def result(self):
        self.conn.recv()
        return self.out_buf.clone(), self.lse_buf.clone()

    def close(self):
        self.conn.send(None)
        self.proc.join(timeout=10)


# ----------------------------------------------------------------------------- other work
def _spin_python(seconds):
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i
    return x


def _make_work(kind, seconds, gpu_q, gpu_k, gpu_v, scale, torch_reps):
    if kind == "wait":
        return lambda: time.sleep(seconds)
    if kind == "python":
        return lambda: _spin_python(seconds)
    if kind == "torch":
        def work():
            for _ in range(torch_reps):
                partial_attention(gpu_q, gpu_k, gpu_v, scale)
        return work
    raise ValueError(kind)


def _steps(host, work, thread_pools, proc_pools, q, hk, hv, scale, T):
    """One step per mode: the host partial and ``work`` (None: the host partial alone)."""
    def seq():
        host()
        if work is not None:
            work()

    fns = {"seq": seq}
    for t, p in thread_pools.items():
        def thread_step(p=p):
            f = p.submit(partial_attention, q, hk, hv, scale)
            if work is not None:
                work()
            return f.result()
        fns[f"thread({t}t)"] = thread_step
    for t, p in proc_pools.items():
        def proc_step(p=p):
            p.submit(q, T)
            if work is not None:
                work()
            return p.result()
        fns[f"process({t}t)"] = proc_step
    return fns


def run(args):
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    Hq, Hkv, D = args.heads, args.kv_heads, args.head_dim
    scale = D ** -0.5
    rows = []
    for B in args.batch:
        T_max = max(args.tokens)
        k = torch.randn(B, Hkv, T_max, D).to(dtype)
        v = torch.randn(B, Hkv, T_max, D).to(dtype)
        q = torch.randn(B, Hq, 1, D).to(dtype)
        thread_pools = {t: CPUAttentionPool(workers=1, torch_threads=t) for t in args.pool_threads}
        proc_pools = {t: SharedMemoryPool(k, v, q.shape, scale, t) for t in args.proc_threads}
        for T in args.tokens:
            hk, hv = k[:, :, :T], v[:, :, :T]
            kv_bytes = 2 * hk.numel() * hk.element_size()
            host = (lambda: partial_attention(q, hk, hv, scale))
            base = {"batch": B, "tokens": T, "kv_MB": round(kv_bytes / 1e6, 1)}
            alone = median_interleaved(_steps(host, None, thread_pools, proc_pools, q, hk, hv, scale, T), args.reps)
            rows.append({**base, "work": "alone", **{f"{n}_ms": t * 1e3 for n, t in alone.items()}})
            t_host = alone["seq"]  # the other work lasts about as long as the host partial
            w = max(1, T // 4)  # the GPU window stand-in for the 'torch' work
            gq, gk, gv = q, k[:, :, :w].clone(), v[:, :, :w].clone()
            t_one = median_time(lambda: partial_attention(gq, gk, gv, scale), args.reps)
            torch_reps = max(1, round(t_host / max(t_one, 1e-6)))
            for kind in args.work:
                work = _make_work(kind, t_host, gq, gk, gv, scale, torch_reps)
                res = median_interleaved(_steps(host, work, thread_pools, proc_pools, q, hk, hv, scale, T), args.reps)
                rows.append({**base, "work": kind, **{f"{n}_ms": t * 1e3 for n, t in res.items()}})
            if proc_pools:  # the process pool computes the same thing
                out_p, _ = next(iter(proc_pools.values())).submit(q, T).result()
                assert torch.allclose(out_p.float(), host()[0].float(), rtol=1e-3, atol=1e-3)
        for p in thread_pools.values():
            p.shutdown()
        for p in proc_pools.values():
            p.close()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ints = (lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--tokens", type=ints, default=[4096, 16384, 32768], help="host tokens per layer")
    ap.add_argument("--batch", type=ints, default=[1, 4])
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--work", type=lambda s: s.split(","), default=["wait", "python", "torch"])
    n = torch.get_num_threads()
    ap.add_argument("--proc-threads", type=ints, default=sorted({1, n}),
                    help="torch threads inside the worker process")
    ap.add_argument("--pool-threads", type=ints, default=sorted({1, n}),
                    help="torch threads of the pool's worker thread")
    ap.add_argument("--reps", type=int, default=5)
    args = parse_checked(ap, argv)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
          f"Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} {args.dtype}; median of {args.reps} (ms)")
    rows = run(args)
    print(f"caller's torch threads after the pools ran: {torch.get_num_threads()}; "
          f"load average now: {os.getloadavg()[0]:.2f}")
    try:
        import pandas as pd
        df = pd.DataFrame(rows)
        print(df.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        ms = [c for c in df.columns if c.endswith("_ms") and c != "seq_ms"]
        best = df[df.work != "alone"].groupby("work")[ms].apply(lambda d: (d.rank(axis=1).eq(1)).sum())
        print("\nwins per mode (fastest in a row), by kind of other work:")
        print(best.to_string())
    except ImportError:
        for r in rows:
            print(r)


if __name__ == "__main__":
    main()
