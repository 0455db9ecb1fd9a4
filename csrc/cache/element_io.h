// Widening loads and narrowing stores of bf16 / fp16 / fp32 elements, for the CPU implementations of the
// stores, writers, fake-quant ops and low-ratio compressors (the CUDA kernels have their own vector paths).
#pragma once

#include <cstdint>

#include "cache_launch.h"
#include "dsv4/quant.cuh"

namespace dsv4 {

inline float load_element(const void* base, int64_t index, ElemType type) {
  switch (type) {
    case ElemType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(base)[index]);
    case ElemType::FP16: return f16_to_f32(static_cast<const uint16_t*>(base)[index]);
    default: return static_cast<const float*>(base)[index];
  }
}

inline void store_element(void* base, int64_t index, ElemType type, float v) {
  switch (type) {
    case ElemType::BF16: static_cast<uint16_t*>(base)[index] = f32_to_bf16(v); break;
    case ElemType::FP16: static_cast<uint16_t*>(base)[index] = f32_to_f16(v); break;
    default: static_cast<float*>(base)[index] = v; break;
  }
}

// Rounds v to the element type and widens it back (identity for fp32).
inline float round_to_type(float v, ElemType type) {
  switch (type) {
    case ElemType::BF16: return round_to_bf16(v);
    case ElemType::FP16: return f16_to_f32(f32_to_f16(v));
    default: return v;
  }
}

inline void load_row(const RowInput& in, int64_t row, int width, float* out) {
  const int64_t base = row * in.row_stride;
  for (int i = 0; i < width; ++i) out[i] = load_element(in.data, base + i, in.type);
}

}  // namespace dsv4
