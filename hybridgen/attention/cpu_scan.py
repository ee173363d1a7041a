"""HybridGen's CPU branch: GQA-aware key scan, partial top-k, gather of the selected rows.

Shapes: q [B, Hq, D] (one decode query per head); keys/values [B, Hkv, T, D] as the views a
:class:`hybridgen.kv.KVSegment` hands out (the rows of one (batch, KV head) contiguous,
the (batch, head) blocks ``capacity`` rows apart; read in place, never copied); mask
[B, Hkv, T] bool (True = real token) or None; Hq = G * Hkv.

Kernels (``backend``):
- ``torch``: one batched matmul of the G query heads of a group against the group's keys in
  the keys' dtype ([B, Hkv, G, D] @ [B, Hkv, D, T]); each key row is read once for the whole
  group. bf16/fp16 keys give logits rounded to that dtype (``exact=False``), so the method
  recomputes the selected logits in fp32 before the softmax.
- ``numba``: a streaming kernel over the same layout that widens bf16 keys to fp32 in
  registers (zero-extend + shift of the uint16 bit pattern, an LLVM bit-cast), reads each
  key row once and feeds it to all G heads of its group (a kernel generated per group size
  G <= 8 with G accumulators; a generic loop beyond), accumulating in fp32 (``exact=True``).
  It is compiled ``nogil`` and run serially per call on a small thread pool of our own
  (work split by (batch, KV head, 512-token block)), never with numba's parallel threading
  layer, which clashes with torch's OpenMP (docs/design.md, thread-runtime pitfalls; the
  Makefile also sets ``NUMBA_THREADING_LAYER=workqueue``). fp16 keys are not handled by numba (its CPU float16
  support is partial) and fall back to ``torch``.
- top-k: ``torch.topk(sorted=False)`` (a partial selection) or numba ``np.argpartition``
  per row (introselect); gather: one ``index_select`` over the flattened (row, D) buffer,
  which can write straight into a pinned staging buffer (``out=``).

Choice, measured with ``benchmarks/bench_cpu_scan.py`` on the 2-core development VM (one
Llama-3.1-8B-shaped layer, batch 2, 16K host tokens, bf16 keys; re-run it on the target
host, where the balance may differ): the numba bf16 kernel scanned a token about 2x faster
than torch's bf16 matmul (and faster than fp32 kernels, which read twice the bytes) while
returning fp32-exact logits, so ``auto`` picks ``numba`` for bf16 and fp32 keys when numba
imports, else ``torch``. It is still compute-bound here (about half of one core's plain
read bandwidth): the per-(token, head) horizontal reduction of a row-major [T, D] layout
is the limit; a token-blocked transposed layout would remove it at the cost of a custom
segment. torch.topk and numba argpartition were within noise of each other (torch.topk is
the default); ``index_select`` gathers rows ~30x faster than ``torch.gather`` with an
expanded index.

Shared (per KV group) selection scores a token by the max over the group's heads of its
host-normalised log-probability (logit - logsumexp over the host tokens of that head): a
token that matters to any head of the group is kept, and heads with larger logit scales do
not drown the others (the paper is silent; ``group_score='sum'`` gives the plain sum of
logits used by ``hybridgen.attention.topk_per_group``).
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from hybridgen.errors import ConfigError

NEG_INF = float("-inf")
SCAN_BACKENDS = ("auto", "torch", "numba")
TOKEN_BLOCK = 512  # token rows per numba work item
MAX_SPECIALISED_GROUP = 8  # GQA group sizes with a generated kernel (larger ones use the generic loop)
_GROUP_KERNELS: dict = {}

try:  # numba is optional; every path has a torch fallback
    import numpy as np
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    _HAVE_NUMBA = True
except Exception:  # pragma: no cover - exercised only without numba
    _HAVE_NUMBA = False


# ------------------------------------------------------------------------------ layout helpers
def rows_view(x: Tensor) -> Tuple[Tensor, int]:
    """A [B, Hkv, T, D] segment view as (rows [(B*Hkv - 1) * cap + T, D] contiguous, cap).

    Row ``bh * cap + t`` is token t of (batch, head) bh. Works without a copy on views whose
    last two dims are contiguous rows and whose (batch, head) blocks are ``cap`` rows apart
    (what KVSegment hands out, also sliced along T); other tensors are made contiguous.
    """
    B, H, T, D = x.shape
    s = x.stride()
    if T > 0 and s[3] == 1 and s[2] == D and s[1] % D == 0 and s[0] == H * s[1] and s[1] // D >= T:
        cap = s[1] // D
        return x.as_strided(((B * H - 1) * cap + T, D), (D, 1)), cap
    x = x.contiguous()
    return x.view(B * H * T, D), T


# ------------------------------------------------------------------------------ numba kernels
if _HAVE_NUMBA:

    @intrinsic
    def _bf16_bits_to_f32(typingctx, bits):  # pragma: no cover - compiled
        """uint16 bf16 bit pattern -> float32 (zero-extend, shift left 16, bit-cast): exact."""
        sig = types.float32(types.uint16)

        def codegen(context, builder, signature, args):
            wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(wide, ir.FloatType())

        return sig, codegen

    @njit(nogil=True, fastmath=True, cache=True)
    def _scan_bf16_kernel(q, k, cap, out, scale, T, block, j0, j1):  # pragma: no cover - compiled
        """q [BH, G, D] f32; k [rows, D] uint16 (bf16 bits; token t of bh at row bh*cap + t); out [BH, G, T] f32.

        Work item j covers (bh, token block). Each key element is widened in registers
        (no scratch tile: a tile through a uint32 view measured 2x slower) and dotted with
        the G heads of its group while the row is in L1.
        """
        G = q.shape[1]
        D = k.shape[1]
        nblk = (T + block - 1) // block
        for job in range(j0, j1):
            bh = job // nblk
            t0 = (job - bh * nblk) * block
            t1 = min(T, t0 + block)
            for t in range(t0, t1):
                row = bh * cap + t
                for g in range(G):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[bh, g, d] * _bf16_bits_to_f32(k[row, d])
                    out[bh, g, t] = acc * scale

    @njit(nogil=True, fastmath=True, cache=True)
    def _scan_f32_kernel(q, k, cap, out, scale, T, block, j0, j1):  # pragma: no cover - compiled
        """q [BH, G, D] f32; k [rows, D] f32 (token t of bh at row bh*cap + t); out [BH, G, T] f32."""
        G = q.shape[1]
        D = k.shape[1]
        nblk = (T + block - 1) // block
        for job in range(j0, j1):
            bh = job // nblk
            t0 = (job - bh * nblk) * block
            t1 = min(T, t0 + block)
            for t in range(t0, t1):
                row = bh * cap + t
                for g in range(G):
                    acc = np.float32(0.0)
                    for d in range(D):
                        acc += q[bh, g, d] * k[row, d]
                    out[bh, g, t] = acc * scale

    _GROUP_KERNEL_SRC = """
