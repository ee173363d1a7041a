"""Every documented ``python experiments/run.py ...`` command resolves to the values its text claims.

Commands are read from the comments of ``conf/**/*.yaml``, ``experiments/README.md``,
``README.md`` and the ``Makefile``. Each one must have an entry in :data:`DOCUMENTED` (a new
documented command gets a check) and each entry must still be documented (a check does not
outlive its text). An entry names the values every point must have, the exact sweep the command
expands to, and, for the documented error example, the one line it prints.

Resolution is :func:`experiments.preflight.resolve_points`: Hydra's own sweeper expansion, every point
composed and validated, what ``run.py``'s preflight callback does before the first job.
To stay fast, the default run composes and validates one method of each sweep (the other methods
are composed by ``tests/test_harness_config.py`` for every experiment) at every other point of the
sweep; ``-m slow`` resolves every point. One command (the issue's own repro) also runs through the
real CLI with ``--cfg job``.

Rule under test (Hydra's): an option the user names on the command line (``workload=pg-text``,
``model=...``) replaces the experiment's default, because experiments choose their workload and
model through their defaults list (``- override /workload: speedup-cpu``), not inline blocks.
"""
from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import yaml
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import preflight, validate  # noqa: E402
from hybridgen.errors import ConfigError  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "NUMBA_THREADING_LAYER": "workqueue"}

ALL_METHODS = ["full", "hybrid-exact", "hybridgen", "flexgen", "infinigen", "h2o", "snapkv", "streamingllm",
               "quest"]
QUICKSTART_METHODS = ["full", "hybrid-exact", "hybridgen"]
SWEEP_METHODS = ["full", "hybridgen", "flexgen", "h2o"]
# The paper's speed template (conf/workload/pg-text.yaml) and the CPU-scale workloads of the experiments.
PG_TEXT = {"workload.batch": 20, "workload.prompt_len": 1920, "workload.gen_len": 128, "workload.source": "pg-text"}
OPT13B = {"model.name": "opt-13b", "model.weights": "dummy", "model.dtype": "float32", "hardware.name": "h100"}
SMOLLM = {"model.name": "smollm2-135m", "model.weights": "real", "model.dtype": "float32"}
CPU = {"hardware.name": "cpu-emulated"}


@dataclass
class Claim:
    """What a documented command claims.

    values: dotted key -> value, on every point. sweep: override key -> values; the command expands
    to exactly their product (every swept key listed, in any order). error: the one-line message
    (a documented failure example). standin: a method name registered for the test only (a
    third-party method the docs use as an example). argv: what to resolve when the text is a
    template (``+exp=X``).
    """

    values: Dict[str, Any] = field(default_factory=dict)
    sweep: Dict[str, List[Any]] = field(default_factory=dict)
    error: Optional[str] = None
    standin: Optional[str] = None
    argv: Optional[List[str]] = None
    covered_by: Optional[str] = None


