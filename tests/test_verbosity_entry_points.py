"""One verbosity for every entry point, checked on what each prints (subprocess, tiny model).

Quiet (``-q``, ``--verbosity WARNING``, ``HYBRIDGEN_LOG_LEVEL=quiet``) prints no progress
message and no bar; the default (info) prints both (so the checks can fail); verbose (``-v``,
``hydra.verbose=true``, ``--verbosity DEBUG``) adds debug messages.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "HF_DATASETS_OFFLINE": "1", "NUMBA_THREADING_LAYER": "workqueue"}
ENV.pop("HYBRIDGEN_LOG_LEVEL", None)
TINY = ["+exp=quickstart", "method=full", "model.weights=random", "model.num_layers=1", "workload.source=random",
        "workload.prompt_len=12", "workload.gen_len=3", "exp.warmup=false", "force=true"]
BAR = "decode [full]"          # the decode bar (progress=true, the default)
MESSAGE = "[1/1] "             # the session's progress message for the sweep's one point


def _run(args, env=None, cwd=ROOT, timeout=600):
    p = subprocess.run([sys.executable, *args], cwd=cwd, env={**ENV, **(env or {})}, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_run_py_quiet_flag_and_env_hide_messages_and_bars_info_shows_them(tmp_path):
    out = [f"results_dir={tmp_path}"]
    info = _run(["experiments/run.py", *TINY, *out])
    assert MESSAGE in info.stderr and BAR in info.stderr and "verbosity: debug" not in info.stderr
    for args, env in ((["-q"], None), ([], {"HYBRIDGEN_LOG_LEVEL": "quiet"})):
        quiet = _run(["experiments/run.py", *args, *TINY, *out], env=env)
        assert quiet.stderr == "", (args, env, quiet.stderr[-2000:])
        assert " done " in quiet.stdout            # the result table is output, not a message


def test_run_py_verbose_flag_and_hydra_verbose_print_debug(tmp_path):
    for extra in (["-v"], ["hydra.verbose=true"]):
        p = _run(["experiments/run.py", *extra, *TINY, f"results_dir={tmp_path}"])
        assert "verbosity: debug" in p.stderr and "resolved config:" in p.stderr, (extra, p.stderr[-2000:])
        assert MESSAGE in p.stderr


def _ppl_cache(tmp_path):
    """A data cache whose ppl step is already done (prepare --only ppl runs offline)."""
    d = tmp_path / "cache" / "data" / "jsonl"
    d.mkdir(parents=True)
    for src in ("pydoc", "pg-text"):
        (d / f"ppl_{src}.jsonl").write_text('{"text": "x"}\n')
    return {"HYBRIDGEN_CACHE": str(tmp_path / "cache")}


def test_data_command_quiet_info_verbose(tmp_path):
    env = _ppl_cache(tmp_path)
    cmd = ["-m", "hybridgen.data"]
    info = _run([*cmd, "prepare", "--only", "ppl"], env=env)
    assert "ppl: pydoc 1 docs" in info.stderr and "data:" in info.stderr   # message and bar
    for args, extra in ((["-q"], {}), ([], {"HYBRIDGEN_LOG_LEVEL": "quiet"})):
        quiet = _run([*cmd, *args, "prepare", "--only", "ppl"], env={**env, **extra})
        assert quiet.stderr == "" and "ready: ppl" in quiet.stdout, quiet.stderr
    verbose = _run([*cmd, "-v", "prepare", "--only", "ppl"], env=env)
    assert "verbosity: debug" in verbose.stderr and "ppl: pydoc 1 docs" in verbose.stderr


@pytest.fixture(scope="module")
def lm_eval_setup(tmp_path_factory):
    """A tiny Llama with a byte tokenizer, and a 4-item multiple-choice task."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.test_eval_lm_adapter import _byte_tokenizer
    from tests.test_reliability_lm_eval import _write_task

    base = tmp_path_factory.mktemp("lm-eval-verbosity")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(base / "model")
    _byte_tokenizer().save_pretrained(base / "model")
    return base / "model", _write_task(base)


def _lm_eval(setup, *extra, env=None):
    model, tasks = setup
    return _run(["-m", "hybridgen.eval.lm_eval_cli", "--model", "hybridgen", "--model_args", f"model={model}",
                 "--include_path", str(tasks), "--tasks", "rel_mc", "--limit", "4", *extra], env=env, cwd=tasks)


@pytest.mark.slow  # ~70 s: lm-eval indexes its own task YAMLs on every start
def test_lm_eval_verbosity_warning_hides_info_and_bars(lm_eval_setup):
    p = _lm_eval(lm_eval_setup, "--verbosity", "WARNING")
    assert " INFO " not in p.stderr and "loglikelihood [full]" not in p.stderr and "%|" not in p.stderr, \
        p.stderr[-3000:]
    assert "|rel_mc" in p.stdout                       # the result table still prints
    q = _lm_eval(lm_eval_setup, env={"HYBRIDGEN_LOG_LEVEL": "quiet"})
    assert " INFO " not in q.stderr and " WARNING " not in q.stderr and "%|" not in q.stderr, q.stderr[-3000:]


@pytest.mark.slow  # ~70 s, as above
def test_lm_eval_debug_shows_debug_messages_and_bars(lm_eval_setup):
    p = _lm_eval(lm_eval_setup, "--verbosity", "DEBUG")
    assert "verbosity: debug" in p.stderr and " DEBUG " in p.stderr and "loglikelihood [full]" in p.stderr
