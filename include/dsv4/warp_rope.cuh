// RoPE on the 64-dim tail of a main row held one row per warp (lane l owns dims [16l, 16l+16), so
// lanes 28..31 hold the tail). Rotating the tail in place would run eight pairs serially on four
// lanes while 28 idle; here each lane rotates one pair instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/packed_lane.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/shared_io.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

// This lane's (cos, sin) entries 2l, 2l+1 of the table row: the pair it rotates.
__device__ __forceinline__ float2 load_table_pair(const float* table_row, int lane) {
  const float* src = table_row + 2 * lane;
  if ((reinterpret_cast<uintptr_t>(src) & 7) == 0) return load_input(reinterpret_cast<const float2*>(src));
  return make_float2(load_input(src), load_input(src + 1));
}

// Both rotations below exchange the tail through `tail_at`: the warp's 32 float2 (256 bytes, 16-byte aligned)
// of shared memory, by shared-space address (shared_io.cuh), which a kernel computes once.
//
// Rotates V4's fp32 tail (the 64 dims held by lanes 28..31, 16 each) one pair per lane and stores it as bf16
// at `dst` (the row's RoPE bytes, 4-byte aligned): the tail lanes put their values in the exchange area,
// lane l rotates pair l and stores its rounded pair at dst + 4l. One pair of work on all lanes instead of
// eight pairs serialized on four, one coalesced 128-byte store, and nothing goes back to the tail lanes (V4
// quantizes only the nope dims). Same operations per pair as rotating in place, so the same bits. `cs` =
// load_table_pair of the row's position. All lanes must call. The opening barrier orders this call's stores
// after every lane's read of the previous call's pair.
__device__ __forceinline__ void rotate_tail_to_bf16_across_warp(const float* y, float2 cs, int lane,
                                                                uint32_t tail_at, uint8_t* dst) {
  __syncwarp();
  if (lane >= kRopeFirstLane) {
    const uint32_t at = tail_at + (lane - kRopeFirstLane) * kLaneDims * 4;
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) {
      store_shared_u4(at + 4 * j, make_uint4(__float_as_uint(y[j]), __float_as_uint(y[j + 1]),
                                             __float_as_uint(y[j + 2]), __float_as_uint(y[j + 3])));
    }
  }
  __syncwarp();
  const uint2 pair = load_shared_u2(tail_at + 8 * lane);
  float re = __uint_as_float(pair.x), im = __uint_as_float(pair.y);
  rotate_pair(re, im, cs.x, cs.y);
  reinterpret_cast<uint32_t*>(dst)[lane] = pack_bf16x2(re, im);
}

// The same for the bf16 tail of a packed lane (packed_lane.cuh; V41 / V41_FP4), rounding each rotated pair
// to bf16 and handing it back: the tail lanes store their words (32 words) in the exchange area, lane l
// rotates values 2m, 2m + 1 (m = l % 8) of tail lane l / 8, which sit in the same half of two adjacent
// words, writes the rounded pair back in place, and the tail lanes reload their words. No barrier opens a
// call: a tail lane's stores only follow its own reads of the previous call, and every other access of that
// call ended before the barrier that preceded them.
__device__ __forceinline__ void rotate_packed_tail_across_warp(uint32_t* words, float2 cs, int lane,
                                                               uint32_t tail_at) {
  const uint32_t lane_at = tail_at + (lane - kRopeFirstLane) * kLaneWords * 4;  // used by the tail lanes only
  if (lane >= kRopeFirstLane) {
    store_shared_u4(lane_at, make_uint4(words[0], words[1], words[2], words[3]));
    store_shared_u4(lane_at + 16, make_uint4(words[4], words[5], words[6], words[7]));
  }
  __syncwarp();
  const int first = 2 * (lane % 8);
  static_assert(packed_word_of(3) == packed_word_of(2) + 1 && packed_half_of(6) == packed_half_of(7),
                "a pair's values share a half of adjacent words");
  // An even word: 8-byte aligned.
  const uint32_t pair_at = tail_at + 4 * ((lane / 8) * kLaneWords + packed_word_of(first));
  const int half = packed_half_of(first);
  const uint2 both = load_shared_u2(pair_at);
  float re = bits_f32(half ? both.x & 0xFFFF0000u : both.x << 16);
  float im = bits_f32(half ? both.y & 0xFFFF0000u : both.y << 16);
  rotate_pair(re, im, cs.x, cs.y);
  const uint32_t rounded = pack_bf16x2(re, im);
  store_shared_u16(pair_at + 2 * half, uint16_t(rounded));
  store_shared_u16(pair_at + 4 + 2 * half, uint16_t(rounded >> 16));
  __syncwarp();
  if (lane >= kRopeFirstLane) {
    const uint4 lo = load_shared_u4(lane_at), hi = load_shared_u4(lane_at + 16);
    words[0] = lo.x; words[1] = lo.y; words[2] = lo.z; words[3] = lo.w;
    words[4] = hi.x; words[5] = hi.y; words[6] = hi.z; words[7] = hi.w;
  }
}

}  // namespace dsv4
