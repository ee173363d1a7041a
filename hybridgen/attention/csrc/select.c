/* Softmax statistics of scan blocks, the selection (group score + partial top-k + the
 * selected logits) and the row gather of HybridGen's CPU branch. Layouts as in scan_exact.c.
 */
#include "hg.h"

/* ---------------------------------------------------------------- block statistics */
static void block_stats_c(const float *ob, int64_t T, int64_t G, int64_t t0, int64_t t1, float *st) {
    for (int64_t g = 0; g < G; g++) {
        const float *x = ob + g * T;
        float m = -INFINITY;
        for (int64_t t = t0; t < t1; t++) m = x[t] > m ? x[t] : m;
        double sum = 0.0;
        if (m > -INFINITY)
            for (int64_t t = t0; t < t1; t++) sum += expf(x[t] - m);
        st[2 * g] = m;
        st[2 * g + 1] = (float)sum;
    }
}

#ifdef HG_X86
AVX2 static float max_row_avx2(const float *x, int64_t T);
AVX2 static double sumexp_row_avx2(const float *x, int64_t T, float m);
AVX512 static float stats_row_avx512(const float *x, int64_t T, double *sum);
#endif

/* (max, sum of exp(logit - max)) per head over the job's tokens [t0, t1) of ob [G][T], to
 * st[2*g], st[2*g+1]: computed while the block's logits are still in L1, so the selection's
 * logsumexp needs no further pass over the logits. */
HG_INTERNAL void hg_block_stats(const float *ob, int64_t T, int64_t G, int64_t t0, int64_t t1, float *st) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX512) {
        for (int64_t g = 0; g < G; g++) {
            double sum;
            st[2 * g] = stats_row_avx512(ob + g * T + t0, t1 - t0, &sum);
            st[2 * g + 1] = (float)sum;
        }
        return;
    }
    if (hg_isa() >= HG_ISA_AVX2) {
        for (int64_t g = 0; g < G; g++) {
            float m = max_row_avx2(ob + g * T + t0, t1 - t0);
            st[2 * g] = m;
            st[2 * g + 1] = m > -INFINITY ? (float)sumexp_row_avx2(ob + g * T + t0, t1 - t0, m) : 0.f;
        }
        return;
    }
#endif
    block_stats_c(ob, T, G, t0, t1, st);
}

/* ---------------------------------------------------------------- selection */
/* order-preserving map of a float to uint32 (NaN never occurs: logits are finite or -inf) */
static inline uint32_t f2key(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

#ifdef HG_X86
/* exp(x) for x <= 0 (8 lanes): 2^n * p(f), degree-5 polynomial, relative error ~2e-7 */
AVX2 static inline __m256 exp_neg_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f));
    __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(1.3333558e-3f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504109e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022651e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

AVX2 static float max_row_avx2(const float *x, int64_t T) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + t));
    float buf[8], r = -INFINITY;
    _mm256_storeu_ps(buf, m);
    for (int i = 0; i < 8; i++) r = buf[i] > r ? buf[i] : r;
    for (; t < T; t++) r = x[t] > r ? x[t] : r;
    return r;
}

/* exp_neg_ps on 16 lanes */
AVX512 static inline __m512 exp_neg_ps512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* max and sum of exp(x - max) of x[0..T) in one call (16 lanes) */
AVX512 static float stats_row_avx512(const float *x, int64_t T, double *sum) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < T; t += 16) {
        __mmask16 in = T - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (T - t)) - 1u);
        mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, x + t));
    }
    float m = _mm512_reduce_max_ps(mv);
    if (!(m > -INFINITY)) {
        *sum = 0.0;
        return m;
    }
    __m512 s = _mm512_setzero_ps(), b = _mm512_set1_ps(m);
    for (int64_t t = 0; t < T; t += 16) {
        __mmask16 in = T - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (T - t)) - 1u);
        s = _mm512_add_ps(s, _mm512_maskz_mov_ps(in, exp_neg_ps512(_mm512_sub_ps(
                                 _mm512_mask_loadu_ps(b, in, x + t), b))));
    }
    *sum = _mm512_reduce_add_ps(s);
    return m;
}

AVX2 static double sumexp_row_avx2(const float *x, int64_t T, float m) {
    __m256 s = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) s = _mm256_add_ps(s, exp_neg_ps(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv)));
    double r = hsum_ps(s);
    for (; t < T; t++) r += expf(x[t] - m);
    return r;
}
#endif

/* sum of exp(x[t] - m) over t < n, for x <= m */
static double sumexp_row(const float *x, int64_t n, float m) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX2) return sumexp_row_avx2(x, n, m);
#endif
    double s = 0.0;
    for (int64_t t = 0; t < n; t++) s += expf(x[t] - m);
    return s;
}

