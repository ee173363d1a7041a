/* The exact CPU key scans (bf16 / fp32 keys, fp32 query, fp32 accumulation) and the exact
 * logits of selected rows.
 *
 * Layout (as hybridgen/attention/cpu_scan.py hands it over): keys as rows, token t of the
 * (batch, KV head) pair bh at row bh*cap + t, D elements per row (bf16 as uint16 bits).
 * q [BH][G][D] float32, out [BH][G][T] float32. Work item j = (bh, token block of `block`
 * tokens); with stats != NULL each item also writes its softmax statistics (hg_block_stats).
 *
 * AVX2 tiles: lanes run over D; NT tokens are processed together with G*NT vector
 * accumulators, so each key vector is widened once for all G heads of its group; the
 * horizontal sums are paid once per (token, head) after the whole row, 8 at a time
 * (reduce8_ps); rows are software-prefetched ahead of the stream. The scan does G*D fp32
 * FMAs per key row whatever the layout, so on a core whose read bandwidth outruns its FMAs
 * (the 2-core development VM: ~26 GB/s per core) it is compute-bound at one thread; a token-
 * blocked layout removes the horizontal sums but not the FMAs (the key sketch, sketch.c,
 * uses one: integer dot products, no FMAs).
 */
#include "hg.h"

/* ---------------------------------------------------------------- portable bodies */
static void scan_bf16_c(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                        int64_t D, int64_t G, int64_t block, int64_t j0, int64_t j1) {
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
        for (int64_t t = t0; t < t1; t++) {
            const uint16_t *row = k + (bh * cap + t) * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + (bh * G + g) * D;
                float acc = 0.f;
                for (int64_t d = 0; d < D; d++) acc += qg[d] * bf16_to_f32(row[d]);
                out[(bh * G + g) * T + t] = acc * scale;
            }
        }
    }
}

static void scan_f32_c(const float *q, const float *k, int64_t cap, float *out, float scale, int64_t T,
                       int64_t D, int64_t G, int64_t block, int64_t j0, int64_t j1) {
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
        for (int64_t t = t0; t < t1; t++) {
            const float *row = k + (bh * cap + t) * D;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + (bh * G + g) * D;
                float acc = 0.f;
                for (int64_t d = 0; d < D; d++) acc += qg[d] * row[d];
                out[(bh * G + g) * T + t] = acc * scale;
            }
        }
    }
}

#ifdef HG_X86
/* ---------------------------------------------------------------- AVX2 bodies */
#define ACC(i) acc[(i) / GG][(i) % GG]
/* results of one tile: out_(n, g, value) for its NN tokens x GG heads (reduce8 when 8 of them) */
#define STORE_F(out_)                                                                               \
    if (GG * NN == 8) {                                                                            \
        float tmp_[8];                                                                              \
        _mm256_storeu_ps(tmp_, reduce8_ps(ACC(0), ACC(1 % (GG * NN)), ACC(2 % (GG * NN)), ACC(3 % (GG * NN)), \
                                          ACC(4 % (GG * NN)), ACC(5 % (GG * NN)), ACC(6 % (GG * NN)),   \
                                          ACC(7 % (GG * NN))));                                    \
        for (int n = 0; n < NN; n++)                                                               \
            for (int g = 0; g < GG; g++) out_(n, g, tmp_[n * GG + g]);                              \
    } else {                                                                                        \
        for (int n = 0; n < NN; n++)                                                               \
            for (int g = 0; g < GG; g++) out_(n, g, hsum_ps(acc[n][g]));                            \
    }

/* ntok (a multiple of NT_) tokens from row r0 on, NT_ at a time, G_ heads each: lanes over D.
 * bf16: one 256-bit load holds 16 keys as 8 uint32 words; `and 0xffff0000` is the odd
 * elements as fp32, `<< 16` the even ones (exact), so qp is the query permuted per
 * 16-element chunk as [8 even, 8 odd] (permute_q). D multiple of 16. */
