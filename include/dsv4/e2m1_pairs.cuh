// e2m1 encoders that take two values per instruction (device only): V41_FP4 codes of bf16-representable
// values, and indexer fp4 codes of any values.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "dsv4/quant.cuh"

namespace dsv4 {

// Why: E2m1RneThresholds (quant.cuh) encodes one fp32 value with three compares and four selects, about 13
// instructions per value, which made the e2m1 encoder the largest cost of every V41_FP4 writer. When the
// values are bf16-representable (every V41_FP4 writer quantizes bf16(y) and a bf16-rounded RoPE tail), the
// same compares can run on bf16x2 pairs: the thresholds t*S have at most 7 significant bits (t has at most
// 3, the e4m3 scale S at most 4) and lie in [2^-11, 2240], so they are bf16 values too, and a bf16
// compare of two bf16 values is the exact compare of E2m1RneThresholds. One packed compare returns
// 0xFFFF or 0 per half, and the binary search of E2m1RneThresholds becomes bitwise selects on these
// masks: about 10 instructions per value instead of 16.5 with the packing included (SASS of 16 values:
// 160 against 264).

// Per 16-bit half: 0xFFFF where a >= b (a > b), else 0; bf16 compare (false for NaN).
__device__ __forceinline__ uint32_t bf16x2_ge_mask(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("set.ge.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t bf16x2_gt_mask(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Per 16-bit half: a * b rounded to bf16.
__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The e2m1 rounding thresholds t_0..t_6 = 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0 as bf16, in both halves.
__device__ __forceinline__ constexpr uint32_t e2m1_threshold_pair(int i) {
  return i == 0 ? 0x3E803E80u : i == 1 ? 0x3F403F40u : i == 2 ? 0x3FA03FA0u : i == 3 ? 0x3FE03FE0u
       : i == 4 ? 0x40204020u : i == 5 ? 0x40604060u : 0x40A040A0u;
}

// Bitwise mask ? a : b (one LOP3).
__device__ __forceinline__ uint32_t select_bits(uint32_t mask, uint32_t a, uint32_t b) {
  return (mask & a) | (~mask & b);
}

// The V41_FP4 encoder of one tile (scale S) for bf16-representable values: the codes of
// E2m1RneThresholds(S), bit for bit (same thresholds, same strictness, sign bit from the value).
struct E2m1Bf16PairEncoder {
  uint32_t t[7];  // t_i * S as bf16, in both halves

  // scale: the tile's e4m3 scale S. The products t_i * S are formed by packed bf16 multiplies, which
  // are exact here (at most 7 significant bits, in [2^-11, 2240]).
  __device__ explicit E2m1Bf16PairEncoder(float scale) {
    const uint32_t s = pack_bf16x2(scale, scale);
#pragma unroll
    for (int i = 0; i < 7; ++i) t[i] = bf16x2_mul(s, e2m1_threshold_pair(i));
  }

  // The codes of lo (bits 0..3) and hi (bits 16..19); the other bits are 0.
  __device__ __forceinline__ uint32_t encode_pair(float lo, float hi) const {
    return codes_at(pack_bf16x2(lo, hi), 0);
  }

  // The e2m1 word of eight bf16 values packed as the pairs (k, k + 4), k = 0..3, in pairs[k] (the packing
  // order of assemble_e2m1_words): the same word as assembling encode_pair's codes.
  __device__ __forceinline__ uint32_t encode_word(const uint32_t* pairs) const {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) word |= codes_at(pairs[k], k);
    return word;
  }

 private:
  // The codes of the packed pair v at nibbles k (lo) and k + 4 (hi), the other bits 0. A compare's mask
  // is all ones in its half, so each index bit is taken from the mask at its final place, and the sign
  // (bit 15 of each half) is shifted there: no per-pair code to form and shift.
  __device__ __forceinline__ uint32_t codes_at(uint32_t v, int k) const {
    const uint32_t a = v & 0x7FFF7FFFu;
    // E2m1RneThresholds' search: index >= 4, then >= 6 or >= 2 (>= thresholds), then the last bit (>).
    const uint32_t m4 = bf16x2_ge_mask(a, t[3]);
    const uint32_t m2 = bf16x2_ge_mask(a, select_bits(m4, t[5], t[1]));
    const uint32_t last = select_bits(m4, select_bits(m2, t[6], t[4]), select_bits(m2, t[2], t[0]));
    const uint32_t m1 = bf16x2_gt_mask(a, last);
    const uint32_t nibble = 0x00010001u << (4 * k);
    return ((v >> (12 - 4 * k)) & (nibble << 3)) | (m4 & (nibble << 2)) | (m2 & (nibble << 1)) | (m1 & nibble);
  }
};

// The e2m1 thresholds of E2m1ThresholdPairEncoder, t_0..t_6 in both bf16 halves (e2m1_threshold_pair),
// in constant memory: a LOP3 takes one immediate, so a bitwise select between two immediate thresholds
// costs two LOP3, and between two constant-bank or register operands one.
static __constant__ uint32_t kE2m1ThresholdPairs[7] = {0x3E803E80u, 0x3F403F40u, 0x3FA03FA0u, 0x3FE03FE0u,
                                                       0x40204020u, 0x40604060u, 0x40A040A0u};

// The indexer fp4 encoder (e2m1_encode_threshold: thresholds strictly exceeded, never a negative zero) for
// any fp32 values q, two at a time. A threshold t is a bf16 value, so q > t exactly when q's magnitude
// rounded up to bf16 exceeds t: adding 0xFFFF to q's bits and keeping the high half rounds the
// magnitude up for either sign (finite q; NaN and infinity are outside the writers' contract). The same
// rounding keeps q's sign, so "q < 0 with a nonzero code" (the sign bit) is one compare, v < -t_0.
struct E2m1ThresholdPairEncoder {
  __device__ __forceinline__ uint32_t encode_pair(float lo, float hi) const {
    const uint32_t* t = kE2m1ThresholdPairs;
    const uint32_t v = __byte_perm(__float_as_uint(lo) + 0xFFFFu, __float_as_uint(hi) + 0xFFFFu, 0x7632);
    const uint32_t a = v & 0x7FFF7FFFu;
    const uint32_t m4 = bf16x2_gt_mask(a, e2m1_threshold_pair(3));
    const uint32_t m2 = bf16x2_gt_mask(a, select_bits(m4, t[5], t[1]));
    const uint32_t last = select_bits(m4, select_bits(m2, t[6], t[4]), select_bits(m2, t[2], t[0]));
    const uint32_t m1 = bf16x2_gt_mask(a, last);
    const uint32_t negative = bf16x2_gt_mask(e2m1_threshold_pair(0) | 0x80008000u, v);  // v < -t_0
    uint32_t code = select_bits(0x00040004u, m4, m2);
    code = select_bits(0x00060006u, code, m1);
    code = select_bits(0x00070007u, code, negative);
    return code & 0x000F000Fu;
  }
};

// Packing order of the e2m1 words. N values (4, or a multiple of 8) are packed with value i in nibble
// i % 8 of words[i / 8] (N == 4: the low 16 bits of words[0]). The encoders take the 8 values of a word
// in the pairs (k, k + 4) (N == 4: (k, k + 2)), so that a pair's codes (bits 0..3 and 16..19) are one
// shift away from their nibbles k and k + 4: the word is built by shift-adds, with no byte permutes.
// pair_codes[j] holds the codes of pair j, pairs in the order (0, 4), (1, 5), (2, 6), (3, 7), (8, 12), ...
template <int N>
__device__ __forceinline__ void assemble_e2m1_words(const uint32_t* pair_codes, uint32_t* words) {
  static_assert(N == 4 || N % 8 == 0, "whole 16- or 32-bit words");
  if constexpr (N == 4) {
    words[0] = __byte_perm((pair_codes[1] << 4) + pair_codes[0], 0u, 0x4420);  // nibbles 0, 1, 4, 5 -> 0..3
  } else {
#pragma unroll
    for (int w = 0; w < N / 8; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 3; k >= 0; --k) word = (word << 4) + pair_codes[4 * w + k];
      words[w] = word;
    }
  }
}

// The packed codes of N fp32 values (packing order above).
template <int N, class PairEncoder>
__device__ __forceinline__ void encode_e2m1_pairs(const PairEncoder& encoder, const float* x, uint32_t* words) {
  constexpr int kHalf = N == 4 ? 2 : 4;  // distance between the two values of a pair
  uint32_t codes[N / 2];
#pragma unroll
  for (int j = 0; j < N / 2; ++j) {
    const int first = (j / kHalf) * 2 * kHalf + j % kHalf;
    codes[j] = encoder.encode_pair(x[first], x[first + kHalf]);
  }
  assemble_e2m1_words<N>(codes, words);
}

// fake_quant_compressed_values (quant.cuh) for N bf16-representable values of one tile, two at a time: the
// V41_FP4 codes of E2m1Bf16PairEncoder decoded and scaled back, the same bits.
template <int N>
__device__ __forceinline__ void fake_quant_compressed_bf16_values(float* x, float tile_amax) {
  static_assert(N % 2 == 0, "whole pairs");
  const float scale = e4m3_decode_finite(v41_fp4_scale_byte_of_bf16(tile_amax));
  const E2m1Bf16PairEncoder encoder(scale);
#pragma unroll
  for (int k = 0; k < N / 2; ++k) {
    const uint32_t codes = encoder.encode_pair(x[2 * k], x[2 * k + 1]);
    x[2 * k] = e2m1_decode(uint8_t(codes & 0xFu)) * scale;
    x[2 * k + 1] = e2m1_decode(uint8_t(codes >> 16)) * scale;
  }
}

}  // namespace dsv4
