"""HybridGen's CPU branch against this machine's plain memory read bandwidth, on cold data.

    python benchmarks/bench_cpu_scan.py --quick --json results/cpu_scan/quick.json
    python benchmarks/bench_cpu_scan.py --batch 8 --tokens 32768 --reps 9 --threads 1,16

One Llama-3.1-8B-shaped layer (8 KV heads x 4 query heads per group, head dim 128, bf16
keys), ``--batch`` sequences of ``--tokens`` host tokens. Every timed call reads a different
copy of its data (``--copies``, each far larger than the last-level cache: cold data), and
every kind of call runs once per round, interleaved with the others, so a noisy (shared)
machine disturbs them alike; reported: the median over ``--reps`` rounds with its spread
(min-max) and the load average. Per thread count:
- ``read``: plain read bandwidth, ``torch.sum`` over float32 buffers of the keys' byte size
  (all buffers are allocated as HybridGen's host KV is: the dram tier's pageable view,
  advised onto transparent huge pages);
- exact bf16 scans (every query head of a group against one read of each key): the C
  kernel (``native``), numba, torch's bf16 matmul; GB/s of key bytes and ratio to read;
- the bf16-dot selection scan (``bf16dot scan``: bf16-rounded query, bf16 products, fp32
  accumulation; AVX-512 BF16 ``vdpbf16ps`` where the CPU has it, else the exact kernels on the
  rounded query) and the whole selection built on it (``bf16dot select``:
  :func:`hybridgen.attention.cpu_select.select_bf16dot`, scan + ``--bf16dot-oversample`` x k
  candidates + exact re-rank) next to the exact scan + selection (``exact select``); GB/s of
  key bytes and ratio to read (JSON ``bf16dot``);
- key-sketch scans (int8, int4): tokens/s (a token = one (batch, KV head) key row) against
  ``bf16_limit_tokens_per_s``, the tokens/s a bf16 scan would reach at 100% of ``read``; on
  an AVX-512 (VNNI) CPU also at the AVX2 level (rows ``... avx2``), side by side;
- the whole CPU branch (:func:`hybridgen.hybrid.host_branch.host_branch`: scan, selection, exact
  recompute (and re-rank of ``--oversample`` x k candidates) after a sketch scan, V-row
  gather) per scan kind (``branch exact``: the exact scan; ``branch int8`` / ``int4``: the
  sketch, the keys past its whole blocks at HybridGen's bf16 precision, fused per row since the
  sketch became the default: earlier files' rows of those names are the stagewise branch with an
  exact tail), as GB/s of *bf16 key
  bytes* (the branch's work, whatever it reads) and its split by stage;
- ``default branch``: the whole CPU branch of ``hybridgen`` at its DEFAULT configuration
  (:func:`default_branch`: its ``key_sketch`` and ``sketch_oversample``, its ``scan`` for bf16
  keys, kernels, group score, shared selection; the top-k at ``--topk-ratio``, the scheduler's
  start ratio by default; the true query's branch, which keeps no key rows): GB/s of key bytes
  (``default_branch_gbps``, stages in ``branch_stages_ms``) against ``read`` of the same run;
  beside it ``default branch stagewise`` (``fused=False``: each stage over every row, then the
  next) and, with a sketch, ``default branch, no sketch`` (``key_sketch='none'``: the bf16-dot
  scan of the keys themselves, ``scan_oversample``);
- recall of the exact top-k by each sketch's selection, by ``select_bf16dot`` and by the default
  branch (``default_recall``: real-like keys) (random keys, and "real-like" keys:
  a few large channels and a set of tokens aligned with the query, as in LLM caches).
Targets: scan >= 0.8 x read, branch >= 0.6 x read, sketch >= 1.5 x bf16 limit (issue 10);
default branch >= 0.8 x read (issue 22).
``--json FILE`` writes the numbers: top-level keys are those of the run at the most threads,
``by_threads`` holds every run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # thread/env settings before torch loads (docs/design.md, thread runtime)

import torch  # noqa: E402

from hybridgen.attention import cpu_scan as cs  # noqa: E402
from hybridgen.attention import native  # noqa: E402
from hybridgen.attention.cpu_pool import CPUAttentionPool  # noqa: E402
from hybridgen.attention.cpu_select import (DEFAULT_OVERSAMPLE, fused_branch_pays,  # noqa: E402
                                            select_bf16dot)
from hybridgen.attention.key_sketch import KeySketch  # noqa: E402
from hybridgen.hybrid.host_branch import fused_host_branch, host_branch, scan_precision, topk_count  # noqa: E402
from hybridgen.eval.environment import cpu_model  # noqa: E402
from hybridgen.eval.provenance import code_version  # noqa: E402
from hybridgen.hybrid import HybridGen  # noqa: E402
from hybridgen.kv import TieredStore  # noqa: E402
from hybridgen.validation.cli import exit_on_existing_output, parse_checked  # noqa: E402
from benchmarks.cpu_branch_recall import DEFAULT, default_branch, real_like_keys, recall_table  # noqa: E402

TARGETS = {"scan_over_read": 0.8, "branch_over_read": 0.6, "sketch_over_bf16_limit": 1.5,
           "default_branch_over_read": 0.8}


def rounds(fns: Dict[str, Callable[[int], object]], reps: int, copies: int) -> Dict[str, List[float]]:
    """Seconds of every fn per round; round r calls each fn(r % copies) once, in turn."""
    for name, fn in fns.items():  # warm-up (compiles, first-touch of scratch)
        fn(0)
    out: Dict[str, List[float]] = {name: [] for name in fns}
    for r in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn(r % copies)
            out[name].append(time.perf_counter() - t)
    return out


def summary(seconds: List[float], nbytes: float) -> Dict[str, float]:
    """GB/s of nbytes at the median time, with the spread (GB/s at the slowest and fastest run)."""
    med = statistics.median(seconds)
    return {"ms": med * 1e3, "gbps": nbytes / med / 1e9, "gbps_min": nbytes / max(seconds) / 1e9,
            "gbps_max": nbytes / min(seconds) / 1e9}


def exact_select(q: torch.Tensor, keys: torch.Tensor, scale: float, k: int, out: torch.Tensor,
                 pool: CPUAttentionPool):
    """The exact scan + the selection (shared, max group score): what ``bf16dot select`` replaces."""
    logits, _, stats = cs.scan_logits_stats(q, keys, scale, None, "native", out=out, pool=pool)
    return cs.select(logits, keys.shape[1], k, False, "max", pool=pool, stats=stats)


def run(args, threads: int, data: dict) -> dict:
    torch.set_num_threads(threads)
    pool = CPUAttentionPool(workers=1, split_threads=threads)
    B, H, G, D, T = args.batch, args.kv_heads, args.group, args.head_dim, args.tokens
    q, keys, vals, reads, sketches = data["q"], data["keys"], data["vals"], data["reads"], data["sketches"]
    scale = D ** -0.5
    k_sel = topk_count(args.topk_ratio, T)
    key_bytes = B * H * T * D * 2
    tokens = B * H * T
    qg16 = q.view(B, H, G, D).to(torch.bfloat16)
    fns: Dict[str, Callable[[int], object]] = {"read": lambda i: reads[i].sum()}
    out = torch.zeros(B * H * G * T)  # preallocated logits (as the branch's scratch): no page faults timed
    v_out = torch.zeros(B * H * k_sel * D, dtype=torch.bfloat16)  # the V rows' staging buffer (HybridGen's packer)
    fns["scan native bf16"] = lambda i: cs.scan_logits(q, keys[i], scale, None, "native", out=out, pool=pool)
    if cs.numba_available():
        fns["scan numba bf16"] = lambda i: cs.scan_logits(q, keys[i], scale, None, "numba", out=out, pool=pool)
    fns["scan torch bf16"] = lambda i: torch.matmul(qg16, keys[i].transpose(-1, -2))
    fns["bf16dot scan"] = lambda i: cs.scan_logits_stats(q, keys[i], scale, None, "native", out=out, pool=pool,
                                                         precision="bf16dot")
    fns["exact select"] = lambda i: exact_select(q, keys[i], scale, k_sel, out, pool)
    fns["bf16dot select"] = lambda i: select_bf16dot(q, keys[i], scale, k_sel, pool=pool, out=out,
                                                     oversample=args.bf16dot_oversample)
    for kind in args.sketches:
        fns[f"sketch {kind}"] = (lambda kd: lambda i: sketches[kd][i].scan(q, scale, 0, T, out=out, pool=pool))(kind)
    if native.isa() > 1:  # the same kernels one level down, side by side
        for kind in args.sketches:
            fns[f"sketch {kind} avx2"] = (lambda kd: lambda i: at_level(1, sketches[kd][i].scan, q, scale, 0, T,
                                                                        out=out, pool=pool))(kind)
    branch_fns = {"branch exact": lambda i: host_branch(q, keys[i], vals, scale, k_sel, False, backend="native",
                                                        pool=pool, v_out=v_out)}
    precision = scan_precision(DEFAULT.scan, torch.bfloat16)  # the tail past a sketch's blocks, as HybridGen's
    for kind in args.sketches:
        branch_fns[f"branch {kind}"] = (lambda kd: lambda i: host_branch(
            q, keys[i], vals, scale, k_sel, False, sketch=sketches[kd][i], pool=pool, v_out=v_out,
            oversample=args.oversample, precision=precision))(kind)
    own = (lambda i: sketches[DEFAULT.key_sketch][i]) if DEFAULT.key_sketch != "none" else (lambda i: None)
    branch_fns["default branch"] = lambda i: default_branch(q, keys[i], vals, k_sel, pool=pool, v_out=v_out,
                                                            sketch=own(i))
    # beside it: the same branch with its stages one after another over every row (before the
    # per-row fusion of csrc/branch.c), and the branch that scans the bf16 keys (no sketch)
    branch_fns["default branch stagewise"] = lambda i: default_branch(q, keys[i], vals, k_sel, pool=pool,
                                                                      v_out=v_out, fused=False, sketch=own(i))
    if DEFAULT.key_sketch != "none":
        plain = dataclasses.replace(DEFAULT, key_sketch="none")
        branch_fns["default branch, no sketch"] = lambda i: default_branch(q, keys[i], vals, k_sel, plain,
                                                                           pool=pool, v_out=v_out)
    if not fused_branch_pays(B * H, pool.threads_for(B * H * G * T * D)):  # the default chose stagewise here
        branch_fns["default branch fused anyway"] = lambda i: fused_host_branch(
            q, keys[i], vals, scale, k_sel, DEFAULT.group_score,
            DEFAULT.scan_oversample if DEFAULT.key_sketch == "none" else DEFAULT.sketch_oversample, v_out, pool,
            sketch=own(i))
    fns.update(branch_fns)
    load0 = os.getloadavg()
    secs = rounds(fns, args.reps, args.copies)
    res: dict = {"threads": threads, "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg())}
    rows = {}
    for name, s in secs.items():
        nbytes = key_bytes
        if name.startswith("sketch"):
            nbytes = tokens * sketches[name.split()[1]][0].bytes_per_token
        rows[name] = summary(s, nbytes)
        rows[name]["tokens_per_s"] = tokens / statistics.median(s)
    read = rows["read"]["gbps"]
    scans = {n: r for n, r in rows.items() if n.startswith("scan")}  # the exact scans
    best_scan = max(scans, key=lambda n: scans[n]["gbps"])
    branches = {n: r for n, r in rows.items() if n.startswith("branch")}
    best_branch = max(branches, key=lambda n: branches[n]["gbps"])
    sk_rows = {n: r for n, r in rows.items() if n.startswith("sketch") and not n.endswith("avx2")}
    best_sketch = max(sk_rows, key=lambda n: sk_rows[n]["tokens_per_s"]) if sk_rows else None
    limit = read * 1e9 / (D * 2)
    # stage split of each branch kind (one more call each, medians of the stages over reps)
    stages = {}
    for name, fn in branch_fns.items():
        parts = {"scan_ms": [], "select_ms": [], "recompute_ms": [], "gather_ms": []}
        for r in range(args.reps):
            sel = fn(r % args.copies)
            for part, v in (("scan_ms", sel.scan_s), ("select_ms", sel.topk_s), ("recompute_ms", sel.recompute_s),
                            ("gather_ms", sel.gather_s)):
                parts[part].append(v * 1e3)
        stages[name] = {p: statistics.median(v) for p, v in parts.items()}
    res.update({
        "read_gbps": read, "read_gbps_spread": [rows["read"]["gbps_min"], rows["read"]["gbps_max"]],
        "scan_gbps": scans[best_scan]["gbps"], "scan_kernel": best_scan,
        "scan_gbps_spread": [scans[best_scan]["gbps_min"], scans[best_scan]["gbps_max"]],
        "branch_gbps": branches[best_branch]["gbps"], "branch_config": best_branch,
        "branch_gbps_spread": [branches[best_branch]["gbps_min"], branches[best_branch]["gbps_max"]],
        "sketch_tokens_per_s": sk_rows[best_sketch]["tokens_per_s"] if best_sketch else None,
        "sketch_kind": best_sketch, "bf16_limit_tokens_per_s": limit, "topk": k_sel,
        "default_branch_gbps": rows["default branch"]["gbps"],
        "default_branch_gbps_spread": [rows["default branch"]["gbps_min"], rows["default branch"]["gbps_max"]],
        "default_config": {"key_sketch": DEFAULT.key_sketch, "sketch_oversample": DEFAULT.sketch_oversample,
                           "scan": DEFAULT.scan, "precision": scan_precision(DEFAULT.scan, torch.bfloat16),
                           "scan_oversample": DEFAULT.scan_oversample, "scan_backend": DEFAULT.scan_backend,
                           "topk_backend": DEFAULT.topk_backend, "group_score": DEFAULT.group_score,
                           "per_head": DEFAULT.per_head, "branch_pieces": DEFAULT.branch_pieces,
                           "topk_ratio": args.topk_ratio},
        "rows": rows, "branch_stages_ms": stages,
    })
    pairs = (("scan", "bf16dot scan"), ("select", "bf16dot select"), ("exact_select", "exact select"))
    res["bf16dot"] = {
        "isa": "avx512_bf16 vdpbf16ps" if native.has_bf16dot() else f"{native.ISA_NAMES[native.isa()]} emulation",
        "oversample": args.bf16dot_oversample,
        **{f"{key}_gbps": rows[name]["gbps"] for key, name in pairs},
        **{f"{key}_gbps_spread": [rows[name]["gbps_min"], rows[name]["gbps_max"]] for key, name in pairs},
        **{f"{key}_over_read": rows[name]["gbps"] / read for key, name in pairs + (("exact_scan", "scan native bf16"),)},
    }
    ratios = {"scan_over_read": res["scan_gbps"] / read, "branch_over_read": res["branch_gbps"] / read,
              "sketch_over_bf16_limit": (res["sketch_tokens_per_s"] / limit) if best_sketch else None,
              "default_branch_over_read": res["default_branch_gbps"] / read}
    res["ratios"] = ratios
    res["targets_met"] = {n: (v is not None and v >= TARGETS[n]) for n, v in ratios.items()}
    pool.shutdown()
    return res


def at_level(level: int, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) with the C kernels capped at instruction-set ``level``."""
    top = native.isa()
    native.set_isa_limit(level)
    try:
        return fn(*args, **kwargs)
    finally:
        native.set_isa_limit(top)