# The documented command (as written, flags included, joined by one space) -> its claims.
DOCUMENTED: Dict[str, Claim] = {
    # conf/config.yaml: the bare command, the root config's defaults.
    "": Claim(values={**SMOLLM, **CPU, "method.name": "full", "workload.batch": 1, "workload.prompt_len": 1024,
                      "workload.gen_len": 32, "workload.source": "pydoc", "exp.name": "adhoc",
                      "results_dir": "outputs"}),
    # README.md: the template; every experiment is resolved point by point there.
    "+exp=NAME [overrides]": Claim(
        covered_by="tests/test_harness_config.py::test_every_experiment_composes_and_validates"),
    # README.md: a method that is only an entry point of another package (a stand-in here).
    "method=pyramidkv method.params.budget=0.1": Claim(
        standin="pyramidkv", values={"method.name": "pyramidkv", "method.params.budget": 0.1}),
    # conf/exp/quickstart.yaml, experiments/README.md, Makefile (`make quickstart` writes the committed results/).
    "+exp=quickstart": Claim(
        values={**SMOLLM, **CPU, "exp.name": "quickstart", "exp.fidelity": True, "workload.batch": 1,
                "workload.prompt_len": 1024, "workload.gen_len": 32, "workload.source": "pydoc",
                "results_dir": "outputs"},
        sweep={"method": QUICKSTART_METHODS}),
    "+exp=quickstart results_dir=results": Claim(
        values={**SMOLLM, "exp.name": "quickstart", "workload.prompt_len": 1024, "workload.gen_len": 32,
                "results_dir": "results"},
        sweep={"method": QUICKSTART_METHODS}),
    # Makefile (`make results EXP=NAME [ARGS=...]`): any experiment into the committed results/.
    "+exp=$(EXP) results_dir=results $(ARGS)": Claim(
        argv=["+exp=speedup", "results_dir=results"], values={**SMOLLM, "exp.name": "speedup", "results_dir": "results"},
        sweep={"method": ALL_METHODS}),
    # Makefile (`make run`): README says it writes outputs/quickstart/<run>/.
    "+exp=quickstart results_dir=outputs": Claim(
        values={**SMOLLM, "exp.name": "quickstart", "workload.prompt_len": 1024, "workload.gen_len": 32,
                "results_dir": "outputs"},
        sweep={"method": QUICKSTART_METHODS}),
    # conf/exp/speedup.yaml: the paper-scale speedup.
    "+exp=speedup model=opt-13b hardware=h100 workload=pg-text": Claim(
        values={**OPT13B, **PG_TEXT, "exp.name": "speedup", "exp.repeats": 2}, sweep={"method": ALL_METHODS}),
    # conf/exp/speedup_projected.yaml: the measured counterpart of the projection (float16).
    "+exp=speedup model=opt-13b-fp16 hardware=h100 workload=pg-text": Claim(
        values={**OPT13B, "model.dtype": "float16", **PG_TEXT, "exp.name": "speedup"},
        sweep={"method": ALL_METHODS}),
    # conf/exp/batch_sweep.yaml: paper-scale, batch 4-20 at prompt 1920.
    "+exp=batch_sweep model=opt-13b hardware=h100 workload=pg-text workload.batch=4,8,12,16,20": Claim(
        values={**OPT13B, "workload.prompt_len": 1920, "workload.gen_len": 128, "workload.source": "pg-text",
                "exp.name": "batch_sweep"},
        sweep={"workload.batch": [4, 8, 12, 16, 20], "method": SWEEP_METHODS}),
    # conf/exp/prompt_sweep.yaml: paper-scale, prompt 384-1920 at batch 20.
    "+exp=prompt_sweep model=opt-13b hardware=h100 workload=pg-text workload.prompt_len=384,768,1152,1536,1920":
        Claim(values={**OPT13B, "workload.batch": 20, "workload.gen_len": 128, "workload.source": "pg-text",
                      "exp.name": "prompt_sweep"},
              sweep={"workload.prompt_len": [384, 768, 1152, 1536, 1920], "method": SWEEP_METHODS}),
    # conf/exp/model_sweep.yaml: paper-scale OPT sizes.
    "+exp=model_sweep hardware=h100 model=opt-6.7b,opt-13b,opt-30b workload.prompt_len=1920 workload.gen_len=128 "
    "workload.batch=8": Claim(
        values={"model.weights": "dummy", "hardware.name": "h100", "workload.batch": 8, "workload.prompt_len": 1920,
                "workload.gen_len": 128, "workload.source": "random", "exp.name": "model_sweep"},
        sweep={"model": ["opt-6.7b", "opt-13b", "opt-30b"], "method": ["full", "hybridgen", "flexgen"]}),
    # conf/exp/budget_sweep.yaml: the same budget sweep as an lm-eval experiment.
    "+exp=budget_sweep exp.kind=accuracy exp.accuracy.tasks=[hg_bigbench_social_iqa] exp.accuracy.limit=100": Claim(
        values={**SMOLLM, "exp.name": "budget_sweep", "exp.kind": "accuracy",
                "exp.accuracy.tasks": ["hg_bigbench_social_iqa"], "exp.accuracy.limit": 100},
        sweep={"method": ["h2o", "snapkv", "streamingllm", "quest", "infinigen"],
               "++method.params.budget": [0.05, 0.1, 0.2, 0.5]}),
    # experiments/README.md: "override anything".
    "+exp=speedup model=qwen2.5-0.5b model.weights=dummy workload=random workload.prompt_len=4096": Claim(
        values={"model.name": "qwen2.5-0.5b", "model.weights": "dummy", **CPU, "workload.batch": 1,
                "workload.prompt_len": 4096, "workload.gen_len": 32, "workload.source": "random",
                "exp.name": "speedup"},
        sweep={"method": ALL_METHODS}),
    # experiments/README.md: the one-line error example (the line below it in the README is checked too).
    "method=h2o method.params.budgte=0.1": Claim(
        error="method 'h2o' has no parameter 'budgte'; its parameters are: budget, chunk, host_tier, offload, recent_fraction, tier"),
    # experiments/README.md and conf/hydra/launcher/*.yaml: the launchers.
    "-m +exp=prompt_sweep hydra/launcher=parallel": Claim(
        values={**SMOLLM, **CPU, "workload.batch": 1, "workload.gen_len": 16, "workload.source": "pydoc",
                "exp.name": "prompt_sweep"},
        sweep={"workload.prompt_len": [512, 1024, 2048, 4096], "method": SWEEP_METHODS}),
    "-m +exp=X hydra/launcher=parallel": Claim(
        argv=["-m", "+exp=quickstart", "hydra/launcher=parallel"], values={"exp.name": "quickstart"},
        sweep={"method": QUICKSTART_METHODS}),
    "-m +exp=speedup hydra/launcher=slurm hydra.launcher.partition=gpu results_dir=/shared/results model=opt-13b "
    "hardware=h100 workload=pg-text": Claim(
        values={**OPT13B, **PG_TEXT, "exp.name": "speedup", "results_dir": "/shared/results"},
        sweep={"method": ALL_METHODS}),
    "-m +exp=speedup hydra/launcher=slurm hydra.launcher.partition=gpu": Claim(
        values={**SMOLLM, **CPU, "workload.batch": 1, "workload.prompt_len": 2048, "workload.gen_len": 32,
                "workload.source": "pydoc", "exp.name": "speedup"},
        sweep={"method": ALL_METHODS}),
    "-m +exp=quickstart hydra/launcher=local": Claim(
        values={**SMOLLM, "exp.name": "quickstart"}, sweep={"method": QUICKSTART_METHODS}),
    # conf/exp/paper_speedup.yaml: a union of three sweeps (hydra/sweeper=union), not one product.
    "+exp=paper_speedup results_dir=results": Claim(
        covered_by="tests/test_paper_speedup.py::test_the_experiment_resolves_to_the_union_of_its_parts"),
    "+exp=paper_speedup --cfg job": Claim(covered_by="tests/test_paper_speedup.py::test_cfg_job_resolves"),
    # conf/exp/paper_regime.yaml: a union of twelve sweeps (issue 23), resolved with every experiment.
    "+exp=paper_regime results_dir=results": Claim(
        covered_by="tests/test_harness_config.py::test_every_experiment_composes_and_validates"),
    "+exp=paper_regime --cfg job": Claim(covered_by="tests/test_paper_regime.py::test_cfg_job_resolves"),
}

