/* HybridGen's default CPU branch fused per (batch, KV head) row: the selection scan, the
 * selection of kc candidates, their exact fp32 logits, the re-rank to kk, and the V-row gather,
 * one row after another on each thread.
 *
 * The serial branch runs each stage over every row before the next stage starts, so the
 * scan's logits ([R][G][T] float32: 34 MB at batch 8 x 8 KV heads x 32K tokens) go out to
 * DRAM and come back for the selection, and the candidates' key rows, read again for their
 * exact logits, left the caches long before. Here a row's logits live in this thread's
 * scratch (G*T floats: 512 KB at G = 4, T = 32K, in L2) and its candidates' keys were just
 * streamed (T*D*2 bytes: 8 MB, mostly still in L3) or, after a sketch scan, are read in place.
 * Each stage is the serial branch's own kernel on that one row (hg_sketch_scan,
 * hg_scan_bf16dot, hg_select, hg_rows_bf16, hg_gather_rows), so the result is the serial
 * branch's, bit for bit.
 *
 * The scan: with no sketch (codes NULL), the bf16-dot scan of the row's T keys; with a key
 * sketch, the sketch's logits of its first ts tokens (its codes hold tokens t_off + [0, ts) of
 * the row: hg_sketch_scan's layout, ntiles tiles and nsb parameter blocks of sblock tokens per
 * row, `bits` per code) and the bf16-dot scan of the keys [ts, T) it does not hold yet, with
 * the block statistics of both parts in that order (as host_branch.sketch_scan).
 *
 * qb [R][G][D] float32 holding bf16 values (the bf16-dot scan's query); qx [R][G][D] float32
 * (the exact query, also the sketch's); k, v: bf16 rows as in the scan (row of (r, t) = r*cap + t
 * for keys, r*vcap + t for values, D elements); how: the group-score code of hg_select (0 max,
 * 1 sum, 2 raw for G = 1); kc >= kk candidates (kc == kk: no re-rank, the candidates' logits
 * are recomputed exactly); idx [R][kk] int64 (ascending); sel [R][G][kk] float32 (exact logits
 * at idx); v_out [R][kk][D] bf16; seconds [R][4]: each row's scan, selection, exact logits +
 * re-rank, gather (thread-seconds). Rows r in [j0, j1). Returns 0, or -1 when the per-thread
 * scratch cannot be allocated.
 */
#include <time.h>

#include "hg.h"

HG_API void hg_sketch_scan(const float *q, const uint8_t *codes, int64_t ntiles, const float *params, int64_t nsb,
                           int64_t sblock, int64_t bits, int64_t t_off, float *out, int64_t ldo, float scale,
                           int64_t T, int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1);
HG_API void hg_scan_bf16dot(const float *q, const uint16_t *k, int64_t cap, float *out, float scale, int64_t T,
                            int64_t D, int64_t G, int64_t block, float *stats, int64_t j0, int64_t j1);
HG_API int hg_select(const float *logits, int64_t T, int64_t G, int64_t how, int64_t kk, int64_t *idx,
                     float *sel, const float *stats, int64_t nblk, const float *approx, int64_t j0, int64_t j1);
HG_API void hg_rows_bf16(const float *q, const uint16_t *k, int64_t cap, const int64_t *idx, int64_t kk,
                         float *out, float scale, int64_t D, int64_t G, int64_t j0, int64_t j1);
HG_API void hg_gather_rows(const uint8_t *src, int64_t cap, const int64_t *idx, int64_t kk, int64_t per,
                           uint8_t *dst, int64_t row_bytes, int64_t j0, int64_t j1);

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* this thread's scratch of at least `bytes`, 64-byte aligned (grown, never freed: the branch
 * runs every layer of every step) */
static uint8_t *branch_scratch(size_t bytes) {
    static __thread uint8_t *buf;
    static __thread size_t have;
    if (have < bytes) {
        free(buf);
        buf = NULL;
        have = 0;
        if (posix_memalign((void **)&buf, 64, bytes)) return NULL;
        have = bytes;
    }
    return buf;
}

#define ALIGN64(n) (((n) + 63) & ~(size_t)63)

/* The scan stage of row r into logits [G][T] and stats [nblk][G][2] (see the top of this file);
 * tail: G*(T - ts) floats of scratch for the keys past the sketch. */
