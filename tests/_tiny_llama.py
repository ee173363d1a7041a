"""A tiny random Llama with GQA (8 query heads over 2 KV heads, 3 layers) for engine-level tests.

The random init's q/k/v are scaled up 8x so attention is far from uniform and tokens differ.
"""
import json

import torch

from hybridgen.model import load_model

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=300, hidden_size=64,
                  num_hidden_layers=3, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu",
                  tie_word_embeddings=False)


def tiny_llama(path):
    """The engine, from a config written into the directory ``path``."""
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    eng = load_model(str(path), weights="random", seed=3, tokenizer=False)
    with torch.no_grad():
        for lw in eng.weights.layers:
            lw.qkv.mul_(8.0)
    return eng


def prompt(B=2, T=96, seed=0):
    """(ids [B, T], mask [B, T]) with left padding in the second row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY_LLAMA["vocab_size"], (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :17] = 0
    return ids, mask
