// Flash-decoding kernels of hybridgen.attention.cuda, compiled at run time by NVRTC (CuPy RawModule).
// No CUDA headers are included (half/bf16 conversion by PTX / bit operations), so NVRTC needs no
// include path. Launch plans: hybridgen/attention/cuda/planning.py (argument order must match).
// Compile-time parameters: SCALAR_ID (0 fp32, 1 fp16, 2 bf16), HEAD_DIM, GROUP, NUM_WARPS.
#if SCALAR_ID == 0
typedef float scalar_t;
#define VEC 4
#else
typedef unsigned short scalar_t;
#define VEC 8
#endif

#define NVEC (HEAD_DIM / VEC)             // 16-byte vectors per row
#define LPR (NVEC < 32 ? NVEC : 32)       // lanes per row
#define VPL (NVEC / LPR)                  // vectors per lane
#define RPW (32 / LPR)                    // rows per warp
#define ROW_GROUPS (RPW * NUM_WARPS)      // rows in flight per block
#define EPL (VPL * VEC)                   // elements per lane

__device__ __forceinline__ float hg_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float hg_to_float(scalar_t x) {
#if SCALAR_ID == 0
  return x;
#elif SCALAR_ID == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#else
  return __uint_as_float(((unsigned int)x) << 16);
#endif
}

__device__ __forceinline__ scalar_t hg_from_float(float f) {
#if SCALAR_ID == 0
  return f;
#elif SCALAR_ID == 1
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                     // round to nearest even
  return (unsigned short)(u >> 16);
#endif
}

// One 16-byte vector (VEC elements) widened to fp32.
__device__ __forceinline__ void hg_load_vec(const scalar_t* __restrict__ p, float* out) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
#if SCALAR_ID == 0
  out[0] = __uint_as_float(raw.x);
  out[1] = __uint_as_float(raw.y);
  out[2] = __uint_as_float(raw.z);
  out[3] = __uint_as_float(raw.w);
#else
  const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = hg_to_float((unsigned short)(w[i] & 0xffffu));
    out[2 * i + 1] = hg_to_float((unsigned short)(w[i] >> 16));
  }
#endif
}

// A row of HEAD_DIM elements: lane j of its row group loads vectors j, j + LPR, ...
__device__ __forceinline__ void hg_load_row(const scalar_t* __restrict__ row, int j, float* out) {
#pragma unroll
  for (int u = 0; u < VPL; ++u) hg_load_vec(row + (j + u * LPR) * VEC, out + u * VEC);
}

