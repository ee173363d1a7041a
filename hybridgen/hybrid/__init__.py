"""HybridGen and its lossless split, one job per module.

- :mod:`~hybridgen.hybrid.method`: :class:`HybridGen`, the method (the decode step, composed
  of the parts below, chosen once at bind time);
- :mod:`~hybridgen.hybrid.exact`: :class:`HybridExact` (``hybrid-exact``), the lossless
  CPU-GPU split merged by log-sum-exp;
- :mod:`~hybridgen.hybrid.host_branch`: one layer's CPU branch (scan, selection, gathers);
- :mod:`~hybridgen.hybrid.ship`: what the CPU branch ships to the GPU and how it enters the softmax;
- :mod:`~hybridgen.hybrid.window`: the GPU-resident sinks + recent window ring;
- :mod:`~hybridgen.hybrid.stream_slice`: the three-way split's streamed host prefixes;
- :mod:`~hybridgen.hybrid.scheduler`: the feedback scheduler (pure logic);
- :mod:`~hybridgen.hybrid.speculation`: stand-in queries for cross-layer pipelining;
- :mod:`~hybridgen.hybrid.timing`: CPU and GPU branch times per layer;
- :mod:`~hybridgen.hybrid.cost`: the performance model's price of a HybridGen layer.
"""
from hybridgen.hybrid.exact import HybridExact
from hybridgen.hybrid.method import HybridGen

__all__ = ["HybridGen", "HybridExact"]
