// The orthonormal 128-point Walsh-Hadamard transform of the indexer compress path, evaluated in the
// fixed order of cache-writers.md §1.4 (butterflies h = 1, 2, ..., 64, then one multiply by the fp32
// nearest to 1/sqrt(128)): a whole-vector version for the CPU kernel and a warp version for CUDA.
#pragma once

#include "dsv4/kv_layout.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"

namespace dsv4 {

// fp32 nearest to 1/sqrt(128) = 0.0883883476...
constexpr uint32_t kHadamardScaleBits = 0x3DB504F3u;

// In place on v[128] (host).
inline void hadamard128(float* v) {
  for (int h = 1; h < kIndexerDim; h *= 2) {
    for (int i = 0; i < kIndexerDim; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = add_rn(a, b);
      v[i + h] = sub_rn(a, b);
    }
  }
  const float c = bits_f32(kHadamardScaleBits);
  for (int i = 0; i < kIndexerDim; ++i) v[i] = mul_rn(v[i], c);
}

#if defined(__CUDACC__)
// Warp version: lane l holds v[4l .. 4l+3]. Stages h = 1, 2 stay inside the lane; stage h = 4m
// (m = 1, 2, 4, 8, 16) pairs lane l with lane l ^ m: the lane with bit m clear holds v_i and keeps
// v_i + v_{i+h}, its partner holds v_{i+h} and keeps v_i - v_{i+h}. All 32 lanes must call this.
__device__ __forceinline__ void warp_hadamard128(float* v, int lane) {
  float a = v[0], b = v[1], c = v[2], d = v[3];
  v[0] = __fadd_rn(a, b); v[1] = __fsub_rn(a, b);
  v[2] = __fadd_rn(c, d); v[3] = __fsub_rn(c, d);
  a = v[0]; b = v[1]; c = v[2]; d = v[3];
  v[0] = __fadd_rn(a, c); v[2] = __fsub_rn(a, c);
  v[1] = __fadd_rn(b, d); v[3] = __fsub_rn(b, d);
#pragma unroll
  for (int mask = 1; mask < 32; mask *= 2) {
    const bool upper = (lane & mask) != 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float partner = __shfl_xor_sync(0xFFFFFFFFu, v[k], mask);
      v[k] = upper ? __fsub_rn(partner, v[k]) : __fadd_rn(v[k], partner);
    }
  }
  const float scale = __uint_as_float(kHadamardScaleBits);
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = __fmul_rn(v[k], scale);
}
#endif

}  // namespace dsv4
