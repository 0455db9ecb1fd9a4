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

// A main row held by a half-warp (lane hl holds dims [16 hl, 16 hl + 16) and [256 + 16 hl, ...)):
// the tail is the second chunk of lanes hl = 12..15, and each lane rotates pairs 2 hl and 2 hl + 1.

// This lane's (cos, sin) entries 4 hl .. 4 hl + 3 of the table row: its two pairs.
__device__ __forceinline__ float4 load_table_quad(const float* table_row, int hl) {
  const float* src = table_row + 4 * hl;
  if (aligned16(src)) return __ldg(reinterpret_cast<const float4*>(src));
  return make_float4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
}

// rotate_tail_across_warp for a half-warp row (`mask`): `tail` holds 32 float2 (16-byte aligned) of
// shared memory private to the half, y1 the lane's second chunk, cs its load_table_quad. All 16 lanes
// must call.
template <bool RoundAfter>
__device__ __forceinline__ void rotate_tail_across_half(float* y1, float4 cs, int hl, unsigned mask, float2* tail) {
  constexpr int kFirst = (kV4NopeDim - kMainDim / 2) / kLaneDims;  // 12: lanes 12..15 hold the tail
  __syncwarp(mask);  // a previous call's reads of `tail` are done
  if (hl >= kFirst) {
    float4* dst = reinterpret_cast<float4*>(tail + (hl - kFirst) * (kLaneDims / 2));
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) dst[j / 4] = make_float4(y1[j], y1[j + 1], y1[j + 2], y1[j + 3]);
  }
  __syncwarp(mask);
  float4 v = reinterpret_cast<float4*>(tail)[hl];
  rotate_pair(v.x, v.y, cs.x, cs.y);
  rotate_pair(v.z, v.w, cs.z, cs.w);
  if (RoundAfter) {
    round_pair_to_bf16(v.x, v.y);
    round_pair_to_bf16(v.z, v.w);
  }
  reinterpret_cast<float4*>(tail)[hl] = v;
  __syncwarp(mask);
  if (hl >= kFirst) {
    const float4* src = reinterpret_cast<const float4*>(tail + (hl - kFirst) * (kLaneDims / 2));
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 4) {
      const float4 q = src[j / 4];
      y1[j] = q.x; y1[j + 1] = q.y; y1[j + 2] = q.z; y1[j + 3] = q.w;
    }
  }
}

// rotate_tail_across_half<true> for a tail held as bf16 pairs in the e2m1 encoders' order (p1: the lane's
// 8 pairs, (k, k + 4) and (8 + k, 12 + k)), so that V41_FP4 keeps its rounded values packed. The tail
// lanes regroup their pairs into RoPE pairs (2j, 2j + 1) for the exchange (`tail`: 32 words of shared
// memory private to the half, 16-byte aligned) and back; the rotation is the same fp32 arithmetic on the
// same bf16 inputs, rounded once per value, so the same bits.
__device__ __forceinline__ void rotate_packed_tail_across_half(uint32_t* p1, float4 cs, int hl, unsigned mask,
                                                               uint32_t* tail) {
  constexpr int kFirst = (kV4NopeDim - kMainDim / 2) / kLaneDims;  // 12
  constexpr uint32_t kLows = 0x5410, kHighs = 0x7632;  // byte_perm selectors: (a.lo, b.lo), (a.hi, b.hi)
  __syncwarp(mask);  // a previous call's reads of `tail` are done
  if (hl >= kFirst) {
    uint32_t rope[8];  // rope[j]: dims (2j, 2j + 1) of the lane's 16
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const uint32_t* q = p1 + 4 * g;
      rope[4 * g] = __byte_perm(q[0], q[1], kLows);
      rope[4 * g + 1] = __byte_perm(q[2], q[3], kLows);
      rope[4 * g + 2] = __byte_perm(q[0], q[1], kHighs);
      rope[4 * g + 3] = __byte_perm(q[2], q[3], kHighs);
    }
    uint4* dst = reinterpret_cast<uint4*>(tail + 8 * (hl - kFirst));
    dst[0] = make_uint4(rope[0], rope[1], rope[2], rope[3]);
    dst[1] = make_uint4(rope[4], rope[5], rope[6], rope[7]);
  }
  __syncwarp(mask);
  uint2 v = reinterpret_cast<uint2*>(tail)[hl];  // RoPE pairs 2 hl and 2 hl + 1
  float re0 = __uint_as_float(v.x << 16), im0 = __uint_as_float(v.x & 0xFFFF0000u);
  float re1 = __uint_as_float(v.y << 16), im1 = __uint_as_float(v.y & 0xFFFF0000u);
  rotate_pair(re0, im0, cs.x, cs.y);
  rotate_pair(re1, im1, cs.z, cs.w);
  reinterpret_cast<uint2*>(tail)[hl] = make_uint2(pack_bf16x2(re0, im0), pack_bf16x2(re1, im1));
  __syncwarp(mask);
  if (hl >= kFirst) {
    const uint4* src = reinterpret_cast<const uint4*>(tail + 8 * (hl - kFirst));
    const uint4 a = src[0], b = src[1];
    const uint32_t rope[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      const uint32_t* r = rope + 4 * g;
      p1[4 * g] = __byte_perm(r[0], r[2], kLows);       // dims 0, 4 of the group
      p1[4 * g + 1] = __byte_perm(r[0], r[2], kHighs);  // 1, 5
      p1[4 * g + 2] = __byte_perm(r[1], r[3], kLows);   // 2, 6
      p1[4 * g + 3] = __byte_perm(r[1], r[3], kHighs);  // 3, 7
    }
  }
}

}  // namespace dsv4
