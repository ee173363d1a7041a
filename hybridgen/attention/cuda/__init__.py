"""CUDA decode-attention kernels compiled at run time with CuPy, with a torch fallback.

Import the dispatchers from here (they live in :mod:`.dispatch`); one job per module:

* ``kernels.cu`` (package data) and :mod:`.source`: the kernel source, its specialisation
  macros and the kernels' parameter lists;
* :mod:`.compiler`: CuPy ``RawModule`` builds (cached) and an NVRTC-only compile to PTX;
* :mod:`.planning`: launch plans (grids, blocks, token splits, typed arguments);
* :mod:`.execution`: running a plan with CuPy on torch's current stream (``cupy_*``);
* :mod:`.verification`: the first-use check of each kernel against torch;
* :mod:`.state`: all process-wide state (availability, compiled modules, verified kernels,
  dispatch counts);
* :mod:`.flash`: torch's flash kernel with its log-sum-exp as a decode partial (GQA as query rows);
* :mod:`.dispatch`: ``partial_attention`` (flash, else CuPy on CUDA; torch otherwise),
  ``softmax_over_parts``, ``hybrid_decode_attention`` (CuPy on CUDA, torch otherwise) and ``backend``.
"""
from hybridgen.attention.cuda.dispatch import backend, hybrid_decode_attention, partial_attention, softmax_over_parts
from hybridgen.attention.cuda.execution import (cupy_hybrid_decode_attention, cupy_partial_attention,
                                                cupy_softmax_over_parts)
from hybridgen.attention.cuda.planning import KernelUnsupported
from hybridgen.attention.cuda.state import dispatch_counts, kernels_available

__all__ = [
    "KernelUnsupported",
    "backend",
    "cupy_hybrid_decode_attention",
    "cupy_partial_attention",
    "cupy_softmax_over_parts",
    "dispatch_counts",
    "hybrid_decode_attention",
    "kernels_available",
    "partial_attention",
    "softmax_over_parts",
]
