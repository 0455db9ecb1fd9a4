// Scalar number formats shared by the CPU and CUDA kernels: e4m3, ue8m0, e2m1, bf16/fp16 bit
// conversions and the per-format scale rules of kv-layouts-and-quant.md §4. Everything is exact
// IEEE fp32 (no fast-math, no FTZ); device code uses the hardware e4m3/bf16 converters, which
// round identically to the software versions the host uses (tests compare both with the reference).
#pragma once

#include <cstdint>
#include <cstring>

#include "dsv4/kv_layout.cuh"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

namespace dsv4 {

// fl32(1e-4): the amax floor of the V4, indexer-fp8 and indexer-fp4 quantizers.
constexpr uint32_t kAmaxFloorBits = 0x38D1B717u;
// The e4m3 scale of V41_FP4 is clamped to [2^-9, 448].
constexpr float kE4m3Max = 448.0f;
constexpr float kE4m3MinSubnormal = 0.001953125f;  // 2^-9

DSV4_HD uint32_t f32_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  return u;
#endif
}

DSV4_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof(v));
  return v;
#endif
}

DSV4_HD float amax_floor() { return bits_f32(kAmaxFloorBits); }

// 2^k for k in [-126, 127] (a normal fp32).
DSV4_HD float pow2f(int k) { return bits_f32(uint32_t(k + 127) << 23); }

DSV4_HD bool is_nan_f32(float v) { return (f32_bits(v) & 0x7FFFFFFFu) > 0x7F800000u; }

// Exponent field E(a) and mantissa field M(a) of a non-negative fp32.
DSV4_HD int exponent_field(float a) { return int(f32_bits(a) >> 23); }
DSV4_HD uint32_t mantissa_field(float a) { return f32_bits(a) & 0x7FFFFFu; }

// ue8m0 byte of the smallest power of two >= s (finite s >= 2^-126).
DSV4_HD int ceil2byte(float s) { return exponent_field(s) + (mantissa_field(s) != 0 ? 1 : 0); }

// ue8m0 byte -> fp32: 0 gives the subnormal 2^-127, 255 gives NaN.
DSV4_HD float ue8m0_to_f32(uint8_t b) {
  if (b == 0) return bits_f32(0x00400000u);
  if (b == 255) return bits_f32(0x7FC00000u);
  return bits_f32(uint32_t(b) << 23);
}

DSV4_HD float fmax_f32(float a, float b) { return a > b ? a : b; }
DSV4_HD float fmin_f32(float a, float b) { return a < b ? a : b; }
DSV4_HD float fabs_f32(float v) { return bits_f32(f32_bits(v) & 0x7FFFFFFFu); }

// ---------------------------------------------------------------------------------------------
// Scale bytes (closed forms of §4.1, 4.2, 4.5; equal to the ceil-log2 definitions for every
// finite amax, which T5 checks exhaustively).

DSV4_HD uint8_t v4_scale_byte(float amax) {
  const float a = fmax_f32(amax, amax_floor());
  return uint8_t(exponent_field(a) - 8 + (mantissa_field(a) > 0x600000u ? 1 : 0));
}

DSV4_HD uint8_t v41_scale_byte(float amax) {
  const int b = exponent_field(amax) - 8 + (mantissa_field(amax) > 0x600000u ? 1 : 0);
  return uint8_t(b > 114 ? b : 114);
}

DSV4_HD uint8_t indexer_fp4_scale_byte(float amax) {
  const float a = fmax_f32(amax, amax_floor());
  return uint8_t(exponent_field(a) - 2 + (mantissa_field(a) > 0x400000u ? 1 : 0));
}

// Multiplier 2^(127 - b) that maps a tile onto its code range (exact: b in [105, 253]).
DSV4_HD float inverse_scale_of_byte(uint8_t b) { return pow2f(127 - int(b)); }

// ---------------------------------------------------------------------------------------------
// e4m3 (OCP FP8 E4M3FN).

// Software RNE encoder with saturation to +-448; the sign is kept for zero results.
DSV4_HD uint8_t e4m3_encode_soft(float v) {
  const uint32_t u = f32_bits(v);
  const uint8_t sign = uint8_t((u >> 31) << 7);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return uint8_t(sign | 0x7F);
  const float a = bits_f32(mag);
  if (a >= kE4m3Max) return uint8_t(sign | 0x7E);
  if (a < 0.015625f) {  // below 2^-6: e4m3 subnormal grid m * 2^-9
    const float q = a * 512.0f;  // exact
    int m = int(q);
    const float frac = q - float(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1))) ++m;
    return uint8_t(sign | m);  // m == 8 is the smallest normal, code 0x08
  }
  const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
  return uint8_t(sign | (rounded - (120u << 3)));
}

