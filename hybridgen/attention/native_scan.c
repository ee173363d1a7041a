/* HybridGen's CPU key scan, group scoring + partial top-k, and exact row logits (C, AVX2).
 *
 * Compiled on first use by hybridgen/attention/native.py (gcc/cc, -O3) into the cache
 * directory and called through ctypes, which releases the GIL: the CPU pool runs slices
 * [j0, j1) of the work on its threads. Every function has a portable C body; the x86-64
 * build adds AVX2+FMA bodies chosen at run time (__builtin_cpu_supports).
 *
 * Layout (as hybridgen/attention/cpu_scan.py hands it over): keys as rows, token t of the
 * (batch, KV head) pair bh at row bh*cap + t, D elements per row (bf16 as uint16 bits; the
 * int8 sketch 1 byte per element; the int4 sketch D/2 bytes: byte j holds element j in its
 * low nibble and element j + D/2 in its high nibble, both stored + 8). q [BH][G][D]
 * (float32; int16 for the int8 sketch, int8 for the int4 one, with one scale per (bh, g)),
 * out [BH][G][T] float32.
 *
 * Scan work item j = (bh, token block of `block` tokens). Lanes run over D; NT tokens are
 * processed together with G*NT vector accumulators, so each key vector is widened once for
 * all G heads of its group; the horizontal sums are paid once per (token, head) after the
 * whole row, 8 at a time (reduce8_*); rows are software-prefetched ahead of the stream.
 * A token-blocked (transposed) layout would do the same FMAs per key (G*D per token) and
 * the in-cache kernel is FMA-bound (~1.5 of 2 FMA/cycle on Zen3), so rows stay row-major.
 * Each scan can also emit per-(bh, block) softmax statistics (stats != NULL) for hg_select.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(HG_PORTABLE) /* -DHG_PORTABLE: portable C only */
#define HG_X86 1
#include <immintrin.h>
#endif

#define HG_API __attribute__((visibility("default")))
#ifndef PF_LOCALITY
#define PF_LOCALITY 1 /* prefetcht2 */
#endif

/* ---------------------------------------------------------------- portable bodies */
static inline float bf16_to_f32(uint16_t b) {
    uint32_t w = ((uint32_t)b) << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

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

/* int8 / int4 sketch: integer dot of the int16 query with the codes, times
 * qscale[bh*G+g] * kscale[bh*nsb + (t + t_off)/sblock] * scale. t_off: first scanned token
 * of the segment (the scales are per absolute block). qsum[bh*G+g]: sum of the int16 query
 * (int4 only: the +8 offset of the stored nibbles). */
static void scan_i8_c(const int16_t *q, const float *qscale, const int8_t *k, const float *kscale, int64_t nsb,
                      int64_t sblock, int64_t t_off, int64_t cap, float *out, float scale, int64_t T, int64_t D,
                      int64_t G, int64_t block, int64_t j0, int64_t j1) {
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
        for (int64_t t = t0; t < t1; t++) {
            const int8_t *row = k + (bh * cap + t + t_off) * D;
            float ks = kscale[bh * nsb + (t + t_off) / sblock] * scale;
            for (int64_t g = 0; g < G; g++) {
                const int16_t *qg = q + (bh * G + g) * D;
                int32_t acc = 0;
                for (int64_t d = 0; d < D; d++) acc += (int32_t)qg[d] * (int32_t)row[d];
                out[(bh * G + g) * T + t] = (float)acc * (qscale[bh * G + g] * ks);
            }
        }
    }
}

