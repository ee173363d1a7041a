#!/usr/bin/env bash
# Everything one lent GPU session checks and measures, in one command of under ten minutes,
# printing as it goes. Outputs (10 files) go to $OUT, else results/gpu/:
#   machine.txt          GPU, driver, CPU and library versions
#   pytest.txt           the CUDA tests: the split methods on the GPU against the float64
#                        reference (tests/test_gpu_methods.py), the CuPy kernels, their dispatch,
#                        the host-to-device stream, the engine on CUDA against the CPU
#   bench_gpu.{md,csv,log}, environment.json
#                        benchmarks/bench_gpu.py (per-layer grid, end to end, kernels, projection)
#   cpu_scan.{json,txt}  benchmarks/bench_cpu_scan.py --quick on the GPU machine's host, at 2
#                        threads (issue 22's target) and at every core but one (what runs there)
#   cpu_scan_b1.{json,txt}  the same at batch 1 (8 rows on every core but one: the default branch
#                        runs stagewise there, fused_branch_pays; its fused twin beside it)
#
#   bash benchmarks/gpu_session.sh              # on the CUDA machine, from the repository root
#   PYTHON=.venv/bin/python bash benchmarks/gpu_session.sh --cpu-smoke   # tiny, on any CPU
#
# Runs with the machine's python (torch, numpy, numba, CuPy, pandas, pytest) from a checkout
# that was never installed; each part under its own timeout, so one hang loses one part.
set -uo pipefail
py=${PYTHON:-python3}
out=${OUT:-results/gpu}
smoke=${1:-}
export PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=passive
mkdir -p "$out"
cores=$(nproc)
all_but_one=$(( cores > 1 ? cores - 1 : 1 ))

echo "== machine"
{
  date -u +"%Y-%m-%d %H:%M UTC"
  echo "code: the working tree sent to this machine (its .git may be older; the results README names the commit)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>/dev/null || echo "no nvidia-smi"
  lscpu 2>/dev/null | grep -E "^Model name|^CPU\(s\)|^NUMA node\(s\)|^L3|^Flags" | cut -c1-400
  free -g 2>/dev/null | head -2
  $py -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
  $py -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
} 2>&1 | tee "$out/machine.txt"

echo "== CUDA tests"
timeout 120 $py -m pytest -q -p no:cacheprovider -p no:hydra_pytest -rs tests/test_gpu_methods.py \
  tests/test_attention_cuda_kernels.py tests/test_attention_cuda_dispatch.py tests/test_kv_transfer.py \
  "tests/test_model_engine.py::test_cuda_engine_matches_cpu" 2>&1 | tee "$out/pytest.txt" | tail -25

echo "== bench_gpu"
if [ "$smoke" = "--cpu-smoke" ]; then
  timeout 300 $py benchmarks/bench_gpu.py --cpu-smoke --out "$out" --force 2>&1 | tee "$out/bench_gpu.log" | tail -40
else
  timeout 300 $py benchmarks/bench_gpu.py --budget-s 260 --out "$out" --force 2>&1 | tee "$out/bench_gpu.log" | tail -60
fi

echo "== bench_cpu_scan"
rm -f "$out/cpu_scan.json"
if [ "$smoke" = "--cpu-smoke" ]; then
  scan_args=(--batch 1 --tokens 4096 --reps 2 --threads 1)
else
  scan_args=(--quick --threads "2,$all_but_one")
fi
timeout 110 $py benchmarks/bench_cpu_scan.py "${scan_args[@]}" --json "$out/cpu_scan.json" 2>&1 \
  | tee "$out/cpu_scan.txt" | tail -30
rm -f "$out/cpu_scan_b1.json"
if [ "$smoke" = "--cpu-smoke" ]; then
  b1_args=(--batch 1 --tokens 4096 --reps 2 --threads 2 --sketches int4)
else
  b1_args=(--batch 1 --tokens 131072 --reps 5 --threads "$all_but_one" --sketches int4)
fi
timeout 90 $py benchmarks/bench_cpu_scan.py "${b1_args[@]}" --json "$out/cpu_scan_b1.json" 2>&1 \
  | tee "$out/cpu_scan_b1.txt" | grep -E "^## |^read|default branch|bf16dot scan"
echo "== done: $(ls "$out" | tr '\n' ' ')"
echo "next, on any machine: python -m benchmarks.gpu.validation_rows --csv <these files>/bench_gpu.csv" \
  "--json results/perfmodel/gpu_runs/validation.json --gpu <GPU> --force (the model's error on this host, in the bands)"
