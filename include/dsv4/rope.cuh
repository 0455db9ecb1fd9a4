// GPT-J (interleaved pair) RoPE rotation and separately rounded fp32 arithmetic (no FMA
// contraction), shared by the CPU and CUDA writers.
#pragma once

#include "dsv4/kv_layout.cuh"

namespace dsv4 {

DSV4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;  // the build passes -ffp-contract=off
#endif
}
DSV4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
DSV4_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
// IEEE round-to-nearest division (never a reciprocal multiply).
DSV4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Forward rotation of the pair (re, im) by (c, s) = (cos, sin): re' = re*c - im*s, im' = re*s + im*c,
// each product and the sum/difference rounded separately.
DSV4_HD void rotate_pair(float& re, float& im, float c, float s) {
  const float new_re = sub_rn(mul_rn(re, c), mul_rn(im, s));
  const float new_im = add_rn(mul_rn(re, s), mul_rn(im, c));
  re = new_re;
  im = new_im;
}

}  // namespace dsv4
