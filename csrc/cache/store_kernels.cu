// CUDA kernels of fused_store_cache: one token per warp, quantized by the warp-level row
// quantizers of warp_quant.cuh (V4's bf16 RoPE dims in one coalesced store). Invalid slots write nothing.
#include "cache_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;

__device__ __forceinline__ float round_to_input(float v, bool input_fp32) {
  return input_fp32 ? v : round_to_bf16(v);
}

template <KVLayout L, bool InputFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) store_main_kernel(StoreParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const size_t elem = InputFp32 ? 4 : 2;
  const char* lane_row =
      static_cast<const char*>(p.input.data) + (token * p.input.row_stride + lane * kLaneDims) * elem;
  const bool rope_lane = p.freqs != nullptr && lane >= kRopeFirstLane;
  // The slot's and the row's lines are prefetched into the L2 before the wait (prefetches only, launch.cuh), so
  // that the row's DRAM trip no longer follows the slot's. H100, three alternating rounds, bf16 rows, consecutive
  // slots, 65536 / 131072 / 2^20 rows, against no prefetch: V4 4 / 6.5 / 8 % faster, V41_FP4 7 / 7.5 / 8 %, V41
  // level / 2 / 2.7 %. Loading the row beside the slot as well, before its test, gained nothing more for V4 and
  // V41 and cost V41_FP4 3 % (H100); on an H200 that build ran V41 at 65536 rows 4 % slower than no prefetch.
  if (token < p.n) {
    if (lane == 0) prefetch_l2(p.slots.address(token));
    prefetch_l2(lane_row);
  }
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const int64_t slot = p.slots[token];
  if (!p.cache.valid(slot)) return;
  float x[kLaneDims];
  load_widen<kLaneDims, InputFp32>(lane_row, x);
  if (rope_lane) {
    // V41 / V41_FP4 with per-row freqs_cis: rotate the tail, round to the activation dtype.
    float f[kLaneDims];
    load_widen<kLaneDims, true>(p.freqs + token * kRopeDim + (lane - kRopeFirstLane) * kLaneDims, f);
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 2) {
      rotate_pair(x[j], x[j + 1], f[j], f[j + 1]);
      x[j] = round_to_input(x[j], InputFp32);
      x[j + 1] = round_to_input(x[j + 1], InputFp32);
    }
  }
  pdl_launch_dependents();
  uint8_t* data = p.cache.data_row(slot);
  if constexpr (L == KVLayout::V4) {
    __shared__ __align__(16) uint32_t tails[kWarpsPerBlock][32];  // each warp's RoPE words
    store_v4_tail_across_warp(x, lane, shared_address(tails[threadIdx.x >> 5]), data + kV4NopeDim);
  }
  // A row's tests are the same for its whole warp, so every lane gets here and the tile-amax shuffles name the
  // whole warp (WholeWarp: no convergence check). H100, three alternating rounds, bf16 rows, 65536 / 131072 rows:
  // V4 2 / 1.5 %, V41 2.3 / 2.3 % faster; V41_FP4 (no shuffles) has the same machine code.
  quantize_main_lane<L, !InputFp32, kLaneDims, true, L == KVLayout::V4>(x, lane, data, p.cache.scale_row(slot));
}

// Indexer rows: four per warp, 8 lanes x 16 dims each (warp_quant.cuh).
template <IndexerFormat F, bool InputFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) store_indexer_kernel(StoreParams p) {
  const int lane = threadIdx.x & 31;
  const int sub = lane % kIndexerGroupLanes;
  const int64_t token = (int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * kIndexerRowsPerWarp +
                        lane / kIndexerGroupLanes;
  const size_t elem = InputFp32 ? 4 : 2;
  const char* lane_row =
      static_cast<const char*>(p.input.data) + (token * p.input.row_stride + sub * kIndexerGroupLaneDims) * elem;
  pdl_wait_dependencies();
  if (token >= p.n) return;  // whole 8-lane groups leave together
  // Unlike store_main_kernel, the row loads beside the slot, before its test, and nothing is prefetched before the
  // wait. H100, against loading after the test: fp8 level, fp4 2-4 % faster at 65536-131072 rows; adding
  // store_main_kernel's prefetches made fp8 4 % slower there and both formats up to 0.1 us slower at 1-256 rows.
  const int64_t slot = p.slots[token];
  float x[kIndexerGroupLaneDims];
  load_widen<kIndexerGroupLaneDims, InputFp32>(lane_row, x);
  if (!p.cache.valid(slot)) return;
  pdl_launch_dependents();
  quantize_indexer_lane<F, kIndexerGroupLaneDims>(x, sub, p.cache.data_row(slot), p.cache.scale_row(slot));
}

// One warp per unit of work (a main row, or four indexer rows).
dim3 token_grid(int64_t warps) { return dim3(unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

template <KVLayout L>
void launch_store_main(const StoreParams& p, cudaStream_t stream) {
  const bool fp32 = p.input.type == ElemType::FP32;
  launch_kernel(fp32 ? store_main_kernel<L, true> : store_main_kernel<L, false>, token_grid(p.n),
                dim3(kWarpsPerBlock * 32), 0, stream, "fused_store_cache", p);
}

template <IndexerFormat F>
void launch_store_indexer(const StoreParams& p, cudaStream_t stream) {
  const bool fp32 = p.input.type == ElemType::FP32;
  const int64_t warps = (p.n + kIndexerRowsPerWarp - 1) / kIndexerRowsPerWarp;
  launch_kernel(fp32 ? store_indexer_kernel<F, true> : store_indexer_kernel<F, false>,
                token_grid(warps), dim3(kWarpsPerBlock * 32), 0, stream, "fused_store_cache", p);
}

}  // namespace

void store_main_cuda(KVLayout layout, const StoreParams& p, cudaStream_t stream) {
  switch (layout) {
    case KVLayout::V4: launch_store_main<KVLayout::V4>(p, stream); break;
    case KVLayout::V41: launch_store_main<KVLayout::V41>(p, stream); break;
    case KVLayout::V41_FP4: launch_store_main<KVLayout::V41_FP4>(p, stream); break;
  }
}

void store_indexer_cuda(IndexerFormat fmt, const StoreParams& p, cudaStream_t stream) {
  if (fmt == IndexerFormat::FP8) {
    launch_store_indexer<IndexerFormat::FP8>(p, stream);
  } else {
    launch_store_indexer<IndexerFormat::FP4>(p, stream);
  }
}

}  // namespace dsv4
