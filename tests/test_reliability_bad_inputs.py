"""Every bad input a demanding new user tried: one line, exit code 2, nothing written.

Each case runs an entry point the way a user would (``experiments/run.py``,
``hybridgen-lm-eval``, ``python -m hybridgen_harness.profile``, ``experiments/aggregate.py``; in this
process through their ``main`` for speed, one case in a subprocess for the real exit status and
the environment variables read at start-up) or a library call. A case passes when:

- the exit status is 2 (library calls: a HybridGenError is raised),
- exactly one line starts with ``error:`` and holds the expected text, and no ``Traceback``
  appears anywhere in the output,
- nothing was written: the run's results directory does not exist afterwards.

``python tests/test_reliability_bad_inputs.py`` runs every case (the slow ones too) and writes
``docs/bad_inputs.md``: input, message, and the counts (cases tried, one-line errors,
tracebacks, silently accepted).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import _reliability_models as rm  # noqa: E402

#: keeps an accidentally accepted run cheap (a 1-layer random model, 8 prompt tokens)
TINY = ["model.weights=random", "model.num_layers=1", "workload.source=random", "workload.prompt_len=8",
        "workload.gen_len=2", "exp.warmup=false", "progress=false", "exp.fidelity=false"]
#: the same for runs on a (damaged) real checkpoint
TINY_REAL = ["model.weights=real", "workload.source=random", "workload.prompt_len=8", "workload.gen_len=2",
             "exp.warmup=false", "progress=false", "exp.fidelity=false"]


@dataclass
class Case:
    """One bad input. args/env may name {tmp} (the case's scratch dir) and {results} (its results dir)."""

    id: str
    kind: str                      # 'run' | 'run-subprocess' | 'lm-eval' | 'profile' | 'aggregate' | 'library'
    args: Sequence[str] = ()
    expect: str = ""               # text the error line must hold
    env: Dict[str, str] = field(default_factory=dict)
    base: Sequence[str] = tuple(TINY)   # overrides added to run cases (unless the case sets the key)
    setup: Optional[Callable[[Path], None]] = None
    call: Optional[Callable[[Path], None]] = None   # library cases
    shown: str = ""                # the input as the table shows it (default: args and env)
    slow: bool = False             # lm-eval builds its task index (~15-30 s) before it can answer


def _cache(damage=None, **kw):
    return lambda tmp: rm.fake_smollm2_cache(tmp / "cache", damage, **kw)


def _ckpt(damage=None, tokenizer=False):
    def setup(tmp):
        p = rm.write_checkpoint(tmp / "ckpt")
        if tokenizer:
            from test_eval_lm_adapter import _byte_tokenizer

            _byte_tokenizer().save_pretrained(p)
        if damage:
            damage(p)
    return setup


def _corrupt_metrics(tmp: Path) -> None:
    d = tmp / "agg" / "quickstart" / "run1"
    d.mkdir(parents=True)
    (d / "DONE").write_text("x\n")
    (d / "metrics.json").write_text('{"run": {"name": "run1"')  # cut short, as by a full disk


def _tiny_engine(tmp: Path):
    from hybridgen.model import load_model

    return load_model(str(rm.write_checkpoint(tmp / "lib")), device="cpu")


def _byte_tok_engine(tmp: Path):
    from test_eval_lm_adapter import _byte_tokenizer

    p = rm.write_checkpoint(tmp / "tok")
    _byte_tokenizer().save_pretrained(p)
    from hybridgen.model import load_model

    return load_model(str(p), device="cpu")


def _lib_device(tmp, device):
    from hybridgen.model import load_model

    load_model("opt-125m", weights="dummy", num_layers=1, device=device)


def _lib_generate_empty_row(tmp):
    import torch

    _tiny_engine(tmp).generate(torch.tensor([[1, 2, 3], [0, 0, 0]]), "full", 2,
                               attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))


def _lib_adapter(tmp, **kw):
    from hybridgen.eval.lm_eval_model import HybridGenLM

    HybridGenLM(engine=_byte_tok_engine(tmp), progress=False, **kw)


def _touch(name):
    return lambda tmp: (tmp / name).write_text("x")


