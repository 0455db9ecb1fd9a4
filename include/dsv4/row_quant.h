// Whole-row quantizers of every cache format for the CPU kernels: the definitions of
// kv-layouts-and-quant.md §4 written on the scalar functions of quant.cuh, one row at a time.
// The CUDA kernels distribute the same computation over a warp.
#pragma once

#include <cstdint>
#include <cstring>

#include "dsv4/quant.cuh"

namespace dsv4 {

inline float tile_amax(const float* x, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = fmax_f32(amax, fabs_f32(x[i]));
  return amax;
}

// x[512] -> the layout's data row and used scale bytes (V4 scale byte 7 is not touched).
inline void quantize_main_row(KVLayout layout, const float* x, uint8_t* data, uint8_t* scale) {
  const FormatTraits t = kv_layout_traits(layout);
  if (layout == KVLayout::V41_FP4) {
    for (int tile = 0; tile < t.num_scales; ++tile) {
      const float* v = x + tile * t.tile;
      const uint8_t scale_byte = v41_fp4_scale_byte(tile_amax(v, t.tile));
      const E2m1RneThresholds encoder(e4m3_decode(scale_byte));
      for (int i = 0; i < t.tile; i += 2) {
        data[(tile * t.tile + i) / 2] = uint8_t(encoder.encode(v[i]) | (encoder.encode(v[i + 1]) << 4));
      }
      scale[tile] = scale_byte;
    }
    return;
  }
  for (int tile = 0; tile < t.num_scales; ++tile) {
    const float* v = x + tile * t.tile;
    const float amax = tile_amax(v, t.tile);
    const uint8_t b = layout == KVLayout::V4 ? v4_scale_byte(amax) : v41_scale_byte(amax);
    const float inv = inverse_scale_of_byte(b);
    for (int i = 0; i < t.tile; ++i) data[tile * t.tile + i] = e4m3_encode(v[i] * inv);
    scale[tile] = b;
  }
  if (layout == KVLayout::V4) {
    for (int j = 0; j < kRopeDim; ++j) {
      const uint16_t bits = f32_to_bf16(x[kV4NopeDim + j]);
      data[kV4NopeDim + 2 * j] = uint8_t(bits & 0xFF);
      data[kV4NopeDim + 2 * j + 1] = uint8_t(bits >> 8);
    }
  }
}

// x[128] -> indexer payload row and scale row (fp8: one little-endian fp32; fp4: 4 ue8m0 bytes).
inline void quantize_indexer_row(IndexerFormat fmt, const float* x, uint8_t* data, uint8_t* scale) {
  if (fmt == IndexerFormat::FP8) {
    const float a = fmax_f32(tile_amax(x, kIndexerDim), amax_floor());
    const float s = a / kE4m3Max;
    const float inv = 1.0f / s;
    for (int i = 0; i < kIndexerDim; ++i) data[i] = e4m3_encode(x[i] * inv);
    const uint32_t bits = f32_bits(s);
    for (int k = 0; k < 4; ++k) scale[k] = uint8_t(bits >> (8 * k));
    return;
  }
  const FormatTraits t = indexer_format_traits(fmt);
  for (int tile = 0; tile < t.num_scales; ++tile) {
    const float* v = x + tile * t.tile;
    const uint8_t b = indexer_fp4_scale_byte(tile_amax(v, t.tile));
    const float inv = inverse_scale_of_byte(b);
    for (int i = 0; i < t.tile; i += 2) {
      data[(tile * t.tile + i) / 2] =
          uint8_t(e2m1_encode_threshold(v[i] * inv) | (e2m1_encode_threshold(v[i + 1] * inv) << 4));
    }
    scale[tile] = b;
  }
}

}  // namespace dsv4
