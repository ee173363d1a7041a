"""`python -m hybridgen.demo`: generate with the real SmolLM2 under several KV methods, side by side.

Prints the generated text of each method and a table of per-phase timings, bytes per tier
and host->GPU bytes. On a machine without CUDA the gpu tier is emulated on the CPU (the
table says so): the numbers show correctness and memory, not GPU speed.
"""
from __future__ import annotations

import argparse
import time

import torch

from hybridgen.errors import cli_errors
from hybridgen.methods import build_method

DEFAULT_PROMPT = ("The key idea of splitting attention between a CPU and a GPU is that "
                  "each processor works on the tokens stored in its own memory. In short,")


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


@cli_errors
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="full,hybrid-exact", help="comma-separated registry names")
    p.add_argument("--gpu-budget", default="25%", help="hybrid-exact: tokens kept on the gpu tier")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--new-tokens", type=int, default=48)
    args = p.parse_args(argv)

    from hybridgen.model import load_model

    engine = load_model(args.model)
    ids, mask = engine.encode([args.prompt])
    rows = []
    texts = {}
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        params = {"gpu_budget": args.gpu_budget} if name == "hybrid-exact" else {}
        method = build_method(name, **params)
        t0 = time.perf_counter()
        res = engine.generate(ids, method, max_new_tokens=args.new_tokens, attention_mask=mask)
        wall = time.perf_counter() - t0
        texts[name] = engine.tokenizer.decode(res.tokens[0], skip_special_tokens=True)
        n_steps = max(len(res.step_s), 1)
        rows.append({
            "method": name,
            "prefill ms": f"{res.prefill_s * 1e3:.1f}",
            "decode ms/token": f"{res.decode_s / n_steps * 1e3:.1f}",
            "total s": f"{wall:.2f}",
            "gpu MiB": _mib(res.peak_bytes_by_tier.get("gpu", 0)),
            "host MiB": _mib(res.peak_bytes_by_tier.get("dram", 0) + res.peak_bytes_by_tier.get("cxl", 0)),
            "H2D MiB": _mib(res.method_stats.get("bytes_h2d", 0)),
        })
    print(f"prompt: {args.prompt!r}\n")
    for name, text in texts.items():
        print(f"[{name}] {text!r}\n")
    if len(texts) > 1:
        base = next(iter(texts.values()))
        same = all(t == base for t in texts.values())
        print(f"identical generations across methods: {same}\n")
    headers = list(rows[0])
    widths = [max(len(h), *(len(r[h]) for r in rows)) for h in headers]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(r[h].rjust(w) for h, w in zip(headers, widths)))
    if not torch.cuda.is_available():
        print("\nno CUDA here: the gpu tier is emulated on the CPU (timings show CPU cost, not GPU speed)")


if __name__ == "__main__":
    main()
