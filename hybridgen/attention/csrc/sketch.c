/* The key sketch of hybridgen/attention/key_sketch.py: quantization and the selection scan.
 *
 * Codes: per (bh, block of `sblock` tokens, channel c), asymmetric: lo = min and
 * s = (max - min) / L over the block's tokens (L = 255 for 8-bit codes, 15 for 4-bit; s = 0
 * when max == min), code u = rne((k - lo) / s) clamped to [0, L] (0 where s == 0). Keys have
 * outlier channels; a scale per channel keeps the small ones resolved (a single scale per
 * block left 4-bit codes with a recall of ~0.8 of the exact top-k on SmolLM2's keys; per
 * channel ~0.95, results/cpu_scan/README.md).
 * params [bh][nsb][2][D] float32: row 0 the scales s, row 1 the minima lo.
 * Codes are token-major in tiles of 16 tokens (sblock is a multiple of 16, so a tile never
 * straddles two blocks); tile i of bh starts at codes + (bh * ntiles + i) * TB:
 *   8-bit: TB = 16*D: for channel quad c, 64 bytes = 16 tokens x the codes of channels 4c..4c+3;
 *   4-bit: TB = 8*D:  for channel octet c, 64 bytes = 16 tokens x 4 bytes, byte b holds
 *                     code(8c + b) in its low nibble and code(8c + 4 + b) in its high one.
 * Tokens of a tile past the last quantized one have code 0.
 *
 * Scan: logit(t, g) = scale * (qs_g * sum_c q8_gc * u_tc + z_g) with, per block,
 * q'_gc = q_gc * s_c, qs_g = max_c |q'_gc| / 127 (1 when that is 0), q8_gc = rne(q'_gc / qs_g),
 * z_g = sum_c q_gc * lo_c (double): the keys' and the query's 8-bit rounding are the only
 * approximations. The integer dot products are exact and identical at every level:
 * AVX-512 VNNI vpdpbusd (16 tokens per vector, 4 channels per lane: no horizontal sums),
 * AVX2 vpmaddubsw + vpmaddwd (8 tokens per vector; 8-bit codes are split into nibbles so
 * no int16 pair sum saturates), portable C.
 */
#include "hg.h"

#define TILE 16

static inline int64_t tile_bytes(int64_t bits, int64_t D) { return TILE * D * bits / 8; }

/* ---------------------------------------------------------------- quantization */
static inline void load_row(const void *src, int src_bf16, int64_t row, int64_t D, float *x) {
    if (src_bf16) {
        const uint16_t *p = (const uint16_t *)src + row * D;
        for (int64_t d = 0; d < D; d++) x[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(x, (const float *)src + row * D, (size_t)D * 4);
    }
}

/* u[d] = clamp(rne((x[d] - lo[d]) / s[d]), 0, L), 0 where s[d] == 0 */
static void row_codes_c(const float *x, const float *s, const float *lo, float L, int64_t D, uint8_t *u) {
    for (int64_t d = 0; d < D; d++) {
        float v = s[d] > 0.f ? nearbyintf((x[d] - lo[d]) / s[d]) : 0.f;
        u[d] = (uint8_t)(v < 0.f ? 0.f : (v > L ? L : v));
    }
}

#ifdef HG_X86
AVX2 static void row_codes_avx2(const float *x, const float *s, const float *lo, float L, int64_t D, uint8_t *u) {
    const __m256 zero = _mm256_setzero_ps(), top = _mm256_set1_ps(L);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 sv = _mm256_loadu_ps(s + d);
        __m256 v = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + d), _mm256_loadu_ps(lo + d)), sv);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_and_ps(_mm256_min_ps(top, _mm256_max_ps(zero, v)), _mm256_cmp_ps(sv, zero, _CMP_GT_OQ));
        int32_t w[8];
        _mm256_storeu_si256((__m256i *)w, _mm256_cvtps_epi32(v));
        for (int i = 0; i < 8; i++) u[d + i] = (uint8_t)w[i];
    }
    row_codes_c(x + d, s + d, lo + d, L, D - d, u + d);
}
#endif

