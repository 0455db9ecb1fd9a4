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

// softmax([s_even, s_odd]) . [k_even, k_odd] written with e = exp(-|s_even - s_odd|) <= 1, so that
// the larger score's value carries weight 1: no overflow and no max subtraction needed. A pad partner
// (k 0, score -inf) gives e = 0 and returns 0 + k_odd.
DSV4_HD float pair_pool(float k_even, float s_even, float k_odd, float s_odd) {
  const float delta = sub_rn(s_even, s_odd);
  const float e = exp_accurate(-fabs_f32(delta));
  const float numerator =
      delta >= 0.0f ? add_rn(k_even, mul_rn(e, k_odd)) : add_rn(mul_rn(e, k_even), k_odd);
  return div_rn(numerator, add_rn(1.0f, e));
}

}  // namespace dsv4