REAL = tuple(TINY_REAL)
CASES: List[Case] = [
    # ---------------------------------------------------------------- experiments/run.py: composition
    Case("misspelt-key", "run", ["model.nmae=x"], "unknown config key 'model.nmae'"),
    Case("unknown-root-key", "run", ["seedd=1"], "unknown config key 'seedd'"),
    Case("exp-without-plus", "run", ["exp=quickstart"], "to append to your default list use +exp=quickstart"),
    Case("unknown-exp", "run", ["+exp=nope"], "unknown exp 'nope'"),
    Case("unknown-method", "run", ["method=h2oo"], "unknown method 'h2oo'"),
    Case("unknown-method-param", "run", ["method=h2o", "method.params.budgte=0.1"], "has no parameter 'budgte'"),
    Case("bad-budget", "run", ["method=snapkv", "method.params.budget=-3"], "budget"),
    Case("param-over-a-method-sweep", "run", ["method=full,h2o", "method.params.budget=0.3"],
         "at sweep point method=full"),
    Case("batch-not-a-number", "run", ["workload.batch=abc"], "workload.batch"),
    Case("batch-zero", "run", ["workload.batch=0"], "workload.batch must be >= 1"),
    Case("repeats-zero", "run", ["exp.repeats=0"], "exp.repeats must be >= 1"),
    Case("unknown-weights", "run", ["model.weights=fake"], "choose one of: real, random, dummy"),
    Case("unknown-dtype", "run", ["model.dtype=int8"], "model.dtype"),
    Case("zero-layers", "run", ["model.num_layers=0"], "model.num_layers must be >= 1"),
    Case("unknown-source", "run", ["workload.source=wiki"], "workload.source"),
    Case("project-without-profile", "run", ["exp.kind=project"], "hardware profile"),
    Case("prompt-too-long", "run", ["workload.prompt_len=8190", "workload.gen_len=8"], "exceeds smollm2-135m's 8192"),
    Case("unknown-local-task", "run", ["+exp=accuracy", "method=full", "exp.accuracy.tasks=[hg_nosuch]"],
         "unknown local task 'hg_nosuch'"),
    Case("accuracy-without-tasks", "run", ["exp.kind=accuracy"], "needs exp.accuracy.tasks"),
    Case("unknown-reference", "run", ["exp.fidelity=true", "exp.reference=nosuch"], "nosuch",
         base=[o for o in TINY if not o.startswith("exp.fidelity")]),
    Case("threads-zero", "run", ["hardware.threads=0"], "hardware.threads must be >= 1"),
    Case("threads-not-a-number", "run", ["hardware.threads=abc"], "hardware.threads"),
    Case("cxl-node-word", "run", ["hardware.cxl_node=banana"], "hardware.cxl_node='banana' is not valid"),
    Case("cxl-node-missing", "run", ["hardware.cxl_node=7"], "hardware.cxl_node=7 is not a NUMA node"),
    Case("dram-node-negative", "run", ["hardware.dram_node=-1"], "hardware.dram_node=-1 is not valid"),
    Case("fail-fast-not-bool", "run", ["fail_fast=maybe"], "fail_fast"),
    Case("force-not-bool", "run", ["force=maybe"], "force"),
    Case("dataset-not-prepared", "run", ["workload.source=essays"], "make data", env={"HYBRIDGEN_CACHE": "{tmp}/c"},
         base=[o for o in TINY if not o.startswith("workload.source")]),
    # ---------------------------------------------------------------- experiments/run.py: where results go
    Case("results-dir-unwritable", "run", ["results_dir=/proc/hybridgen-results"], "is not writable",
         shown="results_dir=/proc/hybridgen-results"),
    Case("results-dir-is-a-file", "run", ["results_dir={tmp}/afile"], "is a file, not a directory",
         setup=_touch("afile"), shown="results_dir=<a file>"),
    # ---------------------------------------------------------------- experiments/run.py: the model on disk
    Case("cache-empty-safetensors", "run", [], "delete", env={"HYBRIDGEN_CACHE": "{tmp}/cache"}, base=REAL,
         setup=_cache(rm.make_empty), shown="model cache with an empty model.safetensors"),
    Case("cache-truncated-safetensors", "run", [], "(truncated)", env={"HYBRIDGEN_CACHE": "{tmp}/cache"},
         base=REAL, setup=_cache(rm.make_truncated), shown="model cache with a truncated model.safetensors"),
    Case("cache-nan-bytes", "run", [], "holds NaN or inf values", env={"HYBRIDGEN_CACHE": "{tmp}/cache"},
         base=REAL, setup=_cache(rm.make_nan_bytes), shown="model cache with bytes overwritten (NaN weights)"),
    Case("weights-overflow-logits", "run", [], "non-finite logits", env={"HYBRIDGEN_CACHE": "{tmp}/cache"},
         base=REAL, setup=_cache(lm_head_value=3e38), shown="finite weights whose logits overflow (inf/NaN)"),
    Case("checkpoint-dir-garbage", "run", ["model.name={tmp}/ckpt"], "is damaged", base=REAL,
         setup=_ckpt(lambda p: (p / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")),
         shown="model.name=<dir whose model.safetensors is garbage>"),
    Case("checkpoint-dir-missing", "run", ["model.name=/no/such/ckpt"], "does not exist", base=REAL),
    Case("shipped-name-without-weights", "run", ["model=llama-3.1-8b"], "no real weights", base=REAL),
    Case("scan-threads-not-a-number", "run-subprocess", ["+exp=quickstart"], "HYBRIDGEN_SCAN_THREADS",
         env={"HYBRIDGEN_SCAN_THREADS": "abc"}),
    Case("hub-task-offline", "run", ["+exp=accuracy", "method=full", "exp.accuracy.tasks=[piqa]",
                                     "exp.accuracy.limit=2"], "from the Hugging Face hub", slow=True),
    Case("unknown-lm-eval-task", "run", ["+exp=accuracy", "method=full", "exp.accuracy.tasks=[nosuch_task]",
                                         "exp.accuracy.limit=2"], "unknown lm-eval task", slow=True),
    # ---------------------------------------------------------------- hybridgen-lm-eval
    Case("lm-eval-include-path-missing", "lm-eval", ["--include_path", "/no/such/dir", "--tasks", "x"],
         "is not a directory"),
    Case("lm-eval-add-bos-word", "lm-eval", ["--model_args", "model={tmp}/ckpt,add_bos=maybe", "--tasks", "x"],
         "add_bos must be true or false", setup=_ckpt()),
    Case("lm-eval-unknown-param", "lm-eval", ["--model_args", "method=h2o,budgte=0.2", "--tasks", "x"], "budgte"),
    Case("lm-eval-score-mode", "lm-eval", ["--model_args", "score_mode=fast", "--tasks", "x"], "score_mode"),
    Case("lm-eval-unknown-task", "lm-eval", ["--model_args", "model={tmp}/ckpt", "--tasks", "nosuch_task"],
         "unknown lm-eval task", setup=_ckpt(), slow=True),
    Case("lm-eval-hub-task-offline", "lm-eval", ["--model_args", "model={tmp}/ckpt", "--tasks", "piqa", "--limit", "2"],
         "from the Hugging Face hub", setup=_ckpt(tokenizer=True), slow=True),
    # ---------------------------------------------------------------- python -m hybridgen_harness.profile
    Case("profile-out-unwritable", "profile", ["--quick", "--out", "/proc/hybridgen/p.json"], "is not writable"),
    Case("profile-out-exists", "profile", ["--quick", "--out", "{tmp}/p.json"], "already exists; pass --force",
         setup=_touch("p.json"), shown="--out <an existing file>"),
    Case("profile-out-is-a-dir", "profile", ["--quick", "--out", "{tmp}"], "is a directory", shown="--out <a directory>"),
    # ---------------------------------------------------------------- experiments/aggregate.py
    Case("aggregate-nothing", "aggregate", ["quickstart", "--results-dir", "{tmp}/agg"], "no finished runs"),
    Case("aggregate-corrupt-metrics", "aggregate", ["quickstart", "--results-dir", "{tmp}/agg"],
         "metrics.json is not valid JSON", setup=_corrupt_metrics, shown="a finished run whose metrics.json is cut short"),
    Case("aggregate-results-dir-is-file", "aggregate", ["--all", "--results-dir", "{tmp}/afile"], "is a file",
         setup=_touch("afile"), shown="--results-dir <a file>"),
    # ---------------------------------------------------------------- library calls
    Case("load-model-tpu", "library", call=lambda tmp: _lib_device(tmp, "tpu"), expect="unknown device 'tpu'",
         shown="load_model('opt-125m', device='tpu')"),
    Case("load-model-xla", "library", call=lambda tmp: _lib_device(tmp, "xla"), expect="not supported",
         shown="load_model('opt-125m', device='xla')"),
    Case("encode-empty-list", "library", call=lambda tmp: _byte_tok_engine(tmp).encode([]),
         expect="at least one text", shown="engine.encode([])"),
    Case("encode-empty-prompt", "library", call=lambda tmp: _byte_tok_engine(tmp).encode(["hello", ""]),
         expect="text 1 of the batch is empty", shown="engine.encode(['hello', ''])"),
    Case("generate-empty-row", "library", call=_lib_generate_empty_row, expect="row 1 of the batch has no tokens",
         shown="engine.generate(ids, attention_mask with an all-zero row)"),
    Case("adapter-add-bos-word", "library", call=lambda tmp: _lib_adapter(tmp, add_bos="maybe"),
         expect="add_bos must be true or false", shown="HybridGenLM(add_bos='maybe')"),
    Case("adapter-rolling-prefill", "library", call=lambda tmp: _lib_adapter(tmp, rolling_prefill="half"),
         expect="rolling_prefill", shown="HybridGenLM(rolling_prefill='half')"),
]

from _bad_inputs_more import more_cases  # noqa: E402  (issue 25's cases)

CASES += more_cases(Case, REAL)


# ------------------------------------------------------------------------------ running a case
@dataclass
class Result:
    rc: Optional[int]
    out: str
    err: str
    wrote: List[str]
    seconds: float

    @property
    def error_lines(self) -> List[str]:
        return [ln for ln in self.err.splitlines() if ln.startswith("error:")]

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.out + self.err

    def verdict(self, case: Case) -> str:
        """'one-line' | 'traceback' | 'accepted' | 'unclear: why'."""
        if self.traceback:
            return "traceback"
        if self.rc == 0:
            return "accepted"
        if self.rc != 2:
            return f"unclear: exit status {self.rc}"
        if len(self.error_lines) != 1:
            return f"unclear: {len(self.error_lines)} error lines"
        if case.expect not in self.error_lines[0]:
            return "unclear: the message lacks the expected text"
        if self.wrote:
            return f"unclear: wrote {self.wrote[0]}"
        return "one-line"


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp)).replace("{results}", str(tmp / "results"))


