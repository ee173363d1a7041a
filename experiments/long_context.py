"""``python experiments/long_context.py --out DIR [...]``: needle retrieval at long context, every method from one prefill.

For each needle document (Paul Graham essays, ``make data``; lengths in tokens of the model's
own tokenizer; depths; the variants single / multikey / multivalue, see
:mod:`hybridgen.data.needle`) the dense prefill is recorded ONCE
(:func:`hybridgen.model.shared_prefill.record_prefill`) and every method at every budget starts
from it and decodes greedily: a table of 15 method configurations costs one prefill per
document, not fifteen. Each method's answer is scored by exact match of the needle's number(s).

Methods at a budget ``b`` (``--budgets``): a method with a ``budget`` parameter keeps ``b`` of
the KV; HybridGen holds ``b/2`` of the prompt on the gpu tier and attends the top ``b/2`` of its
host tokens besides (``gpu_budget=b/2, topk_ratio=b/2``: the ``hybridgen-b20`` convention, top-k
pinned so the scheduler cannot move it; it attends b/2 + (b/2)(1 - b/2) of the prompt, 0.19 at
b = 0.2); FlexGen and hybrid-exact hold ``b`` on the gpu tier and the rest on the host
(lossless). ``full`` runs once. The answer is the generation's first line (the ``hg_needle``
lm-eval task's ``until: ["\n"]``); the whole decoded text is kept beside it.

Writes ``DIR/run.json`` (the arguments, the model's provenance, code version and environment)
and appends one JSON line per (document, method) to ``DIR/samples.jsonl`` as each document
finishes (one write per document; documents run sample by sample, each at every length and
depth, so a run stopped early has covered every cell; an unterminated last line, from a run
killed mid-write, is dropped on resume). An existing DIR is refused unless ``--resume``, which continues it (same
arguments, same code, same machine; finished (document, configuration) pairs are skipped). ``--report`` (or the end of a run)
writes the table and figures (:mod:`hybridgen_harness.long_context`).

``--source ruler`` runs lm-eval's RULER needle tasks that work offline instead (``--variants``
among niah_single_1, niah_multikey_2, niah_multikey_3; ``--samples`` per (length, task); RULER
places its own needles, so no ``--depths``): each sample's prompt as lm-eval sends it, scored as
lm-eval scores RULER (:mod:`hybridgen.eval.ruler_docs`), every method from one prefill per sample.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from hybridgen.errors import ConfigError, cli_errors  # noqa: E402

SAMPLES, RUN = "samples.jsonl", "run.json"
METHODS = "full,hybridgen,flexgen,infinigen,h2o,snapkv,streamingllm,quest"
#: new tokens per variant: a 7-digit number is up to 8 tokens; multivalue asks for two
NEW_TOKENS = {"single": 12, "multikey": 12, "multivalue": 24}


def _csv(value: str, kind=str) -> List[Any]:
    return [kind(v) for v in str(value).split(",") if v.strip()]


def method_configs(specs: List[str], budgets: List[float]) -> List[Tuple[str, str, Dict[str, Any]]]:
    """[(label, method name, params)]: ``full`` once, every other method at every budget. A spec is
    a method's name, or ``NAME:key=value[:key=value]`` with parameters of its own (e.g.
    ``infinigen:partial_weight_ratio=1.0``; labelled ``NAME:key=value@budget``)."""
    from hybridgen.methods import available_methods, build_method, parse_method_spec

    out = []
    for spec in specs:
        name, extra = parse_method_spec(spec)
        if name not in available_methods():
            raise ConfigError(f"unknown method {name!r}; choose among {', '.join(available_methods())}")
        if name == "full":
            out.append(("full", "full", {}))
            continue
        keys = set(build_method(name).config())
        for b in budgets:
            if name == "hybridgen":
                params = {"gpu_budget": b / 2, "topk_ratio": b / 2, "three_way": False}  # a fixed budget
            elif "budget" in keys:
                params = {"budget": b}
            elif "gpu_budget" in keys:
                params = {"gpu_budget": b}
            else:
                raise ConfigError(f"method {name!r} has no budget or gpu_budget parameter; leave it out of --methods")
            clash = sorted(set(extra) & set(params))
            if clash:
                raise ConfigError(f"{spec!r} sets {', '.join(clash)}, which --budgets sets; leave it out of the spec")
            params = {**params, **extra}
            build_method(name, **params)  # checked now, before the model loads
            out.append((f"{spec}@{b:g}", name, params))
    labels = [label for label, _, _ in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--methods names a configuration twice ({', '.join(sorted({x for x in labels if labels.count(x) > 1}))}); "
                          "give each once")
    return out


def _arguments(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--out", required=True, help="the run folder (run.json, samples.jsonl, table, figures)")
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--source", default="needle", choices=("needle", "ruler"),
                   help="the documents: needles over the essays (default), or lm-eval's offline RULER niah tasks")
    p.add_argument("--lengths", default="4096,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default=None, help="needle depths in percent (default 10,30,50,70,90; needle only)")
    p.add_argument("--samples", type=int, default=8, help="documents per (length, depth), or per (length, task)")
    p.add_argument("--variants", default=None, help="needle: variants cycled over a cell's samples (default "
                   "single,multikey,multivalue); ruler: the tasks (default: the three that run offline)")
    p.add_argument("--budgets", default="0.2,0.05")
    p.add_argument("--methods", default=METHODS, help="method names, or NAME:key=value[:key=value] specs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--docs", default="*", help="only the documents whose id matches one of these comma-separated "
                   "patterns (fnmatch), e.g. 'needle-8192-*-0' (the documents stay those of the other arguments)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--report", action="store_true", help="only write the table and figures of --out")
    p.add_argument("--readme", default=None, help="also write the summary between the markers of this README "
                   "(default: the repository's README.md when --out is under the repository's results/)")
    p.add_argument("--no-readme", action="store_true", help="write no README block (e.g. an ablation's run)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    from hybridgen.data.needle import VARIANTS
    from hybridgen.eval.ruler_docs import OFFLINE_TASKS

    ruler = args.source == "ruler"
    if ruler and args.depths is not None:
        raise ConfigError("--depths places the needles of --source needle; RULER's tasks place their own: leave it out")
    known = OFFLINE_TASKS if ruler else VARIANTS
    args.lengths = _csv(args.lengths, int)
    args.depths = None if ruler else _csv(args.depths or "10,30,50,70,90", float)
    args.variants = _csv(args.variants) if args.variants is not None else list(known)
    args.budgets, args.methods = _csv(args.budgets, float), _csv(args.methods)
    if args.samples < 1 or not args.lengths or min(args.lengths) < 64:
        raise ConfigError("--samples must be >= 1 and --lengths at least 64 tokens each")
    if not ruler and (not args.depths or not all(0 <= d <= 100 for d in args.depths)):
        raise ConfigError(f"--depths must be percents in [0, 100], got {args.depths}")
    if not args.budgets or not all(0 < b < 1 for b in args.budgets):
        raise ConfigError(f"--budgets must be fractions in (0, 1), got {args.budgets}")
    if not args.variants or not set(args.variants) <= set(known) or len(set(args.variants)) != len(args.variants):
        raise ConfigError(f"--variants must be among {', '.join(known)} (each once), got {args.variants}")
    if "full" not in args.methods:
        args.methods.insert(0, "full")  # the reference of every paired difference
    return args


def _identity(args) -> Dict[str, Any]:
    keys = ("model", "lengths", "depths", "samples", "variants", "budgets", "methods", "seed", "docs")
    ident = {k: getattr(args, k) for k in keys}
    if args.source != "needle":  # needle runs from before --source existed keep their identity
        ident["source"] = args.source
    return ident


def _open_run(args, out: Path, engine) -> set:
    """The (doc id, label) pairs already in ``out``; writes run.json for a new run."""
    from hybridgen.eval.environment import environment
    from hybridgen.eval.provenance import code_version, describe_version, same_code

    run_file = out / RUN
    if run_file.exists():
        if not args.resume:
            raise ConfigError(f"--out {out} already holds a run; pass --resume to continue it, or choose another --out")
        old = json.loads(run_file.read_text())
        if old["arguments"] != _identity(args):
            raise ConfigError(f"--resume with other arguments than the run in {out} ({old['arguments']}); "
                              "use another --out")
        if not same_code(old["code_version"], code_version()):
            raise ConfigError(f"the run in {out} is from code {describe_version(old['code_version'])}, this is "
                              f"{describe_version(code_version())}; continue it from that code or use another --out")
        if old["environment"]["cpu"]["model"] != environment()["cpu"]["model"]:
            raise ConfigError(f"the run in {out} was made on another machine; use another --out")
        from hybridgen_harness.long_context import read_rows

        return {(row["doc"], row["label"]) for row in read_rows(out / SAMPLES, repair=True)}
    out.mkdir(parents=True, exist_ok=True)
    command = "python experiments/long_context.py " + " ".join(args.argv)
    run_file.write_text(json.dumps({"arguments": _identity(args), "command": command,
                                    "provenance": getattr(engine.spec, "provenance", None) or {"model": args.model},
                                    "engine": repr(engine), "code_version": code_version(),
                                    "environment": environment()}, indent=1, default=str))
    return set()


def run(args) -> Path:
    import torch

    from hybridgen.data import needle, sources
    from hybridgen.eval import ruler_docs
    from hybridgen.log import bar
    from hybridgen.methods import build_method
    from hybridgen.model import load_model
    from hybridgen.model.shared_prefill import record_prefill

    configs = method_configs(args.methods, args.budgets)
    ruler = args.source == "ruler"
    corpus = None if ruler else sources.corpus("essays")  # a one-line error naming `make data` when missing
    engine = load_model(args.model)
    if engine.tokenizer is None:
        raise ConfigError(f"model {args.model!r} has no tokenizer; lengths are counted in its tokens")
    out = Path(args.out)
    done = _open_run(args, out, engine)
    if ruler:
        docs = ruler_docs.build_docs(args.variants, args.lengths, args.samples, engine.tokenizer.name_or_path,
                                     args.seed)
    else:
        # a length at the model's limit leaves room for the answer and the special tokens (the id
        # keeps the nominal length)
        specials = len(engine.tokenizer("")["input_ids"])
        room = engine.spec.max_positions - max(NEW_TOKENS.values()) - specials
        if max(args.lengths) > room:
            print(f"prompts of more than {room} tokens are built to {room}: {engine.spec.max_positions} positions "
                  f"less the longest answer ({max(NEW_TOKENS.values())} tokens) and {specials} special "
                  "token(s)", flush=True)
        docs = needle.build_docs(corpus, args.lengths, args.depths, args.samples, engine.tokenizer, args.seed,
                                 args.variants, max_tokens=room)
    docs = [d for d in docs if any(fnmatch.fnmatchcase(d["id"], pat) for pat in _csv(args.docs))]
    if not docs:
        raise ConfigError(f"--docs {args.docs!r} matches no document id (ids look like "
                          f"{'ruler-niah_single_1-4096-0' if ruler else 'needle-8192-30-0'})")
    todo = [d for d in docs if any((d["id"], label) not in done for label, _, _ in configs)]
    todo.sort(key=lambda d: d["sample"])  # sample by sample (stable: every length and depth of a sample in turn)
    ids_of = {d["id"]: engine.tokenizer(d["prompt"])["input_ids"] for d in todo}  # tokenized once
    for doc in todo:  # every prompt + its answer fits the model, checked before any document runs
        n = len(ids_of[doc["id"]])
        new = (ruler_docs.NEW_TOKENS if ruler else NEW_TOKENS)[doc["variant"]]
        if n + new > engine.spec.max_positions:
            raise ConfigError(f"document {doc['id']}: {n} prompt tokens + {new} new exceed {args.model}'s "
                              f"{engine.spec.max_positions} positions; choose a shorter --lengths")
    print(f"{len(docs)} documents x {len(configs)} method configurations on {engine!r}; "
          f"{len(docs) - len(todo)} finished before", flush=True)
    with open(out / SAMPLES, "a") as sink:
        for doc in bar(todo, desc=f"{args.source} documents", unit="doc", explicit=True):
            ids = torch.tensor([ids_of[doc["id"]]])
            new = (ruler_docs.NEW_TOKENS if ruler else NEW_TOKENS)[doc["variant"]]
            t0 = time.perf_counter()
            shared = record_prefill(engine, ids, None, max_new_tokens=new)
            prefill_s = time.perf_counter() - t0
            rows, line = [], []
            for label, name, params in configs:
                if (doc["id"], label) in done:
                    continue
                t1 = time.perf_counter()
                # RULER: generation stops at EOS, as lm-eval's generate_until stops there even with an
                # empty `until` (needle runs keep their fixed length: their answer is the first line)
                eos = engine.tokenizer.eos_token_id if ruler else None
                r = engine.generate(ids, build_method(name, **params), max_new_tokens=new,
                                    shared_prefill=shared, eos_token_id=eos)  # a fresh store on its device
                generated = r.tokens[0].tolist()
                if eos in generated:
                    generated = generated[:generated.index(eos)]
                decoded = engine.tokenizer.decode(generated, skip_special_tokens=True)
                # RULER scores the whole generation up to EOS; a needle answer is its first line
                text = decoded if ruler else decoded.split("\n")[0]
                score = (ruler_docs.score if ruler else needle.score)(text, doc["answer"])
                rows.append({"doc": doc["id"], "length": doc["length"], "tokens": int(ids.shape[1]),
                             "depth": doc["depth"], "variant": doc["variant"], "sample": doc["sample"],
                             "label": label, "method": name, "params": params, "score": score,
                             "answer": doc["answer"], "generation": text, "decoded": decoded,
                             "peak_bytes_by_tier": r.peak_bytes_by_tier, "method_s": time.perf_counter() - t1,
                             "dense_prefill_s": prefill_s, **({"generated_tokens": len(generated)} if ruler else {})})
                line.append(f"{label} {score:g}")
            sink.write("".join(json.dumps(row) + "\n" for row in rows))  # the whole document in one write
            sink.flush()
            print(f"{doc['id']} ({ids.shape[1]} tok, prefill {prefill_s:.0f} s, methods "
                  f"{sum(r['method_s'] for r in rows):.0f} s): " + ", ".join(line), flush=True)
    return out


@cli_errors
def main(argv=None) -> None:
    args = _arguments(argv)
    from hybridgen_harness.long_context import block_owner, readme_markers, source_of, write_report

    out = Path(args.out)
    if args.report and not (out / RUN).exists():
        raise ConfigError(f"--out {out} holds no run ({RUN} missing); run it first, or point --out at a run folder")
    if args.readme and not Path(args.readme).is_file():
        raise ConfigError(f"--readme {args.readme} is not a file")
    source = source_of(json.loads((out / RUN).read_text())) if args.report else args.source
    # the repository README holds the needle run's summary; another source's only where asked
    readme = None if args.no_readme else Path(args.readme) if args.readme else (
        _ROOT / "README.md" if source == "needle" and out.resolve().is_relative_to((_ROOT / "results").resolve())
        else None)
    if readme is not None and not all(m in readme.read_text() for m in readme_markers(source)):
        raise ConfigError(f"{readme} has no {source} summary markers ({readme_markers(source)[0]}); add them "
                          "where the block goes, or pass --no-readme")  # checked before hours of runs
    owner = block_owner(readme.read_text(), source) if readme is not None and not args.readme else None
    if owner is not None and (readme.parent / owner).resolve() != out.resolve():  # another run's summary: kept unless asked
        print(f"note: {readme} summarises {owner} between its {source} markers; left as it is "
              f"(--readme {readme} replaces it with this run's)")
        readme = None
    if not args.report:
        run(args)
    print(write_report(out, readme))


if __name__ == "__main__":
    main()