// Sum over the LPR lanes of one row group (butterfly: every lane ends with the same value).
__device__ __forceinline__ float hg_row_sum(float s) {
#pragma unroll
  for (int off = LPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  return s;
}

// One block: (split, b * H + h). G query heads share KV head h (G = 1 and H = Hq for per-head
// value sets). GIVEN: logits read from `logits` [B, H*G, T] (last stride 1) instead of q.k.
// Writes unnormalised partials to workspace slot (split_offset + split) * rows_total + row.
template <int G, bool GIVEN>
__device__ __forceinline__ void hg_partial_body(
    const scalar_t* __restrict__ q, long long q_sb, long long q_sh,
    const scalar_t* __restrict__ k, long long k_sb, long long k_sh, long long k_st,
    const float* __restrict__ logits, long long l_sb, long long l_sh,
    const scalar_t* __restrict__ v, long long v_sb, long long v_sh, long long v_st,
    const unsigned char* __restrict__ mask, long long m_sb, long long m_sh,
    int H, int T, int tokens_per_split, float scale,
    float* __restrict__ ws_m, float* __restrict__ ws_l, float* __restrict__ ws_acc,
    int split_offset, int rows_total) {
  extern __shared__ float hg_smem[];
  const int split = blockIdx.x;
  const int b = blockIdx.y / H;
  const int h = blockIdx.y - b * H;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int rg_local = lane / LPR;
  const int rg = warp * RPW + rg_local;
  const int j = lane - rg_local * LPR;
  const int t0 = split * tokens_per_split;
  const int t1 = min(T, t0 + tokens_per_split);
  const float NEG_INF = hg_neg_inf();

  float qf[G][EPL];
  if (!GIVEN) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      hg_load_row(q + (long long)b * q_sb + (long long)(h * G + g) * q_sh, j, qf[g]);
#pragma unroll
      for (int e = 0; e < EPL; ++e) qf[g][e] *= scale;
    }
  }
  float m_run[G], l_run[G], acc[G][EPL];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m_run[g] = NEG_INF;
    l_run[g] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
  }

  const scalar_t* kh = GIVEN ? k : k + (long long)b * k_sb + (long long)h * k_sh;
  const scalar_t* vh = v + (long long)b * v_sb + (long long)h * v_sh;
  const unsigned char* mh = mask ? mask + (long long)b * m_sb + (long long)h * m_sh : mask;
  const float* lh = GIVEN ? logits + (long long)b * l_sb + (long long)(h * G) * l_sh : logits;

  // Uniform loop for the whole block (the shuffles need every lane of a warp).
  for (int base = t0; base < t1; base += 2 * ROW_GROUPS) {
    const int ta = base + rg;
    const int tb = ta + ROW_GROUPS;
    bool va_ok = ta < t1;
    bool vb_ok = tb < t1;
    if (mh) {
      va_ok = va_ok && mh[ta] != 0;
      vb_ok = vb_ok && mh[tb] != 0;
    }
    float sa[G], sb[G];
    if (GIVEN) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        sa[g] = va_ok ? lh[(long long)g * l_sh + ta] : NEG_INF;
        sb[g] = vb_ok ? lh[(long long)g * l_sh + tb] : NEG_INF;
      }
    }
    float ka[EPL], kb[EPL], xa[EPL], xb[EPL];
#pragma unroll
    for (int e = 0; e < EPL; ++e) { ka[e] = 0.f; kb[e] = 0.f; xa[e] = 0.f; xb[e] = 0.f; }
    if (!GIVEN) {
      if (va_ok) hg_load_row(kh + (long long)ta * k_st, j, ka);
      if (vb_ok) hg_load_row(kh + (long long)tb * k_st, j, kb);
    }
    if (va_ok) hg_load_row(vh + (long long)ta * v_st, j, xa);
    if (vb_ok) hg_load_row(vh + (long long)tb * v_st, j, xb);
    if (!GIVEN) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float pa = 0.f, pb = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) {
          pa = fmaf(qf[g][e], ka[e], pa);
          pb = fmaf(qf[g][e], kb[e], pb);
        }
        pa = hg_row_sum(pa);
        pb = hg_row_sum(pb);
        sa[g] = va_ok ? pa : NEG_INF;
        sb[g] = vb_ok ? pb : NEG_INF;
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float mn = fmaxf(m_run[g], fmaxf(sa[g], sb[g]));
      if (mn == NEG_INF) continue;  // nothing seen yet
      const float c = expf(m_run[g] - mn);
      const float pa = expf(sa[g] - mn);
      const float pb = expf(sb[g] - mn);
      l_run[g] = l_run[g] * c + pa + pb;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * c + pa * xa[e] + pb * xb[e];
      m_run[g] = mn;
    }
  }

  // Merge the block's row groups through shared memory.
  float* s_acc = hg_smem;                              // [ROW_GROUPS][G][HEAD_DIM]
  float* s_m = hg_smem + ROW_GROUPS * G * HEAD_DIM;    // [ROW_GROUPS][G]
  float* s_l = s_m + ROW_GROUPS * G;                   // [ROW_GROUPS][G]
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int u = 0; u < VPL; ++u) {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        s_acc[(rg * G + g) * HEAD_DIM + (j + u * LPR) * VEC + e] = acc[g][u * VEC + e];
    }
    if (j == 0) {
      s_m[rg * G + g] = m_run[g];
      s_l[rg * G + g] = l_run[g];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HEAD_DIM; idx += blockDim.x) {
    const int g = idx / HEAD_DIM;
    const int d = idx - g * HEAD_DIM;
    float M = NEG_INF;
    for (int r = 0; r < ROW_GROUPS; ++r) M = fmaxf(M, s_m[r * G + g]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF) {
      for (int r = 0; r < ROW_GROUPS; ++r) {
        const float w = expf(s_m[r * G + g] - M);
        L += s_l[r * G + g] * w;
        A += s_acc[(r * G + g) * HEAD_DIM + d] * w;
      }
    }
    const long long row = (long long)b * H * G + h * G + g;
    const long long slot = (long long)(split_offset + split) * rows_total + row;
    ws_acc[slot * HEAD_DIM + d] = A;
    if (d == 0) {
      ws_m[slot] = M;
      ws_l[slot] = L;
    }
  }
}