static void scan_i4_c(const int8_t *q, const float *qscale, const int32_t *qsum, const uint8_t *k,
                      const float *kscale, int64_t nsb, int64_t sblock, int64_t t_off, int64_t cap, float *out,
                      float scale, int64_t T, int64_t D, int64_t G, int64_t block, int64_t j0, int64_t j1) {
    int64_t nblk = (T + block - 1) / block, H = D / 2;
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
        for (int64_t t = t0; t < t1; t++) {
            const uint8_t *row = k + (bh * cap + t + t_off) * H;
            float ks = kscale[bh * nsb + (t + t_off) / sblock] * scale;
            for (int64_t g = 0; g < G; g++) {
                const int8_t *qg = q + (bh * G + g) * D;
                int32_t acc = 0;
                for (int64_t j = 0; j < H; j++)
                    acc += (int32_t)qg[j] * (row[j] & 15) + (int32_t)qg[j + H] * (row[j] >> 4);
                acc -= 8 * qsum[bh * G + g];
                out[(bh * G + g) * T + t] = (float)acc * (qscale[bh * G + g] * ks);
            }
        }
    }
}

#ifdef HG_X86
/* ---------------------------------------------------------------- AVX2 bodies */
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Software prefetch SCAN_PREFETCH_BYTES ahead of the stream (prefetches past the segment's
 * end are harmless: they never fault). An asm prefetch, not __builtin_prefetch: GCC 12 at
 * -O3 deleted the builtin's prefetches from these tiles (the prefetch-only loop was
 * vectorized away), so the tiles ran without them: 0.59-0.66 of plain read on cold keys at
 * 1 thread; with them 0.78-0.83 (a C harness of this file, Llama layer, batch 8, 32K tokens,
 * interleaved with a plain AVX2 read of the same size, 2-core dev VM).
 * PF_LOCALITY 1 = prefetcht2, 2 = prefetcht1, 3 = prefetcht0. */
#if PF_LOCALITY >= 3
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(a)))
#elif PF_LOCALITY == 2
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(a)))
#else
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht2 %0" : : "m"(*(const char *)(a)))
#endif
#ifndef SCAN_PREFETCH_BYTES
#define SCAN_PREFETCH_BYTES 6144
#endif
static inline void prefetch_rows(const void *p, int64_t bytes, int ok) {
    if (ok)
        for (int64_t o = 0; o < bytes; o += 64) PREFETCH_LINE((const char *)p + o);
}

/* 8 accumulators -> one vector of their 8 horizontal sums (lane i = sum of a_i) */
AVX2 static inline __m256 reduce8_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                     __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