_COMMAND = re.compile(r"(?:python3?|\$\(PY\)) experiments/run\.py\b")


def _doc_files() -> List[Path]:
    return [ROOT / "README.md", ROOT / "experiments" / "README.md", ROOT / "Makefile",
            *sorted((ROOT / "conf").rglob("*.yaml"))]


def _command_text(rest: str) -> str:
    """The arguments of a command found in prose: up to a closing backtick or a trailing comment."""
    rest = rest.split("`", 1)[0]
    rest = re.split(r"\s#\s", rest, maxsplit=1)[0]
    return " ".join(shlex.split(rest))


def documented_commands() -> Dict[str, List[str]]:
    """{command arguments: [files documenting it]}; backslash continuations (also in comments) joined."""
    found: Dict[str, List[str]] = {}
    for path in _doc_files():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            m = _COMMAND.search(line)
            if not m:
                continue
            rest = line[m.end():]
            j = i
            while rest.rstrip().endswith("\\") and j + 1 < len(lines):
                j += 1
                rest = rest.rstrip()[:-1] + " " + lines[j].lstrip("#\t ")
            found.setdefault(_command_text(rest), []).append(str(path.relative_to(ROOT)))
    return found


def test_every_documented_command_has_a_check_and_every_check_a_document():
    found = documented_commands()
    unchecked = {c: f for c, f in found.items() if c not in DOCUMENTED}
    assert not unchecked, f"documented commands without an entry in DOCUMENTED: {unchecked}"
    stale = sorted(set(DOCUMENTED) - set(found))
    assert not stale, f"DOCUMENTED entries no document shows any more: {stale}"
    # the three paper-scale commands are among them, where the issue says they are
    for exp in ("speedup", "batch_sweep", "prompt_sweep"):
        assert any(f"conf/exp/{exp}.yaml" in files and "workload=pg-text" in cmd for cmd, files in found.items()), exp


