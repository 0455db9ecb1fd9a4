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

// Group version: an aligned group of 8 lanes holds one row, lane `sub` its v[16 sub .. 16 sub + 15]; `mask`
// names the lanes of the warp barriers, the group or more (the whole warp where every lane of it that
// has not exited calls this). Stages h = 1..8 stay inside the lane. For h = 16, 32, 64 the row goes through
// `row` (shared memory, kHadamardRowFloats floats, 16-byte aligned, private to the group) and comes back
// transposed: lane `sub` then holds v[16k + 2 sub + e] (k = 0..7, e = 0, 1), so those stages pair k with
// k ^ 1, 2, 4 inside the lane too. The multiply by c happens there, and the row goes back to the lane's 16
// consecutive values. The butterflies of a stage are independent, so this is the host's order. (Exchanging
// the last three stages by shuffles instead cost a shuffle, two predicated adds and a move per value and
// stage: about 200 instructions per warp against about 30 here.) Every lane of `mask` that has not exited
// must call this.
//
// In `row`, v[16 s + j] sits at float kHadamardLaneFloats * s + j: the 4 padding floats per lane put the
// 16-byte chunks that the eight lanes store or load at once (one per lane, same j) on eight different bank
// quads, and the transposed accesses of a lane (v[16k + 2 sub + e] for all k) lie at one base plus
// constant offsets, so every access is one register plus an immediate.
constexpr int kHadamardLaneFloats = kIndexerGroupLaneDims + 4;
// The extra 16 floats put a half-warp's two rows on different banks.
constexpr int kHadamardRowFloats = kIndexerGroupLanes * kHadamardLaneFloats + 16;

__device__ __forceinline__ void butterfly(float& a, float& b) {
  const float sum = __fadd_rn(a, b);
  b = __fsub_rn(a, b);
  a = sum;
}

__device__ __forceinline__ void group_hadamard128(float* v, int sub, unsigned mask, float* row) {
  constexpr int D = kIndexerGroupLaneDims;  // 16
  static_assert(D == 16 && kIndexerGroupLanes == 8, "the transpose below assumes 8 lanes x 16 values");
#pragma unroll
  for (int h = 1; h < D; h *= 2) {
#pragma unroll
    for (int i = 0; i < D; ++i) {
      if ((i & h) == 0) butterfly(v[i], v[i + h]);
    }
  }
  float4* own = reinterpret_cast<float4*>(row + kHadamardLaneFloats * sub);  // v[16 sub .. 16 sub + 15]
#pragma unroll
  for (int c = 0; c < 4; ++c) own[c] = make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
  __syncwarp(mask);
  // u[2k + e] = v[16k + 2 sub + e].
  float2* column = reinterpret_cast<float2*>(row + 2 * sub);
  constexpr int kLaneStride = kHadamardLaneFloats / 2;  // in float2
  float u[D];
#pragma unroll
  for (int k = 0; k < D / 2; ++k) {
    const float2 t = column[kLaneStride * k];
    u[2 * k] = t.x;
    u[2 * k + 1] = t.y;
  }
#pragma unroll
  for (int m = 1; m < D / 2; m *= 2) {  // h = 16 m
#pragma unroll
    for (int k = 0; k < D / 2; ++k) {
      if ((k & m) == 0) {
        butterfly(u[2 * k], u[2 * (k + m)]);
        butterfly(u[2 * k + 1], u[2 * (k + m) + 1]);
      }
    }
  }
  const float scale = __uint_as_float(kHadamardScaleBits);
  __syncwarp(mask);  // every lane has read the row before it is overwritten
#pragma unroll
  for (int k = 0; k < D / 2; ++k) {
    column[kLaneStride * k] = make_float2(__fmul_rn(u[2 * k], scale), __fmul_rn(u[2 * k + 1], scale));
  }
  __syncwarp(mask);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float4 t = own[c];
    v[4 * c] = t.x;
    v[4 * c + 1] = t.y;
    v[4 * c + 2] = t.z;
    v[4 * c + 3] = t.w;
  }
}
#endif

}  // namespace dsv4
