// RoPE on the 64-dim tail of a main row held one row per warp (lane l owns dims [16l, 16l+16), so
// lanes 28..31 hold the tail). Rotating the tail in place would run eight pairs serially on four
// lanes while 28 idle; here each lane rotates one pair instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

// This lane's (cos, sin) entries 2l, 2l+1 of the table row: the pair it rotates.
__device__ __forceinline__ float2 load_table_pair(const float* table_row, int lane) {
  const float* src = table_row + 2 * lane;
  if ((reinterpret_cast<uintptr_t>(src) & 7) == 0) return __ldg(reinterpret_cast<const float2*>(src));
  return make_float2(__ldg(src), __ldg(src + 1));
}

// Rotates the 64 tail dims held by lanes 28..31 (16 each), one pair per lane: the tail goes through
// this warp's 32 float2 (16-byte aligned) of shared memory, so the rotation (and its bf16 rounding when
// RoundAfter) costs one pair of work on all lanes instead of eight pairs serialized on four. Same
// operations per pair as rotating in place, so the same bits. `cs` = load_table_pair of the row's
// position. All lanes must call.
template <bool RoundAfter>
__device__ __forceinline__ void rotate_tail_across_warp(float* y, float2 cs, int lane, float2* tail) {
  __syncwarp();  // a previous call's reads of `tail` are done
  if (lane >= kRopeFirstLane) {
    float4* dst = reinterpret_cast<float4*>(tail + (lane - kRopeFirstLane) * (kLaneDims / 2));
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) dst[j / 4] = make_float4(y[j], y[j + 1], y[j + 2], y[j + 3]);
  }
  __syncwarp();
  float2 v = tail[lane];
  rotate_pair(v.x, v.y, cs.x, cs.y);
  if (RoundAfter) round_pair_to_bf16(v.x, v.y);
  tail[lane] = v;
  __syncwarp();
  if (lane >= kRopeFirstLane) {
    const float4* src = reinterpret_cast<const float4*>(tail + (lane - kRopeFirstLane) * (kLaneDims / 2));
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) {
      const float4 q = src[j / 4];
      y[j] = q.x; y[j + 1] = q.y; y[j + 2] = q.z; y[j + 3] = q.w;
    }
  }
}

}  // namespace dsv4