AVX2 static inline __m256i reduce8_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3, __m256i a4, __m256i a5,
                                         __m256i a6, __m256i a7) {
    __m256i u0 = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    __m256i u1 = _mm256_hadd_epi32(_mm256_hadd_epi32(a4, a5), _mm256_hadd_epi32(a6, a7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

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
#define STORE_I(out_)                                                                               \
    if (GG * NN == 8) {                                                                            \
        int32_t tmp_[8];                                                                            \
        _mm256_storeu_si256((__m256i *)tmp_, reduce8_epi32(ACC(0), ACC(1 % (GG * NN)), ACC(2 % (GG * NN)),  \
                                                           ACC(3 % (GG * NN)), ACC(4 % (GG * NN)),          \
                                                           ACC(5 % (GG * NN)), ACC(6 % (GG * NN)),          \
                                                           ACC(7 % (GG * NN))));                   \
        for (int n = 0; n < NN; n++)                                                               \
            for (int g = 0; g < GG; g++) out_(n, g, tmp_[n * GG + g]);                              \
    } else {                                                                                        \
        for (int n = 0; n < NN; n++)                                                               \
            for (int g = 0; g < GG; g++) out_(n, g, hsum_epi32(acc[n][g]));                         \
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
            prefetch_rows((const char *)r + SCAN_PREFETCH_BYTES, NT_ * 2 * D, 1);                   \
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
            prefetch_rows((const char *)r + SCAN_PREFETCH_BYTES, NT_ * 4 * D, 1);                   \
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

/* int8 codes against the int16 query: 16 elements per vpmaddwd (D multiple of 16);
 * acc_out[token][g] int32 for the ntok tokens. */
#define I8_TILE(G_, NT_)                                                                            \
    AVX2 static void tile_i8_g##G_##_n##NT_(const int16_t *qb, const int8_t *r0, int64_t D, int64_t ntok, \
                                           int32_t *acc_out) { enum { GG = G_, NN = NT_ };                                      \
        for (int64_t i = 0; i < ntok; i += NT_) {                                                   \
            const int8_t *r = r0 + i * D;                                                           \
            prefetch_rows((const char *)r + SCAN_PREFETCH_BYTES, NT_ * D, 1);                       \
            __m256i acc[NT_][G_];                                                                   \
            for (int n = 0; n < NT_; n++)                                                           \
                for (int g = 0; g < G_; g++) acc[n][g] = _mm256_setzero_si256();                    \
            for (int64_t d = 0; d < D; d += 16) {                                                   \
                __m256i kv[NT_];                                                                    \
                for (int n = 0; n < NT_; n++)                                                       \
                    kv[n] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(r + n * D + d))); \
                for (int g = 0; g < G_; g++) { /* each query vector loaded once for the NT_ tokens */ \
                    __m256i qv = _mm256_loadu_si256((const __m256i *)(qb + g * D + d));             \
                    for (int n = 0; n < NT_; n++)                                                   \
                        acc[n][g] = _mm256_add_epi32(acc[n][g], _mm256_madd_epi16(qv, kv[n]));      \
                }                                                                                   \
            }                                                                                       \
            int32_t *o_ = acc_out + i * G_;                                                         \
            STORE_I(OUT_I)                                                                          \
        }                                                                                           \
    }
#define OUT_I(n, g, v) o_[(n) * GG + (g)] = (v)

/* int4 codes against the int8 query (vpmaddubsw: unsigned nibble x signed q, 32 products per
 * instruction; pair sums <= 2*15*127 fit int16 and the <= 4 per lane (H <= 128) are added in
 * int16 before one vpmaddwd widens them): 32 bytes = elements [j, j+32) (low nibbles) and
 * [j+H, j+H+32) (high). D multiple of 64, at most 256. */
#define I4_TILE(G_, NT_)                                                                            \
    AVX2 static void tile_i4_g##G_##_n##NT_(const int8_t *qb, const uint8_t *r0, int64_t D, int64_t ntok, \
                                           int32_t *acc_out) { enum { GG = G_, NN = NT_ };                                      \
        const int64_t H = D / 2;                                                                    \
        const __m256i lo_mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);                  \
        for (int64_t i = 0; i < ntok; i += NT_) {                                                   \
            const uint8_t *r = r0 + i * H;                                                          \
            prefetch_rows((const char *)r + SCAN_PREFETCH_BYTES, NT_ * H, 1);                       \
            __m256i acc[NT_][G_];                                                                   \
            for (int n = 0; n < NT_; n++)                                                           \
                for (int g = 0; g < G_; g++) acc[n][g] = _mm256_setzero_si256();                    \
            for (int64_t j = 0; j < H; j += 32) {                                                   \
                __m256i lo[NT_], hi[NT_];                                                           \
                for (int n = 0; n < NT_; n++) {                                                     \
                    __m256i x = _mm256_loadu_si256((const __m256i *)(r + n * H + j));               \
                    lo[n] = _mm256_and_si256(x, lo_mask);                                           \
                    hi[n] = _mm256_and_si256(_mm256_srli_epi16(x, 4), lo_mask);                     \
                }                                                                                   \
                for (int g = 0; g < G_; g++) { /* each query vector loaded once for the NT_ tokens */ \
                    __m256i ql = _mm256_loadu_si256((const __m256i *)(qb + g * D + j));             \
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(qb + g * D + H + j));         \
                    for (int n = 0; n < NT_; n++)                                                   \
                        acc[n][g] = _mm256_add_epi16(acc[n][g], _mm256_add_epi16(                   \
                            _mm256_maddubs_epi16(lo[n], ql), _mm256_maddubs_epi16(hi[n], qh)));     \
                }                                                                                   \
            }                                                                                       \
            for (int n = 0; n < NT_; n++)                                                           \
                for (int g = 0; g < G_; g++) acc[n][g] = _mm256_madd_epi16(acc[n][g], ones);        \
            int32_t *o_ = acc_out + i * G_;                                                         \
            STORE_I(OUT_I)                                                                          \
        }                                                                                           \
    }

