// CUDA kernels of get_paged_mqa_logits_metadata (§6.5), chosen from the batch size B (a shape):
// B <= 2048: one CTA scans the split counts into a shared int64 prefix (B <= 64: one warp scans);
// B > 2048: 4096-request tiles are scanned in parallel into a workspace, then one CTA scans the tile
// totals and resolves each of the num_sms + 1 rows by a binary search over tiles, then inside a tile.
#include "dsv4/launch.cuh"
#include "metadata_launch.h"

namespace dsv4 {

namespace {

constexpr int kThreads = 1024;  // one row per thread: num_sms + 1 <= 1025 rows, two loop steps at most
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Tile totals scanned per step of the resolve kernel (32 KiB of shared memory; any B fits).
constexpr int kTotalsChunk = 4096;

// B <= 64 is scanned by one warp (two requests per lane): no cross-warp step.
constexpr int64_t kTinyBatch = 64;

__device__ __forceinline__ int64_t warp_inclusive_scan(int64_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(kFullMask, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// Inclusive scan of one int64 per thread over a CTA of kThreads; `total` receives the CTA sum.
// All threads must call it; warp_sums may be reused as soon as it returns.
__device__ __forceinline__ int64_t block_inclusive_scan(int64_t v, int64_t* warp_sums, int64_t& total) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  v = warp_inclusive_scan(v);
  if (lane == 31) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_scan(warp_sums[lane]);
  __syncthreads();
  const int64_t result = v + (warp > 0 ? warp_sums[warp - 1] : 0);
  total = warp_sums[kWarps - 1];
  __syncthreads();
  return result;
}

// Row i of the schedule: request b (B for the sentinel) and the split of `start` inside it.
__device__ __forceinline__ void write_row(int32_t* out, int i, int64_t b, int64_t batch, int64_t start,
                                          int64_t splits_before_b) {
  const bool sentinel = b >= batch;
  out[2 * i] = int32_t(sentinel ? batch : b);
  out[2 * i + 1] = sentinel ? 0 : int32_t(start - splits_before_b);
}

// Scans kItems consecutive requests per thread, from `first`, over the CTA (or over warp 0 alone
// when `one_warp`: the other warps hold no requests); writes each inclusive prefix with
// `store(index, prefix)` and returns the total (in every thread, also with one_warp).
template <int kItems, class Store>
__device__ __forceinline__ int64_t scan_split_counts(const StridedIndex& lens, int64_t first, int64_t end,
                                                     int64_t* warp_sums, bool one_warp, Store store) {
  int32_t n[kItems];
  int64_t local = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    n[j] = first + j < end ? split_count(lens.i32(first + j)) : 0;
    local += n[j];
  }
  int64_t total = 0;
  int64_t inclusive = 0;
  if (one_warp) {
    if (threadIdx.x < 32) {
      inclusive = warp_inclusive_scan(local);
      if (threadIdx.x == 31) warp_sums[0] = inclusive;
    }
  } else {
    inclusive = block_inclusive_scan(local, warp_sums, total);
  }
  int64_t run = inclusive - local;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    run += n[j];
    if (first + j < end) store(first + j, run);
  }
  if (one_warp) {
    __syncthreads();
    total = warp_sums[0];
  }
  return total;
}

__global__ void __launch_bounds__(kThreads) schedule_single_cta_kernel(const ScheduleParams p) {
  constexpr int kItems = int(kScheduleSingleCtaMaxBatch / kThreads);
  __shared__ int64_t prefix[kScheduleSingleCtaMaxBatch];
  __shared__ int64_t warp_sums[kWarps];
  pdl_wait_dependencies();
  const int64_t total = scan_split_counts<kItems>(
      p.lens, int64_t(threadIdx.x) * kItems, p.batch, warp_sums, p.batch <= kTinyBatch,
      [&](int64_t b, int64_t v) { prefix[b] = v; });
  __syncthreads();
  pdl_launch_dependents();  // dependents still wait for this grid to complete before reading
  const SplitPlan plan = split_plan(total, p.num_sms);
  const auto prefix_at = [&](int64_t b) { return prefix[b]; };
  for (int i = threadIdx.x; i <= p.num_sms; i += kThreads) {
    const int64_t start = sm_start(i, plan);
    const int64_t b = count_not_above(prefix_at, p.batch, start);
    write_row(p.out, i, b, p.batch, start, b > 0 && b < p.batch ? prefix[b - 1] : 0);
  }
}

// Phase 1 of the large path: tile-local inclusive prefixes, then the tile total at workspace[B + tile].
__global__ void __launch_bounds__(kThreads) schedule_tile_scan_kernel(const ScheduleParams p) {
  constexpr int kItems = int(kScheduleTile / kThreads);
  __shared__ int64_t warp_sums[kWarps];
  pdl_wait_dependencies();
  const int64_t tile_first = int64_t(blockIdx.x) * kScheduleTile;
  int64_t* tile_prefix = p.workspace + tile_first;
  const int64_t total = scan_split_counts<kItems>(
      p.lens, tile_first + int64_t(threadIdx.x) * kItems, p.batch, warp_sums, false,
      [&](int64_t b, int64_t v) { tile_prefix[b - tile_first] = v; });
  pdl_launch_dependents();
  if (threadIdx.x == 0) p.workspace[p.batch + blockIdx.x] = total;
}

// Phase 2 of the large path: scans the tile totals in place (chunk by chunk through shared
// memory), then resolves the rows.
__global__ void __launch_bounds__(kThreads) schedule_resolve_kernel(const ScheduleParams p) {
  constexpr int kItems = kTotalsChunk / kThreads;
  __shared__ int64_t chunk_prefix[kTotalsChunk];
  __shared__ int64_t warp_sums[kWarps];
  pdl_wait_dependencies();
  const int64_t tiles = (p.batch + kScheduleTile - 1) / kScheduleTile;
  int64_t* tile_totals = p.workspace + p.batch;
  int64_t carry = 0;
  for (int64_t base = 0; base < tiles; base += kTotalsChunk) {
    const int64_t first = base + int64_t(threadIdx.x) * kItems;
    int64_t v[kItems];
    int64_t local = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      v[j] = first + j < tiles ? tile_totals[first + j] : 0;
      local += v[j];
    }
    int64_t chunk_total;
    int64_t run = carry + block_inclusive_scan(local, warp_sums, chunk_total) - local;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      run += v[j];
      if (first + j < tiles) {
        tile_totals[first + j] = run;
        chunk_prefix[first + j - base] = run;
      }
    }
    carry += chunk_total;
  }
  __syncthreads();  // the scanned totals (shared and global) are visible to the whole CTA
  pdl_launch_dependents();
  // With one chunk, the inclusive tile prefixes are all in shared memory.
  const bool totals_in_smem = tiles <= kTotalsChunk;
  const auto tile_prefix_at = [&](int64_t t) { return totals_in_smem ? chunk_prefix[t] : tile_totals[t]; };
  const SplitPlan plan = split_plan(carry, p.num_sms);
  for (int i = threadIdx.x; i <= p.num_sms; i += kThreads) {
    const int64_t start = sm_start(i, plan);
    const int64_t tile = count_not_above(tile_prefix_at, tiles, start);
    if (tile >= tiles) {
      write_row(p.out, i, p.batch, p.batch, start, 0);
      continue;
    }
    // The tile's prefix exceeds start, so the request is inside this tile.
    const int64_t before_tile = tile > 0 ? tile_prefix_at(tile - 1) : 0;
    const int64_t tile_first = tile * kScheduleTile;
    const int64_t tile_len = p.batch - tile_first < kScheduleTile ? p.batch - tile_first : kScheduleTile;
    const int64_t* local = p.workspace + tile_first;
    const auto local_at = [&](int64_t j) { return load_input(local + j); };  // written by phase 1
    const int64_t j = count_not_above(local_at, tile_len, start - before_tile);
    write_row(p.out, i, tile_first + j, p.batch, start, before_tile + (j > 0 ? local_at(j - 1) : 0));
  }
}

}  // namespace

void paged_mqa_schedule_cuda(const ScheduleParams& p, cudaStream_t stream) {
  const char* name = "get_paged_mqa_logits_metadata";
  if (!schedule_uses_workspace(p.batch)) {
    // B == 0 launches too: every row becomes the sentinel (0, 0).
    launch_kernel(schedule_single_cta_kernel, dim3(1), dim3(kThreads), 0, stream, name, p);
    return;
  }
  const int64_t tiles = (p.batch + kScheduleTile - 1) / kScheduleTile;
  launch_kernel(schedule_tile_scan_kernel, dim3(unsigned(tiles)), dim3(kThreads), 0, stream, name, p);
  launch_kernel(schedule_resolve_kernel, dim3(1), dim3(kThreads), 0, stream, name, p);
}

}  // namespace dsv4