#define HG_PARTIAL_ARGS                                                                   \
    const scalar_t* __restrict__ q, long long q_sb, long long q_sh,                       \
    const scalar_t* __restrict__ k, long long k_sb, long long k_sh, long long k_st,       \
    const float* __restrict__ logits, long long l_sb, long long l_sh,                     \
    const scalar_t* __restrict__ v, long long v_sb, long long v_sh, long long v_st,       \
    const unsigned char* __restrict__ mask, long long m_sb, long long m_sh,               \
    int H, int T, int tokens_per_split, float scale,                                      \
    float* __restrict__ ws_m, float* __restrict__ ws_l, float* __restrict__ ws_acc,      \
    int split_offset, int rows_total
#define HG_PARTIAL_PASS q, q_sb, q_sh, k, k_sb, k_sh, k_st, logits, l_sb, l_sh, v, v_sb, v_sh, \
    v_st, mask, m_sb, m_sh, H, T, tokens_per_split, scale, ws_m, ws_l, ws_acc, split_offset, rows_total

extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_qk(HG_PARTIAL_ARGS) {
  hg_partial_body<GROUP, false>(HG_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_given_grouped(HG_PARTIAL_ARGS) {
  hg_partial_body<GROUP, true>(HG_PARTIAL_PASS);
}
extern "C" __global__ void __launch_bounds__(NUM_WARPS * 32) hg_partial_given_perhead(HG_PARTIAL_ARGS) {
  hg_partial_body<1, true>(HG_PARTIAL_PASS);
}

// One block per query-head row (b * Hq + hq): merge every partial of every part.
extern "C" __global__ void hg_combine(const float* __restrict__ ws_m, const float* __restrict__ ws_l,
                                      const float* __restrict__ ws_acc, int num_splits, int rows_total,
                                      scalar_t* __restrict__ out, float* __restrict__ lse) {
  const int row = blockIdx.x;
  const float NEG_INF = hg_neg_inf();
  float M = NEG_INF;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, ws_m[(long long)s * rows_total + row]);
  float L = 0.f;
  if (M != NEG_INF) {
    for (int s = 0; s < num_splits; ++s) {
      const long long slot = (long long)s * rows_total + row;
      L += ws_l[slot] * expf(ws_m[slot] - M);
    }
  }
  for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
    float A = 0.f;
    if (L > 0.f) {
      for (int s = 0; s < num_splits; ++s) {
        const long long slot = (long long)s * rows_total + row;
        A += ws_acc[slot * HEAD_DIM + d] * expf(ws_m[slot] - M);
      }
    }
    out[(long long)row * HEAD_DIM + d] = hg_from_float(L > 0.f ? A / L : 0.f);
  }
  if (threadIdx.x == 0 && lse) lse[row] = L > 0.f ? M + logf(L) : NEG_INF;
}
