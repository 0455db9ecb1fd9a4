// The c2 compressor's pooling of an (even, odd) token pair: the closed-form 2-way softmax of
// compressors.md §1.5 per channel, in fp32 with an accurate exp, separately rounded products and an
// IEEE division, so that equal scores give exactly the mean. Shared by the CPU and CUDA kernels.
#pragma once

#include <cmath>

#include "dsv4/kv_layout.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"

namespace dsv4 {

// The score of the pad partner (a missing even token): it gets weight exp(-inf) = 0.
constexpr float kPadScore = -INFINITY;

// exp(v) for fp32 v. Device: CUDA's accurate expf (within 2 ulp; never the __expf intrinsic), since a
// float64 exp would add about half a microsecond of FP64 work to every warp of a latency-bound kernel.
// Host: the float64 exp rounded once to fp32, the correctly rounded value that the reference computes
// too. The two may differ in the last bit, which is why latents are compared with a tolerance.
DSV4_HD float exp_accurate(float v) {
#if defined(__CUDA_ARCH__)
  return expf(v);
#else
  return float(std::exp(double(v)));
#endif
}

// softmax([s_even, s_odd]) . [k_even, k_odd] = numerator / denominator, written with
// e = exp(-|s_even - s_odd|) <= 1, so that the larger score's value carries weight 1: no overflow and
// no max subtraction needed. A pad partner (k 0, score -inf) gives e = 0 and 0 + k_odd over 1.
struct PairPoolTerms {
  float numerator;
  float denominator;  // 1 + e, in [1, 2], or NaN when the score difference is NaN
};

DSV4_HD PairPoolTerms pair_pool_terms(float k_even, float s_even, float k_odd, float s_odd) {
  const float delta = sub_rn(s_even, s_odd);
  const float e = exp_accurate(-fabs_f32(delta));
  const float numerator =
      delta >= 0.0f ? add_rn(k_even, mul_rn(e, k_odd)) : add_rn(mul_rn(e, k_even), k_odd);
  return {numerator, add_rn(1.0f, e)};
}

DSV4_HD float pair_pool(float k_even, float s_even, float k_odd, float s_odd) {
  const PairPoolTerms t = pair_pool_terms(k_even, s_even, k_odd, s_odd);
  return div_rn(t.numerator, t.denominator);
}

#if defined(__CUDACC__)
// pair_pool for N channels of one thread, the same bits. __fdiv_rn compiles to a reciprocal-based fast
// path, a range check and a branch to a slow subroutine per division, and those branches serialize the
// channels: a latency-bound kernel then waits for N dependent exp + divide chains. Here the channels
// run div.rn's fast-path instructions side by side (one MUFU.RCP, one Newton step for the reciprocal,
// one residual correction of the quotient), and a thread falls back to __fdiv_rn unless every channel
// lies where that path is correctly rounded: a denominator in [1, 2] (never NaN) and a numerator with
// 2^-64 <= |n| <= 2^64. There no step underflows or overflows, so the path's result is its result for the
// numerator's mantissa in [1, 2) scaled by a power of two, an operand pair for which div.rn itself takes
// that path: the correctly rounded quotient. Zeros, subnormals, infinities and NaNs all take __fdiv_rn.
template <int N>
__device__ __forceinline__ void pair_pool_channels(const float* k_even, const float* s_even,
                                                   const float* k_odd, const float* s_odd, float* out) {
  PairPoolTerms t[N];
  bool fast_path_exact = true;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    t[i] = pair_pool_terms(k_even[i], s_even[i], k_odd[i], s_odd[i]);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(t[i].denominator));
    r = fmaf(r, fmaf(-t[i].denominator, r, 1.0f), r);
    const float q = __fmul_rn(t[i].numerator, r);
    out[i] = fmaf(fmaf(-t[i].denominator, q, t[i].numerator), r, q);
    const float magnitude = fabs_f32(t[i].numerator);
    fast_path_exact &= t[i].denominator <= 2.0f && magnitude >= 0x1p-64f && magnitude <= 0x1p64f;
  }
  if (!fast_path_exact) {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = __fdiv_rn(t[i].numerator, t[i].denominator);
  }
}
#endif

}  // namespace dsv4
