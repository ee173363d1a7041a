"""Fidelity of a KV method to a reference (normally `full`): top-1 agreement and mean KL.

Both logit sets must come from the same contexts (teacher-force the reference's tokens, see
``hybridgen.eval.generation.teacher_forced_logits``), so position t of each compares the
two next-token distributions after the same prefix.

    from hybridgen.eval.fidelity import fidelity
    fidelity(ref_logits, logits)   # {'top1_agreement': 0.97, 'mean_kl': 0.004, 'max_kl': ..., 'positions': n}

KL is KL(ref || method) = Σ_v p_ref(v) (log p_ref(v) - log p_method(v)) in nats, computed
from log-softmax in float64 (no clipping), averaged over positions.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from hybridgen.errors import ConfigError


def kl_per_position(ref_logits: Tensor, logits: Tensor) -> Tensor:
    """KL(ref || method) per position: [..., V] x [..., V] -> [...] float64 (nats)."""
    lp_ref = torch.log_softmax(ref_logits.double(), dim=-1)
    lp = torch.log_softmax(logits.double(), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1).clamp_min(0.0)


def fidelity(ref_logits: Tensor, logits: Tensor, mask: Optional[Tensor] = None) -> Dict[str, float]:
    """Top-1 next-token agreement and KL of ``logits`` against ``ref_logits``.

    ref_logits, logits: [..., V] (e.g. [B, n, V]); mask: [...] bool, positions to count
    (default all). Returns top1_agreement (fraction of positions whose argmax agrees),
    mean_kl and max_kl (nats) and positions (the count).
    """
    if ref_logits.shape != logits.shape:
        raise ConfigError(f"fidelity needs logits of the same shape, got {tuple(ref_logits.shape)} "
                          f"and {tuple(logits.shape)}; teacher-force the reference's tokens")
    if ref_logits.dim() < 1 or ref_logits.shape[-1] < 1:
        raise ConfigError("fidelity needs logits with a vocabulary dimension [..., V]")
    agree = (ref_logits.argmax(dim=-1) == logits.argmax(dim=-1))
    kl = kl_per_position(ref_logits, logits)
    if mask is not None:
        if mask.shape != agree.shape:
            raise ConfigError(f"fidelity mask shape {tuple(mask.shape)} != positions shape {tuple(agree.shape)}")
        agree, kl = agree[mask.bool()], kl[mask.bool()]
    n = int(agree.numel())
    if n == 0:
        return {"top1_agreement": float("nan"), "mean_kl": float("nan"), "max_kl": float("nan"), "positions": 0}
    return {"top1_agreement": float(agree.double().mean()), "mean_kl": float(kl.mean()),
            "max_kl": float(kl.max()), "positions": n}