#define BF16_TILE(G_, NT_)                                                                          \
    AVX2 static void tile_bf16_g##G_##_n##NT_(const float *qb, const uint16_t *r0, int64_t D, float *ob,   \
                                             int64_t T, int64_t t, float scale, int64_t ntok) { enum { GG = G_, NN = NT_ };       \
        const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);                                \
        for (int64_t i = 0; i < ntok; i += NT_) {                                                   \
            const uint16_t *r = r0 + i * D;                                                         \
            prefetch_bytes((const char *)r + SCAN_PREFETCH_BYTES, NT_ * 2 * D);                \
            __m256 acc[NT_][G_];                                                                    \
            for (int n = 0; n < NT_; n++)                                                           \
                for (int g = 0; g < G_; g++) acc[n][g] = _mm256_setzero_ps();                       \
            for (int64_t d = 0; d < D; d += 16) {                                                   \
                __m256 ke[NT_], ko[NT_];                                                            \
                for (int n = 0; n < NT_; n++) {                                                     \
                    __m256i w = _mm256_loadu_si256((const __m256i *)(r + n * D + d));               \
                    ke[n] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));                          \
                    ko[n] = _mm256_castsi256_ps(_mm256_and_si256(w, hi_mask));                      \
                }                                                                                   \
                for (int g = 0; g < G_; g++) { /* each query vector loaded once for the NT_ tokens */ \
                    __m256 qe = _mm256_loadu_ps(qb + g * D + d), qo = _mm256_loadu_ps(qb + g * D + d + 8); \
                    for (int n = 0; n < NT_; n++) acc[n][g] = _mm256_fmadd_ps(qe, ke[n], acc[n][g]); \
                    for (int n = 0; n < NT_; n++) acc[n][g] = _mm256_fmadd_ps(qo, ko[n], acc[n][g]); \
                }                                                                                   \
            }                                                                                       \
            float *o_ = ob + t + i;                                                                 \
            STORE_F(OUT_F)                                                                          \
        }                                                                                           \
    }
#define OUT_F(n, g, v) o_[(g) * T + (n)] = (v) * scale

/* q [G][D] -> qp [G][D]: each 16-element chunk as [even elements, odd elements] */
static void permute_q(const float *q, float *qp, int64_t G, int64_t D) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d += 16)
            for (int i = 0; i < 8; i++) {
                qp[g * D + d + i] = q[g * D + d + 2 * i];
                qp[g * D + d + 8 + i] = q[g * D + d + 2 * i + 1];
            }
}

#define F32_TILE(G_, NT_)                                                                           \
    AVX2 static void tile_f32_g##G_##_n##NT_(const float *qb, const float *r0, int64_t D, float *ob,      \
                                            int64_t T, int64_t t, float scale, int64_t ntok) { enum { GG = G_, NN = NT_ };        \
        for (int64_t i = 0; i < ntok; i += NT_) {                                                   \
            const float *r = r0 + i * D;                                                            \
            prefetch_bytes((const char *)r + SCAN_PREFETCH_BYTES, NT_ * 4 * D);                \
            __m256 acc[NT_][G_];                                                                    \
            for (int n = 0; n < NT_; n++)                                                           \
                for (int g = 0; g < G_; g++) acc[n][g] = _mm256_setzero_ps();                       \
            for (int64_t d = 0; d < D; d += 8) {                                                    \
                for (int n = 0; n < NT_; n++) {                                                     \
                    __m256 kv = _mm256_loadu_ps(r + n * D + d);                                     \
                    for (int g = 0; g < G_; g++)                                                    \
                        acc[n][g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), kv, acc[n][g]); \
                }                                                                                   \
            }                                                                                       \
            float *o_ = ob + t + i;                                                                 \
            STORE_F(OUT_F)                                                                          \
        }                                                                                           \
    }


#define ALL_TILES(M) M(1, 8) M(2, 4) M(3, 3) M(4, 2) M(5, 2) M(6, 1) M(7, 1) M(8, 1) \
                     M(1, 1) M(2, 1) M(3, 1) M(4, 1) M(5, 1)
ALL_TILES(BF16_TILE)
ALL_TILES(F32_TILE)

/* tokens per tile for G (must match the instantiations above) */
static inline int nt_float(int64_t G) { static const int nt[9] = {0, 8, 4, 3, 2, 2, 1, 1, 1}; return nt[G]; }

typedef void (*tile_bf16_fn)(const float *, const uint16_t *, int64_t, float *, int64_t, int64_t, float, int64_t);
typedef void (*tile_f32_fn)(const float *, const float *, int64_t, float *, int64_t, int64_t, float, int64_t);
#define TILE_TABLE(kind, type)                                                                          \
    static const type kind##_wide[9] = {0, tile_##kind##_g1_n8, tile_##kind##_g2_n4, tile_##kind##_g3_n3, \
                                        tile_##kind##_g4_n2, tile_##kind##_g5_n2, tile_##kind##_g6_n1,    \
                                        tile_##kind##_g7_n1, tile_##kind##_g8_n1};                        \
    static const type kind##_one[9] = {0, tile_##kind##_g1_n1, tile_##kind##_g2_n1, tile_##kind##_g3_n1, \
                                       tile_##kind##_g4_n1, tile_##kind##_g5_n1, tile_##kind##_g6_n1,     \
                                       tile_##kind##_g7_n1, tile_##kind##_g8_n1};
