"""Reimplemented KV-cache methods, one file each, all on the shared KVMethod protocol."""
from baselines.full import Full
from baselines.flexgen import FlexGen, FlexGenPolicy
from baselines.h2o import H2O
from baselines.infinigen import InfiniGen
from baselines.quest import Quest
from baselines.snapkv import SnapKV
from baselines.streamingllm import StreamingLLM

__all__ = ["Full", "FlexGen", "FlexGenPolicy", "H2O", "InfiniGen", "Quest", "SnapKV", "StreamingLLM"]
