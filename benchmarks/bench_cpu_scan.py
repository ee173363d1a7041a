"""Measure HybridGen's CPU branch against this machine's plain memory read bandwidth.

    NUMBA_THREADING_LAYER=workqueue python benchmarks/bench_cpu_scan.py [--tokens 16384 --batch 2]

Prints, for one Llama-3.1-8B-shaped layer (8 KV heads x 4 query heads per group, head dim
128) with ``--tokens`` host tokens per sequence:
- plain read bandwidth: ``torch.sum`` over a buffer larger than the last-level cache;
- the key scan for each kernel (torch bf16 matmul, torch fp32, torch fp32 over transposed
  keys, numba bf16, numba fp32) as ms, GB/s of key bytes read, and % of plain read;
- top-k (torch.topk vs numba argpartition) and the V-row gather (index_select vs gather);
- the whole CPU branch (scan + top-k + gather) per scan backend.
Sizes default small enough for a 2-core development box; on a real host raise --tokens and
--batch (e.g. --batch 8 --tokens 29500, the issue's measurement point).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hybridgen.attention import cpu_scan as cs  # noqa: E402


def timeit(fn, reps: int, warmup: int = 1) -> float:
    """Best (minimum) seconds of fn() over reps runs after warmup runs.

    The minimum, not the median: development machines are shared, and the least disturbed
    run is the best estimate of what the kernel can do.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def plain_read_gbs(nbytes: int, reps: int) -> float:
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    s = timeit(lambda: buf.sum(), reps)
    return nbytes / s / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384, help="host tokens per sequence")
    ap.add_argument("--topk-ratio", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch and scan threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["HYBRIDGEN_SCAN_THREADS"] = str(args.threads)
    B, H, G, D, T = args.batch, args.kv_heads, args.group, args.head_dim, args.tokens
    Hq = H * G
    scale = D ** -0.5
    k_sel = cs.topk_count(args.topk_ratio, T)
    torch.manual_seed(0)
    print(f"# CPU branch benchmark: threads={torch.get_num_threads()} B={B} Hkv={H} G={G} D={D} "
          f"host tokens={T} top-k={k_sel} numba={'yes' if cs.numba_available() else 'no'}")
    keys16 = torch.randn(B, H, T, D).to(torch.bfloat16)
    vals16 = torch.randn(B, H, T, D).to(torch.bfloat16)
    keys32 = keys16.float()
    keys32_t = keys32.transpose(-1, -2).contiguous()  # [B, H, D, T]
    q = torch.randn(B, Hq, D)
    b16, b32 = keys16.numel() * 2, keys32.numel() * 4
    read = plain_read_gbs(max(4 * b32, 256 << 20), args.reps)
    print(f"plain memory read (torch sum over {max(4 * b32, 256 << 20) >> 20} MiB): {read:.1f} GB/s")
    print(f"{'kernel':34s} {'ms':>8s} {'GB/s':>8s} {'% read':>7s}")

    def row(name, seconds, nbytes):
        gbs = nbytes / seconds / 1e9
        print(f"{name:34s} {seconds * 1e3:8.2f} {gbs:8.1f} {100 * gbs / read:6.0f}%")
        return gbs

    qg16 = q.view(B, H, G, D).to(torch.bfloat16)
    qg32 = q.view(B, H, G, D)
    results = {}
    results["torch-bf16"] = row("scan torch bf16 matmul", timeit(lambda: torch.matmul(qg16, keys16.transpose(-1, -2)), args.reps), b16)
    results["torch-fp32"] = row("scan torch fp32 matmul", timeit(lambda: torch.matmul(qg32, keys32.transpose(-1, -2)), args.reps), b32)
    results["torch-fp32-T"] = row("scan torch fp32 transposed keys", timeit(lambda: torch.matmul(qg32, keys32_t), args.reps), b32)
    if cs.numba_available():
        cs.scan_logits(q, keys16[:, :, :64], scale, None, "numba")  # compile
        cs.scan_logits(q, keys32[:, :, :64], scale, None, "numba")
        results["numba-bf16"] = row("scan numba bf16 (fp32 accumulate)", timeit(lambda: cs.scan_logits(q, keys16, scale, None, "numba"), args.reps), b16)
        results["numba-fp32"] = row("scan numba fp32", timeit(lambda: cs.scan_logits(q, keys32, scale, None, "numba"), args.reps), b32)

    logits, _ = cs.scan_logits(q, keys16, scale, None, "torch")
    scores = cs.group_scores(logits, H)
    print(f"\ntop-k of {k_sel} over [{B}, {H}, {T}] scores")
    print(f"  torch.topk(sorted=False)      {timeit(lambda: cs.topk_indices(scores, k_sel, 'torch'), args.reps) * 1e3:8.2f} ms")
    if cs.numba_available():
        cs.topk_indices(scores[:, :, :128], 4, "numba")
        print(f"  numba argpartition            {timeit(lambda: cs.topk_indices(scores, k_sel, 'numba'), args.reps) * 1e3:8.2f} ms")
    print(f"  group score (max log-prob)    {timeit(lambda: cs.group_scores(logits, H), args.reps) * 1e3:8.2f} ms")
    idx = cs.topk_indices(scores, k_sel)
    rows_bytes = B * H * k_sel * D * 2
    print(f"gather of {k_sel} V rows per (batch, KV head) ({rows_bytes / 1e6:.2f} MB)")
    print(f"  index_select (flat rows)      {timeit(lambda: cs.gather_rows(vals16, idx), args.reps) * 1e3:8.2f} ms")
    print(f"  torch.gather (expanded index) "
          f"{timeit(lambda: torch.gather(vals16, 2, idx[..., None].expand(-1, -1, -1, D)), args.reps) * 1e3:8.2f} ms")

    print("\nwhole CPU branch (scan + top-k + gather), bf16 KV")
    for per_head in (False, True):
        for be in ("torch", "numba") if cs.numba_available() else ("torch",):
            for tk in ("torch", "numba") if cs.numba_available() else ("torch",):
                run = (lambda: cs.host_branch(q, keys16, vals16, scale, k_sel, per_head=per_head, backend=be,
                                              topk_backend=tk))
                s = timeit(run, args.reps)
                print(f"  {'per-head' if per_head else 'shared  '} scan={be:6s} top-k={tk:6s} {s * 1e3:8.2f} ms "
                      f"({b16 / s / 1e9:.1f} GB/s of keys)")
    best = max(results, key=results.get)
    print(f"\nfastest scan per key byte: {best} at {results[best]:.1f} GB/s ({100 * results[best] / read:.0f}% of plain read); "
          f"per token the bf16 kernels read half the bytes of fp32 ones")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
