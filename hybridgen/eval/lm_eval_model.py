"""lm-eval model ``hybridgen``: our engine + any registered KV method.

    from hybridgen.eval import lm_eval_model   # registers the model with lm-eval
    lm_eval.simple_evaluate(model="hybridgen", model_args="model=smollm2-135m,method=h2o,budget=0.2", ...)

or from a shell (lm-eval 0.4.13 does not discover plugins through entry points, so the
wrapper imports this module first and adds our local task directory to the include path):

    python -m hybridgen.eval.lm_eval_cli --model hybridgen --model_args method=h2o,budget=0.2 \\
        --tasks hg_bigbench_social_iqa --limit 200

model_args: ``model`` (shipped name or HF dir), ``weights``, ``dtype``, ``num_layers``,
``seed``, ``method`` and every parameter of that method (``budget=0.2``, ``sinks=4``...),
``score_mode`` ('decode' | 'prefill'), ``max_length``, ``rolling_prefill``, ``fidelity``,
``max_gen_toks``, ``add_bos``, ``batch_size`` (requests scored together; default 16).
Booleans accept true/false/1/0/yes/no (strings from Python too: ``"false"`` is False).

Tokenization follows lm-eval's HF backend (``--model hf``) so that ``method=full`` scores
every item as it does: ``add_bos`` unset (default) encodes with the tokenizer's own special
tokens (a BOS only where the tokenizer adds one, e.g. Llama's, not SmolLM2's; none when the
text already starts with it), an empty context is the prefix token (BOS, else EOS) alone,
and trailing context spaces move to the continuation. ``add_bos=true`` puts the prefix token
before every context, ``add_bos=false`` never adds special tokens.

How a KV method acts on scores (the honest way; documented choice):
- ``loglikelihood`` (score_mode='decode', default): the context except its last token is
  prefilled through the method (which compresses/places it); then the last context token and
  the continuation tokens are fed one decode step at a time (teacher forcing through
  ``method.decode``), so EVERY continuation token, even a one-token answer, is predicted by
  a decode step over the method's KV. In 'prefill' mode context+continuation go through one dense pass, and
  no KV method can change the score (useful as a check only).
- ``loglikelihood_rolling``: each window of at most ``max_length`` tokens is split; its first
  ``rolling_prefill`` share is prefilled (those tokens are scored by the dense pass, identical
  for every method), the rest is scored by teacher-forced decode steps through the method.
- ``generate_until``: prefill the context through the method, then greedy decode.
- A context of ONE token (an empty context becomes the prefix token) has nothing to
  prefill before its last token, so that row's first continuation token is predicted by
  the prefill pass over the one token (identical for every method: one token cannot be
  compressed) and every further continuation token by decode steps through the method.
  Such rows are scored apart from the rest of their batch (counted in
  ``requests_scored['one_token_context']``); no row is ever scored densely behind the
  method's back.
- Budgets resolve against the prefilled length (context - 1 tokens). Requests are batched
  longest-context first and left-padded to the batch's longest context (choice: batching makes
  CPU scoring ~5x faster; a padded row's budget then resolves against the padded length, which
  sorting keeps close to its own).

Each distinct context of a batch is prefilled densely ONCE (the choices of a multiple-choice item
share theirs) and every row holding it starts from that record
(:mod:`hybridgen.eval.forced_scoring`; the same scores as a prefill per row).

Fidelity (``fidelity=true``): every decode-scored token's distribution is compared with the
dense pass over the same tokens (= ``full``): top-1 agreement and KL(full || method),
accumulated over tokens; read it from :attr:`HybridGenLM.fidelity_summary`. lm-eval calls
:meth:`HybridGenLM.get_model_info` after the evaluation: the method, its parameters and the
fidelity summary go into the results' ``config`` (so into lm-eval's results JSON), and the
same record is appended to :data:`REPORTS`, which ``hybridgen-lm-eval`` prints after the
results table.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from hybridgen.errors import ConfigError
from hybridgen.eval.lm_eval_args import check_model_args

#: one record per finished evaluation in this process (see module docstring, fidelity)
REPORTS: List[Dict[str, Any]] = []


@register_model("hybridgen")
class HybridGenLM(LM):
    """An lm-eval LM over :class:`hybridgen.model.Engine` with a KV method (see module docstring)."""

    def __init__(self, model: str = "smollm2-135m", weights: str = "real", dtype: str = "float32",
                 num_layers: Optional[int] = None, seed: int = 0, method: str = "full", score_mode: str = "decode",
                 max_length: Optional[int] = None, rolling_prefill: float = 0.5, fidelity: bool = False,
                 max_gen_toks: int = 32, add_bos: Optional[bool] = None, batch_size: Any = 16, engine: Any = None,
                 progress: bool = True, pretrained: Optional[str] = None, **kwargs: Any):
        super().__init__()
        # lm-eval passes these to every model; its 'device' is "cuda:0" even when --device is not given,
        # so the engine takes only an explicit one: engine_device (the wrapper sets it from --device)
        device = kwargs.pop("engine_device", None)
        for k in ("max_batch_size", "device", "trust_remote_code", "tokenizer"):
            kwargs.pop(k, None)
        args = check_model_args(method=method, score_mode=score_mode, rolling_prefill=rolling_prefill,
                                fidelity=fidelity, add_bos=add_bos, progress=progress, max_gen_toks=max_gen_toks,
                                max_length=max_length, **kwargs)
        self.method_name = args["method"]
        self.method_params = dict(args["method_params"])
        if engine is None:
            from hybridgen.model import load_model

            engine = load_model(pretrained or model, weights=weights, dtype=dtype, seed=int(seed),
                                num_layers=num_layers, device=device)
        self.engine = engine
        self.tok = engine.tokenizer
        if self.tok is None:
            raise ConfigError(f"model {model!r} has no tokenizer; lm-eval tasks need text (use a model with one)")
        self.score_mode = args["score_mode"]
        self.max_length = int(args["max_length"] or engine.spec.max_positions)
        self.rolling_prefill = args["rolling_prefill"]
        self.fidelity = args["fidelity"]
        self.max_gen_toks = int(args["max_gen_toks"])
        self.add_bos: Optional[bool] = args["add_bos"]   # None: as lm-eval's HF backend (the tokenizer's default)
        self.batch = max(1, int(batch_size)) if str(batch_size).isdigit() else 16
        self.progress = args["progress"]
        self._fid = {"tokens": 0, "top1": 0.0, "kl": 0.0, "max_kl": 0.0}
        self.requests_scored = {"loglikelihood": 0, "loglikelihood_rolling": 0, "generate_until": 0,
                                "one_token_context": 0}
        # one dense prefill per distinct context of a batch (hybridgen.eval.forced_scoring); False: a
        # prefill per row (the same scores, for comparisons)
        self.share_prefill = True

    # ------------------------------------------------------------------ helpers
    def new_method(self):
        from hybridgen.methods import build_method

        return build_method(self.method_name, **dict(self.method_params))

    @property
    def prefix_id(self) -> int:
        for tid in (getattr(self.tok, "bos_token_id", None), getattr(self.tok, "eos_token_id", None),
                    self.engine.spec.bos_token_id, self.engine.spec.eos_token_id):
            if tid is not None:
                return int(tid)
        return 0

    def tok_encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without any special token."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> List[int]:
        """Token ids of a context as lm-eval's HF backend makes them (see module docstring, add_bos)."""
        if self.add_bos is None:
            bos = self.tok.decode([self.prefix_id])
            special = not (bos and text.startswith(bos))  # HF: no second BOS before a text starting with one
            return list(self.tok(text, add_special_tokens=special)["input_ids"])
        ids = self.tok_encode(text)
        return [self.prefix_id] + ids if self.add_bos else ids

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """Context ids and continuation ids, split as lm-eval's HF backend does (``LM.loglikelihood``)."""
        if context == "":
            cont = self.tok_encode(continuation)
            if cont and cont[0] == self.prefix_id:  # HF: the continuation's own first token is the context
                return cont[:1], cont[1:]
            return [self.prefix_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        cont = whole[len(ctx):]
        if not cont:  # tokenizer merged across the boundary: fall back to separate encodings
            cont = self.tok_encode(continuation)
        if not ctx:  # an all-space context without special tokens: condition on the prefix token
            ctx = [self.prefix_id]
        return ctx, cont

    def _fit(self, ctx: List[int], cont: List[int]) -> List[int]:
        """Left-truncate the context so context + continuation fit in max_length (keeps >= 1 token)."""
        room = self.max_length - len(cont)
        if room < 1:
            raise ConfigError(f"a continuation of {len(cont)} tokens does not fit max_length={self.max_length}")
        return ctx[-room:]

    def _accumulate_fidelity(self, ref_logits: torch.Tensor, logits: torch.Tensor) -> None:
        """ref_logits, logits: [n, V] for n scored tokens."""
        if not self.fidelity or ref_logits.numel() == 0:
            return
        from hybridgen.eval.generation import fidelity_metrics

        m = fidelity_metrics(ref_logits[None].float(), logits[None].float())
        n = int(ref_logits.shape[0])
        self._fid["tokens"] += n
        self._fid["top1"] += m["top1_agreement"] * n
        self._fid["kl"] += m["mean_kl"] * n
        self._fid["max_kl"] = max(self._fid["max_kl"], m["max_kl"])

    def get_model_info(self) -> Dict[str, Any]:
        """What lm-eval adds to its results' ``config`` once the evaluation is done (also kept in REPORTS)."""
        info = {"hybridgen": {"model": self.engine.name, "method": self.method_name,
                              "method_params": dict(self.method_params), "requests_scored": dict(self.requests_scored),
                              "fidelity": self.fidelity_summary if self.fidelity else None}}
        REPORTS.append(info["hybridgen"])
        return info

    @property
    def fidelity_summary(self) -> Dict[str, Any]:
        n = self._fid["tokens"]
        return {"reference": "full (dense pass)", "tokens": n,
                "top1_agreement": self._fid["top1"] / n if n else None,
                "mean_kl": self._fid["kl"] / n if n else None, "max_kl": self._fid["max_kl"] if n else None}

    def _decode_logits(self, known: torch.Tensor, targets: torch.Tensor,
                       mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, L, V] where [:, j] predicts targets[:, j], every one from a decode step.

        known [B, T0] (T0 >= 2, left-padded when ``mask`` [B, T0] is given): all but its last
        token are prefilled (each distinct context once: hybridgen.eval.forced_scoring), the last is
        fed as the first decode step; then targets[:, :-1] are fed (teacher forcing).
        """
        from hybridgen.eval.forced_scoring import forced_scores

        tokens = torch.cat([known[:, -1:], targets], 1)
        pre_mask = None if mask is None or bool(mask[:, :-1].all()) else mask[:, :-1]
        return forced_scores(self.engine, self.new_method(), known[:, :-1], pre_mask, tokens, self.share_prefill)[:, 1:]

    def _pad_left(self, rows: List[List[int]]) -> Tuple[torch.Tensor, torch.Tensor]:
        T = max(len(r) for r in rows)
        ids = torch.tensor([[self.prefix_id] * (T - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        return ids, mask

    def _targets(self, conts: List[List[int]]) -> torch.Tensor:
        """Continuations right-padded to one length: [B, L] (the padding is never scored)."""
        L = max(len(c) for c in conts)
        return torch.tensor([c + [self.prefix_id] * (L - len(c)) for c in conts], dtype=torch.long)

    def _method_logits(self, ctxs: List[List[int]], conts: List[List[int]]) -> torch.Tensor:
        """Logits [B, L, V] scoring each continuation given its context (row b: positions
        < len(conts[b]) are valid). Contexts are left-padded to a common length.

        Rows with a one-token context are scored apart (see module docstring): the prefill
        over that token predicts the first continuation token, decode steps the rest.
        """
        if self.score_mode == "prefill":
            return self._dense_logits(ctxs, conts)
        one = [b for b, c in enumerate(ctxs) if len(c) < 2]
        if not one:
            known, mask = self._pad_left(ctxs)
            return self._decode_logits(known, self._targets(conts), mask)
        from hybridgen.eval.generation import teacher_forced_logits

        rest = [b for b in range(len(ctxs)) if b not in one]
        parts = [(one, teacher_forced_logits(self.engine, self.new_method(),
                                             torch.tensor([ctxs[b] for b in one], dtype=torch.long), None,
                                             self._targets([conts[b] for b in one])))]
        if rest:
            known, mask = self._pad_left([ctxs[b] for b in rest])
            parts.append((rest, self._decode_logits(known, self._targets([conts[b] for b in rest]), mask)))
        self.requests_scored["one_token_context"] += len(one)
        L = max(len(c) for c in conts)
        out = parts[0][1].new_zeros(len(ctxs), L, parts[0][1].shape[-1])
        for rows, logits in parts:
            out[rows, :logits.shape[1]] = logits
        return out

    def _dense_logits(self, ctxs: List[List[int]], conts: List[List[int]]) -> torch.Tensor:
        """Dense (full-attention) logits [B, L, V] at each row's continuation positions."""
        L = max(len(c) for c in conts)
        ids, mask = self._pad_left([a + b for a, b in zip(ctxs, conts)])
        mask_arg = None if bool(mask.all()) else mask
        logits = self.engine.forward(ids, mask_arg)
        T = ids.shape[1]
        out = logits.new_zeros(len(conts), L, logits.shape[-1])
        for b, c in enumerate(conts):
            n = len(c)
            out[b, :n] = logits[b, T - n - 1:T - 1]
        return out

    # ------------------------------------------------------------------ lm-eval API
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        items = []
        for i, req in enumerate(requests):
            context, continuation = req.args
            ctx, cont = self._encode_pair(context, continuation)
            items.append((i, self._fit(ctx, cont), cont))
        # longest contexts first, so rows batched together have similar lengths (little padding)
        items.sort(key=lambda it: (-len(it[1]), -len(it[2])))
        out: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        bar = self._bar(len(requests), "loglikelihood", disable_tqdm)
        for s in range(0, len(items), self.batch):
            chunk = items[s:s + self.batch]
            ctxs, conts = [c for _, c, _ in chunk], [c for _, _, c in chunk]
            logits = self._method_logits(ctxs, conts)
            ref = self._dense_logits(ctxs, conts) if (self.fidelity and self.score_mode == "decode") else None
            logp = F.log_softmax(logits.float(), -1)
            for b, (idx, _, cont) in enumerate(chunk):
                n = len(cont)
                tgt = torch.tensor(cont, dtype=torch.long)
                lp = logp[b, :n].gather(-1, tgt[:, None]).squeeze(-1)
                greedy = bool((logp[b, :n].argmax(-1) == tgt).all())
                out[idx] = (float(lp.sum()), greedy)
                if ref is not None:
                    self._accumulate_fidelity(ref[b, :n], logits[b, :n])
                self.cache_hook.add_partial("loglikelihood", requests[idx].args, out[idx])
            bar.update(len(chunk))
        bar.close()
        self.requests_scored["loglikelihood"] += len(requests)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        out = []
        bar = self._bar(len(requests), "loglikelihood_rolling", disable_tqdm)
        for req in requests:
            (text,) = req.args[:1]
            toks = self.encode(text) if self.add_bos is None else self.tok_encode(text)  # HF: tok_encode(text)
            total = 0.0
            window = max(2, self.max_length - 1)
            for s in range(0, len(toks), window):
                total += self._score_window(toks[s:s + window])
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            bar.update(1)
        bar.close()
        self.requests_scored["loglikelihood_rolling"] += len(requests)
        return out

    def _score_window(self, x: List[int]) -> float:
        """Sum of log p(x_j) given [prefix] + x[:j].

        decode mode: x_0..x_{P-1} are scored by the dense pass over the prefilled share, x_P.. by
        decode steps through the method (prefill [prefix]+x[:P-1], feed x_{P-1}, x_P, ...).
        """
        seq = [self.prefix_id] + x
        dense = F.log_softmax(self.engine.forward(torch.tensor([seq], dtype=torch.long))[0, :-1].float(), -1)
        tgt = torch.tensor(x, dtype=torch.long)
        m = len(x)
        P = max(1, min(m - 1, int(round(self.rolling_prefill * m)))) if self.score_mode == "decode" else m
        total = float(dense[:P].gather(-1, tgt[:P, None]).sum())
        if P < m:
            known = torch.tensor([seq[:P + 1]], dtype=torch.long)
            logits = self._decode_logits(known, tgt[None, P:])[0]
            lp = F.log_softmax(logits.float(), -1)
            total += float(lp.gather(-1, tgt[P:, None]).sum())
            if self.fidelity:
                self._accumulate_fidelity(dense[P:], logits)
        return total

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out = []
        bar = self._bar(len(requests), "generate_until", disable_tqdm)
        for req in requests:
            context, gen_kwargs = req.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_gen_toks))
            greedy = not gen_kwargs.get("do_sample", False) or float(gen_kwargs.get("temperature", 0.0)) == 0.0
            ctx = (self.encode(context) or [self.prefix_id])[-max(1, self.max_length - max_new):]
            ids = torch.tensor([ctx], dtype=torch.long)
            res = self.engine.generate(ids, self.new_method(), max_new_tokens=max(1, max_new), greedy=greedy,
                                       temperature=float(gen_kwargs.get("temperature", 1.0)) or 1.0,
                                       eos_token_id=getattr(self.tok, "eos_token_id", None))
            text = self.tok.decode(res.tokens[0].tolist(), skip_special_tokens=True)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
            bar.update(1)
        bar.close()
        self.requests_scored["generate_until"] += len(requests)
        return out

    # ------------------------------------------------------------------ chat templates
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tok, "name_or_path", "hybridgen")).replace("/", "__")

    def apply_chat_template(self, chat_history: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _bar(self, total: int, desc: str, disable: bool):
        """lm-eval's request bar: asked for by ``progress`` and hidden by a quiet verbosity (hybridgen/log.py)."""
        from hybridgen.log import bar

        return bar(total=total, desc=f"{desc} [{self.method_name}]", disable=disable or not self.progress,
                   explicit=True)
