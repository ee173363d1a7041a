"""Network mode (issue 13, item 2), with a local stand-in for the hub: a Hugging Face cache
directory in the hub's own layout (``models--acme--tiny-llama/refs/main`` + ``snapshots/<sha>``)
holding a tiny random Llama with a byte-level tokenizer, ``HF_HOME`` pointing at it and
``HF_HUB_OFFLINE=1``, so ``huggingface_hub.snapshot_download`` resolves the id from the cache.

Checked: entry points no longer force offline mode; a hub id loads through huggingface_hub
(same logits as the snapshot directory itself); an id not in the cache while offline is one
line naming the fix; ``hybridgen-lm-eval --model hybridgen`` with a hub id passes the
tokenizer to the tasks (what RULER reads), names its output directory after model and method,
and prints the fidelity summary when ``fidelity=true``.

huggingface_hub reads ``HF_HOME`` when it is imported, so the checks run in one fresh process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"

SCRIPT = textwrap.dedent('''
    import contextlib, io, json, sys
    from pathlib import Path
    import torch
    sys.path[:0] = [ROOT, ROOT + "/tests"]
    from test_eval_lm_adapter import _byte_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    home = Path(HOME)
    repo = home / "hub" / "models--acme--tiny-llama"
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(snap)
    _byte_tokenizer().save_pretrained(snap)

    from hybridgen.errors import MissingDataError
    from hybridgen.model import load_model
    out = {}
    hub = load_model("acme/tiny-llama")
    local = load_model(str(snap))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    out["name"] = hub.name
    out["same_logits"] = bool(torch.equal(hub.forward(ids), local.forward(ids)))
    out["tokenizer"] = hub.tokenizer is not None
    try:
        load_model("acme/not-cached")
        out["missing"] = None
    except MissingDataError as err:
        out["missing"] = str(err)

    tasks = home / "tasks"
    tasks.mkdir()
    items = [{"q": f"Item {i}: the sky is", "choices": [" blue", " green", " loud"], "label": 0} for i in range(4)]
    (tasks / "data.jsonl").write_text("".join(json.dumps(x) + "\\n" for x in items))
    (tasks / "net_mc.yaml").write_text(
        "task: net_mc\\ndataset_path: json\\ndataset_kwargs:\\n  data_files:\\n"
        f"    test: {tasks / 'data.jsonl'}\\ntest_split: test\\noutput_type: multiple_choice\\n"
        'doc_to_text: "{{q}}"\\ndoc_to_choice: choices\\ndoc_to_target: label\\nmetric_list:\\n  - metric: acc\\n')
    from hybridgen.eval import lm_eval_cli
    so, se = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        rc = lm_eval_cli.main(["--model", "hybridgen", "--model_args",
                               "model=acme/tiny-llama,method=h2o,budget=0.5,fidelity=true",
                               "--include_path", str(tasks), "--tasks", "net_mc", "--limit", "4", "--batch_size", "4",
                               "--output_path", str(home / "out")])
    out["rc"], out["stdout"], out["stderr"] = rc, so.getvalue(), se.getvalue()[-3000:]
    out["snapshot"] = str(snap)
    out["results"] = sorted(str(p.relative_to(home / "out")) for p in (home / "out").rglob("*.json"))
    if out["results"]:
        res = json.loads((home / "out" / out["results"][0]).read_text())
        out["config_hybridgen"] = res["config"].get("hybridgen")
        out["task_metadata"] = res["configs"]["net_mc"].get("metadata", {})
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    code = f"ROOT = {str(ROOT)!r}\nHOME = {str(home)!r}\nSHA = {SHA!r}\n" + SCRIPT
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               NUMBA_THREADING_LAYER="workqueue", OMP_WAIT_POLICY="passive", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_hub_id_loads_through_huggingface_hub_cache(run):
    assert run["name"] == "acme--tiny-llama"
    assert run["same_logits"] and run["tokenizer"]


def test_hub_id_missing_while_offline_is_one_line_naming_the_fix(run):
    msg = run["missing"]
    assert msg and "\n" not in msg and "acme/not-cached" in msg and "HF_HUB_OFFLINE" in msg


def test_lm_eval_cli_names_output_after_model_and_method(run):
    assert run["rc"] == 0, run["stderr"]
    assert len(run["results"]) == 1, run["results"]
    assert run["results"][0].startswith("acme--tiny-llama__h2o-budget=0.5/results_"), run["results"]


def test_lm_eval_cli_passes_the_tokenizer_to_tasks(run):
    """RULER's tasks read ``tokenizer`` from the task metadata (lm-eval's ruler/common_utils.py)."""
    assert run["task_metadata"].get("tokenizer") == run["snapshot"]


def test_lm_eval_cli_prints_fidelity_summary(run):
    line = [ln for ln in run["stdout"].splitlines() if ln.startswith("fidelity of acme--tiny-llama / h2o")]
    assert line, run["stdout"][-2000:]
    fid = run["config_hybridgen"]["fidelity"]
    assert fid["tokens"] > 0 and 0.0 <= fid["top1_agreement"] <= 1.0 and fid["mean_kl"] >= 0.0
    assert f"over {fid['tokens']} tokens" in line[0]


def test_run_dir_name_from_model_args():
    from hybridgen.eval.lm_eval_cli import run_dir_name

    assert run_dir_name({"model": "smollm2-135m", "method": "h2o", "budget": 0.2}) == "smollm2-135m__h2o-budget=0.2"
    assert run_dir_name({"method": "full", "fidelity": "true", "batch_size": 8}) == "smollm2-135m__full"
    assert run_dir_name({"model": "/ckpt/my-model", "weights": "random"}) == "my-model-random__full"
    assert run_dir_name({"model": "HuggingFaceTB/SmolLM2-135M", "method": "quest", "page": 16}) == \
        "HuggingFaceTB--SmolLM2-135M__quest-page=16"


def test_no_entry_point_forces_offline_mode():
    """Offline is the make targets' and CI's default (Makefile exports), never forced in code."""
    import re

    forced = re.compile(r"apply(_or_exit)?\([^)]*offline\s*=\s*True|environ\[\"HF_HUB_OFFLINE\"\]\s*=|"
                        r"setdefault\(\"HF_HUB_OFFLINE\"")
    hits = []
    for d in ("hybridgen", "experiments", "benchmarks", "baselines"):
        for p in (ROOT / d).rglob("*.py"):
            if forced.search(p.read_text()):
                hits.append(str(p.relative_to(ROOT)))
    assert hits == []
    make = (ROOT / "Makefile").read_text()
    assert "export HF_HUB_OFFLINE := 1" in make and "export HF_DATASETS_OFFLINE := 1" in make


def test_fidelity_report_without_compared_tokens_says_why():
    from hybridgen.eval.lm_eval_cli import format_report

    line = format_report({"model": "m", "method": "h2o", "method_params": {"budget": 0.2},
                          "fidelity": {"tokens": 0, "top1_agreement": None, "mean_kl": None, "max_kl": None}})
    assert line.startswith("fidelity of m / h2o (budget=0.2) against full: no tokens compared") and "RULER" in line


def test_which_names_are_hub_ids(tmp_path):
    from hybridgen.model.hub import display_name, is_hub_id, split_revision

    assert is_hub_id("HuggingFaceTB/SmolLM2-135M") and is_hub_id("acme/tiny-llama@v1")
    for local in ("smollm2-135m", "no/such/dir", "./acme/x", "/abs/x", "~/acme/x", str(tmp_path)):
        assert not is_hub_id(local), local
    (tmp_path / "acme" / "x").mkdir(parents=True)
    import os
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not is_hub_id("acme/x")  # an existing local directory wins over a hub id
    finally:
        os.chdir(here)
    assert split_revision("acme/x@v1") == ("acme/x", "v1") and display_name("acme/x@v1") == "acme--x@v1"