// Two values -> two e4m3 bytes (lo in bits 0..7), RNE, saturating at +-448.
DSV4_HD uint16_t e4m3x2_encode(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return uint16_t(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
#else
  return uint16_t(e4m3_encode_soft(lo) | (uint16_t(e4m3_encode_soft(hi)) << 8));
#endif
}

DSV4_HD uint8_t e4m3_encode(float v) { return uint8_t(e4m3x2_encode(v, 0.0f) & 0xFF); }

// e4m3 byte -> fp32 (exact); 0x7F / 0xFF -> NaN.
DSV4_HD float e4m3_decode(uint8_t b) {
  const uint32_t sign = uint32_t(b & 0x80) << 24;
  const uint32_t e = (b >> 3) & 0xF;
  const uint32_t m = b & 0x7;
  if (e == 15 && m == 7) return bits_f32(0x7FC00000u);
  if (e == 0) return bits_f32(f32_bits(float(m) * 0.001953125f) | sign);
  return bits_f32(sign | ((e + 120) << 23) | (m << 20));
}

// Two e4m3 bytes (lo in bits 0..7) -> two fp32 values, exact; NaN codes give NaN.
DSV4_HD void e4m3x2_decode(uint16_t pair, float& lo, float& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(pair), __NV_E4M3);
  lo = __half2float(__ushort_as_half(h.x));
  hi = __half2float(__ushort_as_half(h.y));
#else
  lo = e4m3_decode(uint8_t(pair & 0xFF));
  hi = e4m3_decode(uint8_t(pair >> 8));
#endif
}

// e4m3_decode of a byte that is not a NaN code (a scale byte the quantizers just computed) through
// e4m3x2_decode's hardware conversion: two instructions on the device instead of e4m3_decode's branches
// (the NaN codes are where the two may differ in bits).
DSV4_HD float e4m3_decode_finite(uint8_t b) {
  float lo, hi;
  e4m3x2_decode(b, lo, hi);
  return lo;
}

// ---------------------------------------------------------------------------------------------
// e2m1 (OCP FP4 E2M1): magnitudes [0, 0.5, 1, 1.5, 2, 3, 4, 6], bit 3 = sign.

// e2m1 code -> fp32, exact and branch-free: the code's exponent and mantissa bits placed at the
// top of an fp32 (bits 23-24 and 22) give 2^-126 times the e2m1 value (code exponent 0 lands on the
// fp32 subnormal m * 2^-127, which is the e2m1 subnormal m * 0.5 scaled the same way), so one
// exact multiplication by 2^126 decodes every code; bit 3 becomes the sign.
DSV4_HD float e2m1_decode(uint8_t code) {
  const uint32_t bits = (uint32_t(code & 8) << 28) | (uint32_t(code & 7) << 22);
  return bits_f32(bits) * 8.5070591730234616e+37f;  // 2^126
}

// Round-to-nearest-even magnitude index of a = |v| (exact midpoints go to the even index).
DSV4_HD int e2m1_rne_index(float a) {
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
         (a > 5.0f);
}

// V41_FP4 rule: RNE, sign bit from v (so -0.0 and tiny negatives give 0x8).
DSV4_HD uint8_t e2m1_encode_rne(float v) {
  return uint8_t(e2m1_rne_index(fabs_f32(v)) | ((f32_bits(v) >> 31) << 3));
}

// Indexer rule: number of thresholds {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5} strictly exceeded (ties
// toward zero), never a negative zero. The count is found by a three-step binary search over the sorted
// thresholds (1.75, then 3.5 or 0.75, then one of the others) rather than seven compares.
DSV4_HD uint8_t e2m1_encode_threshold(float v) {
  const float a = fabs_f32(v);
  const bool upper = a > 1.75f;                         // index >= 4
  const bool upper_half = a > (upper ? 3.5f : 0.75f);   // index >= 6, or >= 2
  const float last = upper ? (upper_half ? 5.0f : 2.5f) : (upper_half ? 1.25f : 0.25f);
  const int index = (upper ? 4 : 0) | (upper_half ? 2 : 0) | (a > last ? 1 : 0);
  return uint8_t(index | ((v < 0.0f && index != 0) ? 8 : 0));
}

// e2m1_rne(fl(x / S)) for a positive e4m3 scale S, evaluated without the division: each threshold
// t is compared with the exact product t*S under the same strictness. This gives the IEEE quotient's
// code because a quotient within half an ulp of t cannot come from an x on the other side of t*S
// (t*S has at most 7 significant bits and is never a power of two for the >= thresholds).
// The index (number of thresholds passed) is found by a three-step binary search: the first two
// levels test the >= thresholds 1.75, then 3.5 or 0.75; the last level one of the > thresholds.
struct E2m1RneThresholds {
  float t[7];
  DSV4_HD explicit E2m1RneThresholds(float scale) {
    t[0] = 0.25f * scale; t[1] = 0.75f * scale; t[2] = 1.25f * scale; t[3] = 1.75f * scale;
    t[4] = 2.5f * scale;  t[5] = 3.5f * scale;  t[6] = 5.0f * scale;
  }
  DSV4_HD uint8_t encode(float x) const {
    const float a = fabs_f32(x);
    const bool upper = a >= t[3];                 // index >= 4
    const bool upper_half = a >= (upper ? t[5] : t[1]);  // index >= 6, or >= 2
    const float last = upper ? (upper_half ? t[6] : t[4]) : (upper_half ? t[2] : t[0]);
    const int index = (upper ? 4 : 0) | (upper_half ? 2 : 0) | (a > last ? 1 : 0);
    return uint8_t(index | ((f32_bits(x) >> 28) & 8u));
  }
};