def print_run(res: dict, read: float, limit: float) -> None:
    print(f"\n## threads={res['threads']}  load average {res['loadavg_before'][0]:.1f} -> "
          f"{res['loadavg_after'][0]:.1f}  (median of rounds; spread = slowest..fastest)")
    print(f"{'call':20s} {'ms':>8s} {'GB/s':>7s} {'spread':>13s} {'x read':>7s} {'Mtok/s':>8s} {'x limit':>8s}")
    for name, r in res["rows"].items():
        print(f"{name:20s} {r['ms']:8.1f} {r['gbps']:7.2f} {r['gbps_min']:6.2f}-{r['gbps_max']:<6.2f} "
              f"{r['gbps'] / read if not name.startswith('sketch') else float('nan'):7.2f} "
              f"{r['tokens_per_s'] / 1e6:8.1f} {r['tokens_per_s'] / limit:8.2f}")
    for name, st in res["branch_stages_ms"].items():
        print(f"  {name:18s} " + "  ".join(f"{k[:-3]} {v:6.1f} ms" for k, v in st.items()))
    rt, met = res["ratios"], res["targets_met"]
    print(f"targets: scan/read {rt['scan_over_read']:.2f} (>= 0.8: {'met' if met['scan_over_read'] else 'NOT met'}), "
          f"branch/read {rt['branch_over_read']:.2f} (>= 0.6: {'met' if met['branch_over_read'] else 'NOT met'}) "
          f"[{res['branch_config']}], sketch/bf16-limit "
          f"{rt['sketch_over_bf16_limit'] if rt['sketch_over_bf16_limit'] is not None else float('nan'):.2f} "
          f"(>= 1.5: {'met' if met['sketch_over_bf16_limit'] else 'NOT met'}) [{res['sketch_kind']}]")
    dc = res["default_config"]
    scanned = dc["precision"] if dc["key_sketch"] == "none" else f"{dc['key_sketch']} sketch, {dc['precision']} tail"
    over = dc["scan_oversample"] if dc["key_sketch"] == "none" else dc["sketch_oversample"]
    print(f"default branch ({scanned}, oversample {over:g}): {res['default_branch_gbps']:.2f} GB/s = "
          f"{rt['default_branch_over_read']:.2f} x read {read:.2f} (>= 0.8: "
          f"{'met' if met['default_branch_over_read'] else 'NOT met'})")
    bd = res["bf16dot"]
    print(f"bf16-dot ({bd['isa']}): scan/read {bd['scan_over_read']:.2f} (exact scan {bd['exact_scan_over_read']:.2f}), "
          f"select/read {bd['select_over_read']:.2f} (exact scan + select {bd['exact_select_over_read']:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the issue's point: batch 8, 32768 tokens, 5 rounds, "
                                                         "threads 1 and all")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=32768, help="host tokens per sequence")
    ap.add_argument("--topk-ratio", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=None, help="rounds (each call once per round; default 7, 5 with --quick)")
    ap.add_argument("--copies", type=int, default=2, help="copies of the data, cycled (cold data)")
    ap.add_argument("--threads", type=str, default=None, help="comma-separated thread counts (default: 1,all)")
    ap.add_argument("--sketches", type=str, default="int8,int4")
    ap.add_argument("--bf16dot-oversample", type=float, default=DEFAULT_OVERSAMPLE,
                    help="candidates per selected token of the bf16-dot selection, re-ranked exactly")
    ap.add_argument("--oversample", type=float, default=HybridGen.__dataclass_fields__["sketch_oversample"].default,
                    help="sketch candidates per selected token, re-ranked exactly (default: hybridgen's)")
    ap.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    args = parse_checked(ap, argv)
    exit_on_existing_output(args)  # checked before measuring, never overwritten without --force
    if args.reps is None:  # --quick's 5 rounds never override an explicit --reps
        args.reps = 5 if args.quick else 7
    args.sketches = [s for s in args.sketches.split(",") if s]
    if DEFAULT.key_sketch != "none" and DEFAULT.key_sketch not in args.sketches:
        args.sketches.append(DEFAULT.key_sketch)  # the default branch scans it
    n_all = runtime.scan_threads()
    threads = sorted({int(t) for t in args.threads.split(",")}) if args.threads else sorted({1, n_all})
    t_start = time.perf_counter()
    B, H, G, D, T = args.batch, args.kv_heads, args.group, args.head_dim, args.tokens
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H * G, D, generator=gen)
    store = TieredStore()
    # every buffer where HybridGen's host KV lives: the dram tier's pageable view (huge-page
    # advised, docs/design.md placement); the same numbers in every copy, different memory
    host = store["dram"].view(pinned=False)
    k0 = torch.randn(B, H, T, D, generator=gen).to(torch.bfloat16)
    keys = [host.allocate((B, H, T, D), torch.bfloat16, f"bench/k{i}").copy_(k0) for i in range(args.copies)]
    del k0
    vals = host.allocate((B, H, T, D), torch.bfloat16, "bench/v").copy_(keys[0]).neg_()
    reads = [host.allocate((B * H * T * D // 2,), torch.float32, f"bench/read{i}").fill_(1.0)
             for i in range(args.copies)]
    sketches = {}
    for kind in args.sketches:
        sketches[kind] = []
        for i in range(args.copies):
            sk = KeySketch(store["dram"], kind, B, H, D, T, f"bench/{kind}{i}")
            sk.sync(keys[i])
            sketches[kind].append(sk)
    setup_s = time.perf_counter() - t_start
    print(f"# CPU branch benchmark: B={B} Hkv={H} G={G} D={D} host tokens={T} (bf16 keys "
          f"{B * H * T * D * 2 / 1e6:.0f} MB per copy x {args.copies} copies), top-k {args.topk_ratio:.0%}; "
          f"C kernels: {native.ISA_NAMES[native.isa()] if native.available() else native.build_error}; "
          f"numba: {'yes' if cs.numba_available() else 'no'}; setup {setup_s:.0f} s")
    data = {"q": q, "keys": keys, "vals": vals, "reads": reads, "sketches": sketches}
    runs = {}
    for n in threads:
        res = run(args, n, data)
        runs[str(n)] = res
        print_run(res, res["read_gbps"], res["bf16_limit_tokens_per_s"])
    k_sel = topk_count(args.topk_ratio, T)
    rec_T = min(T, 8192)
    rk = topk_count(args.topk_ratio, rec_T)
    rec = recall_table(q, keys[0][:, :, :rec_T].contiguous(), real_like_keys(B, H, rec_T, D, q, gen).to(torch.bfloat16),
                       rk, store, args.sketches, args.oversample, args.bf16dot_oversample)
    print(f"\nrecall of the exact top-{rk} of {rec_T} tokens by each selection (kind@oversample): "
          + ", ".join(f"{k} {v:.3f}" for k, v in rec.items()))
    top = runs[str(max(threads))]
    out = {k: top[k] for k in ("read_gbps", "scan_gbps", "branch_gbps", "sketch_tokens_per_s",
                               "bf16_limit_tokens_per_s", "threads", "ratios", "targets_met", "scan_kernel",
                               "branch_config", "sketch_kind", "bf16dot", "default_branch_gbps",
                               "default_branch_gbps_spread", "default_config")}
    out.update({"default_recall": rec["default_real_like"], "default_recall_random": rec["default_random"]})
    out.update({"shape": {"batch": B, "kv_heads": H, "group": G, "head_dim": D, "host_tokens": T, "topk": k_sel,
                          "dtype": "bfloat16"},
                "reps": args.reps, "copies": args.copies, "cold_bytes_per_copy": B * H * T * D * 2,
                "recall": {"topk": rk, "tokens": rec_T, **rec}, "by_threads": runs,
                "oversample": args.oversample, "command": " ".join(["python", *sys.argv]),
                "code": code_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "cpu_isa": native.ISA_NAMES[native.isa()],
                            "torch": torch.__version__},
                "elapsed_s": time.perf_counter() - t_start})
    print(f"elapsed {out['elapsed_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
