"""The fuzzed configuration space of ``experiments/run.py`` (issue 25, item 1).

Every field of the experiment schema (``experiments/schema.py``), every hardware and workload
field and every method parameter (from the methods' typed dataclasses) gets values by class:
``valid`` (must be accepted), ``invalid`` (must be refused with ONE line naming the field) and
``any`` (no oracle but the common one). The edges: NaN, +-inf, huge, negative, zero, empty,
unicode, wrong types, mappings and lists. An example sets 1-3 fields on top of ``BASE`` (a
1-layer random model, 8-token prompts) and runs the preflight in this process
(:func:`check`: the sweep composed and validated, the results directory checked). Outcomes:

- ``refused``: a HybridGenError of one line; with an invalid value it must name that field;
- ``accepted``: the preflight passed; wrong when a value was invalid (a *silent acceptance*);
- ``traceback``: any other exception; ``wrote``: anything under the results directory.

``python tests/fuzz_configs.py`` runs it at size (``make fuzz``); ``tests/test_fuzz_configs.py``
a fixed-seed few hundred in ``make test``.
"""
from __future__ import annotations

import contextlib
import io
import typing
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hypothesis import strategies as st

BASE = ["model.weights=random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=8",
        "workload.gen_len=2", "exp.warmup=false", "progress=false", "exp.fidelity=false"]


@dataclass(frozen=True)
class Value:
    """One generated setting: the override text, its oracle class and its edge label."""

    key: str          # e.g. 'workload.batch' or 'method.params.budget'
    text: str         # the value as typed on the command line
    oracle: str       # 'valid' | 'invalid' | 'any'
    edge: str         # 'valid', 'nan', 'inf', 'huge', 'negative', 'zero', 'empty', 'unicode', 'wrong-type', ...
    method: str = ""  # the method a method.params value belongs to

    @property
    def leaf(self) -> str:
        return self.key.rsplit(".", 1)[-1]

    @property
    def override(self) -> str:
        return f"{self.key}={self.text}"


def _v(key, oracle, pairs, method=""):
    return st.sampled_from([Value(key, t, oracle, e, method) for t, e in pairs])


# ---------------------------------------------------------------- edge values written as Hydra text
NON_FINITE = [("nan", "nan"), ("inf", "inf"), ("-inf", "-inf")]
HUGE_INT = [("99999999999999999999", "huge"), ("1e309", "huge")]
WRONG = [("abc", "wrong-type"), ("'héllo'", "unicode"), ("{a:1}", "mapping"), ("[1,2]", "list"), ("''", "empty")]
#: full-width digits: OmegaConf reads '１２' as 12 for an int field (the number meant), so no oracle
WIDE_DIGITS = [("'１２'", "unicode")]