#define ALL_TILES(M) M(1, 8) M(2, 4) M(3, 3) M(4, 2) M(5, 2) M(6, 1) M(7, 1) M(8, 1) \
                     M(1, 1) M(2, 1) M(3, 1) M(4, 1) M(5, 1)
ALL_TILES(BF16_TILE)
ALL_TILES(F32_TILE)
#define INT_TILES(M) M(1, 8) M(2, 4) M(3, 2) M(4, 2) M(5, 1) M(6, 1) M(7, 1) M(8, 1) \
                     M(1, 1) M(2, 1) M(3, 1) M(4, 1)
INT_TILES(I8_TILE)
INT_TILES(I4_TILE)

/* tokens per tile for G (must match the instantiations above) */
static inline int nt_float(int64_t G) { static const int nt[9] = {0, 8, 4, 3, 2, 2, 1, 1, 1}; return nt[G]; }
static inline int nt_int(int64_t G) { static const int nt[9] = {0, 8, 4, 2, 2, 1, 1, 1, 1}; return nt[G]; }

typedef void (*tile_bf16_fn)(const float *, const uint16_t *, int64_t, float *, int64_t, int64_t, float, int64_t);
typedef void (*tile_f32_fn)(const float *, const float *, int64_t, float *, int64_t, int64_t, float, int64_t);
typedef void (*tile_i8_fn)(const int16_t *, const int8_t *, int64_t, int64_t, int32_t *);
typedef void (*tile_i4_fn)(const int8_t *, const uint8_t *, int64_t, int64_t, int32_t *);
#define TILE_TABLE(kind, type)                                                                          \
    static const type kind##_wide[9] = {0, tile_##kind##_g1_n8, tile_##kind##_g2_n4, tile_##kind##_g3_n3, \
                                        tile_##kind##_g4_n2, tile_##kind##_g5_n2, tile_##kind##_g6_n1,    \
                                        tile_##kind##_g7_n1, tile_##kind##_g8_n1};                        \
    static const type kind##_one[9] = {0, tile_##kind##_g1_n1, tile_##kind##_g2_n1, tile_##kind##_g3_n1, \
                                       tile_##kind##_g4_n1, tile_##kind##_g5_n1, tile_##kind##_g6_n1,     \
                                       tile_##kind##_g7_n1, tile_##kind##_g8_n1};
TILE_TABLE(bf16, tile_bf16_fn)
TILE_TABLE(f32, tile_f32_fn)
#define ITILE_TABLE(kind, type)                                                                         \
    static const type kind##_wide[9] = {0, tile_##kind##_g1_n8, tile_##kind##_g2_n4, tile_##kind##_g3_n2, \
                                        tile_##kind##_g4_n2, tile_##kind##_g5_n1, tile_##kind##_g6_n1,    \
                                        tile_##kind##_g7_n1, tile_##kind##_g8_n1};                        \
    static const type kind##_one[9] = {0, tile_##kind##_g1_n1, tile_##kind##_g2_n1, tile_##kind##_g3_n1, \
                                       tile_##kind##_g4_n1, tile_##kind##_g5_n1, tile_##kind##_g6_n1,     \
                                       tile_##kind##_g7_n1, tile_##kind##_g8_n1};
ITILE_TABLE(i8, tile_i8_fn)
ITILE_TABLE(i4, tile_i4_fn)

static int have_avx2(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
}
#endif /* HG_X86 */

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
#endif

