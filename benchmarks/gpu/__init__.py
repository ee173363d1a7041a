"""GPU benchmark of HybridGen against the baselines, in one run of under six minutes on one H200.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py   # on a CUDA machine (writes $OUT or results/gpu/)
    python3 benchmarks/bench_gpu.py --cpu-smoke           # a tiny version on the CPU (checks that it runs)
    python3 -m benchmarks.gpu [...]                       # the same

Prints, side by side, for a Llama-3.1-8B-shaped layer (batch 8, 32 query heads, 8 KV heads,
head dim 128, bf16):
1. per-layer decode attention time of ``full``, ``hybrid-exact``, ``hybridgen``, FlexGen
   streaming (``flexgen`` attention_on='gpu') and FlexGen CPU-compute (attention_on='cpu')
   at host shares 50/75/90/95% (``gpu_budget`` = 1 - host share) and contexts 8K-64K, each
   method built from the registry and driven on one layer by ``hybridgen.testing``, with the
   error of its output against dense attention over the same KV (:mod:`.layer`);
2. end-to-end decode tokens/s with dummy weights for the same methods (:mod:`.e2e`);
3. the CPU key scan's GB/s (pageable and pinned keys) against the host's read bandwidth (:mod:`.scan`);
4. HybridGen's step time against max(CPU branch, GPU branch) (its ``cpu_branch_s``/``gpu_branch_s``);
5. the ratios against the issue's targets (HybridGen >= 3x FlexGen streaming and >= 1.8x
   CPU-compute at 90% host and 32K; scan >= 80% of host read; step <= 1.2x max branch) (:mod:`.report`);
6. the CuPy kernels (``hybridgen.attention.cuda``) against torch on GPU-resident KV (:mod:`.kernels`);
7. the performance model's PROJECTED per-layer times for the ``h200-host`` profile and their error
   against the measured ones (:mod:`.projection`).

Runtime: ``hybridgen.runtime`` sets ``OMP_WAIT_POLICY=passive`` and the numba threading
layer before torch loads, and the CPU branch gets every core but one (``--torch-threads``,
``--scan-threads``; see :func:`.config.default_threads`); the record is in ``environment.json``.

Robustness: every configuration runs inside its own try/except (a failure prints an error
row and the run goes on); a global clock (``--budget-s``, default 300 s, minus a 30 s margin)
skips what remains, keeping a reserve for the kernels section while the per-layer grid runs;
the target configuration (32K, 90%) runs first. Results: CSV, markdown and environment.json
under ``--out`` (default: $OUT when set, else results/gpu/, results/gpu_smoke/ for the smoke
run). Runs on a bare machine's python with only torch, numpy, numba, CuPy and pandas, from a
checkout that was never installed: nothing here imports Hydra, lm-eval, datasets or
transformers (the methods are found through the checkout's pyproject.toml).

Choices: ``hybridgen`` runs with its top-k ratio pinned at the scheduler's start value
(0.05) in the per-layer table, so rows compare like with like (the scheduler still records
branch times); per-layer times are the median of ``BenchConfig.steps`` decode steps after its warm-up steps.
"""