def _ints(lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.integers(lo, hi).map(str)


def count_field(key: str, lo: int = 1, hi: int = 4000) -> st.SearchStrategy[Value]:
    """An integer field >= lo (valid values up to ``hi``)."""
    valid = _ints(lo, hi).map(lambda t: Value(key, t, "valid", "valid"))
    below = [(str(lo - 1), "zero" if lo == 1 else "negative"), ("-3", "negative"), (str(-2 ** 40), "negative")]
    invalid = _v(key, "invalid", below + HUGE_INT + NON_FINITE + WRONG + [("2.5", "wrong-type")])
    return st.one_of(valid, invalid, _v(key, "any", WIDE_DIGITS))


def size_field(key: str, units_valid=("", "B", "KB", "MiB", "GiB", "GB", "TiB")) -> st.SearchStrategy[Value]:
    units = st.sampled_from(list(units_valid))
    valid = st.tuples(st.integers(1, 900), units).map(lambda p: Value(key, f"{p[0]}{p[1]}", "valid", "valid"))
    bad = [("1e309GiB", "huge"), ("2000000TiB", "huge"), ("-5GB", "negative"), ("nan", "nan"), ("-inf", "-inf"),
           ("banana", "wrong-type"), ("'１GB'", "unicode"), ("{a:1}", "mapping"), ("[1,2]", "list"),
           ("true", "wrong-type")]
    return st.one_of(valid, _v(key, "valid", [("null", "valid")]), _v(key, "invalid", bad))


def fraction_field(key: str, hi_open: bool = False) -> st.SearchStrategy[Value]:
    valid = st.floats(0.001, 0.999 if hi_open else 1.0).map(lambda x: Value(key, repr(x), "valid", "valid"))
    bad = [("0", "zero"), ("-0.5", "negative"), ("1.5", "huge"), ("1e309", "huge")] + NON_FINITE + WRONG
    if hi_open:
        bad.append(("1.0", "huge"))
    return st.one_of(valid, _v(key, "invalid", bad))


def choice_field(key: str, choices: List[str], oracle_valid: str = "valid") -> st.SearchStrategy[Value]:
    return st.one_of(_v(key, oracle_valid, [(c, "valid") for c in choices]),
                     _v(key, "invalid", [("nosuch", "wrong-type"), ("'ünï'", "unicode"), ("''", "empty"),
                                         ("{a:1}", "mapping"), ("[1,2]", "list"), ("7", "wrong-type")]))


def bool_field(key: str) -> st.SearchStrategy[Value]:
    return st.one_of(_v(key, "valid", [("true", "valid"), ("false", "valid")]),
                     _v(key, "invalid", [("maybe", "wrong-type"), ("{a:1}", "mapping"), ("[1]", "list"),
                                         ("'ö'", "unicode")]))


def any_text(key: str) -> st.SearchStrategy[Value]:
    return st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12)
                     .map(lambda t: Value(key, "'" + t.replace("\\", "").replace("'", "") + "'", "any", "unicode")),
                     _v(key, "any", [("''", "empty"), ("{a:1}", "mapping"), ("[1,2]", "list"), ("nan", "nan")]))


