// A main-row lane's 16 values once they are rounded to bf16 (V41 / V41_FP4 writers), kept packed two per
// word rather than widened back to fp32 (device only).
#pragma once

#include <cstdint>

#include "dsv4/e2m1_pairs.cuh"
#include "dsv4/kv_layout.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

// Why packed: the RoPE exchange then moves half the bytes, the tile amax takes packed max instructions, and the
// V41_FP4 encoder consumes the words as they are.
//
// Word order: value 8g + k sits in the low half of word 4g + k and value 8g + k + 4 in its high half
// (g = 0, 1; k = 0..3): the (k, k + 4) pairs of e2m1_pairs.cuh, so the encoder's codes land one shift
// from their nibbles.
constexpr int kLaneWords = kLaneDims / 2;  // 8

// The word and half that hold value i of the lane (the order above).
__host__ __device__ constexpr int packed_word_of(int i) { return (i / 8) * 4 + i % 4; }
__host__ __device__ constexpr int packed_half_of(int i) { return (i % 8) / 4; }

// Rounds the lane's 16 values to bf16 (RNE) and packs them.
__device__ __forceinline__ void pack_lane_bf16(const float* y, uint32_t* words) {
#pragma unroll
  for (int w = 0; w < kLaneWords; ++w) words[w] = pack_bf16x2(y[(w / 4) * 8 + w % 4], y[(w / 4) * 8 + w % 4 + 4]);
}

// The lane's 16 values as fp32 (exact).
__device__ __forceinline__ void unpack_lane_bf16(const uint32_t* words, float* y) {
#pragma unroll
  for (int w = 0; w < kLaneWords; ++w) {
    y[(w / 4) * 8 + w % 4] = bits_f32(words[w] << 16);
    y[(w / 4) * 8 + w % 4 + 4] = bits_f32(words[w] & 0xFFFF0000u);
  }
}

// Per 16-bit half: the larger bf16 value (max.bf16x2).
__device__ __forceinline__ uint32_t bf16x2_max(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// max |x_i| over the lane's 16 values (exact, as an fp32 of the bf16 value; finite values): a tree of
// packed max on the magnitudes, then the larger half.
__device__ __forceinline__ float packed_lane_abs_max(const uint32_t* words) {
  uint32_t m[kLaneWords / 2];
#pragma unroll
  for (int w = 0; w < kLaneWords / 2; ++w) {
    m[w] = bf16x2_max(words[w] & 0x7FFF7FFFu, words[w + kLaneWords / 2] & 0x7FFF7FFFu);
  }
  const uint32_t m2 = bf16x2_max(bf16x2_max(m[0], m[2]), bf16x2_max(m[1], m[3]));
  return bits_f32(bf16x2_max(m2, m2 >> 16) << 16);
}

// quantize_main_lane for a V41 / V41_FP4 row held one per warp (lane l: dims [16l, 16l + 16)), from the
// packed values: the same bytes. V41_FP4 encodes the words as they are; V41 widens them for its e4m3
// conversions. Every lane of the warp must call this (V41's tile amax is shared by two lanes), so the shuffle
// names the whole warp: a computed group mask made the compiler check convergence first (MATCH.ANY, REDUX.OR,
// VOTE and a branch; H200, K writer V41 at 64 rows 1.67 -> 1.43 us, at 2^20 rows 461 -> 451 us).
template <KVLayout L>
__device__ __forceinline__ void quantize_packed_lane(const uint32_t* words, int lane, PagedCache::RowPointers rows) {
  static_assert(L != KVLayout::V4, "V4 keeps its RoPE dims in fp32 until the store");
  constexpr int kLanesPerTile = LayoutTraits<L>::kTile / kLaneDims;  // V41 2, V41_FP4 1
  const float amax = warp_max_xor(packed_lane_abs_max(words), kLanesPerTile, 0xFFFFFFFFu);
  uint8_t scale_byte;
  if constexpr (L == KVLayout::V41_FP4) {
    scale_byte = v41_fp4_scale_byte_of_bf16(amax);
    const E2m1Bf16PairEncoder encoder(e4m3_decode_finite(scale_byte));
    const uint32_t packed[kLaneDims / 8] = {encoder.encode_word(words), encoder.encode_word(words + 4)};
    store_words<kLaneDims / 2>(rows.data + kLaneDims / 2 * lane, packed);
  } else {
    scale_byte = v41_scale_byte(amax);
    float x[kLaneDims];
    unpack_lane_bf16(words, x);
    store_e4m3_lane<kLaneDims>(x, scale_byte, rows.data + kLaneDims * lane);
  }
  if (lane % kLanesPerTile == 0) rows.scale[lane / kLanesPerTile] = scale_byte;
}

}  // namespace dsv4
