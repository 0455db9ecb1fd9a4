// Device helpers that move short runs of elements between global memory and registers: 16-byte
// vector accesses when the address allows, element accesses otherwise (same results either way).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/quant.cuh"

namespace dsv4 {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Loads N (a multiple of 8) consecutive bf16/fp16/fp32 elements (ElemBits 16 or 32, IsHalf selects
// fp16 over bf16) and widens them to fp32.
template <int N, bool IsFp32, bool IsHalf = false>
__device__ __forceinline__ void load_widen(const void* src, float* out) {
  if constexpr (IsFp32) {
    const float* s = static_cast<const float*>(src);
    if (aligned16(s)) {
#pragma unroll
      for (int i = 0; i < N; i += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(s + i));
        out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) out[i] = __ldg(s + i);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    uint16_t h[N];
    if (aligned16(s)) {
#pragma unroll
      for (int i = 0; i < N; i += 8) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(s + i));
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          h[i + 2 * k] = uint16_t(w[k] & 0xFFFF);
          h[i + 2 * k + 1] = uint16_t(w[k] >> 16);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) h[i] = __ldg(s + i);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = IsHalf ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
  }
}

// Loads 4 elements (indexer rows): 8 bytes of bf16 or 16 bytes of fp32.
template <bool IsFp32>
__device__ __forceinline__ void load_widen4(const void* src, float* out) {
  if constexpr (IsFp32) {
    const float* s = static_cast<const float*>(src);
    if (aligned16(s)) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(s));
      out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = __ldg(s + i);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if ((reinterpret_cast<uintptr_t>(s) & 7) == 0) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(s));
      out[0] = bf16_to_f32(uint16_t(v.x & 0xFFFF)); out[1] = bf16_to_f32(uint16_t(v.x >> 16));
      out[2] = bf16_to_f32(uint16_t(v.y & 0xFFFF)); out[3] = bf16_to_f32(uint16_t(v.y >> 16));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = bf16_to_f32(__ldg(s + i));
    }
  }
}

// Stores N (a multiple of 8) 16-bit values.
template <int N>
__device__ __forceinline__ void store_u16(uint16_t* dst, const uint16_t* v) {
  if (aligned16(dst)) {
#pragma unroll
    for (int i = 0; i < N; i += 8) {
      uint4 w;
      w.x = v[i] | (uint32_t(v[i + 1]) << 16);
      w.y = v[i + 2] | (uint32_t(v[i + 3]) << 16);
      w.z = v[i + 4] | (uint32_t(v[i + 5]) << 16);
      w.w = v[i + 6] | (uint32_t(v[i + 7]) << 16);
      *reinterpret_cast<uint4*>(dst + i) = w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = v[i];
  }
}

// Stores N (a multiple of 4) fp32 values.
template <int N>
__device__ __forceinline__ void store_f32(float* dst, const float* v) {
  if (aligned16(dst)) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
      *reinterpret_cast<float4*>(dst + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = v[i];
  }
}

// Max over an aligned group of `lanes` lanes (a power of two <= 32). The shuffle mask names only
// the group, so a group may leave early while others of its warp continue.
__device__ __forceinline__ float warp_max_xor(float v, int lanes) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned group = lanes >= 32 ? 0xFFFFFFFFu : (((1u << lanes) - 1u) << (lane & ~unsigned(lanes - 1)));
  for (int mask = 1; mask < lanes; mask <<= 1) v = fmax_f32(v, __shfl_xor_sync(group, v, mask));
  return v;
}

}  // namespace dsv4
