"""The transformers backend's engine: any ``AutoModelForCausalLM`` with pluggable KV methods,
driven like the lean engine (:class:`hybridgen.model.engine.Engine`), so the same
:func:`hybridgen.model.generation.generate`, the same methods, tier ledger and metrics apply.

Flow of one generation:

    prefill   the model's forward over the prompt with a :func:`~hybridgen.hf.attention.method_cache`;
              at each globally attending layer the ``"hybridgen"`` attention implementation
              runs transformers' dense sdpa attention, then ``method.prefill(j, q, k, v, valid)``
              (q/k/v post-rotary, and post q/k-norm where the model has one).
    decode    per step, the model's forward over one token per row: a forward pre-hook on every
              globally attending decoder layer calls ``method.on_layer_input(j, hidden)``, and the
              layer's attention is ``method.decode(j, q, k, v)``.

A method's layer j is the model's j-th globally attending layer (``ModelView.method_layers``);
sliding-window layers keep transformers' sliding cache and attention. Ragged batches are
left-padded; positions are cumsum(mask) - 1 as in the lean engine and transformers' generate.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Union

import torch
from torch import Tensor

from hybridgen.errors import ConfigError
from hybridgen.hf.attention import ATTN_IMPLEMENTATION, DECODE, BackendRun, method_cache
from hybridgen.hf.model_view import ModelView
from hybridgen.methods import KVMethod, MethodContext
from hybridgen.model.engine import Engine
from hybridgen.model.text_io import TextIO


@dataclass
class HFModelSpec:
    """The architecture facts the harness reads from an engine's ``spec`` (run records, prompt
    building, byte counts), for a transformers model. num_layers counts every decoder layer;
    method_layers lists the globally attending ones."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    method_layers: List[int] = field(default_factory=list)
    sliding_window: Optional[int] = None
    params: int = 0
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    name: str = ""
    backend: str = "transformers"
    provenance: Optional[Dict[str, Any]] = None  # the prepared checkpoint's hybridgen_provenance.json

    def param_count(self) -> int:
        return self.params

    def kv_bytes_per_token(self, bytes_per_elem: int = 2) -> int:
        """KV bytes per token over the globally attending layers (those a method holds)."""
        return 2 * len(self.method_layers) * self.num_kv_heads * self.head_dim * bytes_per_elem

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _first_id(value: Any) -> Optional[int]:
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def spec_of_config(config, name: str, params: int = 0) -> HFModelSpec:
    """The spec of a transformers (text) config, without building the model."""
    from hybridgen.hf.model_view import global_layers

    c = config.get_text_config(decoder=True)
    heads = int(c.num_attention_heads)
    return HFModelSpec(
        family=str(getattr(c, "model_type", "")), vocab_size=int(c.vocab_size), hidden_size=int(c.hidden_size),
        num_layers=int(c.num_hidden_layers), num_heads=heads,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        max_positions=int(getattr(c, "max_position_embeddings", None) or 2 ** 31 - 1),
        method_layers=global_layers(c), sliding_window=getattr(c, "sliding_window", None), params=params,
        bos_token_id=_first_id(getattr(c, "bos_token_id", None)), eos_token_id=_first_id(getattr(c, "eos_token_id", None)),
        pad_token_id=_first_id(getattr(c, "pad_token_id", None)), name=name)


class _Recorder:
    """Stands in for a method during a recorded dense prefill: keeps each method layer's q/k/v."""

    def __init__(self):
        self.layers: List[tuple] = []

    def prefill(self, layer: int, q: Tensor, k: Tensor, v: Tensor, valid: Optional[Tensor]) -> None:
        if layer != len(self.layers):
            raise RuntimeError(f"method layer {layer} recorded out of order (expected {len(self.layers)})")
        self.layers.append((q, k, v))