/* token n's codes u[D] into its tile (layout above) */
static void put_row(uint8_t *tile, int64_t bits, int64_t n, const uint8_t *u, int64_t D) {
    if (bits == 8) {
        for (int64_t c = 0; c < D / 4; c++) memcpy(tile + c * 64 + n * 4, u + 4 * c, 4);
    } else {
        for (int64_t c = 0; c < D / 8; c++)
            for (int b = 0; b < 4; b++) tile[c * 64 + n * 4 + b] = (uint8_t)(u[8 * c + b] | (u[8 * c + 4 + b] << 4));
    }
}

/* Codes of token t of bh with its block's parameters (s, lo) into its tile; x, u: D floats / bytes of work */
static void code_token(const void *src, int64_t src_bf16, int64_t cap, uint8_t *codes, int64_t ntiles, int64_t bits,
                       int64_t bh, int64_t t, int64_t D, const float *s, const float *lo, float *x, uint8_t *u) {
    const float L = bits == 8 ? 255.f : 15.f;
    load_row(src, (int)src_bf16, bh * cap + t, D, x);
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX2) row_codes_avx2(x, s, lo, L, D, u);
    else
#endif
        row_codes_c(x, s, lo, L, D, u);
    put_row(codes + (bh * ntiles + t / TILE) * tile_bytes(bits, D), bits, t % TILE, u, D);
}

/* Quantize block b of bh (tokens [b*sblock, b*sblock + sblock) up to T1): its parameters, and
 * every tile it overlaps (codes past T1: 0). work x: 3*D floats + D bytes. */
static void quantize_block(const void *src, int64_t src_bf16, int64_t cap, uint8_t *codes, int64_t ntiles,
                           float *params, int64_t nsb, int64_t sblock, int64_t bits, int64_t bh, int64_t b, int64_t T1,
                           int64_t D, float *x) {
    const float L = bits == 8 ? 255.f : 15.f;
    float *mn = x + D, *mx = x + 2 * D;
    uint8_t *u = (uint8_t *)(x + 3 * D);
    int64_t t0 = b * sblock, t1 = t0 + sblock < T1 ? t0 + sblock : T1;
    for (int64_t d = 0; d < D; d++) { mn[d] = INFINITY; mx[d] = -INFINITY; }
    for (int64_t t = t0; t < t1; t++) {
        load_row(src, (int)src_bf16, bh * cap + t, D, x);
        for (int64_t d = 0; d < D; d++) {
            mn[d] = x[d] < mn[d] ? x[d] : mn[d];
            mx[d] = x[d] > mx[d] ? x[d] : mx[d];
        }
    }
    float *s = params + (bh * nsb + b) * 2 * D, *lo = s + D;
    for (int64_t d = 0; d < D; d++) {
        s[d] = mx[d] > mn[d] ? (mx[d] - mn[d]) / L : 0.f;
        lo[d] = t1 > t0 ? mn[d] : 0.f;
    }
    const int64_t TB = tile_bytes(bits, D);
    for (int64_t i = t0 / TILE; i < (t1 + TILE - 1) / TILE; i++) memset(codes + (bh * ntiles + i) * TB, 0, (size_t)TB);
    for (int64_t t = t0; t < t1; t++) code_token(src, src_bf16, cap, codes, ntiles, bits, bh, t, D, s, lo, x, u);
}

/* Job j in [j0, j1) quantizes block b0 + j % nb of bh = j / nb (tokens [b*sblock, b*sblock +
 * sblock) up to T1). src: key rows (bf16 bits if src_bf16, else float32), row of (bh, t) at
 * bh*cap + t. Writes the block's parameters and every tile it overlaps (codes past T1: 0).
 * The same numbers as the torch path of key_sketch.py (elementwise IEEE operations only). */