TILE_TABLE(bf16, tile_bf16_fn)
TILE_TABLE(f32, tile_f32_fn)

/* AVX-512 exact logits of NT_ gathered rows x G_ heads at once (rows[n] -> o[n*G_ + g]): lanes
 * over 32 elements, each bf16 vector widened to its even and odd elements (fp32) once for all
 * heads; qp is the query permuted per 32-element chunk as [16 even, 16 odd] (permute_q32).
 * Several rows at once keep the FMA chains short (one row alone waits on the FMA latency). */
static void permute_q32(const float *q, float *qp, int64_t G, int64_t D) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d += 32)
            for (int i = 0; i < 16; i++) {
                qp[g * D + d + i] = q[g * D + d + 2 * i];
                qp[g * D + d + 16 + i] = q[g * D + d + 2 * i + 1];
            }
}

#define ROWS512(G_, NT_)                                                                             \
    AVX512 static void rows512_g##G_(const float *qp, const uint16_t *const *rows, int64_t D, float scale, \
                                     float *o) {                                                     \
        const __m512i hi_mask = _mm512_set1_epi32((int)0xffff0000u);                                 \
        __m512 acc[NT_][G_];                                                                         \
        for (int n = 0; n < NT_; n++)                                                                \
            for (int g = 0; g < G_; g++) acc[n][g] = _mm512_setzero_ps();                            \
        for (int64_t d = 0; d < D; d += 32) {                                                        \
            __m512 ke[NT_], ko[NT_];                                                                 \
            for (int n = 0; n < NT_; n++) {                                                          \
                __m512i w = _mm512_loadu_si512((const void *)(rows[n] + d));                         \
                ke[n] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));                               \
                ko[n] = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));                           \
            }                                                                                        \
            for (int g = 0; g < G_; g++) {                                                           \
                __m512 qe = _mm512_loadu_ps(qp + g * D + d), qo = _mm512_loadu_ps(qp + g * D + d + 16); \
                for (int n = 0; n < NT_; n++)                                                        \
                    acc[n][g] = _mm512_fmadd_ps(qo, ko[n], _mm512_fmadd_ps(qe, ke[n], acc[n][g]));   \
            }                                                                                        \
        }                                                                                            \
        enum { NA = NT_ * G_ };                                                                      \
        const __m512 *a = &acc[0][0];                                                                \
        int i = 0;                                                                                   \
        for (; i + 8 <= NA; i += 8) /* eight horizontal sums at once, in token-major order */        \
            _mm256_storeu_ps(o + i, _mm256_mul_ps(reduce8_ps(FOLD512(a[i]), FOLD512(a[i + 1]), FOLD512(a[i + 2]), \
                                                             FOLD512(a[i + 3]), FOLD512(a[i + 4]), FOLD512(a[i + 5]), \
                                                             FOLD512(a[i + 6]), FOLD512(a[i + 7])),  \
                                                  _mm256_set1_ps(scale)));                           \
        for (; i < NA; i++) o[i] = hsum_ps(FOLD512(a[i])) * scale;                                   \
    }
ROWS512(1, 8) ROWS512(2, 4) ROWS512(3, 4) ROWS512(4, 4) ROWS512(5, 2) ROWS512(6, 2) ROWS512(7, 2) ROWS512(8, 2)
typedef void (*rows512_fn)(const float *, const uint16_t *const *, int64_t, float, float *);
static const rows512_fn rows512[9] = {0, rows512_g1, rows512_g2, rows512_g3, rows512_g4,
                                      rows512_g5, rows512_g6, rows512_g7, rows512_g8};
static const int rows512_nt[9] = {0, 8, 4, 4, 4, 2, 2, 2, 2};
#endif /* HG_X86 */