/* logsumexp of x[0..T) (0 when no entry is finite, as torch's group_scores) */
static double lse_row(const float *x, int64_t T) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX2) {
        float m = max_row_avx2(x, T);
        if (!(m > -INFINITY)) return 0.0;
        return (double)m + log(sumexp_row_avx2(x, T, m));
    }
#endif
    float m = -INFINITY;
    for (int64_t t = 0; t < T; t++) m = x[t] > m ? x[t] : m;
    if (!(m > -INFINITY)) return 0.0;
    double s = 0.0;
    for (int64_t t = 0; t < T; t++) s += expf(x[t] - m);
    return (double)m + log(s);
}

/* Top-kk of x[0..n) by value (ties: lower position first) into pos[0..kk) (ascending).
 * Radix select on the order-preserving keys, 11 + 11 + 10 bits; work: keys[n]. */
static void radix_topk(const float *x, int64_t n, int64_t kk, int64_t *pos, uint32_t *keys) {
    static const int shifts[3] = {21, 10, 0};
    static const uint32_t widths[3] = {2048, 2048, 1024};
    uint32_t hist[2048];
    for (int64_t t = 0; t < n; t++) keys[t] = f2key(x[t]);
    uint32_t prefix = 0, prefix_mask = 0;
    int64_t need = kk;
    for (int level = 0; level < 3; level++) {
        memset(hist, 0, sizeof(hist));
        int sh = shifts[level];
        uint32_t w = widths[level];
        for (int64_t t = 0; t < n; t++)
            if ((keys[t] & prefix_mask) == prefix) hist[(keys[t] >> sh) & (w - 1)]++;
        int64_t b = (int64_t)w - 1, above = 0;
        while (b > 0 && above + hist[b] < need) { above += hist[b]; b--; }
        need -= above;
        prefix |= ((uint32_t)b) << sh;
        prefix_mask |= (w - 1) << sh;
    }
    /* keys > prefix are in; exactly `need` of the keys == prefix (lowest positions first) */
    int64_t m = 0;
    for (int64_t t = 0; t < n; t++) {
        uint32_t key = keys[t];
        if (key > prefix) pos[m++] = t;
        else if (key == prefix && need > 0) { pos[m++] = t; need--; }
    }
}

/* The scores one selection row ranks: score(t) = max over g < G of (lr[g*T + t] - off[g])
 * (how 0), the sum over g (how 1), or lr[t] (how 2, G == 1). */
typedef struct {
    const float *lr;
    int64_t T, G, how;
    const float *off;
} scores_t;

static inline float score_at(const scores_t *s, int64_t t) {
    const float *lr = s->lr;
    if (s->how == 2) return lr[t];
    float v = s->how == 1 ? 0.f : -INFINITY;
    for (int64_t g = 0; g < s->G; g++) {
        float x = lr[g * s->T + t];
        if (s->how == 1) v += x;
        else v = x - s->off[g] > v ? x - s->off[g] : v;
    }
    return v;
}

#ifdef HG_X86
/* score[t] = max over g < G of (lr[g*T + t] - off[g]): one pass over the G logit rows */
AVX2 static void group_max_avx2(const float *lr, int64_t T, int64_t G, const float *off, float *score) {
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(lr + t), _mm256_set1_ps(off[0]));
        for (int64_t g = 1; g < G; g++)
            v = _mm256_max_ps(v, _mm256_sub_ps(_mm256_loadu_ps(lr + g * T + t), _mm256_set1_ps(off[g])));
        _mm256_storeu_ps(score + t, v);
    }
    for (; t < T; t++) {
        float v = lr[t] - off[0];
        for (int64_t g = 1; g < G; g++) v = lr[g * T + t] - off[g] > v ? lr[g * T + t] - off[g] : v;
        score[t] = v;
    }
}

/* The tokens with score >= tau, 16 at a time: their positions to pos, scores to val (in
 * token order; both need 16 entries of slack past T); returns how many. */