HG_API void hg_sketch_quantize(const void *src, int64_t src_bf16, int64_t cap, uint8_t *codes, int64_t ntiles,
                               float *params, int64_t nsb, int64_t sblock, int64_t bits, int64_t b0, int64_t nb,
                               int64_t T1, int64_t D, int64_t j0, int64_t j1) {
    float *x = (float *)malloc((size_t)D * 13);
    if (!x) return;
    for (int64_t job = j0; job < j1; job++)
        quantize_block(src, src_bf16, cap, codes, ntiles, params, nsb, sblock, bits, job / nb, b0 + job % nb, T1, D, x);
    free(x);
}

/* ---------------------------------------------------------------- the query of one block */
/* q8 [G][D], a[g] = qs_g * scale, c[g] = z_g * scale for the block with params p = [s | lo]:
 * q8 = rne((q * s) * (1 / qs)), every step one IEEE operation, so every level gives the same
 * q8 and qs; z is summed in double. */
static void block_query_c(const float *q, const float *p, int64_t G, int64_t D, float scale, int8_t *q8, float *a,
                          float *c) {
    const float *s = p, *lo = p + D;
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        float amax = 0.f;
        double z = 0.0;
        for (int64_t d = 0; d < D; d++) {
            float v = fabsf(qg[d] * s[d]);
            amax = v > amax ? v : amax;
            z += (double)qg[d] * (double)lo[d];
        }
        float qs = amax > 0.f ? amax / 127.f : 1.f, inv = 1.f / qs;
        for (int64_t d = 0; d < D; d++) {
            float r = nearbyintf((qg[d] * s[d]) * inv);
            q8[g * D + d] = (int8_t)(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
        }
        a[g] = qs * scale;
        c[g] = (float)(z * (double)scale);
    }
}

#ifdef HG_X86
/* block_query_c, 8 channels per vector (D a multiple of 8) */
AVX2 static void block_query_avx2(const float *q, const float *p, int64_t G, int64_t D, float scale, int8_t *q8,
                                  float *a, float *c) {
    const float *s = p, *lo = p + D;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 top = _mm256_set1_ps(127.f), bot = _mm256_set1_ps(-127.f);
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        __m256 mx = _mm256_setzero_ps();
        __m256d z = _mm256_setzero_pd();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(qg + d), lv = _mm256_loadu_ps(lo + d);
            mx = _mm256_max_ps(mx, _mm256_and_ps(absmask, _mm256_mul_ps(qv, _mm256_loadu_ps(s + d))));
            z = _mm256_add_pd(z, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(qv)),
                                               _mm256_cvtps_pd(_mm256_castps256_ps128(lv))));
            z = _mm256_add_pd(z, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(qv, 1)),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(lv, 1))));
        }
        float m8[8];
        double z4[4];
        _mm256_storeu_ps(m8, mx);
        _mm256_storeu_pd(z4, z);
        float amax = 0.f;
        for (int i = 0; i < 8; i++) amax = m8[i] > amax ? m8[i] : amax;
        float qs = amax > 0.f ? amax / 127.f : 1.f;
        __m256 inv = _mm256_set1_ps(1.f / qs);
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(s + d)), inv);
            r = _mm256_min_ps(top, _mm256_max_ps(bot, _mm256_round_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            int32_t w[8];
            _mm256_storeu_si256((__m256i *)w, _mm256_cvtps_epi32(r));
            for (int i = 0; i < 8; i++) q8[g * D + d + i] = (int8_t)w[i];
        }
        a[g] = qs * scale;
        c[g] = (float)(((z4[0] + z4[1]) + (z4[2] + z4[3])) * (double)scale);
    }
}

