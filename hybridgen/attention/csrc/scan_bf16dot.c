/* The bf16-dot selection scan: logits of a bf16-rounded query against bf16 keys, bf16 x bf16
 * products (exact in fp32) summed with fp32 accumulation. For the SELECTION only: the caller
 * re-ranks an over-selected candidate set by exact fp32 logits (cpu_select.select_bf16dot).
 *
 * Layout and work items as hg_scan_bf16 (scan_exact.c): keys as rows (token t of (batch, KV
 * head) bh at row bh*cap + t, D bf16 elements as uint16 bits), q [BH][G][D] float32 whose
 * values the caller has rounded to bf16 (round to nearest even: every value is a bf16, so
 * its upper 16 bits ARE the bf16), out [BH][G][T] float32, work item j = (bh, token block);
 * with stats != NULL each item writes its softmax statistics (hg_block_stats).
 *
 * Bodies: AVX-512 BF16 (vdpbf16ps: 32 bf16 pairs per instruction into 16 fp32 lanes, four
 * times the multiply-adds of an AVX2 FMA; denormal inputs and results flush to zero) where
 * the CPU has it and the level is avx512; elsewhere hg_scan_bf16 on the rounded query (the
 * same exact bf16 x bf16 products, fp32 FMA accumulation: the AVX2 emulation, else the
 * portable C). Lanes over D (multiple of 32 for vdpbf16ps); NT tokens per iteration with
 * G*NT accumulators (each key vector loaded once for the group's G heads), horizontal sums
 * 8 at a time (reduce8_ps), software prefetch ahead of the stream, as the exact scan.
 */
#include "hg.h"

HG_API void hg_scan_bf16(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                         int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1);

static int bf16dot_hw = -1;

/* 1 when the CPU has AVX-512 BF16 (vdpbf16ps) and the level in use is avx512 */
HG_API int hg_has_bf16dot(void) {
#ifdef HG_X86
    if (bf16dot_hw < 0) {
        __builtin_cpu_init();
        bf16dot_hw = __builtin_cpu_supports("avx512bf16") ? 1 : 0;
    }
    return hg_isa() >= HG_ISA_AVX512 && bf16dot_hw;
#else
    return 0;
#endif
}

#ifdef HG_X86
#define AVX512BF16 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))


/* ntok (a multiple of NT_) tokens from row r0 on, NT_ at a time, G_ heads each; qb [G_][D] bf16 */
#define DP_TILE(G_, NT_)                                                                              \
    AVX512BF16 static void dp_tile_g##G_##_n##NT_(const uint16_t *qb, const uint16_t *r0, int64_t D, float *ob, \
                                                 int64_t T, int64_t t, float scale, int64_t ntok) {      \
        enum { NA = G_ * NT_ };                                                                       \
        for (int64_t i = 0; i < ntok; i += NT_) {                                                     \
            const uint16_t *r = r0 + i * D;                                                           \
            prefetch_bytes((const char *)r + SCAN_PREFETCH_BYTES, NT_ * 2 * D);                      \
            __m512 acc[NA];                                                                           \
            for (int a = 0; a < NA; a++) acc[a] = _mm512_setzero_ps();                               \
            for (int64_t d = 0; d < D; d += 32) {                                                     \
                __m512bh kv[NT_];                                                                     \
                for (int n = 0; n < NT_; n++) kv[n] = (__m512bh)_mm512_loadu_si512((const void *)(r + n * D + d)); \
                for (int g = 0; g < G_; g++) {                                                        \
                    __m512bh qv = (__m512bh)_mm512_loadu_si512((const void *)(qb + g * D + d));      \
                    for (int n = 0; n < NT_; n++) acc[n * G_ + g] = _mm512_dpbf16_ps(acc[n * G_ + g], qv, kv[n]); \
                }                                                                                     \
            }                                                                                         \
            float tmp[NA];                                                                            \
            int a = 0;                                                                                \
            for (; a + 8 <= NA; a += 8)                                                               \
                _mm256_storeu_ps(tmp + a, reduce8_ps(FOLD512(acc[a]), FOLD512(acc[a + 1]), FOLD512(acc[a + 2]), \
                                                     FOLD512(acc[a + 3]), FOLD512(acc[a + 4]), FOLD512(acc[a + 5]), \
                                                     FOLD512(acc[a + 6]), FOLD512(acc[a + 7])));              \
            for (; a < NA; a++) tmp[a] = hsum_ps(FOLD512(acc[a]));                                    \
            for (int n = 0; n < NT_; n++)                                                             \
                for (int g = 0; g < G_; g++) ob[g * T + t + i + n] = tmp[n * G_ + g] * scale;         \
        }                                                                                             \
    }
#define DP_TILES(M) M(1, 8) M(2, 8) M(3, 4) M(4, 4) M(5, 2) M(6, 2) M(7, 2) M(8, 2) \
                    M(1, 1) M(2, 1) M(3, 1) M(4, 1) M(5, 1) M(6, 1) M(7, 1) M(8, 1)
DP_TILES(DP_TILE)

typedef void (*dp_tile_fn)(const uint16_t *, const uint16_t *, int64_t, float *, int64_t, int64_t, float, int64_t);
static const dp_tile_fn dp_wide[9] = {0, dp_tile_g1_n8, dp_tile_g2_n8, dp_tile_g3_n4, dp_tile_g4_n4,
                                      dp_tile_g5_n2, dp_tile_g6_n2, dp_tile_g7_n2, dp_tile_g8_n2};
static const dp_tile_fn dp_one[9] = {0, dp_tile_g1_n1, dp_tile_g2_n1, dp_tile_g3_n1, dp_tile_g4_n1,
                                     dp_tile_g5_n1, dp_tile_g6_n1, dp_tile_g7_n1, dp_tile_g8_n1};
static const int dp_nt[9] = {0, 8, 8, 4, 4, 2, 2, 2, 2};
#endif /* HG_X86 */

/* Arguments as hg_scan_bf16; q holds bf16 values (see the top of this file). */
HG_API void hg_scan_bf16dot(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                            int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1) {
#ifdef HG_X86
    if (hg_has_bf16dot() && D % 32 == 0 && D <= 512 && G >= 1 && G <= 8) {
        int64_t nblk = (T + block - 1) / block, nt = dp_nt[G], last = -1;
        uint16_t qb[8 * 512];
        for (int64_t job = j0; job < j1; job++) {
            int64_t bh = job / nblk, t0 = (job - bh * nblk) * block, t1 = t0 + block < T ? t0 + block : T;
            if (bh != last) { /* the upper half of each fp32 word: exact for bf16 values */
                for (int64_t i = 0; i < G * D; i++) {
                    uint32_t w;
                    memcpy(&w, q + bh * G * D + i, 4);
                    qb[i] = (uint16_t)(w >> 16);
                }
                last = bh;
            }
            float *ob = out + bh * G * T;
            int64_t nw = ((t1 - t0) / nt) * nt;
            dp_wide[G](qb, k + (bh * cap + t0) * D, D, ob, T, t0, scale, nw);
            for (int64_t t = t0 + nw; t < t1; t++) dp_one[G](qb, k + (bh * cap + t) * D, D, ob, T, t, scale, 1);
            STATS_AFTER_JOB(job);
        }
        return;
    }
#endif
    hg_scan_bf16(q, k, cap, out, scale, T, D, G, block, stats, j0, j1);
}
