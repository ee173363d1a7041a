/* Instruction-set level of the kernels: the CPU's, capped by hg_set_isa_limit (tests run
 * every level the CPU has on the same inputs; HYBRIDGEN_CPU_ISA sets the cap from Python). */
#include "hg.h"

static int detected = -1, limit = HG_ISA_AVX512;

static int detect(void) {
#ifdef HG_X86
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) return HG_ISA_PORTABLE;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return HG_ISA_AVX512;
    return HG_ISA_AVX2;
#else
    return HG_ISA_PORTABLE;
#endif
}

HG_INTERNAL int hg_isa(void) {
    if (detected < 0) detected = detect();
    return detected < limit ? detected : limit;
}

/* The level in use: 0 portable, 1 AVX2 + FMA, 2 AVX-512 + VNNI. */
HG_API int hg_isa_level(void) { return hg_isa(); }

/* Cap the level every kernel uses (0, 1 or 2); returns the level in use afterwards. */
HG_API int hg_set_isa_limit(int level) {
    limit = level < HG_ISA_PORTABLE ? HG_ISA_PORTABLE : (level > HG_ISA_AVX512 ? HG_ISA_AVX512 : level);
    return hg_isa();
}