/* block_query_c, 16 channels per vector (D a multiple of 16) */
AVX512 static void block_query_avx512(const float *q, const float *p, int64_t G, int64_t D, float scale, int8_t *q8,
                                      float *a, float *c) {
    const float *s = p, *lo = p + D;
    const __m512 top = _mm512_set1_ps(127.f), bot = _mm512_set1_ps(-127.f);
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * D;
        __m512 mx = _mm512_setzero_ps();
        __m512d z0 = _mm512_setzero_pd(), z1 = _mm512_setzero_pd();
        for (int64_t d = 0; d < D; d += 16) {
            __m512 qv = _mm512_loadu_ps(qg + d), lv = _mm512_loadu_ps(lo + d);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_mul_ps(qv, _mm512_loadu_ps(s + d))));
            z0 = _mm512_add_pd(z0, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(qv)),
                                                 _mm512_cvtps_pd(_mm512_castps512_ps256(lv))));
            z1 = _mm512_add_pd(z1, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(qv, 1)),
                                                 _mm512_cvtps_pd(_mm512_extractf32x8_ps(lv, 1))));
        }
        float amax = _mm512_reduce_max_ps(mx);
        float qs = amax > 0.f ? amax / 127.f : 1.f;
        __m512 inv = _mm512_set1_ps(1.f / qs);
        for (int64_t d = 0; d < D; d += 16) {
            __m512 r = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(s + d)), inv);
            r = _mm512_min_ps(top, _mm512_max_ps(bot, _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
            _mm_storeu_si128((__m128i *)(q8 + g * D + d), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
        }
        a[g] = qs * scale;
        c[g] = (float)(_mm512_reduce_add_pd(_mm512_add_pd(z0, z1)) * (double)scale);
    }
}
#endif

static void block_query(const float *q, const float *p, int64_t G, int64_t D, float scale, int8_t *q8, float *a,
                        float *c) {
#ifdef HG_X86
    if (hg_isa() >= HG_ISA_AVX512 && D % 16 == 0) {
        block_query_avx512(q, p, G, D, scale, q8, a, c);
        return;
    }
    if (hg_isa() >= HG_ISA_AVX2) {
        block_query_avx2(q, p, G, D, scale, q8, a, c);
        return;
    }
#endif
    block_query_c(q, p, G, D, scale, q8, a, c);
}

/* ---------------------------------------------------------------- one tile */
/* The logits of one tile: o[g*T + n] = fma(acc(g, n), a[g], c[g]) for its tokens n in
 * [n0, n1), acc(g, n) = sum_c q8[g][c] * u(n, c) (exact int32) */
static void tile_logits_c(const uint8_t *tile, int64_t bits, const int8_t *q8, int64_t G, int64_t D, const float *a,
                          const float *c, float *o, int64_t T, int64_t n0, int64_t n1) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t n = n0; n < n1; n++) {
            int32_t sum = 0;
            for (int64_t k = 0; k < D; k++) {
                int32_t u;
                if (bits == 8) {
                    u = tile[(k / 4) * 64 + n * 4 + k % 4];
                } else {
                    uint8_t b = tile[(k / 8) * 64 + n * 4 + (k % 8) % 4];
                    u = k % 8 < 4 ? (b & 15) : (b >> 4);
                }
                sum += (int32_t)q8[g * D + k] * u;
            }
            o[g * T + n] = fmaf((float)sum, a[g], c[g]);
        }
}

/* The logits of the tokens [s0, s1) of one block (ob[g*T + t], absolute t): its tiles in turn */
static void tiles_c(const uint8_t *cb, int64_t TB, int64_t s0, int64_t s1, int64_t bits, const int8_t *q8, int64_t G,
                    int64_t D, const float *a, const float *c, float *ob, int64_t T) {
    for (int64_t i = s0 / TILE; i * TILE < s1; i++) {
        int64_t n0 = s0 > i * TILE ? s0 - i * TILE : 0, n1 = s1 < i * TILE + TILE ? s1 - i * TILE : TILE;
        tile_logits_c(cb + i * TB, bits, q8, G, D, a, c, ob + i * TILE, T, n0, n1);
    }
}

