// RoPE on the 64-dim tail of a main row held one row per warp (lane l owns dims [16l, 16l+16), so
// lanes 28..31 hold the tail). Rotating the tail in place would run eight pairs serially on four
// lanes while 28 idle; here each lane rotates one pair instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/packed_lane.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

// This lane's (cos, sin) entries 2l, 2l+1 of the table row: the pair it rotates.
__device__ __forceinline__ float2 load_table_pair(const float* table_row, int lane) {
  const float* src = table_row + 2 * lane;
  if ((reinterpret_cast<uintptr_t>(src) & 7) == 0) return load_input(reinterpret_cast<const float2*>(src));
  return make_float2(load_input(src), load_input(src + 1));
}

// Rotates the 64 tail dims held by lanes 28..31 (16 each), one pair per lane: the tail goes through
// this warp's 32 float2 (16-byte aligned) of shared memory, so the rotation costs one pair of work on all
// lanes instead of eight pairs serialized on four. Same operations per pair as rotating in place, so the
// same bits. V4's fp32 tail; `cs` = load_table_pair of the row's position. All lanes must call.
// No barrier opens a call: a tail lane's stores only follow its own reads of the previous call, and every
// other access of that call ended before the barrier that preceded them.
__device__ __forceinline__ void rotate_tail_across_warp(float* y, float2 cs, int lane, float2* tail) {
  if (lane >= kRopeFirstLane) {
    float4* dst = reinterpret_cast<float4*>(tail + (lane - kRopeFirstLane) * (kLaneDims / 2));
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) dst[j / 4] = make_float4(y[j], y[j + 1], y[j + 2], y[j + 3]);
  }
  __syncwarp();
  float2 v = tail[lane];
  rotate_pair(v.x, v.y, cs.x, cs.y);
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

// The same for the bf16 tail of a packed lane (packed_lane.cuh; V41 / V41_FP4), rounding each rotated pair
// to bf16: the tail lanes store their words (32 words, 16-byte aligned, in `tail`), lane l rotates values
// 2m, 2m + 1 (m = l % 8) of tail lane l / 8, which sit in the same half of two adjacent words, writes
// the rounded pair back in place, and the tail lanes reload their words (no opening barrier, as above).
__device__ __forceinline__ void rotate_packed_tail_across_warp(uint32_t* words, float2 cs, int lane,
                                                               uint32_t* tail) {
  if (lane >= kRopeFirstLane) {
    uint4* dst = reinterpret_cast<uint4*>(tail + (lane - kRopeFirstLane) * kLaneWords);
    dst[0] = make_uint4(words[0], words[1], words[2], words[3]);
    dst[1] = make_uint4(words[4], words[5], words[6], words[7]);
  }
  __syncwarp();
  const int first = 2 * (lane % 8);
  static_assert(packed_word_of(3) == packed_word_of(2) + 1 && packed_half_of(6) == packed_half_of(7),
                "a pair's values share a half of adjacent words");
  uint32_t* pair = tail + (lane / 8) * kLaneWords + packed_word_of(first);  // an even word: 8-byte aligned
  const int half = packed_half_of(first);
  const uint2 both = *reinterpret_cast<const uint2*>(pair);
  float re = bits_f32(half ? both.x & 0xFFFF0000u : both.x << 16);
  float im = bits_f32(half ? both.y & 0xFFFF0000u : both.y << 16);
  rotate_pair(re, im, cs.x, cs.y);
  const uint32_t rounded = pack_bf16x2(re, im);
  reinterpret_cast<uint16_t*>(pair)[half] = uint16_t(rounded);
  reinterpret_cast<uint16_t*>(pair + 1)[half] = uint16_t(rounded >> 16);
  __syncwarp();
  if (lane >= kRopeFirstLane) {
    const uint4* src = reinterpret_cast<const uint4*>(tail + (lane - kRopeFirstLane) * kLaneWords);
    const uint4 lo = src[0], hi = src[1];
    words[0] = lo.x; words[1] = lo.y; words[2] = lo.z; words[3] = lo.w;
    words[4] = hi.x; words[5] = hi.y; words[6] = hi.z; words[7] = hi.w;
  }
}

}  // namespace dsv4
