// Shared-memory accesses by shared-space address, a 32-bit value a kernel computes once. Under register
// pressure the compiler recomputes a shared array's address from the block's shared window at each use (a
// special-register read and three more instructions; twice per row in the pipelined K writer's RoPE
// exchange); from opaque_shared_address it cannot, and these accessors take the value as it is. Each access
// is volatile with a memory clobber: it stays where the code puts it relative to __syncwarp and the other
// memory accesses.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4 {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The same address held in a register: the compiler cannot see where it came from, so it keeps the value
// instead of recomputing it from the block's shared window at each use.
__device__ __forceinline__ uint32_t opaque_shared_address(const void* p) {
  uint32_t at;
  asm("mov.b32 %0, %1;" : "=r"(at) : "r"(shared_address(p)));
  return at;
}

__device__ __forceinline__ void store_shared_u16(uint32_t at, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(at), "h"(v) : "memory");
}

// 16 bytes at a 16-byte aligned address.
__device__ __forceinline__ void store_shared_u4(uint32_t at, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// 4 bytes at a 4-byte aligned address.
__device__ __forceinline__ uint32_t load_shared_u32(uint32_t at) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(at) : "memory");
  return v;
}

// 8 bytes at an 8-byte aligned address.
__device__ __forceinline__ uint2 load_shared_u2(uint32_t at) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(at) : "memory");
  return v;
}

// 16 bytes at a 16-byte aligned address.
__device__ __forceinline__ uint4 load_shared_u4(uint32_t at) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(at)
               : "memory");
  return v;
}

}  // namespace dsv4