#ifdef HG_X86
static inline int32_t quad(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* tiles_c with 16 tokens per vector, G (compile-time) accumulators, masked stores */
#define DOTS512(G_)                                                                                  \
    AVX512 static void dots512_g##G_(const uint8_t *cb, int64_t TB, int64_t s0, int64_t s1, int64_t bits,  \
                                     const int8_t *q8, int64_t D, const float *a, const float *c, float *ob, \
                                     int64_t T) {                                                    \
      __m512 av[G_], cv[G_];                                                                         \
      for (int g = 0; g < G_; g++) { av[g] = _mm512_set1_ps(a[g]); cv[g] = _mm512_set1_ps(c[g]); }  \
      for (int64_t i = s0 / TILE; i * TILE < s1; i++) {                                              \
        const uint8_t *tile = cb + i * TB;                                                           \
        int64_t n0 = s0 > i * TILE ? s0 - i * TILE : 0, n1 = s1 < i * TILE + TILE ? s1 - i * TILE : TILE; \
        prefetch_bytes(tile + 4 * TB, TB);                                                           \
        __m512i acc[G_];                                                                             \
        for (int g = 0; g < G_; g++) acc[g] = _mm512_setzero_si512();                                \
        if (bits == 8) {                                                                             \
            for (int64_t c = 0; c < D / 4; c++) {                                                    \
                __m512i u = _mm512_loadu_si512((const void *)(tile + c * 64));                       \
                for (int g = 0; g < G_; g++)                                                         \
                    acc[g] = _mm512_dpbusd_epi32(acc[g], u, _mm512_set1_epi32(quad(q8 + g * D + 4 * c))); \
            }                                                                                        \
        } else {                                                                                     \
            const __m512i m4 = _mm512_set1_epi8(15);                                                 \
            for (int64_t c = 0; c < D / 8; c++) {                                                    \
                __m512i x = _mm512_loadu_si512((const void *)(tile + c * 64));                       \
                __m512i lo = _mm512_and_si512(x, m4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), m4); \
                for (int g = 0; g < G_; g++) {                                                       \
                    acc[g] = _mm512_dpbusd_epi32(acc[g], lo, _mm512_set1_epi32(quad(q8 + g * D + 8 * c))); \
                    acc[g] = _mm512_dpbusd_epi32(acc[g], hi, _mm512_set1_epi32(quad(q8 + g * D + 8 * c + 4))); \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        __mmask16 keep = (__mmask16)(((1u << n1) - 1u) & ~((1u << n0) - 1u));                      \
        for (int g = 0; g < G_; g++)                                                                 \
            _mm512_mask_storeu_ps(ob + i * TILE + g * T, keep,                                       \
                                  _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[g]), av[g], cv[g]));        \
      }                                                                                              \
    }

/* tiles_c with 8 tokens per vector (two halves of a tile), G (compile-time) accumulators per
 * half; u8 x s8 through vpmaddubsw (int16 pair sums, at most 2*15*127 with nibbles) +
 * vpmaddwd; masked stores. */
#define DOTS256(G_)                                                                                  \
    AVX2 static void dots256_g##G_(const uint8_t *cb, int64_t TB, int64_t s0, int64_t s1, int64_t bits,    \
                                   const int8_t *q8, int64_t D, const float *a, const float *c, float *ob, \
                                   int64_t T) {                                                      \
      for (int64_t i = s0 / TILE; i * TILE < s1; i++) {                                              \
        const uint8_t *tile = cb + i * TB;                                                           \
        int64_t n0 = s0 > i * TILE ? s0 - i * TILE : 0, n1 = s1 < i * TILE + TILE ? s1 - i * TILE : TILE; \
        float *o = ob + i * TILE;                                                                    \
        prefetch_bytes(tile + 4 * TB, TB);                                                           \
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16); \
        for (int h = 0; h < 2; h++) {                                                                \
            __m256i acc[G_];                                                                         \
            for (int g = 0; g < G_; g++) acc[g] = _mm256_setzero_si256();                            \
            if (bits == 8) {                                                                         \
                for (int64_t c = 0; c < D / 4; c++) {                                                \
                    __m256i x = _mm256_loadu_si256((const __m256i *)(tile + c * 64 + h * 32));       \
                    __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4); \
                    for (int g = 0; g < G_; g++) {                                                   \
                        __m256i qv = _mm256_set1_epi32(quad(q8 + g * D + 4 * c));                    \
                        acc[g] = _mm256_add_epi32(acc[g], _mm256_add_epi32(                          \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(lo, qv), one),                    \
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, qv), sixteen)));              \
                    }                                                                                \
                }                                                                                    \
            } else {                                                                                 \
                for (int64_t c = 0; c < D / 8; c++) {                                                \
                    __m256i x = _mm256_loadu_si256((const __m256i *)(tile + c * 64 + h * 32));       \
                    __m256i lo = _mm256_and_si256(x, m4), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m4); \
                    for (int g = 0; g < G_; g++) {                                                   \
                        __m256i pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(quad(q8 + g * D + 8 * c)));   \
                        __m256i ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(quad(q8 + g * D + 8 * c + 4))); \
                        acc[g] = _mm256_add_epi32(acc[g], _mm256_madd_epi16(_mm256_add_epi16(pl, ph), one)); \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(h * 8)); \
            __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(lane, _mm256_set1_epi32((int)n0 - 1)),        \
                                            _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n1), lane));           \
            for (int g = 0; g < G_; g++)                                                             \
                _mm256_maskstore_ps(o + g * T + h * 8, keep, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[g]), \
                                    _mm256_set1_ps(a[g]), _mm256_set1_ps(c[g])));                   \
        }                                                                                            \
      }                                                                                              \
    }
