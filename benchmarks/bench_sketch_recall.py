"""Recall of HybridGen's exact top-k by the key sketch's selection, on a real model's keys.

    .venv/bin/python benchmarks/bench_sketch_recall.py --ctx 4096,8000 --json results/hybridgen_fidelity/sketch_recall.json

One prefill of a real prompt (``--source``, as ``bench_baselines.py``) through ``full``; per
layer, the queries of the last ``--queries`` prompt positions act as decode queries over
the keys before them (the host share of a decode step). For each query position the CPU
branch's selection (:func:`hybridgen.hybrid.host_branch.host_branch`, shared per KV head, max group
score, ``--topk-ratio`` of the tokens) is made twice, from the exact keys and from each
sketch (:class:`hybridgen.attention.key_sketch.KeySketch`) at each ``--oversample`` (the
sketch proposes ceil(o * k) candidates, re-ranked by their exact logits: HybridGen's
``sketch_oversample``); recall = |sketch ∩ exact| / k, averaged over layers, positions,
batch and KV heads (per layer in the JSON; key ``<kind>@<o>``). Only the SELECTION is
compared: the selected rows' logits are recomputed exactly either way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()

import torch  # noqa: E402

from hybridgen.attention.key_sketch import SKETCH_KINDS, KeySketch  # noqa: E402
from hybridgen.errors import cli_errors  # noqa: E402
from hybridgen.hybrid.host_branch import host_branch, topk_count  # noqa: E402
from hybridgen.kv import TieredStore  # noqa: E402
from hybridgen.methods.full import Full  # noqa: E402
from hybridgen.validation.cli import exit_on_existing_output, parse_checked  # noqa: E402


class CapturingFull(Full):
    """``full`` that keeps each layer's prompt q [B, Hq, T, D] and k [B, Hkv, T, D] (CPU, fp32)."""

    def bind(self, ctx):
        super().bind(ctx)
        self.captured: Dict[int, tuple] = {}

    def prefill(self, layer, q, k, v, valid):
        self.captured[layer] = (q.detach().float().cpu(), k.detach().float().cpu())
        return super().prefill(layer, q, k, v, valid)


def layer_recall(q: torch.Tensor, k: torch.Tensor, n_queries: int, ratio: float, store: TieredStore,
                 scale: float, oversample: List[float]) -> Dict[str, float]:
    """Mean recall per (sketch kind, oversampling) over the last ``n_queries`` positions of one layer."""
    B, Hkv, T, D = k.shape
    hosts = T - n_queries
    keys = k[:, :, :hosts].to(torch.bfloat16).contiguous()
    kk = topk_count(ratio, hosts)
    out: Dict[str, List[float]] = {f"{kind}@{o:g}": [] for kind in SKETCH_KINDS for o in oversample}
    sketches = {}
    for kind in SKETCH_KINDS:
        sk = KeySketch(store["dram"], kind, B, Hkv, D, hosts, f"recall/{kind}")
        sk.sync(keys)
        sketches[kind] = sk
    for pos in range(hosts, T):
        qq = q[:, :, pos].contiguous()
        exact = host_branch(qq, keys, keys, scale, kk, per_head=False, backend="auto").idx
        for kind, sk in sketches.items():
            for o in oversample:
                sel = host_branch(qq, keys, keys, scale, kk, per_head=False, sketch=sk, oversample=o).idx
                hits = (exact.unsqueeze(-1) == sel.unsqueeze(-2)).any(-1).float().mean().item()
                out[f"{kind}@{o:g}"].append(hits)
    for sk in sketches.values():
        sk.release()
    return {key: statistics.mean(v) for key, v in out.items()}


@cli_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--ctx", default="4096,8000")
    ap.add_argument("--queries", type=int, default=8, help="last prompt positions used as decode queries")
    ap.add_argument("--topk-ratio", type=float, default=0.05, help="selected share of the host tokens "
                    "(hybridgen's scheduler starts at 0.05)")
    ap.add_argument("--oversample", default="1,1.25,1.5", help="comma-separated sketch_oversample values")
    ap.add_argument("--source", default="pydoc")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    args = parse_checked(ap, argv)
    exit_on_existing_output(args)  # checked before measuring, never overwritten without --force
    from hybridgen.data.sources import prompt_ids
    from hybridgen.model import load_model

    engine = load_model(args.model, dtype="float32")
    oversample = [float(o) for o in args.oversample.split(",")]
    res = {"model": args.model, "source": args.source, "queries": args.queries, "topk_ratio": args.topk_ratio,
           "oversample": oversample, "by_ctx": {}}
    for ctx in [int(c) for c in args.ctx.split(",")]:
        ids = prompt_ids(engine.tokenizer, engine.spec.vocab_size, args.source, 1, ctx, 0)
        method = CapturingFull()
        store = TieredStore(gpu_device=engine.device)
        engine.prefill(ids, None, method, store=store, max_new_tokens=1)
        scale = engine.spec.head_dim ** -0.5
        per_layer = {}
        for layer in sorted(method.captured):
            q, k = method.captured[layer]
            per_layer[layer] = layer_recall(q, k, args.queries, args.topk_ratio, store, scale, oversample)
        engine.release()
        keys = list(next(iter(per_layer.values())))
        mean = {key: statistics.mean(r[key] for r in per_layer.values()) for key in keys}
        worst = {key: min(r[key] for r in per_layer.values()) for key in keys}
        res["by_ctx"][str(ctx)] = {"mean": mean, "worst_layer": worst, "per_layer": per_layer,
                                   "topk": topk_count(args.topk_ratio, ctx - args.queries)}
        print(f"ctx {ctx}: top-{res['by_ctx'][str(ctx)]['topk']} recall " + ", ".join(
            f"{key} mean {mean[key]:.3f} (worst layer {worst[key]:.3f})" for key in keys), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