class HFEngine(TextIO):
    """A transformers causal LM with pluggable per-layer KV methods (the lean Engine's interface).

    model: an ``AutoModelForCausalLM`` (switched to the ``"hybridgen"`` attention implementation,
    which without a bound method is transformers' sdpa); tokenizer: an HF tokenizer or None.
    """

    # the input checks and the generation loop are the lean engine's, unchanged (text: TextIO):
    # they read only ``spec``, ``device``, ``name``, ``tokenizer`` and the methods below
    _prepare = Engine._prepare
    _method = Engine._method
    _decode_input = Engine._decode_input
    _checked = Engine._checked
    _sync = Engine._sync
    generate = Engine.generate

    def __init__(self, model: torch.nn.Module, tokenizer: Any = None, name: str = ""):
        self.name = name or getattr(model.config, "name_or_path", "") or type(model).__name__
        model.eval()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.view = ModelView(model, self.name)
        self.spec = spec_of_config(model.config, self.name, sum(p.numel() for p in model.parameters()))
        self.tokenizer = tokenizer
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.rotary = self.view.rotary
        self.current_positions: Optional[Tensor] = None
        self._run: Optional[BackendRun] = None
        self._hooks = [self.view.decoder_layers[i].register_forward_pre_hook(self._layer_input_hook(j),
                                                                             with_kwargs=True)
                       for j, i in enumerate(self.view.method_layers)]

    def __repr__(self) -> str:
        s = self.spec
        return (f"HFEngine({self.name!r}, {s.family}, layers={s.num_layers} ({len(s.method_layers)} global), "
                f"hidden={s.hidden_size}, heads={s.num_heads}/{s.num_kv_heads}, dtype={self.dtype}, "
                f"device={self.device})")

    # ------------------------------------------------------------------ what methods read
    def stand_in_query(self, layer: int, hidden: Tensor, positions: Tensor) -> Tensor:
        """Method layer ``layer``'s query [B, Hq, T, D] from ``hidden`` [B, T, h] at ``positions`` [B, T]."""
        return self.view.stand_in_query(layer, hidden, positions)

    def attention_weights(self, layer: int):
        """Method layer ``layer``'s q/k/v/o projections (:meth:`ModelView.attention_weights`)."""
        return self.view.attention_weights(layer)

    def _layer_input_hook(self, j: int):
        def hook(module, args, kwargs):
            run = self._run
            if run is not None and run.phase == DECODE:
                hidden = args[0] if args else kwargs["hidden_states"]
                run.method.on_layer_input(j, hidden)
        return hook

    # ------------------------------------------------------------------ passes
    def _forward(self, ids: Tensor, mask: Optional[Tensor], positions: Tensor, cache=None,
                 run: Optional[BackendRun] = None, last_only: bool = False) -> Tensor:
        kw = {} if run is None else {"hybridgen": run}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                         use_cache=cache is not None, logits_to_keep=1 if last_only else 0, **kw)
        return out.logits.float()

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """Dense reference pass (no KV method, transformers' sdpa): logits [B, T, V] float32."""
        ids, valid, positions = self._prepare(input_ids, attention_mask, 0)
        return self._forward(ids, None if valid is None else valid.long(), positions)

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                method: Union[str, KVMethod] = "full", store: Any = None, max_new_tokens: int = 1,
                pool: Any = None, shared_prefill: Any = None) -> Tensor:
        """Run the prompt, bind ``method`` and hand it every global layer's KV. Returns last-position logits [B, V].

        shared_prefill: a :class:`~hybridgen.model.shared_prefill.SharedPrefill` of these inputs
        (:meth:`record_dense_prefill`): the method takes its recorded q/k/v and the sliding-window
        layers start from a copy of its cache, instead of a new dense pass.
        """
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
        ids, valid, positions = self._prepare(input_ids, attention_mask, max_new_tokens)
        if shared_prefill is not None:
            shared_prefill.check_matches(self, ids, valid, max_new_tokens)
        method = self._method(method)
        self.release()
        if store is None:
            from hybridgen.kv import TieredStore
            store = TieredStore(gpu_device=self.device)
        if store["gpu"].device.type != self.device.type:
            raise ConfigError(f"the engine runs on {self.device} but the store's gpu tier is on "
                              f"{store['gpu'].device}; load the model with device='{store['gpu'].device.type}'")
        v = self.view
        B, T = ids.shape
        method.bind(MethodContext(
            num_layers=len(v.method_layers), num_heads=v.num_heads, num_kv_heads=v.num_kv_heads,
            head_dim=v.head_dim, scale=v.scale, batch_size=B, prompt_len=T, max_new_tokens=max_new_tokens,
            dtype=self.dtype, compute_device=self.device, store=store, pool=pool, rotary=self.rotary, engine=self))
        mask = None if valid is None else valid.long()
        run = BackendRun(method=method, method_layer={i: j for j, i in enumerate(v.method_layers)}, valid=valid,
                         store=store, attention_mask=mask, next_pos=positions[:, -1] + 1, steps_left=max_new_tokens,
                         cache=method_cache(self.model.config, v.method_layers) if shared_prefill is None
                         else copy.deepcopy(shared_prefill.model_cache))
        try:
            if shared_prefill is None:
                logits = self._forward(ids, mask, positions, run.cache, run, last_only=True)
            else:
                for j, layer in enumerate(shared_prefill.layers):
                    method.prefill(j, *layer, valid)
                logits = shared_prefill.logits[:, None].clone()
        except BaseException:
            method.release()
            raise
        run.phase = DECODE
        self._run = run
        return self._checked(logits[:, -1])

    @torch.no_grad()
    def record_dense_prefill(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                             max_new_tokens: int = 1):
        """The dense prefill of ``input_ids`` [B, T] recorded once (use
        :func:`hybridgen.model.shared_prefill.record_prefill`): every globally attending layer's
        q/k/v as the attention function hands them to a method, the cache after the pass (the
        sliding-window layers' KV) and the last-position logits."""
        from hybridgen.model.shared_prefill import SharedPrefill

        ids, valid, positions = self._prepare(input_ids, attention_mask, max_new_tokens)
        self.release()
        v = self.view
        recorder = _Recorder()
        mask = None if valid is None else valid.long()
        run = BackendRun(method=recorder, method_layer={i: j for j, i in enumerate(v.method_layers)}, valid=valid,
                         cache=method_cache(self.model.config, v.method_layers))
        logits = self._checked(self._forward(ids, mask, positions, run.cache, run, last_only=True)[:, -1])
        return SharedPrefill(ids=ids, valid=valid, positions=positions, layers=recorder.layers, logits=logits,
                             max_new_tokens=max_new_tokens, engine_id=id(self), model_cache=run.cache)

    @torch.no_grad()
    def decode_step(self, tokens: Tensor, method: Optional[KVMethod] = None) -> Tensor:
        """Feed one token per sequence (tokens [B] or [B, 1]) through every layer; returns logits [B, V]."""
        run, ids = self._decode_input(tokens, method)
        pos = run.next_pos[:, None]
        self.current_positions = pos
        if run.attention_mask is not None:
            run.attention_mask = torch.cat([run.attention_mask, torch.ones_like(ids)], 1)
        logits = self._forward(ids, run.attention_mask, pos, run.cache, run)
        run.method.end_step()
        run.next_pos = run.next_pos + 1
        run.steps_left -= 1
        return self._checked(logits[:, -1])

    def release(self) -> None:
        """Free the bound method's KV (after a generate(..., keep=True) or a manual prefill)."""
        if self._run is not None:
            self._run.method.release()
            self._run = None
        self.current_positions = None
