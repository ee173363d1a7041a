"""Reimplemented KV-cache baselines, one file each, on the KVMethod protocol.

They are registered through the ``hybridgen.methods`` entry points in pyproject.toml (the
library never imports this package).
"""
from baselines.flexgen import FlexGen
from baselines.h2o import H2O
from baselines.infinigen import InfiniGen
from baselines.quest import Quest
from baselines.snapkv import SnapKV
from baselines.streamingllm import StreamingLLM

__all__ = ["FlexGen", "H2O", "InfiniGen", "Quest", "SnapKV", "StreamingLLM"]
