"""Typed method parameters: every bad input is refused at construction with one line.

The table of cases below is also the documentation: ``docs/method_params.md`` is rendered from
it and compared here (regenerate with ``HYBRIDGEN_WRITE_DOCS=1 pytest tests/test_methods_params.py``).
"""
import os
from pathlib import Path

import pytest

from hybridgen.errors import ConfigError
from hybridgen.methods import Budget, build_method, method_class

DOC = Path(__file__).resolve().parents[1] / "docs" / "method_params.md"

# (method, parameter, bad value, a fragment the message must contain)
BAD = [
    ("flexgen", "compress_kv", "maybe", "expects a boolean"),
    ("hybridgen", "pipeline", "enabled", "expects a boolean"),
    ("streamingllm", "shift_positions", 2, "expects a boolean"),
    ("h2o", "chunk", "abc", "expects an integer"),
    ("h2o", "chunk", 0, "expects an integer >= 1"),
    ("h2o", "chunk", -5, "expects an integer >= 1"),
    ("h2o", "chunk", 2.5, "expects an integer"),
    ("h2o", "recent_fraction", "half", "expects a number"),
    ("h2o", "recent_fraction", 1.5, "in [0, 1]"),
    ("infinigen", "alpha", "nan", "not NaN"),
    ("infinigen", "partial_weight_ratio", 0.0, "in (0, 1]"),
    ("hybridgen", "topk_ratio", "lots", "or null"),
    ("hybridgen", "topk_ratio", 0, "in (0, 1]"),
    ("hybridgen", "group_score", "mean", "one of 'max', 'sum'"),
    ("hybridgen", "mapping", "ssd", "one of 'semantic'"),
    ("hybridgen", "key_sketch", "int2", "one of 'none', 'int8', 'int4'"),
    ("hybridgen", "sketch_oversample", 0.5, "in [1, 16]"),
    ("hybridgen", "scan", "fp8", "one of 'bf16dot', 'exact'"),
    ("hybridgen", "scan_oversample", 0.5, "in [1, 16]"),
    ("flexgen", "attention_on", "tpu", "one of 'gpu', 'cpu'"),
    ("hybrid-exact", "key_tier", "gpu", "one of 'dram', 'cxl'"),
    ("snapkv", "kernel", 4, "odd integer"),
    ("quest", "page_size", "16 tokens", "expects an integer"),
    ("h2o", "budget", 1, "ambiguous"),
    ("h2o", "budget", "1", "ambiguous"),
    ("h2o", "budget", 0, "at least one token"),
    ("h2o", "budget", "0%", "at least one token"),
    ("h2o", "budget", 1.5, "ratio must be in [0, 1]"),
    ("h2o", "budget", 512.0, "'512t'"),
    ("h2o", "budget", "120%", "ratio must be in [0, 1]"),
    ("h2o", "budget", -3, ">= 0"),
    ("h2o", "budget", "lots", "cannot read"),
    ("h2o", "budget", True, "cannot read"),
    ("hybridgen", "gpu_budget", "half", "cannot read"),
    ("flexgen", "gpu_budget", 2.0, "'2t'"),
]

# (method, parameter, accepted input, the value it means)
GOOD = [
    ("flexgen", "compress_kv", "no", False),
    ("flexgen", "compress_kv", "off", False),
    ("flexgen", "compress_kv", "0", False),
    ("flexgen", "compress_kv", "yes", True),
    ("flexgen", "compress_kv", "TRUE", True),
    ("hybridgen", "pipeline", 0, False),
    ("streamingllm", "shift_positions", "off", False),
    ("h2o", "chunk", "128", 128),
    ("h2o", "recent_fraction", "0.25", 0.25),
    ("hybridgen", "topk_ratio", "null", None),
    ("hybridgen", "topk_ratio", "0.1", 0.1),
    ("h2o", "budget", 0.2, Budget(ratio=0.2)),
    ("h2o", "budget", "20%", Budget(ratio=0.2)),
    ("h2o", "budget", "1.0", Budget(ratio=1.0)),
    ("h2o", "budget", "100%", Budget(ratio=1.0)),
    ("h2o", "budget", "1t", Budget(tokens=1)),
    ("h2o", "budget", 512, Budget(tokens=512)),
    ("h2o", "budget", "512 tokens", Budget(tokens=512)),
    ("hybridgen", "gpu_budget", 0.0, Budget(ratio=0.0)),
]