/* (max, sum of exp(logit - max)) per head over the job's tokens [t0, t1) of ob [G][T], to
 * st[2*g], st[2*g+1]: computed while the block's logits are still in L1, so the selection's
 * logsumexp needs no further pass over the logits. */
static void block_stats(const float *ob, int64_t T, int64_t G, int64_t t0, int64_t t1, float *st) {
#ifdef HG_X86
    if (have_avx2()) {
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

#define STATS_AFTER_JOB(job)                                                                 \
    do {                                                                                     \
        if (stats) {                                                                         \
            int64_t bh_ = (job) / nblk, b_ = (job) - bh_ * nblk, t0_ = b_ * block;           \
            int64_t t1_ = t0_ + block < T ? t0_ + block : T;                                 \
            block_stats(out + bh_ * G * T, T, G, t0_, t1_, stats + ((job) * G) * 2);        \
        }                                                                                    \
    } while (0)

/* ---------------------------------------------------------------- exported scans */
HG_API int hg_has_avx2(void) {
#ifdef HG_X86
    return have_avx2();
#else
    return 0;
#endif
}

HG_API void hg_scan_bf16(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                         int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (have_avx2() && D % 16 == 0 && D <= 512 && G >= 1 && G <= 8) {
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
    if (have_avx2() && D % 8 == 0 && G >= 1 && G <= 8) {
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

/* int32 sketch dot products accb [t1 - t0][G] -> logits ob[g * T + t] of one (bh, job):
 * (acc - 8 * qsum[g]) * qscale[g] * kscale[(t + t_off) / sblock] * scale (qsum NULL: int8
 * codes, no nibble offset; the int4 nibbles are stored + 8). */
static void scale_sketch_logits(const int32_t *accb, const int32_t *qsum, const float *qscale, const float *kscale,
                                int64_t sblock, int64_t t_off, float scale, float *ob, int64_t T, int64_t G,
                                int64_t t0, int64_t t1) {
    int64_t blk_end = -1;
    float ks = 0.f;
    for (int64_t t = t0; t < t1; t++) {
        if (t + t_off >= blk_end) {
            int64_t blk = (t + t_off) / sblock;
            blk_end = (blk + 1) * sblock;
            ks = kscale[blk] * scale;
        }
        const int32_t *a = accb + (t - t0) * G;
        for (int64_t g = 0; g < G; g++)
            ob[g * T + t] = (float)(a[g] - (qsum ? 8 * qsum[g] : 0)) * (qscale[g] * ks);
    }
}

HG_API void hg_scan_i8(const int16_t *q, const float *qscale, const int8_t *k, const float *kscale, int64_t nsb,
                       int64_t sblock, int64_t t_off, int64_t cap, float *out, float scale, int64_t T, int64_t D,
                       int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (have_avx2() && D % 16 == 0 && G >= 1 && G <= 8) {
        int64_t nblk = (T + block - 1) / block, nt = nt_int(G);
        int32_t *accb = (int32_t *)malloc((size_t)(block * G) * 4);
        if (!accb) return;
        for (int64_t job = j0; job < j1; job++) {
            int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
            const int16_t *qb = q + bh * G * D;
            float *ob = out + bh * G * T;
            int64_t nw = ((t1 - t0) / nt) * nt;
            i8_wide[G](qb, k + (bh * cap + t0 + t_off) * D, D, nw, accb);
            for (int64_t t = t0 + nw; t < t1; t++) i8_one[G](qb, k + (bh * cap + t + t_off) * D, D, 1, accb + (t - t0) * G);
            scale_sketch_logits(accb, NULL, qscale + bh * G, kscale + bh * nsb, sblock, t_off, scale, ob, T, G, t0, t1);
            STATS_AFTER_JOB(job);
        }
        free(accb);
        return;
    }
#endif
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        scan_i8_c(q, qscale, k, kscale, nsb, sblock, t_off, cap, out, scale, T, D, G, block, job, job + 1);
        STATS_AFTER_JOB(job);
    }
}

HG_API void hg_scan_i4(const int8_t *q, const float *qscale, const int32_t *qsum, const uint8_t *k,
                       const float *kscale, int64_t nsb, int64_t sblock, int64_t t_off, int64_t cap, float *out,
                       float scale, int64_t T, int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (have_avx2() && D % 64 == 0 && D <= 256 && G >= 1 && G <= 8) {
        int64_t nblk = (T + block - 1) / block, nt = nt_int(G), H = D / 2;
        int32_t *accb = (int32_t *)malloc((size_t)(block * G) * 4);
        if (!accb) return;
        for (int64_t job = j0; job < j1; job++) {
            int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
            const int8_t *qb = q + bh * G * D;
            float *ob = out + bh * G * T;
            int64_t nw = ((t1 - t0) / nt) * nt;
            i4_wide[G](qb, k + (bh * cap + t0 + t_off) * H, D, nw, accb);
            for (int64_t t = t0 + nw; t < t1; t++) i4_one[G](qb, k + (bh * cap + t + t_off) * H, D, 1, accb + (t - t0) * G);
            scale_sketch_logits(accb, qsum + bh * G, qscale + bh * G, kscale + bh * nsb, sblock, t_off, scale, ob, T, G, t0, t1);
            STATS_AFTER_JOB(job);
        }
        free(accb);
        return;
    }
#endif
    int64_t nblk = (T + block - 1) / block;
    for (int64_t job = j0; job < j1; job++) {
        scan_i4_c(q, qscale, qsum, k, kscale, nsb, sblock, t_off, cap, out, scale, T, D, G, block, job, job + 1);
        STATS_AFTER_JOB(job);
    }
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

AVX2 static double sumexp_row_avx2(const float *x, int64_t T, float m) {
    __m256 s = _mm256_setzero_ps(), mv = _mm256_set1_ps(m);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) s = _mm256_add_ps(s, exp_neg_ps(_mm256_sub_ps(_mm256_loadu_ps(x + t), mv)));
    double r = hsum_ps(s);
    for (; t < T; t++) r += expf(x[t] - m);
    return r;
}
#endif

/* logsumexp of x[0..T) (0 when no entry is finite, as torch's group_scores) */
static double lse_row(const float *x, int64_t T) {
#ifdef HG_X86
    if (have_avx2()) {
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

/* Top-kk of score[0..T) (ties: lower index first) into idx[0..kk) (ascending indices).
 * A strided sample of SAMPLE scores gives a threshold that about 1.3 kk + 32 scores pass;
 * one branch-free pass collects them and the radix select runs on those candidates only
 * (every score equal to the kk-th largest passes, so the result is the full select's).
 * When too few pass (an unlucky sample) the radix select runs on the whole row.
 * work: keys[T], cand[T] (int64), cval[T] (float). */
#define SAMPLE 1024
static void topk_row(const float *score, int64_t T, int64_t kk, int64_t *idx, uint32_t *keys, int64_t *cand,
                     float *cval) {
    if (kk >= T) {
        for (int64_t t = 0; t < T; t++) idx[t] = t;
        return;
    }
    if (kk <= 0) return;
    if (T > 4 * SAMPLE) {
        float smp[SAMPLE];
        int64_t spos[SAMPLE];
        int64_t stride = T / SAMPLE;
        for (int i = 0; i < SAMPLE; i++) smp[i] = score[i * stride];
        int64_t r = (int64_t)((double)kk * SAMPLE / T * 1.3) + 32;
        if (r < SAMPLE) {
            radix_topk(smp, SAMPLE, r, spos, keys);
            float tau = INFINITY;
            for (int64_t i = 0; i < r; i++) tau = smp[spos[i]] < tau ? smp[spos[i]] : tau;
            int64_t n = 0;
            for (int64_t t = 0; t < T; t++) {
                cand[n] = t;
                cval[n] = score[t];
                n += score[t] >= tau;
            }
            if (n >= kk) {
                radix_topk(cval, n, kk, idx, keys);
                for (int64_t i = 0; i < kk; i++) idx[i] = cand[idx[i]];
                return;
            }
        }
    }
    radix_topk(score, T, kk, idx, keys);
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
#endif

/* Group scoring + partial top-k + the selected logits, per row r in [j0, j1).
 * logits [R*G][T] (R rows of G heads; masked entries already -inf); how: 0 = max over g of
 * (logit - logsumexp_t(logit of g)), 1 = sum over g, 2 = the row itself (G must be 1).
 * stats: the scan's block statistics [R][nblk][G][2] (max, sum exp) or NULL (then the
 * logsumexp takes two more passes over the row). idx [R][kk] int64 out (unsorted, ascending
 * token order); sel [R*G][kk] float32 out (the logits at idx, every head).
 * Returns 0, or -1 when the scratch (20*T bytes per call) cannot be allocated. */
HG_API int hg_select(const float *logits, int64_t T, int64_t G, int64_t how, int64_t kk, int64_t *idx,
                     float *sel, const float *stats, int64_t nblk, int64_t j0, int64_t j1) {
    uint8_t *mine = (uint8_t *)malloc((size_t)(20 * T + 64));
    if (!mine) return -1;
    float *score = (float *)(mine);
    uint32_t *keys = (uint32_t *)(mine + 4 * T);
    int64_t *cand = (int64_t *)(mine + 8 * T + 8 - ((uintptr_t)(mine + 8 * T) & 7));
    float *cval = (float *)(cand + T);
    for (int64_t r = j0; r < j1; r++) {
        const float *lr = logits + r * G * T;
        if (how == 2 || G == 1) {
            memcpy(score, lr, 4 * T);
        } else if (how == 1) {
            for (int64_t t = 0; t < T; t++) score[t] = lr[t];
            for (int64_t g = 1; g < G; g++)
                for (int64_t t = 0; t < T; t++) score[t] += lr[g * T + t];
        } else {
            float off[8];
            for (int64_t g = 0; g < G && g < 8; g++)
                off[g] = (float)(stats ? lse_from_stats(stats, r, g, G, nblk) : lse_row(lr + g * T, T));
#ifdef HG_X86
            if (have_avx2() && G <= 8)
                group_max_avx2(lr, T, G, off, score);
            else
#endif
            {
                for (int64_t t = 0; t < T; t++) score[t] = lr[t] - off[0];
                for (int64_t g = 1; g < G; g++) {
                    float o = g < 8 ? off[g] : (float)(stats ? lse_from_stats(stats, r, g, G, nblk) : lse_row(lr + g * T, T));
                    for (int64_t t = 0; t < T; t++) {
                        float v = lr[g * T + t] - o;
                        score[t] = v > score[t] ? v : score[t];
                    }
                }
            }
        }
        int64_t *ir = idx + r * kk;
        topk_row(score, T, kk, ir, keys, cand, cval);
        for (int64_t g = 0; g < G; g++)
            for (int64_t i = 0; i < kk; i++) sel[(r * G + g) * kk + i] = lr[g * T + ir[i]];
    }
    free(mine);
    return 0;
}

#define PREFETCH_AHEAD 12 /* rows ahead: random rows are latency-bound without it */
static inline void prefetch_row(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o, 0, PF_LOCALITY);
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
        if (have_avx2() && D % 16 == 0 && D <= 512 && G >= 1 && G <= 8) {
            float qp[8 * 512], tmp[8];
            permute_q(qb, qp, G, D);
            for (int64_t i = 0; i < kk; i++) {
                if (i + PREFETCH_AHEAD < kk) prefetch_row(k + (r * cap + ir[i + PREFETCH_AHEAD]) * D, 2 * D);
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
            if (i + PREFETCH_AHEAD < kk) prefetch_row(base + is[i + PREFETCH_AHEAD] * row_bytes, row_bytes);
            memcpy(d + i * row_bytes, base + is[i] * row_bytes, (size_t)row_bytes);
        }
    }
}

/* ---------------------------------------------------------------- sketch quantization */
/* Quantize key blocks for the int8 / int4 sketch: job j in [j0, j1) is (bh, block b0 + j % nb)
 * of `sblock` tokens (the last one may end at T1). src: key rows (bf16 bits if src_bf16, else
 * float32), row of (bh, t) at bh*cap + t; codes: int8 rows [bh*cap_dst + t][D] (kind 8) or
 * uint8 [bh*cap_dst + t][D/2] (kind 4: byte j = (c[j] + 8) | (c[j + D/2] + 8) << 4);
 * scales [bh*nsb + block] = max|k| / qmax (1 when the block is all zero); code = round-half-
 * even(k / scale) clamped to +-qmax: the same numbers as the torch path of key_sketch.py. */
/* one row of D keys as float32 into x */
static inline void load_row(const void *src, int src_bf16, int64_t row, int64_t D, float *x) {
    if (src_bf16) {
        const uint16_t *p = (const uint16_t *)src + row;
        for (int64_t d = 0; d < D; d++) x[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(x, (const float *)src + row, (size_t)D * 4);
    }
}

#ifdef HG_X86
/* c[d] = clamp(round-half-even(x[d] / s), +-qmax) for d < D (D multiple of 8) */
AVX2 static void quant_row_avx2(const float *x, int64_t D, float s, float qmax, float *c) {
    __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
    for (int64_t d = 0; d < D; d += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + d), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_ps(c + d, _mm256_min_ps(hi, _mm256_max_ps(lo, v)));
    }
}
#endif

HG_API void hg_quantize(const void *src, int64_t src_bf16, int64_t cap, uint8_t *codes, int64_t cap_dst,
                        float *scales, int64_t nsb, int64_t sblock, int64_t kind, int64_t b0, int64_t nb, int64_t T1,
                        int64_t D, int64_t j0, int64_t j1) {
    const float qmax = kind == 8 ? 127.f : 7.f;
    float *x = (float *)malloc((size_t)D * 8), *c = x + D;
    if (!x) return;
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nb, b = b0 + job % nb;
        int64_t t0 = b * sblock, t1 = t0 + sblock < T1 ? t0 + sblock : T1;
        float amax = 0.f;
        for (int64_t t = t0; t < t1; t++) {
            load_row(src, (int)src_bf16, (bh * cap + t) * D, D, x);
            for (int64_t d = 0; d < D; d++) {
                float a = fabsf(x[d]);
                amax = a > amax ? a : amax;
            }
        }
        float s = amax > 0.f ? amax / qmax : 1.f;
        scales[bh * nsb + b] = s;
        for (int64_t t = t0; t < t1; t++) {
            load_row(src, (int)src_bf16, (bh * cap + t) * D, D, x);
#ifdef HG_X86
            if (have_avx2() && D % 8 == 0) {
                quant_row_avx2(x, D, s, qmax, c);
            } else
#endif
            {
                for (int64_t d = 0; d < D; d++) {
                    float v = nearbyintf(x[d] / s);
                    c[d] = v > qmax ? qmax : (v < -qmax ? -qmax : v);
                }
            }
            if (kind == 8) {
                int8_t *dst = (int8_t *)codes + (bh * cap_dst + t) * D;
                for (int64_t d = 0; d < D; d++) dst[d] = (int8_t)c[d];
            } else {
                int64_t H = D / 2;
                uint8_t *dst = codes + (bh * cap_dst + t) * H;
                for (int64_t j = 0; j < H; j++) dst[j] = (uint8_t)((int)c[j] + 8) | (uint8_t)(((int)c[j + H] + 8) << 4);
            }
        }
    }
    free(x);
}
