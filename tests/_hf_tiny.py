"""Small random transformers models of four architectures for the backend's tests (no hub).

mistral: plain GQA; qwen3: q/k norms; phi3: a fused qkv projection; gemma3: sliding-window
layers between global ones (window 6 < the prompts used), q/k norms, its own softmax scale.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               max_position_embeddings=256)


def tiny_config(arch: str):
    if arch == "mistral":
        return transformers.MistralConfig(**_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
                                          sliding_window=None)
    if arch == "qwen3":
        return transformers.Qwen3Config(**_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=16)
    if arch == "phi3":
        return transformers.Phi3Config(**_COMMON, num_hidden_layers=3, num_key_value_heads=2, pad_token_id=0)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**_COMMON, num_hidden_layers=5, num_key_value_heads=1, head_dim=16,
                                             query_pre_attn_scalar=20, sliding_window=6,
                                             layer_types=["sliding_attention", "full_attention"] * 2
                                             + ["full_attention"])
    raise KeyError(arch)


ARCHS = ("mistral", "qwen3", "phi3", "gemma3")


def tiny_pair(arch: str, dtype=torch.float64):
    """(model for the backend, transformers' own sdpa model with the same weights), both eval."""
    torch.manual_seed(0)
    cfg = tiny_config(arch)
    ours = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    for p in ours.parameters():  # larger than the 0.02 init, so attention is far from uniform
        p.data.normal_(0, 0.2) if p.dim() > 1 else None
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    ref.load_state_dict(ours.state_dict())
    return ours.eval(), ref.eval()


def prompts(batch: int = 2, length: int = 18, seed: int = 1):
    """(ids [B, T], mask [B, T]) left-padded: row b has length - 3*b real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for b in range(batch):
        mask[b, :3 * b] = 0
        ids[b, :3 * b] = 0
    return ids, mask