// V41_FP4 tile scale: e4m3 RNE of clamp(fl(amax / 6), 2^-9, 448) (IEEE division).
DSV4_HD uint8_t v41_fp4_scale_byte(float amax) {
  const float r = amax / 6.0f;
  return e4m3_encode(fmin_f32(fmax_f32(r, kE4m3MinSubnormal), kE4m3Max));
}

// v41_fp4_scale_byte of a bf16-representable amax (every V41_FP4 writer quantizes bf16 values): the product
// with fl(1/6) can differ from the IEEE quotient in its last bit, but never in the clamped e4m3 byte, for
// any of the 2^15 non-negative bf16 values (test_quant_identities checks them all); one multiply instead
// of a division sequence.
DSV4_HD uint8_t v41_fp4_scale_byte_of_bf16(float amax) {
  const float r = amax * (1.0f / 6.0f);
  return e4m3_encode(fmin_f32(fmax_f32(r, kE4m3MinSubnormal), kE4m3Max));
}

// fake_quant_compressed_kv of one V41_FP4 tile, in place: the V41_FP4 codes of the tile times its
// decoded e4m3 scale (exact in fp32; -0.0 and tiny negatives give -0.0). _values takes n of the tile's
// values and the amax of the whole tile (a tile spread over several threads); _tile a whole tile of n.
DSV4_HD void fake_quant_compressed_values(float* x, int n, float tile_amax) {
  const float scale = e4m3_decode(v41_fp4_scale_byte(tile_amax));
  const E2m1RneThresholds encoder(scale);
  for (int i = 0; i < n; ++i) x[i] = e2m1_decode(encoder.encode(x[i])) * scale;
}

DSV4_HD void fake_quant_compressed_tile(float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = fmax_f32(amax, fabs_f32(x[i]));
  fake_quant_compressed_values(x, n, amax);
}

// fake_quant_fp4 block scale byte: ceil2byte(fl(max(amax, 6*2^-126) / 6)) in [1, 253].
DSV4_HD uint8_t fp4_pow2_scale_byte(float amax) {
  const float a = fmax_f32(amax, 6.0f * 1.1754943508222875e-38f);
  return uint8_t(ceil2byte(a / 6.0f));
}

// ---------------------------------------------------------------------------------------------
// bf16 / fp16 bit conversions (round to nearest even).

DSV4_HD float bf16_to_f32(uint16_t bits) { return bits_f32(uint32_t(bits) << 16); }

DSV4_HD uint16_t f32_to_bf16(float v) {
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
#else
  const uint32_t u = f32_bits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // keep NaN a NaN
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
#endif
}

// Round v to bf16 and widen it back.
DSV4_HD float round_to_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

#if defined(__CUDACC__)
// Two values rounded to bf16 (RNE) by one packed conversion: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// round_to_bf16 of a pair, with one conversion instead of two.
__device__ __forceinline__ void round_pair_to_bf16(float& lo, float& hi) {
  const uint32_t packed = pack_bf16x2(lo, hi);
  lo = bits_f32(packed << 16);
  hi = bits_f32(packed & 0xFFFF0000u);
}
#endif

DSV4_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t e = (h >> 10) & 0x1F;
  const uint32_t m = h & 0x3FF;
  if (e == 0x1F) return bits_f32(sign | 0x7F800000u | (m << 13));
  if (e == 0) return bits_f32(f32_bits(float(m) * 5.9604644775390625e-08f) | sign);  // m * 2^-24
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
#endif
}

DSV4_HD uint16_t f32_to_f16(float v) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(v));
#else
  uint32_t u = f32_bits(v);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  u &= 0x7FFFFFFFu;
  if (u > 0x7F800000u) return uint16_t(sign | 0x7E00);
  if (u >= 0x477FF000u) return uint16_t(sign | 0x7C00);  // >= 65520 rounds to infinity
  if (u >= 0x38800000u) {                                // normal half (>= 2^-14)
    return uint16_t(sign | ((u + 0xFFFu + ((u >> 13) & 1u) - 0x38000000u) >> 13));
  }
  if (u <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (2^-25 is a tie to even 0)
  const uint32_t mantissa = (u & 0x7FFFFFu) | 0x800000u;
  const int shift = 126 - int(u >> 23);  // half subnormal unit is 2^-24
  uint32_t r = mantissa >> shift;
  const uint32_t rem = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (r & 1u))) ++r;
  return uint16_t(sign | r);
#endif
}

// The canonical NaN every dequantizer writes.
constexpr uint16_t kBf16CanonicalNaN = 0x7FC0;

DSV4_HD uint16_t f32_to_bf16_canonical(float v) {
  return is_nan_f32(v) ? kBf16CanonicalNaN : f32_to_bf16(v);
}

}  // namespace dsv4