def _run_argv(case: Case, tmp: Path) -> List[str]:
    args = [_fill(a, tmp) for a in case.args]
    keys = {a.split("=", 1)[0].lstrip("+~") for a in args}
    base = [b for b in case.base if b.split("=", 1)[0] not in keys]
    if "results_dir" not in keys:
        base.append(f"results_dir={tmp / 'results'}")
    return args + base


@contextlib.contextmanager
def _env(env: Dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _in_process(fn: Callable[[], Optional[int]]):
    out, err = io.StringIO(), io.StringIO()
    rc: Optional[int]
    saved_argv = list(sys.argv)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn()
            rc = 0 if rc is None else int(rc)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:  # noqa: BLE001 - a traceback is a finding, not a test crash
            import traceback

            traceback.print_exc(file=err)
            rc = 1
        finally:
            sys.argv[:] = saved_argv  # entry points may rewrite sys.argv for Hydra's own parser
    return rc, out.getvalue(), err.getvalue()


def run_case(case: Case, tmp: Path) -> Result:
    """Run one case in scratch dir ``tmp`` (created); never raises for the case's own failure."""
    tmp.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(tmp)
    env = {k: _fill(v, tmp) for k, v in case.env.items()}
    t0 = time.perf_counter()
    with _env(env):
        if case.kind == "run":
            from experiments import run

            argv = _run_argv(case, tmp)
            rc, out, err = _in_process(lambda: run.main(argv))
        elif case.kind == "run-subprocess":
            p = subprocess.run([sys.executable, "experiments/run.py", *_run_argv(case, tmp)], cwd=ROOT,
                               env={**os.environ}, capture_output=True, text=True, timeout=300)
            rc, out, err = p.returncode, p.stdout, p.stderr
        elif case.kind == "lm-eval":
            from hybridgen.eval import lm_eval_cli

            argv = ["--model", "hybridgen", *[_fill(a, tmp) for a in case.args]]
            rc, out, err = _in_process(lambda: lm_eval_cli.main(argv))
        elif case.kind == "profile":
            from hybridgen_harness import profile

            rc, out, err = _in_process(lambda: profile.main([_fill(a, tmp) for a in case.args]))
        elif case.kind == "aggregate":
            from experiments import aggregate

            rc, out, err = _in_process(lambda: aggregate.main([_fill(a, tmp) for a in case.args]))
        elif case.kind == "library":
            rc, out, err = _library(case, tmp)
        else:  # pragma: no cover
            raise ValueError(case.kind)
    wrote = []
    results = tmp / "results"
    if results.exists():
        wrote = [str(p.relative_to(tmp)) for p in sorted(results.rglob("*"))] or ["results/"]
    if case.kind == "profile" and case.id != "profile-out-exists":
        wrote += [str(p.relative_to(tmp)) for p in tmp.rglob("*.json")]
    return Result(rc, out, err, wrote, time.perf_counter() - t0)


def _library(case: Case, tmp: Path):
    from hybridgen.errors import HybridGenError

    try:
        case.call(tmp)
    except HybridGenError as err:
        return 2, "", f"error: {err}\n"
    except Exception:  # noqa: BLE001
        import traceback

        return 1, "", traceback.format_exc()
    return 0, "", ""


# ------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else [])
                                  for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(case, tmp_path):
    res = run_case(case, tmp_path / "case")
    verdict = res.verdict(case)
    assert verdict == "one-line", f"{verdict}\nerror lines: {res.error_lines}\nstderr tail:\n{res.err[-2000:]}"
    assert "\n" not in res.error_lines[0]


def test_the_table_in_docs_lists_every_case():
    text = (ROOT / "docs" / "bad_inputs.md").read_text()
    missing = [c.id for c in CASES if f"`{c.id}`" not in text]
    assert not missing, f"regenerate docs/bad_inputs.md (python tests/test_reliability_bad_inputs.py): {missing}"


# ------------------------------------------------------------------------------ the table
def _shown(case: Case) -> str:
    if case.shown:
        return case.shown
    env = " ".join(f"{k}={v}" for k, v in case.env.items() if "{tmp}" not in v)
    prog = {"run": "run.py", "run-subprocess": "run.py", "lm-eval": "hybridgen-lm-eval --model hybridgen",
            "profile": "python -m hybridgen_harness.profile", "aggregate": "aggregate.py"}.get(case.kind, "")
    args = " ".join(a.replace("{tmp}/", "<tmp>/") for a in case.args)
    return " ".join(x for x in (env, prog, args) if x)


def write_table(path: Path) -> Dict[str, int]:
    """Run every case and write the markdown table; returns the counts."""
    import tempfile

    rows, counts = [], {"tried": 0, "one-line": 0, "traceback": 0, "accepted": 0, "unclear": 0}
    with tempfile.TemporaryDirectory() as d:
        for i, case in enumerate(CASES):
            res = run_case(case, Path(d) / f"c{i}")
            verdict = res.verdict(case)
            counts["tried"] += 1
            counts[verdict.split(":")[0]] += 1
            msg = res.error_lines[0][len("error: "):] if res.error_lines else (res.err.strip().splitlines() or ["-"])[-1]
            msg = msg.replace(d + "/", "<tmp>/").replace(str(ROOT) + "/", "")
            msg = re.sub(r"<tmp>/c\d+\b/?", "<tmp>/", msg)
            before = "yes" if "loaded Engine" not in res.err else "no"
            rows.append(f"| `{case.id}` | {_shown(case).replace('|', '/')} | {msg.replace('|', '/')} | "
                        f"{res.rc} | {before} | {verdict} |")
            print(f"{verdict:10s} {res.seconds:5.1f}s {case.id}", file=sys.stderr)
    lines = [
        "# Bad inputs and what they give",
        "",
        "Generated by `python tests/test_reliability_bad_inputs.py` from the parametrised cases of",
        "`tests/test_reliability_bad_inputs.py` (the test suite checks each: exit status 2, exactly one",
        "`error:` line holding the expected text, no traceback, nothing written to the results directory).",
        "Library calls count a one-line `HybridGenError` as status 2. *Before load*: the error came before",
        "any model was loaded.",
        "",
        f"**Cases tried: {counts['tried']}. One-line errors: {counts['one-line']}. Tracebacks: "
        f"{counts['traceback']}. Silently accepted: {counts['accepted']}. Unclear: {counts['unclear']}.**",
        "",
        "| case | input | message | exit | before load | verdict |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]
    old = path.read_text() if path.exists() else ""
    fuzz = old[old.index("<!-- fuzz: begin"):] if "<!-- fuzz: begin" in old else ""  # tests/fuzz_configs.py --doc
    path.write_text("\n".join(lines) + ("\n" + fuzz if fuzz else ""))
    return counts


if __name__ == "__main__":
    from hybridgen import runtime

    runtime.apply_or_exit()
    out = ROOT / "docs" / "bad_inputs.md"
    counts = write_table(out)
    print(f"wrote {out}: {counts}")
    sys.exit(0 if counts["one-line"] == counts["tried"] else 1)
