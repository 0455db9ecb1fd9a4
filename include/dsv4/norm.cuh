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
// RMSNorm of a D = 32 * G row held by an aligned group of 32 / LaneGroups lanes (`mask` names the lanes
// of the shuffles: the group, or the whole warp where every lane that has not exited calls this), each holding
// LaneGroups consecutive groups of G dims of §1.2 (x: its G * LaneGroups values, w: their weights; y
// receives its outputs). Step 1 stays in the lane. In step 2, a level h >= LaneGroups pairs group g
// with group g + h, which sits at the same place on lane ^ (h / LaneGroups): shfl_xor, where lane and
// partner add the same two partials in either order (fp32 add is commutative); the levels
// h < LaneGroups add the lane's own partials. Every lane of the group ends with the same ss.
// Used by a whole warp (LaneGroups 1) and by 8 lanes of a D = 128 row (G 4, LaneGroups 4).
template <int G, int LaneGroups>
__device__ __forceinline__ void lanes_rms_norm(const float* x, const float* w, float eps, unsigned mask,
                                               float* y) {
  float partial[LaneGroups];
#pragma unroll
  for (int g = 0; g < LaneGroups; ++g) {
    float q[G];
#pragma unroll
    for (int j = 0; j < G; ++j) q[j] = __fmul_rn(x[G * g + j], x[G * g + j]);
    partial[g] = rms_group_partial<G>(q);
  }
#pragma unroll
  for (int m = 16 / LaneGroups; m >= 1; m /= 2) {
#pragma unroll
    for (int g = 0; g < LaneGroups; ++g) partial[g] = __fadd_rn(partial[g], __shfl_xor_sync(mask, partial[g], m));
  }
#pragma unroll
  for (int h = LaneGroups / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int g = 0; g < h; ++g) partial[g] = __fadd_rn(partial[g], partial[g + h]);
  }
  const float r = rms_inverse(partial[0], 32 * G, eps);
#pragma unroll
  for (int j = 0; j < G * LaneGroups; ++j) y[j] = rms_scale(x[j], r, w[j]);
}

// Whole-warp RMSNorm: lane l holds group l (G values). All 32 lanes must call this.
template <int G>
__device__ __forceinline__ void warp_rms_norm(const float* x, const float* w, float eps, float* y) {
  lanes_rms_norm<G, 1>(x, w, eps, 0xFFFFFFFFu, y);
}
#endif

}  // namespace dsv4