def schema_fields(tmp: Path) -> Dict[str, st.SearchStrategy[Value]]:
    """Every field of the run schema (experiments/schema.py) with its strategy."""
    from experiments import schema

    f: Dict[str, st.SearchStrategy[Value]] = {
        "seed": st.one_of(_ints(0, 2 ** 32 - 1).map(lambda t: Value("seed", t, "valid", "valid")),
                          _v("seed", "invalid", [("-1", "negative"), (str(2 ** 32), "huge")] + HUGE_INT + WRONG)),
        "workload.batch": count_field("workload.batch", hi=64),
        "workload.prompt_len": count_field("workload.prompt_len"),
        "workload.gen_len": count_field("workload.gen_len"),
        "exp.repeats": count_field("exp.repeats", hi=20),
        "model.num_layers": count_field("model.num_layers", hi=30),
        "hardware.threads": count_field("hardware.threads", hi=64),
        "exp.accuracy.max_length": count_field("exp.accuracy.max_length"),
        "exp.accuracy.max_gen_toks": count_field("exp.accuracy.max_gen_toks"),
        "exp.accuracy.needle_samples": count_field("exp.accuracy.needle_samples"),
        "exp.accuracy.num_fewshot": count_field("exp.accuracy.num_fewshot", lo=0, hi=25),
        "exp.accuracy.limit": count_field("exp.accuracy.limit"),
        "exp.accuracy.ppl_max_docs": count_field("exp.accuracy.ppl_max_docs"),
        "hardware.gpu_kv_fraction": fraction_field("hardware.gpu_kv_fraction"),
        "exp.accuracy.rolling_prefill": fraction_field("exp.accuracy.rolling_prefill", hi_open=True),
        "hardware.gpu_memory": size_field("hardware.gpu_memory"),
        "hardware.gpu_capacity": size_field("hardware.gpu_capacity"),
        "hardware.dram_capacity": size_field("hardware.dram_capacity"),
        "hardware.cxl_capacity": size_field("hardware.cxl_capacity"),
        "model.name": st.one_of(_v("model.name", "valid", [("smollm2-135m", "valid")]),
                                _v("model.name", "invalid", [("nosuch", "wrong-type"), ("/no/such/ckpt", "missing"),
                                                             ("''", "empty"), ("'ü'", "unicode")])),
        "model.dtype": choice_field("model.dtype", list(schema.DTYPES)),
        "model.weights": choice_field("model.weights", ["random", "dummy"]),
        "model.backend": choice_field("model.backend", list(schema.BACKENDS)),
        "workload.source": choice_field("workload.source", ["random", "pydoc"]),
        "exp.kind": choice_field("exp.kind", ["generate"]),
        "exp.accuracy.score_mode": choice_field("exp.accuracy.score_mode", ["decode", "prefill"]),
        "hardware.cxl_node": st.one_of(_v("hardware.cxl_node", "valid", [("auto", "valid"), ("null", "valid")]),
                                       _v("hardware.cxl_node", "invalid", [("-1", "negative"), ("7777", "huge"),
                                                                          ("banana", "wrong-type"), ("nan", "nan")])),
        "hardware.dram_node": st.one_of(_v("hardware.dram_node", "valid", [("null", "valid")]),
                                        _v("hardware.dram_node", "invalid", [("-1", "negative"), ("7777", "huge"),
                                                                            ("abc", "wrong-type")])),
        "results_dir": st.one_of(_v("results_dir", "valid", [(str(tmp / "results"), "valid")]),
                                 _v("results_dir", "invalid", [("''", "empty"), (str(tmp / "afile" / "r"), "file"),
                                                               (str(tmp / "dangling" / "r"), "dangling-link"),
                                                               ("/proc/hybridgen-r", "read-only")])),
        "exp.accuracy.needle_lengths": _list_field("exp.accuracy.needle_lengths", 1, 9000),
        "exp.accuracy.ruler_lengths": _list_field("exp.accuracy.ruler_lengths", 1, 9000),
        "exp.accuracy.needle_depths": _list_field("exp.accuracy.needle_depths", 0, 100),
    }
    for key in ("fail_fast", "force", "exp.fidelity", "exp.warmup", "exp.trace", "exp.accuracy.fidelity",
                "exp.accuracy.log_samples", "progress"):
        f[key] = bool_field(key)
    for key in ("exp.name", "exp.description", "hardware.name", "hardware.description", "hardware.gpu",
                "exp.reference", "hardware.profile", "exp.accuracy.tasks"):  # no oracle: checked only where used
        f[key] = any_text(key)
    f["memory.gpu_kv"] = size_field("memory.gpu_kv", units_valid=("GiB", "TiB"))  # smaller may not fit: refused
    return f


def _list_field(key: str, lo: int, hi: int) -> st.SearchStrategy[Value]:
    valid = st.lists(st.integers(max(lo, 1) if lo else 0, hi), min_size=1, max_size=3).map(
        lambda xs: Value(key, "[" + ",".join(map(str, xs)) + "]", "valid", "valid"))
    bad = [(f"[{lo - 1}]", "negative"), (f"[{hi * 10 ** 9}]" if hi > 100 else "[101]", "huge"), ("[nan]", "nan"),
           ("[inf]", "inf"), ("[abc]", "wrong-type"), ("{a:1}", "mapping")]
    return st.one_of(valid, _v(key, "invalid", bad))


