"""The CPU key scan API: GQA-aware scan, group scores, partial top-k, gather of selected rows.

Shapes: q [B, Hq, D] (one decode query per head); keys/values [B, Hkv, T, D] as the views a
:class:`hybridgen.kv.KVSegment` hands out (the rows of one (batch, KV head) contiguous,
the (batch, head) blocks ``capacity`` rows apart; read in place, never copied); mask
[B, Hkv, T] bool (True = real token) or None; Hq = G * Hkv.

Kernels (``backend``):
- ``native`` (the default where it builds): the C kernels of
  :mod:`hybridgen.attention.native` (``csrc/scan_exact.c``, compiled on first use, AVX2+FMA
  on x86-64). Lanes run over D; NT tokens per iteration with G*NT vector accumulators (G query
  heads of a group against one read of each key, each bf16 key vector widened once by a
  shift / mask of its 32-bit words), horizontal sums of 8 accumulators at once, software
  prefetch ahead of the stream, fp32 accumulation (``exact=True``). The scan also writes
  per-(row, 512-token block) softmax statistics so :func:`select` needs no logsumexp pass.
- ``precision='bf16dot'`` (:func:`scan_logits_stats`): the selection scan at the memory limit,
  the query rounded to bf16 and bf16 x bf16 products summed in fp32 (``csrc/scan_bf16dot.c``:
  AVX-512 BF16 ``vdpbf16ps`` where the CPU has it); its selection is re-ranked by exact
  logits in :func:`hybridgen.attention.cpu_select.select_bf16dot`.
- ``torch``: one batched matmul of the G query heads of a group against the group's keys in
  the keys' dtype ([B, Hkv, G, D] @ [B, Hkv, D, T]); each key row is read once for the whole
  group. bf16/fp16 keys give logits rounded to that dtype (``exact=False``), so the method
  recomputes the selected logits in fp32 before the softmax.
- ``numba``: a streaming kernel over the same layout that widens bf16 keys to fp32 in
  registers, reads each key row once and feeds it to all G heads of its group
  (:mod:`hybridgen.attention.scan_kernels`), fp32 accumulation (``exact=True``).
Every kernel runs serially per slice on the threads of the one CPU pool
(:meth:`hybridgen.attention.cpu_pool.CPUAttentionPool.run_split`, the ``pool`` argument,
else the default pool; work split by (batch, KV head, 512-token block)): numba's kernels
compiled ``nogil``, never under numba's parallel threading layer (docs/design.md,
thread-runtime pitfalls); the C ones through ctypes, which releases the GIL. fp16 keys are
scanned by ``torch``.
- selection: :func:`select` (C: group score + a sampled-threshold radix top-k + the logits at
  the selection, one pass per row), else ``torch.topk(sorted=False)`` or numba
  ``np.argpartition``; gather: the C row copy with prefetch, else one ``index_select`` over
  the flattened (row, D) buffer, either writing straight into a pinned staging buffer.

Choice (``auto``): native, else numba, else torch. Measured with
``benchmarks/bench_cpu_scan.py`` on the shared 2-core development VM (Llama-3.1-8B layer,
bf16 keys, batch 8 x 32K tokens, cold): native and numba within noise of each other
(0.4-0.7 of plain read), torch's bf16 matmul 0.16-0.26 (results/cpu_scan/README.md).
Re-run it on the target host.

Shared (per KV group) selection scores a token by the max over the group's heads of its
host-normalised log-probability (logit - logsumexp over the host tokens of that head): a
token that matters to any head of the group is kept, and heads with larger logit scales do
not drown the others (the paper is silent; ``group_score='sum'`` gives the plain sum of
logits used by ``hybridgen.attention.topk_per_group``).

HybridGen's branch built from these (scan + top-k + gather of one layer) is
:func:`hybridgen.hybrid.host_branch.host_branch`.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from hybridgen.attention import native
from hybridgen.attention.cpu_pool import CPUAttentionPool, default_pool
from hybridgen.attention.scan_kernels import HAVE_NUMBA, TOKEN_BLOCK, key_array, scan_kernel, topk_kernel
from hybridgen.errors import ConfigError

NEG_INF = float("-inf")
SCAN_BACKENDS = ("auto", "torch", "numba", "native")
TOPK_BACKENDS = ("auto", "native", "torch", "numba")
SELECT_HOW = {"max": 0, "sum": 1, "raw": 2}
SCAN_PRECISIONS = ("exact", "bf16dot")
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


def numba_available() -> bool:
    """True when numba imports (the ``numba`` scan and top-k backends are usable)."""
    return HAVE_NUMBA


def native_fits(dtype: torch.dtype, G: int, D: int) -> bool:
    """True when the C kernels run their AVX2 bodies for keys of ``dtype``, group G, head dim D."""
    if not native.has_avx2() or not 1 <= G <= 8:
        return False
    if dtype == torch.bfloat16:
        return D % 16 == 0 and D <= 512
    return dtype == torch.float32 and D % 8 == 0


def resolve_backend(backend: str, dtype: torch.dtype) -> str:
    """The scan kernel used for keys of ``dtype``.

    'auto' -> ``native`` (the C kernels) for bf16/fp32 keys when they build and the CPU has
    AVX2, else ``numba`` when it imports, else ``torch`` (the order measured fastest on this
    project's machines: ``benchmarks/bench_cpu_scan.py``, results/cpu_scan/README.md). A
    requested backend that cannot run here falls back the same way.
    """
    if backend not in SCAN_BACKENDS:
        raise ConfigError(f"unknown scan backend {backend!r}; choose one of: {', '.join(SCAN_BACKENDS)}")
    native_ok = dtype in (torch.bfloat16, torch.float32) and native.has_avx2()
    numba_ok = HAVE_NUMBA and dtype in (torch.bfloat16, torch.float32)
    if backend == "auto" or (backend == "native" and not native_ok):
        return "native" if native_ok else ("numba" if numba_ok else "torch")
    if backend == "numba" and not numba_ok:
        return "torch"
    return backend


def scan_is_exact(kind: str, dtype: torch.dtype) -> bool:
    """Whether scan backend ``kind`` (as resolved) returns fp32-exact logits for keys of ``dtype``."""
    return kind in ("numba", "native") or dtype in (torch.float32, torch.float64)


# ------------------------------------------------------------------------------ scan
def scan_logits(q: Tensor, keys: Tensor, scale: float, mask: Optional[Tensor] = None,
                backend: str = "auto", out: Optional[Tensor] = None,
                pool: Optional[CPUAttentionPool] = None) -> Tuple[Tensor, bool]:
    """Host logits of every query head against the host keys.

    q: [B, Hq, D] or [B, Hq, 1, D]; keys: [B, Hkv, T, D] (CPU); mask: [B, Hkv, T] or None.
    pool: whose threads run the numba kernel's slices (default: :func:`default_pool`).
    Returns (logits [B, Hq, T] float32 with masked entries -inf, exact) where exact says the
    logits were accumulated and kept in fp32 (False for torch over bf16/fp16 keys).
    """
    logits, exact, _ = scan_logits_stats(q, keys, scale, mask, backend, out, pool)
    return logits, exact


def scan_logits_stats(q: Tensor, keys: Tensor, scale: float, mask: Optional[Tensor] = None,
                      backend: str = "auto", out: Optional[Tensor] = None,
                      pool: Optional[CPUAttentionPool] = None,
                      precision: str = "exact") -> Tuple[Tensor, bool, Optional[Tensor]]:
    """:func:`scan_logits` plus, from the C kernel without a mask, the per-block softmax
    statistics [B*Hkv, ceil(T / TOKEN_BLOCK), G, 2] (max, sum of exp(logit - max)) that
    :func:`select` turns into each head's logsumexp without another pass over the logits;
    None from every other path.

    precision: 'exact' (fp32 query) or 'bf16dot' (the SELECTION scan: the query rounded to
    bf16, round to nearest even, so every product with a bf16 key is a bf16 x bf16 product,
    summed in fp32; the C kernel ``hg_scan_bf16dot`` runs AVX-512 BF16 ``vdpbf16ps`` where
    the CPU has it; other backends scan the rounded query exactly). The returned ``exact``
    is False for 'bf16dot': re-rank the selection by exact logits
    (:func:`hybridgen.attention.cpu_select.select_bf16dot`).
    """
    if precision not in SCAN_PRECISIONS:
        raise ConfigError(f"unknown scan precision {precision!r}; choose one of: {', '.join(SCAN_PRECISIONS)}")
    if q.dim() == 4:
        q = q[:, :, 0]
    if precision == "bf16dot":
        q = q.to(torch.bfloat16)
    B, Hq, D = q.shape
    Hkv, T = keys.shape[1], keys.shape[2]
    G = Hq // Hkv
    kind = resolve_backend(backend, keys.dtype)
    stats: Optional[Tensor] = None
    if T == 0:
        return q.new_zeros(B, Hq, 0, dtype=torch.float32), True, None
    if kind == "native" and not native_fits(keys.dtype, G, D):
        kind = "numba" if HAVE_NUMBA else "torch"
    if kind in ("native", "numba"):  # compiled kernels: key rows read in place, fp32 query rows
        kr, cap = rows_view(keys)
        qg = q.float().reshape(B * Hkv, G, D).contiguous()
        res = (out if out is not None else torch.empty(B * Hkv, G, T, dtype=torch.float32)).view(B * Hkv, G, T)
        nblk = (T + TOKEN_BLOCK - 1) // TOKEN_BLOCK
        bf16 = keys.dtype == torch.bfloat16
        if kind == "native":
            fn = (native.lib().hg_scan_bf16dot if precision == "bf16dot" else native.lib().hg_scan_bf16) if bf16 \
                else native.lib().hg_scan_f32
            stats = torch.empty(B * Hkv, nblk, G, 2, dtype=torch.float32) if mask is None else None
            (pool or default_pool()).run_split(fn, B * Hkv * nblk, qg.data_ptr(), kr.data_ptr(), cap, res.data_ptr(),
                                               float(scale), T, D, G, TOKEN_BLOCK,
                                               stats.data_ptr() if stats is not None else None, work=B * Hkv * T * D)
        else:
            (pool or default_pool()).run_split(scan_kernel(G, bf16), B * Hkv * nblk, qg.numpy(), key_array(kr, bf16),
                                               cap, res.numpy(), float(scale), T, TOKEN_BLOCK, work=B * Hkv * T * D)
        logits, exact = res.view(B, Hq, T), precision == "exact"
    else:
        qg = q.reshape(B, Hkv, G, D).to(keys.dtype)
        logits = torch.matmul(qg, keys.transpose(-1, -2)).float().mul_(scale).view(B, Hq, T)
        exact = (keys.dtype == torch.float32 or keys.dtype == torch.float64) and precision == "exact"
        if out is not None:
            out.view(B, Hq, T).copy_(logits)
            logits = out.view(B, Hq, T)
    if mask is not None:
        logits.view(B, Hkv, G, T).masked_fill_(~mask.expand(B, Hkv, T)[:, :, None, :], NEG_INF)
    return logits, exact, stats


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


def topk_indices(scores: Tensor, k: int, backend: str = "torch", pool: Optional[CPUAttentionPool] = None) -> Tensor:
    """Unsorted top-k token indices per row. scores [..., T] float32 -> [..., k] int64 (k <= T).

    pool: whose threads run the numba kernel's slices (default: :func:`default_pool`)."""
    T = scores.shape[-1]
    k = min(k, T)
    if backend == "numba" and HAVE_NUMBA and k > 0:
        flat = scores.reshape(-1, T).contiguous()
        out = torch.empty(flat.shape[0], k, dtype=torch.int64)
        (pool or default_pool()).run_split(topk_kernel(), flat.shape[0], flat.numpy(), k, out.numpy(), work=flat.numel())
        return out.view(*scores.shape[:-1], k)
    return torch.topk(scores, k, dim=-1, sorted=False).indices


def select(logits: Tensor, num_kv_heads: int, k: int, per_head: bool, how: str = "max",
           topk_backend: str = "auto", pool: Optional[CPUAttentionPool] = None,
           stats: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Selection + the selected logits in one call. logits [B, Hq, T] float32 (masked = -inf).

    Returns (idx [B, Hsel, k] int64 unsorted, logits at idx [B, Hq, k]); Hsel = Hq
    (per_head) or Hkv (shared, ranked by :func:`group_scores` ``how``). With the C kernels
    (``hg_select``: group score, radix-select top-k, ties to the lower index, and the
    logits at the selection, one pass per row on the pool's threads; ``stats`` from
    :func:`scan_logits_stats` spare it the logsumexp passes) for ``topk_backend``
    'auto'/'native' when they build; else :func:`group_scores` + :func:`topk_indices` + :func:`logits_at`.
    """
    if how not in ("max", "sum"):
        raise ConfigError(f"unknown group score {how!r}; choose 'max' or 'sum'")
    B, Hq, T = logits.shape
    k = max(0, min(k, T))
    Hsel = Hq if per_head else num_kv_heads
    G = Hq // Hsel
    lib = native.lib()
    if topk_backend not in TOPK_BACKENDS:
        raise ConfigError(f"unknown top-k backend {topk_backend!r}; choose one of: {', '.join(TOPK_BACKENDS)}")
    if lib is not None and topk_backend in ("auto", "native") and k > 0 and T > 0:
        lg = logits.contiguous()
        idx = torch.empty(B, Hsel, k, dtype=torch.int64)
        sel = torch.empty(B, Hq, k, dtype=torch.float32)
        code = SELECT_HOW["raw" if G == 1 else how]
        use = stats is not None and not per_head and stats.shape[-2] == G
        (pool or default_pool()).run_split(lib.hg_select, B * Hsel, lg.data_ptr(), T, G, code, k, idx.data_ptr(),
                                           sel.data_ptr(), stats.data_ptr() if use else None,
                                           stats.shape[1] if use else 0, None, work=B * Hq * T)
        return idx, sel
    scores = logits if per_head else group_scores(logits, num_kv_heads, how)
    idx = topk_indices(scores, k, "numba" if topk_backend == "numba" else "torch", pool=pool)
    return idx, logits_at(logits, idx)


def exact_logits_at(q: Tensor, keys: Tensor, idx: Tensor, scale: float,
                    pool: Optional[CPUAttentionPool] = None) -> Tensor:
    """Exact fp32 logits of q against the key rows at idx, read in place from the segment.

    q [B, Hq, D] or [B, Hq, 1, D]; keys [B, Hkv, T, D]; idx [B, Hsel, k] (Hsel = Hkv or Hq).
    -> [B, Hq, k]. bf16 keys with shared selection use the C kernel (``hg_rows_bf16``: no
    gather copy); anything else gathers the rows and uses :func:`rows_logits`.
    """
    if q.dim() == 4:
        q = q[:, :, 0]
    B, Hq, D = q.shape
    Hkv, Hsel, k = keys.shape[1], idx.shape[1], idx.shape[2]
    if Hsel == Hkv and k > 0 and native_fits(keys.dtype, Hq // Hkv, D) and keys.dtype == torch.bfloat16:
        kr, cap = rows_view(keys)
        qg = q.float().reshape(B * Hkv, Hq // Hkv, D).contiguous()
        ic = idx.contiguous()
        out = torch.empty(B, Hq, k, dtype=torch.float32)
        (pool or default_pool()).run_split(native.lib().hg_rows_bf16, B * Hkv, qg.data_ptr(), kr.data_ptr(), cap,
                                           ic.data_ptr(), k, out.data_ptr(), float(scale), D, Hq // Hkv,
                                           work=B * Hq * k * D)
        return out
    return rows_logits(q, gather_rows(keys, idx), scale)


# ------------------------------------------------------------------------------ gather
def _flat_row_index(idx: Tensor, num_kv_heads: int, cap: int) -> Tensor:
    """idx [B, Hsel, k] (Hsel = Hq or Hkv) -> row numbers into the [B*Hkv*cap, D] buffer."""
    B, Hsel, k = idx.shape
    g = Hsel // num_kv_heads
    kv = torch.arange(Hsel, device=idx.device) // g  # KV head serving each selected head
    base = (torch.arange(B, device=idx.device)[:, None] * num_kv_heads + kv[None, :]) * cap  # [B, Hsel]
    return (base[:, :, None] + idx).reshape(-1)


def gather_rows(x: Tensor, idx: Tensor, out: Optional[Tensor] = None,
                pool: Optional[CPUAttentionPool] = None) -> Tensor:
    """Rows of a segment view at idx. x [B, Hkv, T, D]; idx [B, Hsel, k] -> [B, Hsel, k, D].

    Hsel = Hkv (shared selection) or Hq (per-head: head h reads KV head h // G).
    out: optional destination (e.g. a pinned staging buffer) with B*Hsel*k*D elements.
    With the C kernels: a prefetching row copy (``hg_gather_rows``) on the pool's threads;
    else one ``index_select`` over the flattened rows.
    """
    B, Hkv, T, D = x.shape
    flat, cap = rows_view(x)
    lib = native.lib()
    if lib is not None and idx.shape[2] > 0 and (out is None or out.is_contiguous()):
        Hsel, k = idx.shape[1], idx.shape[2]
        dst = out.view(-1) if out is not None else torch.empty(B * Hsel * k * D, dtype=x.dtype)
        ic = idx.contiguous()
        (pool or default_pool()).run_split(lib.hg_gather_rows, B * Hsel, flat.data_ptr(), cap, ic.data_ptr(), k,
                                           Hsel // Hkv, dst.data_ptr(), D * x.element_size(), work=B * Hsel * k * D)
        return dst[:B * Hsel * k * D].view(B, Hsel, k, D)
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
