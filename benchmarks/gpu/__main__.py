"""``python3 -m benchmarks.gpu [--cpu-smoke ...]`` (the same as ``python3 benchmarks/bench_gpu.py``)."""
import sys

from hybridgen import runtime

runtime.apply_or_exit()  # OMP_WAIT_POLICY and the numba layer before torch loads

from benchmarks.gpu.main import main  # noqa: E402

sys.exit(main())
