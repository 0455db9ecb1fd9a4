// Hopper bulk copies (the TMA engine's cp.async.bulk) from global into shared memory, completed on an
// mbarrier: one instruction moves a whole row, and the data arrive without occupying the registers or
// the issue slots of the warp that waits for them (device only, sm_90 and later).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dsv4/shared_io.cuh"

namespace dsv4 {

// An mbarrier that completes a phase after `count` arrivals and the bytes it was told to expect.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(count) : "memory");
}

// Makes initialized mbarriers visible to the bulk-copy (async) proxy.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The functions below take shared-memory addresses (shared_address), which a loop computes once: from a
// generic pointer, each call would redo the conversion (a special-register read and arithmetic).

// One arrival that also expects `bytes` more bytes in the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory at `dst`;
// the transfer counts against `bar`'s expected bytes.
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// Orders the shared-memory accesses of the generic proxy (plain loads and stores) that happen before this
// point, in this thread or in threads it has synchronized with, before its later bulk copies (the async
// proxy) into the same memory. An mbarrier that releases a buffer to be refilled orders the generic
// accesses only: without this fence, a refill can land before the reads it was meant to follow.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Waits until phase `parity` (0 or 1) of the mbarrier at shared address `bar` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

}  // namespace dsv4
