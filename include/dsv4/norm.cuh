// RMSNorm of the cache writers with the fixed summation order of cache-writers.md §1.2, written once
// for the CPU kernels (whole row) and the CUDA kernels (one row per warp, lane l owns group l), so
// that both produce the reference's bits on every finite row.
#pragma once

#include <cmath>

#include "dsv4/kv_layout.cuh"
#include "dsv4/rope.cuh"

namespace dsv4 {

// Step 1 of §1.2 on one group of G squares: halving inside the group (h = G/2, ..., 1); returns
// the group's partial. `q` is overwritten.
template <int G>
DSV4_HD float rms_group_partial(float* q) {
  for (int h = G / 2; h >= 1; h /= 2) {
    for (int j = 0; j < h; ++j) q[j] = add_rn(q[j], q[j + h]);
  }
  return q[0];
}

// r = 1 / sqrt(ss / D + eps): one rounded add, an IEEE square root, then an IEEE division (an
// approximate rsqrt would change bits). D is a power of two, so the device multiplies by 1 / D
// instead of dividing: both are the exact ss / D rounded once (also when it is subnormal), so the
// bits are the same and the warp skips a division sequence.
DSV4_HD float rms_inverse(float ss, int dim, float eps) {
#if defined(__CUDA_ARCH__)
  const float v = __fadd_rn(__fmul_rn(ss, 1.0f / float(dim)), eps);
  return __frcp_rn(__fsqrt_rn(v));
#else
  const float v = ss / float(dim) + eps;
  const float root = std::sqrt(v);
  return 1.0f / root;
#endif
}

// y_i = (x_i * r) * w_i, two rounded products in this order.
DSV4_HD float rms_scale(float x, float r, float w) { return mul_rn(mul_rn(x, r), w); }

// Whole-row RMSNorm (host): y = RMSNorm(x) * w for D = 32 * G (G = 16 for 512, 4 for 128).
template <int D>
inline void rms_norm_row(const float* x, const float* w, float eps, float* y) {
  constexpr int G = D / 32;
  float partial[32];
  for (int l = 0; l < 32; ++l) {
    float q[G];
    for (int j = 0; j < G; ++j) q[j] = mul_rn(x[G * l + j], x[G * l + j]);
    partial[l] = rms_group_partial<G>(q);
  }
  for (int h = 16; h >= 1; h /= 2) {
    for (int l = 0; l < h; ++l) partial[l] = add_rn(partial[l], partial[l + h]);
  }
  const float r = rms_inverse(partial[0], D, eps);
  for (int i = 0; i < D; ++i) y[i] = rms_scale(x[i], r, w[i]);
}

#if defined(__CUDACC__)
// Warp RMSNorm: this lane holds the G = D/32 values of group `lane` in x (and their weights in w)
// and receives its G outputs in y. Step 2 of §1.2 is shfl_xor with masks 16, 8, 4, 2, 1: lane l < h
// adds s_{l+h}, the others add the same two partials in the other order (fp32 add is commutative),
// so every lane ends with the same ss. All 32 lanes must call this.
template <int G>
__device__ __forceinline__ void warp_rms_norm(const float* x, const float* w, float eps, float* y) {
  float q[G];
#pragma unroll
  for (int j = 0; j < G; ++j) q[j] = __fmul_rn(x[j], x[j]);
  float s = rms_group_partial<G>(q);
#pragma unroll
  for (int mask = 16; mask >= 1; mask /= 2) s = __fadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, mask));
  const float r = rms_inverse(s, 32 * G, eps);
#pragma unroll
  for (int j = 0; j < G; ++j) y[j] = rms_scale(x[j], r, w[j]);
}

// RMSNorm of a D = 128 row held by an aligned group of 8 lanes (`mask`), lane s holding dims [16s, 16s+16),
// i.e. the four 4-dim groups 4s..4s+3 of §1.2. Step 1 stays in the lane; step 2's levels h = 16, 8, 4
// pair lane s with lane s ^ 4, ^ 2, ^ 1 (each lane adds the same two partials, in either order: fp32 add
// is commutative), and levels h = 2, 1 are the lane's own partials. All 8 lanes end with the same ss.
__device__ __forceinline__ void group_rms_norm128(const float* x, const float* w, float eps, unsigned mask,
                                                  float* y) {
  constexpr int G = 4, kLaneGroups = 4;
  float partial[kLaneGroups];
#pragma unroll
  for (int g = 0; g < kLaneGroups; ++g) {
    float q[G];
#pragma unroll
    for (int j = 0; j < G; ++j) q[j] = __fmul_rn(x[G * g + j], x[G * g + j]);
    partial[g] = rms_group_partial<G>(q);
  }
#pragma unroll
  for (int m = 4; m >= 1; m /= 2) {
#pragma unroll
    for (int g = 0; g < kLaneGroups; ++g) partial[g] = __fadd_rn(partial[g], __shfl_xor_sync(mask, partial[g], m));
  }
  const float s = __fadd_rn(__fadd_rn(partial[0], partial[2]), __fadd_rn(partial[1], partial[3]));
  const float r = rms_inverse(s, G * 32, eps);
#pragma unroll
  for (int j = 0; j < G * kLaneGroups; ++j) y[j] = rms_scale(x[j], r, w[j]);
}
#endif

}  // namespace dsv4