/* ---------------------------------------------------------------- exported */
HG_API void hg_scan_bf16(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                         int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX2 && D % 16 == 0 && D <= 512 && G >= 1 && G <= 8) {
        int64_t nblk = (T + block - 1) / block, nt = nt_float(G), last = -1;
        float qp[8 * 512];
        for (int64_t job = j0; job < j1; job++) {
            int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
            if (bh != last) { permute_q(q + bh * G * D, qp, G, D); last = bh; }
            float *ob = out + bh * G * T;
            int64_t nw = ((t1 - t0) / nt) * nt;
            bf16_wide[G](qp, k + (bh * cap + t0) * D, D, ob, T, t0, scale, nw);
            for (int64_t t = t0 + nw; t < t1; t++) bf16_one[G](qp, k + (bh * cap + t) * D, D, ob, T, t, scale, 1);
            STATS_AFTER_JOB(job);
        }
        return;
    }
#endif
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        scan_bf16_c(q, k, cap, out, scale, T, D, G, block, job, job + 1);
        STATS_AFTER_JOB(job);
    }
}

HG_API void hg_scan_f32(const float *q, const float *k, int64_t cap, float *out, float scale, int64_t T,
                        int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX2 && D % 8 == 0 && G >= 1 && G <= 8) {
        int64_t nblk = (T + block - 1) / block, nt = nt_float(G);
        for (int64_t job = j0; job < j1; job++) {
            int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
            const float *qb = q + bh * G * D;
            float *ob = out + bh * G * T;
            int64_t nw = ((t1 - t0) / nt) * nt;
            f32_wide[G](qb, k + (bh * cap + t0) * D, D, ob, T, t0, scale, nw);
            for (int64_t t = t0 + nw; t < t1; t++) f32_one[G](qb, k + (bh * cap + t) * D, D, ob, T, t, scale, 1);
            STATS_AFTER_JOB(job);
        }
        return;
    }
#endif
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        scan_f32_c(q, k, cap, out, scale, T, D, G, block, job, job + 1);
        STATS_AFTER_JOB(job);
    }
}

/* Exact fp32 logits of the selected rows straight from the bf16 key rows (no gather copy).
 * q [R][G][D] f32; k rows as in the scan (row of (r, t) = r*cap + t); idx [R][kk] int64;
 * out [R][G][kk]; rows r in [j0, j1). */
HG_API void hg_rows_bf16(const float *q, const uint16_t *k, int64_t cap, const int64_t *idx, int64_t kk,
                         float *out, float scale, int64_t D, int64_t G, int64_t j0, int64_t j1) {
    for (int64_t r = j0; r < j1; r++) {
        const float *qb = q + r * G * D;
        const int64_t *ir = idx + r * kk;
#ifdef HG_X86
        if (hg_isa() >= HG_ISA_AVX512 && D % 32 == 0 && D <= 512 && G >= 1 && G <= 8) {
            float qp[8 * 512], tmp[16];
            const uint16_t *rows[8];
            permute_q32(qb, qp, G, D);
            const int nt = rows512_nt[G];
            for (int64_t i = 0; i < kk; i += nt) {
                for (int n = 0; n < nt; n++) {
                    int64_t j = i + n < kk ? i + n : kk - 1; /* the tail repeats the last row */
                    rows[n] = k + (r * cap + ir[j]) * D;
                    if (j + PREFETCH_AHEAD < kk) prefetch_bytes(k + (r * cap + ir[j + PREFETCH_AHEAD]) * D, 2 * D);
                }
                rows512[G](qp, rows, D, scale, tmp);
                for (int n = 0; n < nt && i + n < kk; n++)
                    for (int64_t g = 0; g < G; g++) out[(r * G + g) * kk + i + n] = tmp[n * G + g];
            }
            continue;
        }
        if (hg_isa() >= HG_ISA_AVX2 && D % 16 == 0 && D <= 512 && G >= 1 && G <= 8) {
            float qp[8 * 512], tmp[8];
            permute_q(qb, qp, G, D);
            for (int64_t i = 0; i < kk; i++) {
                if (i + PREFETCH_AHEAD < kk) prefetch_bytes(k + (r * cap + ir[i + PREFETCH_AHEAD]) * D, 2 * D);
                bf16_one[G](qp, k + (r * cap + ir[i]) * D, D, tmp, 1, 0, scale, 1); /* tmp[g] */
                for (int64_t g = 0; g < G; g++) out[(r * G + g) * kk + i] = tmp[g];
            }
            continue;
        }
#endif
        for (int64_t i = 0; i < kk; i++) {
            const uint16_t *row = k + (r * cap + ir[i]) * D;
            for (int64_t g = 0; g < G; g++) {
                float acc = 0.f;
                for (int64_t d = 0; d < D; d++) acc += qb[g * D + d] * bf16_to_f32(row[d]);
                out[(r * G + g) * kk + i] = acc * scale;
            }
        }
    }
}