AVX512 static int64_t collect_avx512(const scores_t *s, float tau, int32_t *pos, float *val) {
    const int64_t T = s->T, G = s->G;
    const __m512 tv = _mm512_set1_ps(tau);
    __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    int64_t n = 0;
    for (int64_t t = 0; t < T; t += 16) {
        __mmask16 in = T - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (T - t)) - 1u);
        __m512 v;
        if (s->how == 2) {
            v = _mm512_maskz_loadu_ps(in, s->lr + t);
        } else {
            v = s->how == 1 ? _mm512_setzero_ps() : _mm512_set1_ps(-INFINITY);
            for (int64_t g = 0; g < G; g++) {
                __m512 x = _mm512_maskz_loadu_ps(in, s->lr + g * T + t);
                v = s->how == 1 ? _mm512_add_ps(v, x) : _mm512_max_ps(v, _mm512_sub_ps(x, _mm512_set1_ps(s->off[g])));
            }
        }
        __mmask16 m = _mm512_mask_cmp_ps_mask(in, v, tv, _CMP_GE_OQ);
        /* compress in registers, then a full store (16 slots of slack): a compress-store to
         * memory is microcoded and slow on some CPUs (Zen 4) */
        _mm512_storeu_ps(val + n, _mm512_maskz_compress_ps(m, v));
        _mm512_storeu_si512((void *)(pos + n), _mm512_maskz_compress_epi32(m, lane));
        n += __builtin_popcount((unsigned)m);
        lane = _mm512_add_epi32(lane, sixteen);
    }
    return n;
}
#endif

static int64_t collect(const scores_t *s, float tau, int32_t *pos, float *val) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX512) return collect_avx512(s, tau, pos, val);
#endif
    int64_t n = 0;
    for (int64_t t = 0; t < s->T; t++) { /* branch-free append */
        float v = score_at(s, t);
        pos[n] = (int32_t)t;
        val[n] = v;
        n += v >= tau;
    }
    return n;
}

static void all_scores(const scores_t *s, float *score) {
#ifdef HG_X86
    if (s->how == 0 && s->G <= 8 && hg_isa() >= HG_ISA_AVX2) {
        group_max_avx2(s->lr, s->T, s->G, s->off, score);
        return;
    }
#endif
    for (int64_t t = 0; t < s->T; t++) score[t] = score_at(s, t);
}

/* Top-kk of the scores (ties: lower index first) into idx[0..kk) (ascending indices).
 * A strided sample of SAMPLE scores gives a threshold that about 1.3 kk + 32 scores pass;
 * one pass computes the scores and keeps those that pass (AVX-512: compress-stores, no
 * score array), and the radix select runs on them only (every score equal to the kk-th
 * largest passes, so the result is the full select's). When too few pass (an unlucky
 * sample) the radix select runs on every score. work: keys[T] uint32, pos[T] int32,
 * val[T] float. */
#define SAMPLE 1024
static void topk_row(const scores_t *s, int64_t kk, int64_t *idx, uint32_t *keys, int32_t *pos, float *val) {
    const int64_t T = s->T;
    if (kk >= T) {
        for (int64_t t = 0; t < T; t++) idx[t] = t;
        return;
    }
    if (kk <= 0) return;
    if (T > 4 * SAMPLE) {
        float smp[SAMPLE];
        int64_t spos[SAMPLE];
        int64_t stride = T / SAMPLE;
        for (int i = 0; i < SAMPLE; i++) smp[i] = score_at(s, i * stride);
        int64_t r = (int64_t)((double)kk * SAMPLE / T * 1.3) + 32;
        if (r < SAMPLE) {
            radix_topk(smp, SAMPLE, r, spos, keys);
            float tau = INFINITY;
            for (int64_t i = 0; i < r; i++) tau = smp[spos[i]] < tau ? smp[spos[i]] : tau;
            int64_t n = collect(s, tau, pos, val);
            if (n >= kk) {
                radix_topk(val, n, kk, idx, keys);
                for (int64_t i = 0; i < kk; i++) idx[i] = pos[idx[i]];
                return;
            }
        }
    }
    all_scores(s, val);
    radix_topk(val, T, kk, idx, keys);
}

/* logsumexp of head g of row r from the scan's block statistics st [R][nblk][G][2] */
static double lse_from_stats(const float *st, int64_t r, int64_t g, int64_t G, int64_t nblk) {
    const float *p = st + (r * nblk * G + g) * 2;
    float m = -INFINITY;
    for (int64_t b = 0; b < nblk; b++) m = p[b * G * 2] > m ? p[b * G * 2] : m;
    if (!(m > -INFINITY)) return 0.0;
    double sum = 0.0;
    for (int64_t b = 0; b < nblk; b++)
        if (p[b * G * 2] > -INFINITY) sum += (double)p[b * G * 2 + 1] * exp((double)p[b * G * 2] - (double)m);
    return (double)m + log(sum);
}


/* logsumexp of a head whose scan saw approx[0..n) where the exact logits are x[0..n):
 * log(exp(lse) - sum exp(approx) + sum exp(x)) (lse: the scan's, over every token) */
