// The orthonormal 128-point Walsh-Hadamard transform of the indexer compress path, evaluated in the
// fixed order of cache-writers.md §1.4 (butterflies h = 1, 2, ..., 64, then one multiply by the fp32
// nearest to 1/sqrt(128)): a whole-vector version for the CPU kernel and an 8-lane group version for
// CUDA.
#pragma once

#include "dsv4/kv_layout.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#if defined(__CUDACC__)
#include "dsv4/warp_quant.cuh"
#endif

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

// Group version: the 8 lanes of `mask` (an aligned group) hold one row, lane `sub` its v[16 sub .. 16 sub + 15].
// Stages h = 1..8 stay inside the lane; stage h = 16m (m = 1, 2, 4) pairs lane sub with lane sub ^ m: the
// lane with bit m clear holds v_i and keeps v_i + v_{i+h}, its partner holds v_{i+h} and keeps
// v_i - v_{i+h}. The butterflies of a stage are independent, so this is the host's order. Every lane of
// the group must call this.
__device__ __forceinline__ void group_hadamard128(float* v, int sub, unsigned mask) {
  constexpr int D = kIndexerGroupLaneDims;
#pragma unroll
  for (int h = 1; h < D; h *= 2) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      if (i & h) continue;
      const float a = v[i], b = v[i + h];
      v[i] = __fadd_rn(a, b);
      v[i + h] = __fsub_rn(a, b);
    }
  }
#pragma unroll
  for (int m = 1; m < kIndexerGroupLanes; m *= 2) {
    const bool upper = (sub & m) != 0;
#pragma unroll
    for (int k = 0; k < D; ++k) {
      const float partner = __shfl_xor_sync(mask, v[k], m);
      v[k] = upper ? __fsub_rn(partner, v[k]) : __fadd_rn(v[k], partner);
    }
  }
  const float scale = __uint_as_float(kHadamardScaleBits);
#pragma unroll
  for (int k = 0; k < D; ++k) v[k] = __fmul_rn(v[k], scale);
}
#endif

}  // namespace dsv4