def _argv(command: str) -> List[str]:
    claim = DOCUMENTED[command]
    return list(claim.argv) if claim.argv is not None else shlex.split(command)


def _overrides(argv: Sequence[str]) -> List[str]:
    """What run.py resolves: the arguments less its flags (only -m is documented)."""
    flags = [a for a in argv if a.startswith("-")]
    assert set(flags) <= {"-m", "--multirun"}, flags
    return [a for a in argv if not a.startswith("-")]


def _expansion(overrides: Sequence[str]) -> List[List[str]]:
    return preflight.expand(overrides)


def _swept(points: Sequence[Sequence[str]], keys: Sequence[str]) -> List[Tuple[str, ...]]:
    """Per point, the value it gives each key of ``keys`` (as override text)."""
    out = []
    for pt in points:
        given = {}
        for o in pt:
            k, _, v = o.partition("=")
            given[k] = v
        out.append(tuple(given.get(k, "<missing>") for k in keys))
    return out


def _is_method_key(key: str) -> bool:
    return key.lstrip("+~").split(".")[0] == "method"


@pytest.fixture()
def standin_method(monkeypatch):
    """Register a third-party-looking method for one test (undone afterwards)."""
    from dataclasses import dataclass as dc

    from baselines.streamingllm import StreamingLLM
    from hybridgen.methods import registry

    def add(name: str) -> None:
        cls = dc(type("StandInMethod", (StreamingLLM,), {"name": name}))  # `name` stays a class attribute
        monkeypatch.setitem(registry._loaded, name, cls)

    return add


def _check(command: str, every_point: bool, standin_method) -> None:
    claim = DOCUMENTED[command]
    if claim.covered_by:
        pytest.skip(f"a template; resolved for every experiment by {claim.covered_by}")
    if claim.standin:
        standin_method(claim.standin)
    overrides = _overrides(_argv(command))
    if claim.error is not None:
        with pytest.raises(ConfigError) as ei:
            preflight.resolve_points(overrides)
        assert str(ei.value) == claim.error
        assert f"error: {claim.error}" in (ROOT / "experiments" / "README.md").read_text()
        return
    points = _expansion(overrides)
    keys = list(claim.sweep)
    expected = sorted(itertools.product(*[[str(v) for v in claim.sweep[k]] for k in keys]))
    assert sorted(_swept(points, keys)) == expected, f"{command!r} expands to another sweep"
    assert len(points) == len(expected), f"{command!r} sweeps keys its claim does not list: {points[:2]}"
    if every_point:
        resolved = preflight.resolve_points(overrides)
    else:  # one value of each method key; every other point of the sweep
        pins = [f"{k}={claim.sweep[k][0]}" for k in keys if _is_method_key(k)]
        resolved = preflight.resolve_points(overrides + pins)
        assert len(resolved) == len(expected) // max(1, _product([len(claim.sweep[k]) for k in keys
                                                                    if _is_method_key(k)]))
    for pt, cfg in resolved:
        for key, want in claim.values.items():
            got = OmegaConf.select(cfg, key)
            got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
            assert got == want, f"{command!r} at {pt}: {key}={got!r}, documented {want!r}"
        for o in pt:  # the point's own key=value overrides reach the config (group choices: by `values`)
            key, _, text = o.partition("=")
            key = key.lstrip("+~")
            if key in ("model", "method", "hardware", "workload", "exp") or key.startswith("hydra") or "/" in key:
                continue
            got = OmegaConf.select(cfg, key)
            got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
            assert got == yaml.safe_load(text), f"{command!r} at {pt}: {key}={got!r}, given {text!r}"