# ---------------------------------------------------------------- method parameters, from their types
def param_values(method: str, name: str, tp: Any) -> st.SearchStrategy[Value]:
    """Valid values (oracle 'any': parameters constrain each other) and invalid ones ('invalid') by type."""
    from hybridgen.methods.params import Range, _strip

    key = f"method.params.{name}"
    mk = lambda oracle, pairs: _v(key, oracle, pairs, method)  # noqa: E731
    optional = typing.get_origin(tp) is typing.Union
    if optional:
        tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
    base, meta = _strip(tp)
    rng = next((m for m in meta if isinstance(m, Range)), None)
    nulls = [("null", "valid")] if optional else [("null", "empty")]
    if typing.get_origin(base) is typing.Literal:
        return st.one_of(mk("valid", [(str(c), "valid") for c in typing.get_args(base)]),
                         mk("invalid", [("nosuch", "wrong-type"), ("'ü'", "unicode"), ("{a:1}", "mapping"),
                                        ("[1]", "list")] + ([] if optional else nulls)))
    if base is bool:
        return st.one_of(mk("valid", [("true", "valid"), ("false", "valid")]),
                         mk("invalid", [("maybe", "wrong-type"), ("2", "huge"), ("{a:1}", "mapping")]))
    if base is int:
        lo = int(rng.lo) if rng is not None and rng.lo is not None else -(2 ** 20)
        hi = int(rng.hi) if rng is not None and rng.hi is not None else lo + 64
        bad = [(str(lo - 1), "negative" if lo <= 0 else "zero")] if rng is not None and rng.lo is not None else []
        bad += [("99999999999999999999", "huge"), ("2.5", "wrong-type"), ("abc", "wrong-type"), ("nan", "nan"),
                ("inf", "inf"), ("{a:1}", "mapping"), ("[1]", "list"), ("'３'", "unicode")]
        if rng is not None and rng.hi is not None:
            bad.append((str(int(rng.hi) + 1), "huge"))
        return st.one_of(_ints(lo, hi).map(lambda t: Value(key, t, "any", "valid", method)), mk("invalid", bad))
    if base is float:
        lo = rng.lo if rng is not None and rng.lo is not None else -10.0
        hi = rng.hi if rng is not None and rng.hi is not None else 10.0
        valid = st.floats(lo, hi, exclude_min=bool(rng and rng.lo_open), exclude_max=bool(rng and rng.hi_open)) \
            .map(lambda x: Value(key, repr(x), "any", "valid", method))
        inf_ok = bool(rng and rng.inf_ok)  # +inf means something there (InfiniGen's alpha: always the cap)
        bad = [e for e in NON_FINITE if not (inf_ok and e[0] == "inf")]
        bad += [("abc", "wrong-type"), ("{a:1}", "mapping"), ("[1]", "list")]
        if rng is not None and rng.lo is not None:
            bad.append((repr(rng.lo - 1.0), "negative"))
        if rng is not None and rng.hi is not None:
            bad.append((repr(rng.hi + 1.0), "huge"))
        if inf_ok:
            valid = st.one_of(valid, mk("valid", [("inf", "inf")]))
        return st.one_of(valid, mk("invalid", bad))
    if getattr(base, "__name__", "") == "Budget":
        return st.one_of(mk("any", [("0.2", "valid"), ("'20%'", "valid"), ("64t", "valid"), ("{ratio:0.5}", "valid"),
                                    ("{tokens:12}", "valid")]),
                         mk("invalid", [("inf", "inf"), ("nan", "nan"), ("-3", "negative"), ("1", "wrong-type"),
                                        ("1.5", "huge"), ("{tokens:5.5}", "mapping"), ("{ratio:'0.5'}", "mapping"),
                                        ("{ratio:0.1,tokens:3}", "mapping"), ("abc", "wrong-type"), ("[1]", "list"),
                                        ("'２０%'", "unicode"), ("1e309", "huge")]))
    return mk("any", [("'x'", "unicode"), ("null", "empty"), ("{a:1}", "mapping")])


def method_fields() -> Dict[str, st.SearchStrategy[Value]]:
    from hybridgen.methods.params import field_types
    from hybridgen.methods.registry import available_methods, method_class

    out = {"method": st.one_of(_v("method", "valid", [(m, "valid") for m in available_methods()]),
                               _v("method", "invalid", [("nosuch", "wrong-type"), ("'ü'", "unicode")]))}
    for m in available_methods():
        for name, tp in field_types(method_class(m)).items():
            out[f"{m}:{name}"] = param_values(m, name, tp)
    return out