static double corrected_lse(double lse, const float *approx, const float *x, int64_t n) {
    float top = (float)lse;
    for (int64_t i = 0; i < n; i++) top = x[i] > top ? x[i] : top;
    if (!(top > -INFINITY)) return 0.0;
    double rest = exp(lse - top) - sumexp_row(approx, n, top); /* approx <= lse <= top */
    return top + log((rest > 0.0 ? rest : 0.0) + sumexp_row(x, n, top));
}

/* The logsumexp head g of row r is normalised by in the 'max' group score (hg_select) */
static float head_lse(const float *lr, const float *stats, const float *approx, int64_t r, int64_t g, int64_t G,
                      int64_t T, int64_t nblk) {
    if (!stats) return (float)lse_row(lr + g * T, T);
    double lse = lse_from_stats(stats, r, g, G, nblk);
    return (float)(approx ? corrected_lse(lse, approx + (r * G + g) * T, lr + g * T, T) : lse);
}

/* This thread's scratch of at least `bytes` (grown, never freed: the selection runs every
 * layer of every step, and a fresh allocation of this size page-faults each time). */
static uint8_t *thread_scratch(size_t bytes) {
    static __thread uint8_t *buf;
    static __thread size_t have;
    if (have < bytes) {
        uint8_t *p = (uint8_t *)realloc(buf, bytes);
        if (!p) return NULL;
        buf = p;
        have = bytes;
    }
    return buf;
}

/* Group scoring + partial top-k + the selected logits, per row r in [j0, j1).
 * logits [R*G][T] (R rows of G heads; masked entries already -inf); how: 0 = max over g of
 * (logit - logsumexp_t(logit of g)), 1 = sum over g, 2 = the row itself (G must be 1).
 * stats: the scan's block statistics [R][nblk][G][2] (max, sum exp) or NULL (then the
 * logsumexp takes two more passes over the row). approx: NULL, or (how 0 with stats: a re-
 * rank of candidates) their scan logits [R*G][T], and the logsumexp is the stats' with the
 * candidates' terms replaced by their exact ones (corrected_lse). idx [R][kk] int64 out
 * (unsorted, ascending token order); sel [R*G][kk] float32 out (the logits at idx, every head).
 * Returns 0, or -1 when the scratch (12*T bytes and some per thread) cannot be allocated. */
HG_API int hg_select(const float *logits, int64_t T, int64_t G, int64_t how, int64_t kk, int64_t *idx,
                     float *sel, const float *stats, int64_t nblk, const float *approx, int64_t j0, int64_t j1) {
    uint8_t *mine = thread_scratch((size_t)(12 * (T + 16)));
    if (!mine) return -1;
    float *val = (float *)mine;
    uint32_t *keys = (uint32_t *)(mine + 4 * (T + 16));
    int32_t *pos = (int32_t *)(mine + 8 * (T + 16));
    for (int64_t r = j0; r < j1; r++) {
        const float *lr = logits + r * G * T;
        float off[8] = {0};
        float *offs = off;
        if (how == 0 && G > 1) {
            if (G > 8 && !(offs = (float *)malloc((size_t)G * sizeof(float)))) return -1;
            for (int64_t g = 0; g < G; g++) offs[g] = head_lse(lr, stats, approx, r, g, G, T, nblk);
        }
        scores_t sc = {lr, T, G, (how == 2 || G == 1) ? 2 : how, offs};
        int64_t *ir = idx + r * kk;
        topk_row(&sc, kk, ir, keys, pos, val);
        if (offs != off) free(offs);
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < kk; i++) sel[(r * G + g) * kk + i] = lr[g * T + ir[i]];
    }
    return 0;
}

/* Gather rows of `row_bytes` bytes: dst[(r*per + h)*kk + i] = src row (r*cap + idx[(r*per + h)*kk + i]),
 * for selection rows s = r*per + h in [j0, j1) (per: selection rows per source row block,
 * i.e. G for per-head selection, 1 for shared). */
HG_API void hg_gather_rows(const uint8_t *src, int64_t cap, const int64_t *idx, int64_t kk, int64_t per,
                           uint8_t *dst, int64_t row_bytes, int64_t j0, int64_t j1) {
    for (int64_t sr = j0; sr < j1; sr++) {
        const uint8_t *base = src + (sr / per) * cap * row_bytes;
        const int64_t *is = idx + sr * kk;
        uint8_t *d = dst + sr * kk * row_bytes;
        for (int64_t i = 0; i < kk; i++) {
            if (i + PREFETCH_AHEAD < kk) prefetch_bytes(base + is[i + PREFETCH_AHEAD] * row_bytes, row_bytes);
            memcpy(d + i * row_bytes, base + is[i] * row_bytes, (size_t)row_bytes);
        }
    }
}