static void scan_row(const float *qb, const float *qx, const uint16_t *kr, int64_t cap, const uint8_t *codes,
                     int64_t ntiles, const float *params, int64_t nsb, int64_t sblock, int64_t bits, int64_t t_off,
                     int64_t ts, float scale, int64_t T, int64_t D, int64_t G, int64_t block, float *logits,
                     float *stats, float *tail) {
    if (!codes) {
        hg_scan_bf16dot(qb, kr, cap, logits, scale, T, D, G, block, stats, 0, (T + block - 1) / block);
        return;
    }
    int64_t nblk_s = (ts + block - 1) / block, rest = T - ts;
    if (ts)
        hg_sketch_scan(qx, codes, ntiles, params, nsb, sblock, bits, t_off, logits, T, scale, ts, D, G, block, stats,
                       0, nblk_s);
    if (rest) {
        hg_scan_bf16dot(qb, kr + ts * D, cap, tail, scale, rest, D, G, block, stats + nblk_s * G * 2, 0,
                        (rest + block - 1) / block);
        for (int64_t g = 0; g < G; g++) memcpy(logits + g * T + ts, tail + g * rest, (size_t)rest * 4);
    }
}

HG_API int hg_branch(const float *qb, const float *qx, const uint16_t *k, const uint16_t *v, int64_t cap, int64_t vcap,
                     const uint8_t *codes, int64_t ntiles, const float *params, int64_t nsb, int64_t sblock,
                     int64_t bits, int64_t t_off, int64_t ts, float scale, int64_t T, int64_t D, int64_t G,
                     int64_t block, int64_t how, int64_t kk, int64_t kc, int64_t *idx, float *sel, uint16_t *v_out,
                     double *seconds, int64_t j0, int64_t j1) {
    if (!codes) ts = 0;
    int64_t nblk = (ts + block - 1) / block + (T - ts + block - 1) / block;
    int64_t tb = 2 * D * bits; /* code bytes per tile of 16 tokens */
    size_t b_logits = ALIGN64((size_t)(G * T) * 4), b_stats = ALIGN64((size_t)(nblk * G * 2) * 4);
    size_t b_cand = ALIGN64((size_t)kc * 8), b_kc = ALIGN64((size_t)(G * kc) * 4);
    size_t b_tail = codes ? ALIGN64((size_t)(G * (T - ts)) * 4) : 0;
    uint8_t *mine = branch_scratch(b_logits + b_stats + b_cand + 2 * b_kc + ALIGN64((size_t)kk * 8) + b_tail);
    if (!mine) return -1;
    float *logits = (float *)mine, *stats = (float *)(mine + b_logits);
    int64_t *cand = (int64_t *)(mine + b_logits + b_stats);
    float *approx = (float *)(mine + b_logits + b_stats + b_cand), *exact = approx + b_kc / 4;
    int64_t *pos = (int64_t *)((uint8_t *)exact + b_kc);
    float *tail = (float *)((uint8_t *)pos + ALIGN64((size_t)kk * 8));
    int lse = G > 1 && how == 0; /* the re-rank normalises each head by the scan's (corrected) logsumexp */
    for (int64_t r = j0; r < j1; r++) {
        const uint16_t *kr = k + r * cap * D;
        int64_t *ir = idx + r * kk;
        float *sr = sel + r * G * kk;
        double t0 = seconds_now();
        scan_row(qb + r * G * D, qx + r * G * D, kr, cap, codes ? codes + r * ntiles * tb : NULL, ntiles,
                 codes ? params + r * nsb * 2 * D : NULL, nsb, sblock, bits, t_off, ts, scale, T, D, G, block,
                 logits, stats, tail);
        double t1 = seconds_now();
        if (hg_select(logits, T, G, how, kc, cand, approx, stats, nblk, NULL, 0, 1)) return -1;
        double t2 = seconds_now();
        if (kc > kk) {
            hg_rows_bf16(qx + r * G * D, kr, cap, cand, kc, exact, scale, D, G, 0, 1);
            if (hg_select(exact, kc, G, how, kk, pos, sr, lse ? stats : NULL, lse ? nblk : 0, lse ? approx : NULL, 0,
                          1))
                return -1;
            for (int64_t i = 0; i < kk; i++) ir[i] = cand[pos[i]];
        } else {
            memcpy(ir, cand, (size_t)kk * 8);
            hg_rows_bf16(qx + r * G * D, kr, cap, ir, kk, sr, scale, D, G, 0, 1);
        }
        double t3 = seconds_now();
        hg_gather_rows((const uint8_t *)(v + r * vcap * D), vcap, ir, kk, 1, (uint8_t *)(v_out + r * kk * D), 2 * D,
                       0, 1);
        double t4 = seconds_now();
        double *s = seconds + 4 * r;
        s[0] = t1 - t0, s[1] = t2 - t1, s[2] = t3 - t2, s[3] = t4 - t3;
    }
    return 0;
}
