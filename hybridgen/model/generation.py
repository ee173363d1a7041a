"""One generation through a KV method: prefill, then decode steps, timed (:func:`generate`).

Shapes: input_ids [B, T] (left-padded, ``attention_mask`` [B, T]); the result's tokens [B, n]
and logits [B, n, V] float32. Timings synchronise CUDA at phase and step boundaries;
decode_s = sum(step_s). ``Engine.generate`` calls this function.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import torch
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.methods import KVMethod
from hybridgen.model.sampling import check_sampling, select_next

if TYPE_CHECKING:
    from hybridgen.model.engine import Engine


@dataclass
class GenerationResult:
    """Output of :meth:`Engine.generate`.

    tokens [B, n] new tokens; logits [B, n, V] float32 (logits[:, 0] from the prefill) or None;
    prefill_s / decode_s seconds; step_s seconds per decode step (n - 1 entries);
    bytes_by_tier / peak_bytes_by_tier from the store at the end of decoding (before release).
    """

    tokens: Tensor
    logits: Optional[Tensor]
    prefill_s: float
    decode_s: float
    step_s: List[float]
    method_stats: Dict[str, float]
    bytes_by_tier: Dict[str, int]
    store_description: Dict[str, Any]
    peak_bytes_by_tier: Dict[str, int]
    method: str = ""
    method_config: Dict[str, Any] = field(default_factory=dict)
    batch_size: int = 0
    prompt_len: int = 0

    @property
    def decode_ms_per_step(self) -> float:
        return 1e3 * self.decode_s / max(len(self.step_s), 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch_size * len(self.step_s) / self.decode_s if self.decode_s > 0 else float("nan")

    def summary(self) -> Dict[str, Any]:
        """Plain numbers for a result file."""
        return {"method": self.method, "batch_size": self.batch_size, "prompt_len": self.prompt_len,
                "new_tokens": int(self.tokens.shape[1]), "prefill_s": self.prefill_s, "decode_s": self.decode_s,
                "decode_ms_per_step": self.decode_ms_per_step, "decode_tokens_per_s": self.decode_tokens_per_s,
                "method_stats": dict(self.method_stats), "bytes_by_tier": dict(self.bytes_by_tier),
                "peak_bytes_by_tier": dict(self.peak_bytes_by_tier)}



@torch.no_grad()
def generate(engine: "Engine", input_ids: Tensor, method: Union[str, KVMethod] = "full", max_new_tokens: int = 32,
             attention_mask: Optional[Tensor] = None, store: Any = None, greedy: bool = True,
             temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, return_logits: bool = False,
             progress: bool = False, keep: bool = False, pool: Any = None,
             eos_token_id: Optional[int] = None, shared_prefill: Any = None) -> GenerationResult:
    """Prefill + (max_new_tokens - 1) decode steps through ``method``.

    shared_prefill: a dense prefill of these inputs recorded once
    (:func:`hybridgen.model.shared_prefill.record_prefill`); the method starts from it instead of
    a prefill of its own (same tokens and logits; ``prefill_s`` is then the method's own part).

    keep: leave the method bound (KV held) after returning; call ``engine.release()`` later.
    eos_token_id: when given, a row that produced it keeps producing it and generation stops
    once every row has; by default exactly ``max_new_tokens`` tokens are generated.
    """
    check_sampling(greedy, temperature, top_p)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    method = engine._method(method)
    gen = None
    if not greedy:
        gen = torch.Generator(device=engine.device)
        gen.manual_seed(seed)
    pick = lambda lg: select_next(lg, greedy, temperature, top_p, gen)  # noqa: E731
    tokens: List[Tensor] = []
    logits_out: List[Tensor] = []
    step_s: List[float] = []
    try:
        engine._sync()
        t0 = time.perf_counter()
        logits = engine.prefill(input_ids, attention_mask, method, store, max_new_tokens, pool, shared_prefill)
        tok = pick(logits)
        engine._sync()
        prefill_s = time.perf_counter() - t0
        run = engine._run
        finished = None if eos_token_id is None else tok == eos_token_id
        tokens.append(tok)
        if return_logits:
            logits_out.append(logits)
        steps = range(max_new_tokens - 1)
        if progress:  # asked for: shown unless the verbosity hides bars (hybridgen/log.py)
            from hybridgen.log import bar
            steps = bar(steps, desc=f"decode [{method.name}]", unit="tok", explicit=True)
        for _ in steps:
            if finished is not None and bool(finished.all()):
                break
            t = time.perf_counter()
            logits = engine.decode_step(tok, method)
            tok = pick(logits)
            if finished is not None:
                tok = torch.where(finished, torch.full_like(tok, eos_token_id), tok)
                finished = finished | (tok == eos_token_id)
            engine._sync()
            step_s.append(time.perf_counter() - t)
            tokens.append(tok)
            if return_logits:
                logits_out.append(logits)
        result = GenerationResult(
            tokens=torch.stack(tokens, 1), logits=torch.stack(logits_out, 1) if return_logits else None,
            prefill_s=prefill_s, decode_s=float(sum(step_s)), step_s=step_s,
            method_stats=dict(method.stats), bytes_by_tier=run.store.bytes_by_tier(),
            store_description=run.store.describe(), peak_bytes_by_tier=run.store.peak_by_tier(),
            method=method.name, method_config=method.config(), batch_size=int(tokens[0].shape[0]),
            prompt_len=int(input_ids.shape[-1]))
    finally:
        if not keep:
            method.release()
            engine._run = None
            engine.current_positions = None
    return result