# ---------------------------------------------------------------- one example
@dataclass
class Outcome:
    values: List[Value]
    verdict: str                 # 'refused' | 'accepted' | 'traceback'
    message: str = ""
    problems: List[str] = field(default_factory=list)


def overrides_of(values: List[Value]) -> List[str]:
    method = next((v.method for v in values if v.method), None)
    args = [o for o in BASE if o.split("=", 1)[0] not in {v.key for v in values}]
    args += [v.override for v in values]
    if method and not any(v.key == "method" for v in values):
        args.append(f"method={method}")
    return args


def check(values: List[Value], tmp: Path) -> Outcome:
    """Run the preflight in this process; classify and judge the outcome (``problems`` empty: good)."""
    from experiments.model_checks import _WARNED
    from experiments.preflight import check_results_dirs, resolve_points
    from hybridgen.errors import HybridGenError

    args = overrides_of(values)
    if not any(a.startswith("results_dir=") for a in args):
        args.append(f"results_dir={tmp / 'results'}")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            points = resolve_points(args)
            check_results_dirs([p.cfg for p in points])
        out = Outcome(values, "accepted")
    except HybridGenError as e:
        out = Outcome(values, "refused", str(e))
    except Exception as e:  # noqa: BLE001 - a finding
        out = Outcome(values, "traceback", f"{type(e).__name__}: {e}")
    _WARNED.clear()
    invalid = [v for v in values if v.oracle == "invalid"]
    if out.verdict == "traceback":
        out.problems.append("traceback")
    elif out.verdict == "accepted" and invalid:
        out.problems.append("silent acceptance of " + ", ".join(v.override for v in invalid))
    elif out.verdict == "refused":
        if "\n" in out.message.strip():
            out.problems.append("more than one line")
        named = invalid + [v for v in values if v.oracle == "any"]  # an 'any' value may be refused first
        if invalid and not any(v.leaf in out.message or v.text.strip("'") in out.message for v in named):
            out.problems.append("the message names none of " + ", ".join(v.key for v in invalid))
        if not invalid and all(v.oracle == "valid" for v in values):
            out.problems.append("a valid configuration refused")
    if (tmp / "results").exists() or (tmp / "afile" / "r").exists():
        out.problems.append("wrote files")
    return out


def prepare(tmp: Path) -> None:
    """The scratch layout the path cases name: a file and a dangling link."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "afile").write_text("x")
    if not (tmp / "dangling").is_symlink():
        (tmp / "dangling").symlink_to(tmp / "gone")


def examples(tmp: Path) -> st.SearchStrategy[List[Value]]:
    pool = {**schema_fields(tmp), **method_fields()}
    keys = sorted(pool)
    return st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True).flatmap(
        lambda ks: st.tuples(*(pool[k] for k in ks)).map(list)).filter(
        lambda vs: len({v.method for v in vs if v.method}) <= 1 and not (
            any(v.method for v in vs) and any(v.key == "method" for v in vs)))


# ---------------------------------------------------------------- counts
def tally(outcomes: List[Outcome]) -> Dict[str, Any]:
    """Counts overall and by case class (oracle, edge)."""
    total = Counter()
    classes: Dict[Tuple[str, str], Counter] = {}
    for o in outcomes:
        total["examples"] += 1
        total[o.verdict] += 1
        total["tracebacks"] += "traceback" in o.problems
        total["silent acceptances"] += any(p.startswith("silent") for p in o.problems)
        total["files written"] += "wrote files" in o.problems
        total["unclear"] += any(p.startswith(("the message", "more than", "a valid")) for p in o.problems)
        for v in o.values:
            c = classes.setdefault((v.oracle, v.edge), Counter())
            c["settings"] += 1
            c[o.verdict] += 1
            c["problems"] += bool(o.problems)
    return {"total": dict(total), "classes": {f"{k[0]}/{k[1]}": dict(c) for k, c in sorted(classes.items())}}
