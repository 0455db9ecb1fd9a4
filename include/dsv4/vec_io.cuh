// Device helpers that move short runs of elements between global memory and registers: 16-byte
// vector accesses when the address allows, element accesses otherwise (same results either way).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"

namespace dsv4 {

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// N (a multiple of 8) consecutive bf16/fp16/fp32 elements as they were loaded, before widening, so a
// load can be issued well ahead of the code that waits for it.
template <int N, bool IsFp32>
struct RawElements {
  static constexpr int kVectors = N * (IsFp32 ? 4 : 2) / 16;
  uint4 v[kVectors];
};

// Element-by-element fallback of load_raw for a misaligned source (each 32-bit word takes one fp32
// or two 16-bit elements). The loop is kept rolled (through a local buffer) so that the compiler emits
// it as a branch: unrolled, it would be if-converted into predicated loads that every aligned call
// still issues.
template <int N, bool IsFp32>
__device__ __forceinline__ void load_raw_misaligned(const void* src, RawElements<N, IsFp32>& raw) {
  constexpr int kWords = 4 * RawElements<N, IsFp32>::kVectors;
  uint32_t buffer[kWords];
#pragma unroll 1
  for (int i = 0; i < kWords; ++i) {
    if constexpr (IsFp32) {
      buffer[i] = load_input(static_cast<const uint32_t*>(src) + i);
    } else {
      const uint16_t* s = static_cast<const uint16_t*>(src) + 2 * i;
      buffer[i] = uint32_t(load_input(s)) | (uint32_t(load_input(s + 1)) << 16);
    }
  }
#pragma unroll
  for (int k = 0; k < RawElements<N, IsFp32>::kVectors; ++k) {
    raw.v[k] = make_uint4(buffer[4 * k], buffer[4 * k + 1], buffer[4 * k + 2], buffer[4 * k + 3]);
  }
}

// Issues the loads of N elements: 16-byte loads when the source is 16-byte aligned.
template <int N, bool IsFp32>
__device__ __forceinline__ void load_raw(const void* src, RawElements<N, IsFp32>& raw) {
  if (!aligned16(src)) {
    load_raw_misaligned(src, raw);
    return;
  }
#pragma unroll
  for (int k = 0; k < RawElements<N, IsFp32>::kVectors; ++k) {
    raw.v[k] = load_input(static_cast<const uint4*>(src) + k);
  }
}

// Widens loaded elements to fp32 (IsHalf selects fp16 over bf16); a bf16 takes one shift or mask.
template <int N, bool IsFp32, bool IsHalf = false>
__device__ __forceinline__ void widen_raw(const RawElements<N, IsFp32>& raw, float* out) {
#pragma unroll
  for (int k = 0; k < RawElements<N, IsFp32>::kVectors; ++k) {
    const uint32_t w[4] = {raw.v[k].x, raw.v[k].y, raw.v[k].z, raw.v[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (IsFp32) {
        out[4 * k + j] = bits_f32(w[j]);
      } else if constexpr (IsHalf) {
        out[8 * k + 2 * j] = f16_to_f32(uint16_t(w[j] & 0xFFFF));
        out[8 * k + 2 * j + 1] = f16_to_f32(uint16_t(w[j] >> 16));
      } else {
        out[8 * k + 2 * j] = bits_f32(w[j] << 16);
        out[8 * k + 2 * j + 1] = bits_f32(w[j] & 0xFFFF0000u);
      }
    }
  }
}

// Loads N (a multiple of 8) consecutive bf16/fp16/fp32 elements and widens them to fp32.
template <int N, bool IsFp32, bool IsHalf = false>
__device__ __forceinline__ void load_widen(const void* src, float* out) {
  RawElements<N, IsFp32> raw;
  load_raw(src, raw);
  widen_raw<N, IsFp32, IsHalf>(raw, out);
}

// Loads 4 elements (indexer rows): 8 bytes of bf16 or 16 bytes of fp32.
template <bool IsFp32>
__device__ __forceinline__ void load_widen4(const void* src, float* out) {
  if constexpr (IsFp32) {
    const float* s = static_cast<const float*>(src);
    if (aligned16(s)) {
      const float4 v = load_input(reinterpret_cast<const float4*>(s));
      out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = load_input(s + i);
    }
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    if ((reinterpret_cast<uintptr_t>(s) & 7) == 0) {
      const uint2 v = load_input(reinterpret_cast<const uint2*>(s));
      out[0] = bf16_to_f32(uint16_t(v.x & 0xFFFF)); out[1] = bf16_to_f32(uint16_t(v.x >> 16));
      out[2] = bf16_to_f32(uint16_t(v.y & 0xFFFF)); out[3] = bf16_to_f32(uint16_t(v.y >> 16));
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = bf16_to_f32(load_input(s + i));
    }
  }
}

// 8 16-bit values as the 16 bytes they occupy in memory (little-endian).
__device__ __forceinline__ uint4 pack_u16x8(const uint16_t* v) {
  return make_uint4(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16), v[4] | (uint32_t(v[5]) << 16),
                    v[6] | (uint32_t(v[7]) << 16));
}

// Stores N (a multiple of 8) 16-bit values.
template <int N>
__device__ __forceinline__ void store_u16(uint16_t* dst, const uint16_t* v) {
  if (aligned16(dst)) {
#pragma unroll
    for (int i = 0; i < N; i += 8) *reinterpret_cast<uint4*>(dst + i) = pack_u16x8(v + i);
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

// Max over an aligned group of `lanes` lanes (a power of two <= 32) of finite values (tile amax).
// `members` names the lanes taking part in the shuffles: the group itself (the default: a group may then
// leave early or wait elsewhere while others of its warp continue), or the whole warp where every lane
// that has not exited calls this (a constant full mask spares the convergence check that the compiler
// wraps around shuffles with a computed mask, about 5 instructions).
__device__ __forceinline__ float warp_max_xor(float v, int lanes, unsigned members) {
  for (int mask = 1; mask < lanes; mask <<= 1) v = fmaxf(v, __shfl_xor_sync(members, v, mask));
  return v;
}

__device__ __forceinline__ float warp_max_xor(float v, int lanes) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned group = lanes >= 32 ? 0xFFFFFFFFu : (((1u << lanes) - 1u) << (lane & ~unsigned(lanes - 1)));
  return warp_max_xor(v, lanes, group);
}

}  // namespace dsv4
