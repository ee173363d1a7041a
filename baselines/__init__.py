"""Reimplemented KV-cache methods, one file each, all on the shared KVMethod protocol."""
from baselines.full import Full

__all__ = ["Full"]
