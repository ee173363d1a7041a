"""The decoder engine: one forward for OPT, Llama (GQA, Llama-3 RoPE) and Qwen2, whose attention
at every layer goes through a KV method, so the same code yields speed and accuracy numbers.

Flow of one generation (``generate``):

    prefill   dense causal attention (SDPA) over the prompt at every layer, then
              method.prefill(layer, q, k, v, valid) hands the prompt's KV to the method;
              logits of the last prompt position pick the first new token.
    decode    per step and layer: method.on_layer_input(layer, hidden), q/k/v projections,
              rotary at each sequence's position, out = method.decode(layer, q, k, v).

Ragged batches are left-padded; positions come from the attention mask as transformers
computes them (cumsum - 1), so a padded row gives the same logits as the row alone.

Choices:
- ``max_new_tokens`` = n gives n new tokens: the first from the prefill logits, then n - 1
  decode steps (the last token is not fed back), as transformers' generate does.
- Timings synchronise CUDA at phase and step boundaries; decode_s = sum(step_s).
- Sampling draws from one torch.Generator on the engine's device seeded with ``seed``.
- Logits are returned in float32 whatever the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.methods import KVMethod, MethodContext, build_method
from hybridgen.model import ops
from hybridgen.model.generation import GenerationResult, generate
from hybridgen.model.rotary import RotaryEmbedding
from hybridgen.model.spec import ModelSpec
from hybridgen.model.text_io import TextIO
from hybridgen.model.weights import LayerWeights, ModelWeights

#: prompts of at least this many tokens (batch x length) get a per-layer prefill progress bar
PREFILL_BAR_TOKENS = 2048


@dataclass
class AttnWeights:
    """One layer's attention projections, [out, in] like nn.Linear (views of the fused weights).

    wq [Hq*D, h], wk/wv [Hkv*D, h], wo [h, Hq*D]; biases [out] or None.
    """

    wq: Tensor
    bq: Optional[Tensor]
    wk: Tensor
    bk: Optional[Tensor]
    wv: Tensor
    bv: Optional[Tensor]
    wo: Tensor
    bo: Optional[Tensor]


@dataclass
class _Run:
    """State between prefill and decode steps."""

    method: KVMethod
    store: Any
    next_pos: Tensor        # [B] position of the next token to decode
    steps_left: int


class Engine(TextIO):
    """A decoder-only model with pluggable per-layer KV methods.

    spec: the architecture; weights: :class:`ModelWeights` on ``device`` in ``dtype``;
    tokenizer: an HF tokenizer or None.
    """

    def __init__(self, spec: ModelSpec, weights: ModelWeights, tokenizer: Any = None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu", name: str = ""):
        self.spec = spec
        self.weights = weights
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.name = name or spec.name
        self.rotary: Optional[RotaryEmbedding] = None
        if spec.uses_rotary:
            self.rotary = RotaryEmbedding(spec.head_dim, spec.rope_theta, spec.rope_type, spec.rope_params,
                                          device=self.device)
        self.current_positions: Optional[Tensor] = None
        self.attn_chunk = 4096   # prefill queries per SDPA call (bounds the mask's memory)
        self.mlp_chunk = 8192    # prefill tokens per MLP call (bounds the intermediate's memory)
        self._run: Optional[_Run] = None
        hq, hkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self._qkv_split = (hq, hkv, hkv)

    def __repr__(self) -> str:
        s = self.spec
        return (f"Engine({self.name!r}, {s.family}, layers={s.num_layers}, hidden={s.hidden_size}, "
                f"heads={s.num_heads}/{s.num_kv_heads}, dtype={self.dtype}, device={self.device})")

    # ------------------------------------------------------------------ weights access
    def attention_weights(self, layer: int) -> AttnWeights:
        lw = self.weights.layers[layer]
        wq, wk, wv = lw.qkv.split(self._qkv_split, 0)
        bq = bk = bv = None
        if lw.qkv_b is not None:
            bq, bk, bv = lw.qkv_b.split(self._qkv_split, 0)
        return AttnWeights(wq, bq, wk, bk, wv, bv, lw.o, lw.o_b)

    def stand_in_query(self, layer: int, hidden: Tensor, positions: Tensor) -> Tensor:
        """Query of ``layer`` computed from ``hidden`` [B, T, h] at ``positions`` [B, T]: [B, Hq, T, D].

        Applies the layer's attention-input norm (pre-norm models), q projection (+ bias) and rotary.
        """
        s = self.spec
        lw = self.weights.layers[layer]
        x = self._norm_attn(lw, hidden) if s.pre_norm else hidden
        hq = self._qkv_split[0]
        q = F.linear(x, lw.qkv[:hq], None if lw.qkv_b is None else lw.qkv_b[:hq])
        B, T = hidden.shape[:2]
        q = q.view(B, T, s.num_heads, s.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q = self.rotary.rotate(q, positions)
        return q.contiguous()

    # ------------------------------------------------------------------ building blocks
    def _norm_attn(self, lw: LayerWeights, h: Tensor) -> Tensor:
        return ops.norm(self.spec.norm, h, lw.attn_norm, lw.attn_norm_b, self.spec.norm_eps)

    def _norm_mlp(self, lw: LayerWeights, h: Tensor) -> Tensor:
        return ops.norm(self.spec.norm, h, lw.mlp_norm, lw.mlp_norm_b, self.spec.norm_eps)

    def _embed(self, ids: Tensor, positions: Tensor) -> Tensor:
        """ids, positions [B, T] -> hidden [B, T, h]."""
        w, s = self.weights, self.spec
        x = F.embedding(ids, w.embed)
        if w.project_in is not None:
            x = F.linear(x, w.project_in)
        if s.learned_positions:
            x = x + F.embedding(positions + s.position_offset, w.pos_embed)
        return x

    def _qkv(self, lw: LayerWeights, x: Tensor, cos_sin: Optional[Tuple[Tensor, Tensor]]):
        """x [B, T, h] -> q [B, Hq, T, D], k, v [B, Hkv, T, D] (contiguous, rotary applied)."""
        s = self.spec
        B, T = x.shape[:2]
        q, k, v = F.linear(x, lw.qkv, lw.qkv_b).split(self._qkv_split, -1)
        q = q.view(B, T, s.num_heads, s.head_dim).transpose(1, 2)
        k = k.view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(B, T, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if cos_sin is not None:
            q = RotaryEmbedding.apply(q, *cos_sin)
            k = RotaryEmbedding.apply(k, *cos_sin)
        return q.contiguous(), k.contiguous(), v.contiguous()

    def _layer(self, i: int, h: Tensor, cos_sin, attend) -> Tensor:
        """One decoder layer on hidden [B, T, h]; ``attend(i, q, k, v) -> [B, Hq, T, D]``."""
        s = self.spec
        lw = self.weights.layers[i]
        B, T = h.shape[:2]
        x = self._norm_attn(lw, h) if s.pre_norm else h
        q, k, v = self._qkv(lw, x, cos_sin)
        a = attend(i, q, k, v)
        h = h + F.linear(a.transpose(1, 2).reshape(B, T, s.num_heads * s.head_dim), lw.o, lw.o_b)
        if not s.pre_norm:
            h = self._norm_attn(lw, h)
        if T <= self.mlp_chunk:
            return self._mlp_block(lw, h)
        # position-wise, so chunking over tokens is exact; bounds the [B, T, 2I] intermediate
        return torch.cat([self._mlp_block(lw, h[:, t:t + self.mlp_chunk]) for t in range(0, T, self.mlp_chunk)], 1)

    def _mlp_block(self, lw: LayerWeights, h: Tensor) -> Tensor:
        s = self.spec
        x = self._norm_mlp(lw, h) if s.pre_norm else h
        h = h + ops.mlp(x, lw.w_in, lw.b_in, lw.w_out, lw.b_out, s.activation, s.gated_mlp)
        if not s.pre_norm:
            h = self._norm_mlp(lw, h)
        return h

    def _logits(self, h: Tensor) -> Tensor:
        """hidden [..., h] -> float32 logits [..., V]."""
        w, s = self.weights, self.spec
        if w.final_norm is not None:
            h = ops.norm(s.norm, h, w.final_norm, w.final_norm_b, s.norm_eps)
        if w.project_out is not None:
            h = F.linear(h, w.project_out)
        return F.linear(h, w.lm_head).float()

    def _checked(self, logits: Tensor) -> Tensor:
        """``logits`` [B, V] unchanged, or a one-line NumericalError when any is NaN or inf (argmax over
        NaN logits silently picks token 0; such a run must stop, not be recorded)."""
        if not bool(torch.isfinite(logits).all()):
            from hybridgen.errors import NumericalError

            rows = (~torch.isfinite(logits).all(-1)).nonzero().flatten().tolist()
            raise NumericalError(f"{self.name}: non-finite logits (NaN or inf) in batch row(s) {rows[:4]}; the "
                                 "weights or the KV method produced them (check the checkpoint, try "
                                 "dtype=float32, or report the method)")
        return logits

    def _cos_sin(self, positions: Tensor):
        return None if self.rotary is None else self.rotary.cos_sin(positions)

    def _dense(self, ids: Tensor, positions: Tensor, attend, layers=None) -> Tensor:
        """The dense pass over ids / positions [B, T]: hidden [B, T, h] after every layer, each
        attending through ``attend(i, q, k, v)``; ``layers``: the layer indices to iterate (e.g. a
        progress bar over them; default all)."""
        h = self._embed(ids, positions)
        cs = self._cos_sin(positions)
        for i in range(self.spec.num_layers) if layers is None else layers:
            h = self._layer(i, h, cs, attend)
        return h

    # ------------------------------------------------------------------ input checks
    def _prepare(self, input_ids: Tensor, attention_mask: Optional[Tensor],
                 extra_positions: int) -> Tuple[Tensor, Optional[Tensor], Tensor]:
        """Validate inputs; returns (ids [B, T], valid [B, T] bool or None when unpadded, positions [B, T])."""
        s = self.spec
        if not isinstance(input_ids, Tensor):
            raise ConfigError("input_ids must be a LongTensor [batch, tokens]; use engine.encode(texts) for text")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.shape[0] == 0:
            raise ConfigError(f"input_ids must be a non-empty [batch, tokens] tensor, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ConfigError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        ids = input_ids.to(self.device, torch.long)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= s.vocab_size:
            raise ConfigError(f"token id {hi if hi >= s.vocab_size else lo} is outside the vocabulary "
                              f"[0, {s.vocab_size}); tokenize with this model's tokenizer")
        B, T = ids.shape
        if T + extra_positions > s.max_positions:
            raise ConfigError(f"prompt of {T} tokens + {extra_positions} new tokens exceeds {self.name}'s "
                              f"{s.max_positions} positions; shorten the prompt or lower max_new_tokens")
        valid = None
        if attention_mask is not None:
            if tuple(attention_mask.shape) != (B, T):
                raise ConfigError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {(B, T)}")
            m = attention_mask.to(self.device).bool()
            empty = (~m.any(-1)).nonzero().flatten().tolist()
            if empty:
                raise ConfigError(f"row {empty[0]} of the batch has no tokens (its attention_mask is all zeros); "
                                  "drop empty prompts from the batch")
            if not bool(m[:, -1].all()) or not bool((m[:, 1:] >= m[:, :-1]).all()):
                raise ConfigError("attention_mask must be left-padded (zeros first, then ones, every row "
                                  "ending in a real token); engine.encode pads on the left")
            if not bool(m.all()):
                valid = m
        if valid is None:
            positions = torch.arange(T, device=self.device).expand(B, T)
        else:
            positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        return ids, valid, positions

    def _method(self, method: Union[str, KVMethod]) -> KVMethod:
        if isinstance(method, str):
            return build_method(method)
        if not isinstance(method, KVMethod):
            raise ConfigError(f"method must be a KVMethod or a registered name, got {type(method).__name__}")
        return method

    # ------------------------------------------------------------------ public passes
    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """Dense reference pass (no KV method): logits [B, T, V] float32."""
        ids, valid, positions = self._prepare(input_ids, attention_mask, 0)
        scale = self.spec.scale
        attend = lambda i, q, k, v: ops.causal_attention(q, k, v, scale, valid, self.attn_chunk)  # noqa: E731
        return self._logits(self._dense(ids, positions, attend))

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                method: Union[str, KVMethod] = "full", store: Any = None, max_new_tokens: int = 1,
                pool: Any = None, shared_prefill: Any = None) -> Tensor:
        """Run the prompt, bind ``method`` and hand it every layer's KV. Returns last-position logits [B, V].

        max_new_tokens: decode steps that may follow (methods reserve room; positions are checked).
        store: a TieredStore (a fresh unlimited one when None). pool: CPU attention pool for methods.
        shared_prefill: a :class:`~hybridgen.model.shared_prefill.SharedPrefill` of these inputs: the
        method takes its recorded q/k/v instead of a new dense pass (same tensors, same logits).
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        ids, valid, positions = self._prepare(input_ids, attention_mask, max_new_tokens)
        if shared_prefill is not None:
            shared_prefill.check_matches(self, ids, valid, max_new_tokens)
        method = self._method(method)
        self.release()  # a run left bound (keep=True) frees its KV before the next one starts
        if store is None:
            from hybridgen.kv import TieredStore
            store = TieredStore(gpu_device=self.device)
        if store["gpu"].device.type != self.device.type:
            raise ConfigError(f"the engine runs on {self.device} but the store's gpu tier is on "
                              f"{store['gpu'].device}; load the model with device='{store['gpu'].device.type}'")
        s = self.spec
        B, T = ids.shape
        method.bind(MethodContext(
            num_layers=s.num_layers, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            scale=s.scale, batch_size=B, prompt_len=T, max_new_tokens=max_new_tokens, dtype=self.dtype,
            compute_device=self.device, store=store, pool=pool, rotary=self.rotary, engine=self))

        def attend(i, q, k, v):
            out = ops.causal_attention(q, k, v, s.scale, valid, self.attn_chunk)
            method.prefill(i, q, k, v, valid)
            return out

        from hybridgen.log import bar

        try:  # a per-layer bar on long prompts (hidden unless hybridgen.log is at info; see hybridgen/log.py)
            layers = bar(range(s.num_layers), desc=f"prefill [{method.name}] {B}x{T} tok", unit="layer",
                         disable=None if B * T >= PREFILL_BAR_TOKENS else True, leave=False)
            if shared_prefill is None:
                logits = self._checked(self._logits(self._dense(ids, positions, attend, layers)[:, -1]))
            else:
                for i in layers:
                    method.prefill(i, *shared_prefill.layers[i], valid)
                logits = shared_prefill.logits.clone()
        except BaseException:
            method.release()  # e.g. a CapacityError at some layer: free what earlier layers took
            raise
        self._run = _Run(method=method, store=store, next_pos=positions[:, -1] + 1, steps_left=max_new_tokens)
        return logits

    def _decode_input(self, tokens: Tensor, method: Optional[KVMethod]) -> Tuple[Any, Tensor]:
        """The run a decode step continues and its token ids [B, 1]; one line for a step out of order."""
        run = self._run
        if run is None:
            raise ConfigError("decode_step needs a prefill first (engine.prefill(...))")
        if method is not None and method is not run.method:
            raise ConfigError("decode_step got a different method than the one bound at prefill")
        if run.steps_left <= 0:
            raise ConfigError("more decode steps than max_new_tokens given at prefill; raise max_new_tokens")
        ids = tokens.reshape(-1, 1).to(self.device, torch.long)
        if ids.shape[0] != run.next_pos.shape[0]:
            raise ConfigError(f"decode_step got {ids.shape[0]} tokens for a batch of {run.next_pos.shape[0]}")
        return run, ids

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, method: Optional[KVMethod] = None) -> Tensor:
        """Feed one token per sequence (tokens [B] or [B, 1]) through every layer; returns logits [B, V]."""
        run, ids = self._decode_input(tokens, method)
        method = run.method
        pos = run.next_pos[:, None]
        self.current_positions = pos
        h = self._embed(ids, pos)
        cs = self._cos_sin(pos)
        for i in range(self.spec.num_layers):
            method.on_layer_input(i, h)
            h = self._layer(i, h, cs, method.decode)
        method.end_step()
        run.next_pos = run.next_pos + 1
        run.steps_left -= 1
        return self._checked(self._logits(h[:, -1]))

    def release(self) -> None:
        """Free the bound method's KV (after a generate(..., keep=True) or a manual prefill)."""
        if self._run is not None:
            self._run.method.release()
            self._run = None
        self.current_positions = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def generate(self, input_ids: Tensor, method: Union[str, KVMethod] = "full", max_new_tokens: int = 32,
                 attention_mask: Optional[Tensor] = None, store: Any = None, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, return_logits: bool = False,
                 progress: bool = False, keep: bool = False, pool: Any = None,
                 eos_token_id: Optional[int] = None, shared_prefill: Any = None) -> "GenerationResult":
        """Prefill + (max_new_tokens - 1) decode steps through ``method``: see
        :func:`hybridgen.model.generation.generate` (the same arguments)."""
        return generate(self, input_ids, method, max_new_tokens, attention_mask=attention_mask, store=store,
                        greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
                        return_logits=return_logits, progress=progress, keep=keep, pool=pool,
                        eos_token_id=eos_token_id, shared_prefill=shared_prefill)