#define EVERY_G(M) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8)
EVERY_G(DOTS512)
EVERY_G(DOTS256)
typedef void (*dots_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const int8_t *, int64_t, const float *,
                        const float *, float *, int64_t);
static const dots_fn dots512[9] = {0, dots512_g1, dots512_g2, dots512_g3, dots512_g4,
                                   dots512_g5, dots512_g6, dots512_g7, dots512_g8};
static const dots_fn dots256[9] = {0, dots256_g1, dots256_g2, dots256_g3, dots256_g4,
                                   dots256_g5, dots256_g6, dots256_g7, dots256_g8};
#endif /* HG_X86 */

/* ---------------------------------------------------------------- scan */
/* Sketch logits of tokens [0, T) (absolute t + t_off) for work items (bh, token block of
 * `block` tokens) j in [j0, j1): q [BH][G][D] float32 (G <= 8, D a multiple of 8, <= 512),
 * out [BH][G][ldo] float32 (tokens [0, T) of each row of ldo >= T), stats as hg_scan_bf16's. */
HG_API void hg_sketch_scan(const float *q, const uint8_t *codes, int64_t ntiles, const float *params, int64_t nsb,
                           int64_t sblock, int64_t bits, int64_t t_off, float *out, int64_t ldo, float scale,
                           int64_t T, int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
    if (G < 1 || G > 8 || D % 8 || D > 512) return;
    const int64_t nblk = (T + block - 1) / block, TB = tile_bytes(bits, D);
#ifdef HG_X86
    const int isa = hg_isa();
#endif
    int8_t q8[8 * 512];
    float a[8], c[8];
    for (int64_t job = j0; job < j1; job++) {
        int64_t bh = job / nblk, r0 = (job - bh * nblk) * block, r1 = r0 + block < T ? r0 + block : T;
        int64_t a0 = r0 + t_off, a1 = r1 + t_off;  /* absolute tokens of this item */
        const float *qb = q + bh * G * D;
        float *ob = out + bh * G * ldo - t_off;     /* ob[g*ldo + absolute t] */
        const uint8_t *cb = codes + bh * ntiles * TB;
        for (int64_t sb = a0 / sblock; sb * sblock < a1; sb++) {
            int64_t s0 = sb * sblock > a0 ? sb * sblock : a0, s1 = sb * sblock + sblock < a1 ? sb * sblock + sblock : a1;
            block_query(qb, params + (bh * nsb + sb) * 2 * D, G, D, scale, q8, a, c);
#ifdef HG_X86
            if (isa >= HG_ISA_AVX512) dots512[G](cb, TB, s0, s1, bits, q8, D, a, c, ob, ldo);
            else if (isa >= HG_ISA_AVX2) dots256[G](cb, TB, s0, s1, bits, q8, D, a, c, ob, ldo);
            else
#endif
                tiles_c(cb, TB, s0, s1, bits, q8, G, D, a, c, ob, ldo);
        }
        if (stats) hg_block_stats(out + bh * G * ldo, ldo, G, r0, r1, stats + job * G * 2);
    }
}