def _product(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _id(command: str) -> str:
    return re.sub(r"[^\w=.,+/-]+", "_", command) or "bare"


@pytest.mark.parametrize("command", sorted(DOCUMENTED), ids=_id)
def test_documented_command_resolves_to_what_it_claims(command, prepared_cache, standin_method):
    _check(command, every_point=False, standin_method=standin_method)


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(c for c, cl in DOCUMENTED.items() if cl.sweep), ids=_id)
def test_documented_command_every_point(command, prepared_cache, standin_method):
    _check(command, every_point=True, standin_method=standin_method)


# Each experiment's own values (no override), as its conf/exp comment describes them; the paper-scale
# commands above change only what they name.
EXPERIMENT_DEFAULTS = {
    "quickstart": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 32, "pydoc")),
    "speedup": ("smollm2-135m", "float32", "cpu-emulated", (1, 2048, 32, "pydoc")),
    "batch_sweep": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 8, "pydoc")),
    "prompt_sweep": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 16, "pydoc")),
    "model_sweep": ("opt-125m", "float32", "cpu-emulated", (1, 1024, 8, "random")),
    "budget_sweep": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 32, "pydoc")),
    "mapping_ablation": ("smollm2-135m", "float32", "cpu-emulated", (1, 2048, 16, "pydoc")),
    "scheduler_trace": ("smollm2-135m", "float32", "cpu-emulated", (1, 2048, 64, "pydoc")),
    "speedup_projected": ("opt-13b", "float16", "h100", (20, 1920, 128, "pg-text")),
    "paper_speedup": ("opt-13b", "float16", "h100", (20, 1920, 128, "pg-text")),
    "paper_regime": ("llama-3.1-8b", "float32", "h200", (8, 130944, 128, "pg-text")),
    "accuracy": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 32, "pydoc")),
    "ruler": ("smollm2-135m", "float32", "cpu-emulated", (1, 1024, 32, "pydoc")),
}


def test_every_experiment_has_its_documented_defaults():
    from hydra import initialize_config_dir

    exps = sorted(p.stem for p in (ROOT / "conf" / "exp").glob("*.yaml"))
    assert sorted(EXPERIMENT_DEFAULTS) == exps
    with initialize_config_dir(config_dir=str(validate.CONF_DIR), version_base="1.3", job_name="run"):
        for exp, (model, dtype, hardware, workload) in EXPERIMENT_DEFAULTS.items():
            cfg = preflight.compose([f"+exp={exp}"])
            w = cfg.workload
            assert (cfg.model.name, cfg.model.dtype, cfg.hardware.name) == (model, dtype, hardware), exp
            assert (w.batch, w.prompt_len, w.gen_len, w.source) == workload, exp


def test_experiments_choose_workload_and_model_through_their_defaults_list():
    """No inline workload:/model: block, which would win over `workload=`/`model=` on the command line."""
    for path in sorted((ROOT / "conf" / "exp").glob("*.yaml")):
        conf = yaml.safe_load(path.read_text())
        assert "workload" not in conf and "model" not in conf, f"{path.name}: use `- override /workload: NAME`"


def test_cfg_job_shows_the_named_workload():
    """The issue's repro through the real CLI: `workload=pg-text` replaces the experiment's workload."""
    p = subprocess.run([sys.executable, "experiments/run.py", "+exp=speedup", "model=opt-13b", "hardware=h100",
                        "workload=pg-text", "--cfg", "job"], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["model"]["name"] == "opt-13b" and cfg["hardware"]["name"] == "h100"
    assert cfg["workload"] == {"batch": 20, "prompt_len": 1920, "gen_len": 128, "source": "pg-text"}