def kernel(q, k, cap, out, scale, T, block, j0, j1):
    D = k.shape[1]
    nblk = (T + block - 1) // block
    for job in range(j0, j1):
        bh = job // nblk
        t0 = (job - bh * nblk) * block
        t1 = min(T, t0 + block)
{qrows}
        for t in range(t0, t1):
            row = k[bh * cap + t]
{zero}
            for d in range(D):
                kv = {widen}
{fma}
{store}
"""

    def _group_kernel(G: int, bf16: bool):
        """A scan kernel specialised to G query heads per KV head (G scalar accumulators).

        Each key element is widened once and feeds all G dot products, so LLVM keeps G vector
        accumulators along D; this measured ~1.4x faster than the generic kernel below, which
        loops over g and re-reads (and re-widens) the key row for every head.
        """
        key = (G, bf16)
        if key not in _GROUP_KERNELS:
            ind = " " * 16
            src = _GROUP_KERNEL_SRC.format(
                qrows="\n".join(f"        q{g} = q[bh, {g}]" for g in range(G)),
                zero="\n".join(f"            a{g} = np.float32(0.0)" for g in range(G)),
                widen="_bf16_bits_to_f32(row[d])" if bf16 else "row[d]",
                fma="\n".join(f"{ind}a{g} += q{g}[d] * kv" for g in range(G)),
                store="\n".join(f"            out[bh, {g}, t] = a{g} * scale" for g in range(G)))
            ns = {"np": np, "_bf16_bits_to_f32": _bf16_bits_to_f32}
            exec(compile(src, f"<hybridgen scan kernel G={G} bf16={bf16}>", "exec"), ns)  # noqa: S102
            _GROUP_KERNELS[key] = njit(nogil=True, fastmath=True)(ns["kernel"])
        return _GROUP_KERNELS[key]

    @njit(nogil=True, cache=True)
    def _topk_kernel(scores, kk, out, r0, r1):  # pragma: no cover - compiled
        """scores [R, T] f32 -> out [R, kk] int64 (unsorted top-kk per row)."""
        T = scores.shape[1]
        for r in range(r0, r1):
            part = np.argpartition(-scores[r], kk - 1) if kk < T else np.arange(T)
            for i in range(kk):
                out[r, i] = part[i]


_executor: Optional[ThreadPoolExecutor] = None
_executor_threads = 0


def _threads() -> int:
    return max(1, int(os.environ.get("HYBRIDGEN_SCAN_THREADS", torch.get_num_threads())))


def _run_split(fn, total: int, *args) -> None:
    """Run fn(*args, lo, hi) over [0, total) split across the scan threads (nogil kernels)."""
    global _executor, _executor_threads
    n = min(_threads(), total)
    if n <= 1:
        fn(*args, 0, total)
        return
    if _executor is None or _executor_threads != n:
        if _executor is not None:
            _executor.shutdown(wait=False)
        _executor = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hg-scan")
        _executor_threads = n
    bounds = [total * i // n for i in range(n + 1)]
    futs = [_executor.submit(fn, *args, bounds[i], bounds[i + 1]) for i in range(n)]
    for f in futs:
        f.result()


def numba_available() -> bool:
    return _HAVE_NUMBA


def resolve_backend(backend: str, dtype: torch.dtype) -> str:
    """The scan kernel used for keys of ``dtype`` ('auto' -> numba for bf16/fp32 when available)."""
    if backend not in SCAN_BACKENDS:
        raise ConfigError(f"unknown scan backend {backend!r}; choose one of: {', '.join(SCAN_BACKENDS)}")
    numba_ok = _HAVE_NUMBA and dtype in (torch.bfloat16, torch.float32)
    if backend == "auto":
        return "numba" if numba_ok else "torch"
    if backend == "numba" and not numba_ok:
        return "torch"
    return backend


# ------------------------------------------------------------------------------ scan
def scan_logits(q: Tensor, keys: Tensor, scale: float, mask: Optional[Tensor] = None,
                backend: str = "auto", out: Optional[Tensor] = None) -> Tuple[Tensor, bool]:
    """Host logits of every query head against the host keys.

    q: [B, Hq, D] or [B, Hq, 1, D]; keys: [B, Hkv, T, D] (CPU); mask: [B, Hkv, T] or None.
    Returns (logits [B, Hq, T] float32 with masked entries -inf, exact) where exact says the
    logits were accumulated and kept in fp32 (False for torch over bf16/fp16 keys).
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    kind = resolve_backend(backend, keys.dtype)
    if T == 0:
        return q.new_zeros(B, Hq, 0, dtype=torch.float32), True
    if kind == "numba":
        kr, cap = rows_view(keys)
        qg = q.float().reshape(B * Hkv, G, D).contiguous()
        res = out if out is not None else torch.empty(B * Hkv, G, T, dtype=torch.float32)
        res = res.view(B * Hkv, G, T)
        nblk = (T + TOKEN_BLOCK - 1) // TOKEN_BLOCK
        bf16 = keys.dtype == torch.bfloat16
        if G <= MAX_SPECIALISED_GROUP:
            kernel = _group_kernel(G, bf16)
        else:
            kernel = _scan_bf16_kernel if bf16 else _scan_f32_kernel
        k_np = kr.view(torch.int16).numpy().view(np.uint16) if bf16 else kr.numpy()
        _run_split(kernel, B * Hkv * nblk, qg.numpy(), k_np, cap, res.numpy(), float(scale), T, TOKEN_BLOCK)
        logits, exact = res.view(B, Hq, T), True
    else:
        qg = q.reshape(B, Hkv, G, D).to(keys.dtype)
        logits = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale).view(B, Hq, T)
        exact = keys.dtype == torch.float32 or keys.dtype == torch.float64
        if out is not None:
            out.view(B, Hq, T).copy_(logits)
            logits = out.view(B, Hq, T)
    if mask is not None:
        logits.view(B, Hkv, G, T).masked_fill_(~mask.expand(B, Hkv, T)[:, :, None, :], NEG_INF)
    return logits, exact


