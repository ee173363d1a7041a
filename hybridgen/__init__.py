"""HybridGen harness: CPU-GPU collaborative attention over a tiered KV cache."""
__version__ = "0.1.0"