def _message(method, param, value):
    with pytest.raises(ConfigError) as info:
        build_method(method, **{param: value})
    return str(info.value)


@pytest.mark.parametrize("method,param,value,fragment", BAD)
def test_bad_parameter_is_one_line_naming_method_and_parameter(method, param, value, fragment):
    msg = _message(method, param, value)
    assert "\n" not in msg
    assert fragment in msg, msg
    assert repr(method) in msg and param in msg, msg


@pytest.mark.parametrize("method,param,value,fragment", BAD[:6])
def test_python_constructor_checks_the_same_way(method, param, value, fragment):
    with pytest.raises(ConfigError, match=param):
        method_class(method)(**{param: value})


@pytest.mark.parametrize("method,param,value,expected", GOOD)
def test_accepted_inputs_mean_what_they_say(method, param, value, expected):
    assert getattr(build_method(method, **{param: value}), param) == expected


def test_budget_is_parsed_by_type_not_by_name():
    from hybridgen.hybrid import HybridGen

    assert HybridGen(gpu_budget=0.2).gpu_budget == Budget(ratio=0.2)
    assert HybridGen(gpu_budget="64t").gpu_budget == Budget(tokens=64)


def test_budget_text_round_trips():
    for b in (Budget(ratio=1.0), Budget(ratio=0.0), Budget(ratio=0.25), Budget(ratio=1e-5), Budget(tokens=1),
              Budget(tokens=4096)):
        assert Budget.parse(str(b)) == b


def test_unknown_parameter_lists_the_real_ones():
    msg = _message("h2o", "budgte", 0.1)
    assert "'budgte'" in msg and "budget" in msg and "chunk" in msg


def render_table() -> str:
    lines = ["# Method parameters: bad inputs and what they get", "",
             "Generated from `tests/test_methods_params.py` (`HYBRIDGEN_WRITE_DOCS=1 pytest "
             "tests/test_methods_params.py` rewrites it); each row is a test. Every parameter is",
             "converted from its declared type when the method is built, whatever the entry point",
             "(Python constructor, `build_method`, Hydra `method.params.X=...`, lm-eval `--model_args`).", "",
             "## Refused (one line, before any model loads)", "",
             "| method | parameter | input | message |", "|---|---|---|---|"]
    for method, param, value, _ in BAD:
        msg = _message(method, param, value).replace("|", "\\|")
        lines.append(f"| {method} | {param} | `{value!r}` | {msg} |")
    lines += ["", "## Accepted, with their meaning", "", "| method | parameter | input | means |", "|---|---|---|---|"]
    for method, param, value, expected in GOOD:
        lines.append(f"| {method} | {param} | `{value!r}` | `{expected}` |")
    lines += ["", f"{len(BAD)} refused inputs, {len(GOOD)} accepted ones; the budget grammar is documented once in",
              "`hybridgen/methods/budget.py` and in `docs/methods.md`.", ""]
    return "\n".join(lines)


def test_docs_table_is_current():
    text = render_table()
    if os.environ.get("HYBRIDGEN_WRITE_DOCS"):
        DOC.write_text(text)
    assert DOC.exists() and DOC.read_text() == text, "regenerate: HYBRIDGEN_WRITE_DOCS=1 pytest tests/test_methods_params.py"


def test_inf_is_accepted_only_where_the_range_says_it_means_something():
    """InfiniGen's alpha=inf means 'always the budget's cap' (bench_baselines' infinigen-cap);
    another float parameter refuses inf, and NaN / -inf are refused everywhere."""
    import math

    from hybridgen.methods.params import ParamError

    assert build_method("infinigen", alpha="inf").alpha == math.inf
    assert build_method("infinigen", alpha=math.inf).alpha == math.inf
    for bad in ("nan", "-inf"):
        with pytest.raises(ParamError, match="inf allowed"):
            build_method("infinigen", alpha=bad)
    with pytest.raises(ParamError, match="finite number"):
        build_method("infinigen", partial_weight_ratio="inf")