# ------------------------------------------------------------------------------ top-k
def group_scores(logits: Tensor, num_kv_heads: int, how: str = "max") -> Tensor:
    """Shared selection score per KV group. logits [B, Hq, T] -> [B, Hkv, T] float32.

    how='max': max over the group's heads of (logit - logsumexp_host(head)); 'sum': sum of logits.
    """
    B, Hq, T = logits.shape
    lg = logits.view(B, num_kv_heads, Hq // num_kv_heads, T)
    if how == "sum":
        return lg.sum(dim=2)
    if how != "max":
        raise ConfigError(f"unknown group score {how!r}; choose 'max' or 'sum'")
    lse = torch.logsumexp(lg, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return (lg - lse).amax(dim=2)


def topk_indices(scores: Tensor, k: int, backend: str = "torch") -> Tensor:
    """Unsorted top-k token indices per row. scores [..., T] float32 -> [..., k] int64 (k <= T)."""
    T = scores.shape[-1]
    k = min(k, T)
    if backend == "numba" and _HAVE_NUMBA and k > 0:
        flat = scores.reshape(-1, T).contiguous()
        out = torch.empty(flat.shape[0], k, dtype=torch.int64)
        _run_split(_topk_kernel, flat.shape[0], flat.numpy(), k, out.numpy())
        return out.view(*scores.shape[:-1], k)
    return torch.topk(scores, k, dim=-1, sorted=False).indices


# ------------------------------------------------------------------------------ gather
def _flat_row_index(idx: Tensor, num_kv_heads: int, cap: int) -> Tensor:
    """idx [B, Hsel, k] (Hsel = Hq or Hkv) -> row numbers into the [B*Hkv*cap, D] buffer."""
    B, Hsel, k = idx.shape
    g = Hsel // num_kv_heads
    kv = torch.arange(Hsel, device=idx.device) // g  # KV head serving each selected head
    base = (torch.arange(B, device=idx.device)[:, None] * num_kv_heads + kv[None, :]) * cap  # [B, Hsel]
    return (base[:, :, None] + idx).reshape(-1)


def gather_rows(x: Tensor, idx: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Rows of a segment view at idx. x [B, Hkv, T, D]; idx [B, Hsel, k] -> [B, Hsel, k, D].

    Hsel = Hkv (shared selection) or Hq (per-head: head h reads KV head h // G).
    out: optional destination (e.g. a pinned staging buffer) with B*Hsel*k*D elements.
    """
    B, Hkv, T, D = x.shape
    flat, cap = rows_view(x)
    ridx = _flat_row_index(idx, Hkv, cap)
    if out is not None:
        dst = out.view(-1, D)
        torch.index_select(flat, 0, ridx, out=dst)
        return dst.view(B, idx.shape[1], idx.shape[2], D)
    return torch.index_select(flat, 0, ridx).view(B, idx.shape[1], idx.shape[2], D)


def gather_mask(mask: Optional[Tensor], idx: Tensor) -> Optional[Tensor]:
    """mask [B, Hkv, T] at idx [B, Hsel, k] -> [B, Hsel, k] (None stays None)."""
    if mask is None:
        return None
    B, Hsel, _ = idx.shape
    Hkv = mask.shape[1]
    m = mask.expand(B, Hkv, mask.shape[-1]).repeat_interleave(Hsel // Hkv, dim=1)
    return torch.gather(m, 2, idx)


def logits_at(logits: Tensor, idx: Tensor) -> Tensor:
    """logits [B, Hq, T] at idx [B, Hsel, k] -> [B, Hq, k] (shared idx serves every head of its group)."""
    B, Hq, T = logits.shape
    Hsel = idx.shape[1]
    if Hsel != Hq:
        idx = idx.repeat_interleave(Hq // Hsel, dim=1)
    return torch.gather(logits, 2, idx)


def rows_logits(q: Tensor, k_rows: Tensor, scale: float) -> Tensor:
    """Exact fp32 logits of q against gathered key rows.

    q: [B, Hq, D] or [B, Hq, 1, D]; k_rows: [B, Hsel, k, D] (Hsel = Hq or Hkv). -> [B, Hq, k].
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq, D = q.shape
    Hsel, k = k_rows.shape[1], k_rows.shape[2]
    qg = q.float().reshape(B, Hsel, Hq // Hsel, D)
    return torch.matmul(qg, k_rows.float().transpose(-1, -2)).mul_(scale).reshape(B, Hq, k)


# ------------------------------------------------------------------------------ the branch
@dataclass
class HostSelection:
    """What the CPU branch hands the GPU side for one layer.

    idx [B, Hsel, k]; logits [B, Hq, k] float32 (-inf where masked or padding);
    v_rows [B, Hsel, k, D]; k_rows [B, Hsel, k, D] or None (kept when exact logits are to be
    recomputed from a different query); exact: logits are fp32-accurate for the scanned query;
    timings in seconds (scan, topk, gather).
    """

    idx: Tensor
    logits: Tensor
    v_rows: Tensor
    k_rows: Optional[Tensor]
    mask: Optional[Tensor]
    exact: bool
    scan_s: float = 0.0
    topk_s: float = 0.0
    gather_s: float = 0.0
    offset: int = 0  # first scanned token of the segment (idx is relative to it)


def host_branch(q: Tensor, keys: Tensor, values: Tensor, scale: float, k: int, per_head: bool,
                mask: Optional[Tensor] = None, keep_keys: bool = False, backend: str = "auto",
                topk_backend: str = "torch", group_score: str = "max",
                v_out: Optional[Tensor] = None) -> HostSelection:
    """Scan + top-k + gather over one layer's host KV.

    q [B, Hq, D] or [B, Hq, 1, D] (CPU); keys/values [B, Hkv, T, D]; k tokens per
    (batch, KV head) (shared) or per (batch, query head) (per_head), clamped to T.
    v_out: optional buffer (e.g. pinned) the V rows are gathered into.
    """
    import time

    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    k = max(0, min(k, T))
    t0 = time.perf_counter()
    logits, exact = scan_logits(q, keys, scale, mask, backend)
    t1 = time.perf_counter()
    scores = logits if per_head else group_scores(logits, Hkv, group_score)
    idx = topk_indices(scores, k, topk_backend)  # [B, Hsel, k]
    sel_logits = logits_at(logits, idx)
    t2 = time.perf_counter()
    v_rows = gather_rows(values, idx, out=v_out)
    k_rows = gather_rows(keys, idx) if keep_keys else None
    sel_mask = gather_mask(mask, idx)
    t3 = time.perf_counter()
    return HostSelection(idx, sel_logits, v_rows, k_rows, sel_mask, exact, t1 - t0, t2 - t1, t3 - t2)


def topk_count(ratio: float, host_tokens: int, minimum: int = 1) -> int:
    """Tokens to select for a ratio of the host tokens: ceil(ratio * n), at least ``minimum``, at most n."""
    if host_tokens <= 0:
        return 0
    return min(host_tokens, max(minimum, int(math.ceil(ratio * host_tokens - 1e-9))))
