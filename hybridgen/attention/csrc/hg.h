/* Shared declarations of HybridGen's CPU kernels (compiled together into one shared object by
 * hybridgen/attention/native.py; called through ctypes, which releases the GIL, with slices
 * [j0, j1) of the work on the CPU pool's threads).
 *
 * Every kernel has a portable C body; x86-64 builds add bodies for two instruction-set
 * levels, chosen per call from hg_isa() (the CPU's level, capped by hg_set_isa_limit):
 *   HG_ISA_AVX2   AVX2 + FMA
 *   HG_ISA_AVX512 AVX-512 F/BW/VL/DQ + VNNI (integer dot products: vpdpbusd)
 * Files: isa.c (levels), scan_exact.c (bf16/fp32 key scans, exact rows), sketch.c (key
 * sketch quantization and scan), select.c (block statistics, group score + top-k, gathers).
 */
#ifndef HG_H
#define HG_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && !defined(HG_PORTABLE) /* -DHG_PORTABLE: portable C only */
#define HG_X86 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#endif

#define HG_API __attribute__((visibility("default")))
#define HG_INTERNAL __attribute__((visibility("hidden")))

enum { HG_ISA_PORTABLE = 0, HG_ISA_AVX2 = 1, HG_ISA_AVX512 = 2 };
HG_INTERNAL int hg_isa(void); /* the level the kernels use now */

/* tokens per scan work item (= cpu_scan.TOKEN_BLOCK): each item also yields its softmax
 * statistics (max, sum exp) per head, see hg_block_stats */
HG_INTERNAL void hg_block_stats(const float *ob, int64_t T, int64_t G, int64_t t0, int64_t t1, float *st);
#define STATS_AFTER_JOB(job)                                                                  \
    do {                                                                                      \
        if (stats) {                                                                          \
            int64_t bh_ = (job) / nblk, b_ = (job) - bh_ * nblk, t0_ = b_ * block;            \
            int64_t t1_ = t0_ + block < T ? t0_ + block : T;                                  \
            hg_block_stats(out + bh_ * G * T, T, G, t0_, t1_, stats + ((job) * G) * 2);      \
        }                                                                                     \
    } while (0)

static inline float bf16_to_f32(uint16_t b) {
    uint32_t w = ((uint32_t)b) << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

/* Software prefetch ahead of a stream (prefetches past a buffer's end never fault). An asm
 * prefetch, not __builtin_prefetch: GCC 12 at -O3 deleted the builtin's prefetches from the
 * scan tiles (the prefetch-only loop was vectorized away). PF_LOCALITY 1 = prefetcht2,
 * 2 = prefetcht1, 3 = prefetcht0. */
#ifndef PF_LOCALITY
#define PF_LOCALITY 1
#endif
#ifdef HG_X86
#if PF_LOCALITY >= 3
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht0 %0" : : "m"(*(const char *)(a)))
#elif PF_LOCALITY == 2
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht1 %0" : : "m"(*(const char *)(a)))
#else
#define PREFETCH_LINE(a) __asm__ volatile("prefetcht2 %0" : : "m"(*(const char *)(a)))
#endif
#else
#define PREFETCH_LINE(a) __builtin_prefetch((const char *)(a), 0, PF_LOCALITY)
#endif
#ifndef SCAN_PREFETCH_BYTES
#define SCAN_PREFETCH_BYTES 6144
#endif
#define PREFETCH_AHEAD 12 /* rows ahead in gathers: random rows are latency-bound without it */
static inline void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) PREFETCH_LINE((const char *)p + o);
}

#ifdef HG_X86
AVX2 static inline float hsum_ps(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one 512-bit fp32 accumulator -> 256 bits (the two halves added; AVX-512 DQ bodies) */
#define FOLD512(a) _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps((a), 1))

/* 8 accumulators -> one vector of their 8 horizontal sums (lane i = sum of a_i) */
AVX2 static inline __m256 reduce8_ps(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                                     __m256 a7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#endif /* HG_H */
