"""GPU benchmark of HybridGen against the baselines: the entry point of ``benchmarks/gpu/``.

    PYTHONUNBUFFERED=1 python3 benchmarks/bench_gpu.py   # on a CUDA machine (writes $OUT or results/gpu/)
    python3 benchmarks/bench_gpu.py --cpu-smoke           # a tiny version on the CPU (checks that it runs)

Runs from the repository root of a checkout that was never installed, with only torch, numpy,
numba, CuPy and pandas. What it measures and how: ``benchmarks/gpu/__init__.py``; one module
per section there (config, layer, e2e, scan, kernels, projection, report, main).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybridgen import runtime  # noqa: E402

runtime.apply_or_exit()  # OMP_WAIT_POLICY and the numba layer before torch loads

from benchmarks.gpu.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
