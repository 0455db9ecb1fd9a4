// CUDA planners for c4/c128: the decode planner (one thread per request), the GPU-input prefill
// planner (deterministic block scans of E', n_c, n_w, then one thread per plan row that finds its
// request by binary search and writes final bytes) and the stage-1 kernel of the host-input path.
#include "plan_launch.h"
#include "dsv4/launch.cuh"

namespace dsv4 {

namespace {

constexpr int kScanThreads = 1024;   // one request per thread per tile
constexpr int kFusedRowsPerThread = 1;  // rows are latency chains: spread them over blocks
constexpr int kRowThreads = 256;

__device__ __forceinline__ void store_entry(DecodeEntry* dst, const DecodeEntry& e) {
  *reinterpret_cast<uint4*>(dst) =
      make_uint4(e.seq_len, uint32_t(e.write_loc), uint32_t(e.read_page_0), uint32_t(e.read_page_1));
}

__device__ __forceinline__ void store_entry(CompressEntry* dst, const CompressEntry& e) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(e.seq_len, uint32_t(e.ragged_id) | (uint32_t(e.buffer_len) << 16),
                                              uint32_t(e.read_page_0), uint32_t(e.read_page_1));
}

__device__ __forceinline__ void store_entry(WriteEntry* dst, const WriteEntry& e) {
  *reinterpret_cast<uint2*>(dst) = make_uint2(e.word0, uint32_t(e.write_loc));
}

__device__ __forceinline__ CompressEntry load_entry(const CompressEntry* src) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  return CompressEntry{v.x, uint16_t(v.y & 0xFFFFu), uint16_t(v.y >> 16), int32_t(v.z), int32_t(v.w)};
}

__device__ __forceinline__ WriteEntry load_entry(const WriteEntry* src) {
  const uint2 v = *reinterpret_cast<const uint2*>(src);
  return WriteEntry{v.x, int32_t(v.y)};
}

__global__ void decode_plan_kernel(DecodePlanParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  store_entry(p.plan + b, decode_entry(p.seq_lens[b], p.req_pool_indices[b], p.lookup, p.ratio));
}

// ---- block scan ----

// Exclusive prefix sums of (x, y) in thread order over a kScanThreads block; also the block totals.
// Warp shuffles, then one warp over the warp totals: a fixed order, no atomics.
struct ScanPair {
  long long x, y;
};

__device__ ScanPair block_exclusive_scan(ScanPair v, ScanPair& total) {
  constexpr int kWarps = kScanThreads / 32;
  __shared__ ScanPair warp_sums[kWarps + 1];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  ScanPair inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const long long tx = __shfl_up_sync(0xFFFFFFFFu, inc.x, d);
    const long long ty = __shfl_up_sync(0xFFFFFFFFu, inc.y, d);
    if (lane >= d) {
      inc.x += tx;
      inc.y += ty;
    }
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const ScanPair own = lane < kWarps ? warp_sums[lane] : ScanPair{0, 0};
    ScanPair w = own;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const long long tx = __shfl_up_sync(0xFFFFFFFFu, w.x, d);
      const long long ty = __shfl_up_sync(0xFFFFFFFFu, w.y, d);
      if (lane >= d) {
        w.x += tx;
        w.y += ty;
      }
    }
    if (lane < kWarps) warp_sums[lane] = ScanPair{w.x - own.x, w.y - own.y};
    if (lane == kWarps - 1) warp_sums[kWarps] = w;
  }
  __syncthreads();
  const ScanPair base = warp_sums[warp];
  total = warp_sums[kWarps];
  __syncthreads();  // warp_sums is reused by the next call
  return ScanPair{base.x + inc.x - v.x, base.y + inc.y - v.y};
}

// What the emitters need per request: the §3.3 inputs, the first plan row of each plan, and the
// request id (loaded by the scan together with the lengths, so that an emitter's state-slot lookup is
// its only dependent load).
struct RequestStarts {
  int32_t start_c, start_w;
  int32_t seq_len, extend_len;  // as planned (clamped into int32)
  int32_t off;                  // ragged offset, saturated at num_q_tokens (a request past it plans nothing)
  int32_t pad_;
  int64_t rid;                  // req_pool_indices[b]
};

struct ScanCarry {
  long long off, c, w;
};

// Scans the tile of requests [base, base + kScanThreads): returns this thread's request starts and
// advances the carry by the tile's sums. Threads past the batch contribute zeros.
__device__ RequestStarts scan_tile(const PrefillPlanParams& p, int64_t base, ScanCarry& carry) {
  const int64_t b = base + threadIdx.x;
  const bool live = b < p.batch;
  const int64_t L = live ? planned_seq_len(p.seq_lens[b]) : 0;
  const int64_t E = live ? planned_extend_len(p.extend_lens[b]) : 0;
  const int64_t rid = live ? p.req_pool_indices[b] : 0;
  ScanPair total;
  const ScanPair ex_off = block_exclusive_scan(ScanPair{E, 0}, total);
  const long long off = carry.off + ex_off.x;
  carry.off += total.x;
  RequestPlan rp{};
  if (live) rp = plan_request(p.geometry, L, E, off);
  const ScanPair ex_n = block_exclusive_scan(ScanPair{rp.n_c, rp.n_w}, total);
  RequestStarts s{};
  s.start_c = int32_t(carry.c + ex_n.x);
  s.start_w = int32_t(carry.w + ex_n.y);
  s.seq_len = int32_t(L);
  s.extend_len = int32_t(E);
  s.off = int32_t(off < p.geometry.num_q_tokens ? off : p.geometry.num_q_tokens);
  s.rid = rid;
  carry.c += total.x;
  carry.w += total.y;
  return s;
}

// Last request whose first row is <= row (row < total, so that request owns the row).
template <bool kWritePlan>
__device__ __forceinline__ int64_t find_request(const RequestStarts* starts, int64_t batch, int64_t row) {
  int64_t lo = 0, hi = batch;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    const int32_t start = kWritePlan ? starts[mid].start_w : starts[mid].start_c;
    if (start <= row) lo = mid; else hi = mid;
  }
  return lo;
}

// Final bytes of plan row `row` of both plans (rows past the totals get sentinels).
__device__ void emit_rows(const PrefillPlanParams& p, const RequestStarts* starts, int64_t total_c,
                          int64_t total_w, int64_t row) {
  if (row < p.rows_c) {
    CompressEntry e = invalid_compress_entry();
    if (row < total_c) {
      const int64_t b = find_request<false>(starts, p.batch, row);
      const RequestStarts s = starts[b];
      const RequestPlan rp = plan_request(p.geometry, s.seq_len, s.extend_len, s.off);
      e = compress_entry_stage0(p.geometry, rp, row - s.start_c, b);
      finalize_compress_entry(e, s.rid, p.lookup, p.geometry.ratio);
    }
    store_entry(p.plan_c + row, e);
  }
  if (row < p.rows_w) {
    WriteEntry e = invalid_write_entry();
    if (row < total_w) {
      const int64_t b = find_request<true>(starts, p.batch, row);
      const RequestStarts s = starts[b];
      const RequestPlan rp = plan_request(p.geometry, s.seq_len, s.extend_len, s.off);
      e = write_entry_stage0(p.geometry, rp, row - s.start_w, b);
      finalize_write_entry(e, s.rid, p.lookup);
    }
    store_entry(p.plan_w + row, e);
  }
}

// Batches of at most kScanThreads requests: every block scans the whole batch into shared memory
// (cheap and redundant), then writes its rows. One launch.
__global__ void __launch_bounds__(kScanThreads) prefill_plan_fused_kernel(PrefillPlanParams p) {
  __shared__ RequestStarts starts[kScanThreads];
  __shared__ long long totals[2];
  pdl_wait_dependencies();
  pdl_launch_dependents();
  ScanCarry carry{0, 0, 0};
  const RequestStarts s = scan_tile(p, 0, carry);
  if (threadIdx.x < p.batch) starts[threadIdx.x] = s;
  if (threadIdx.x == 0) {
    totals[0] = carry.c;
    totals[1] = carry.w;
  }
  __syncthreads();
  const int64_t first = int64_t(blockIdx.x) * kScanThreads * kFusedRowsPerThread + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kFusedRowsPerThread; ++k) {
    emit_rows(p, starts, totals[0], totals[1], first + int64_t(k) * kScanThreads);
  }
}

// Larger batches, first launch: one block walks the batch tile by tile and stores every request's
// starts, and the totals after the last request.
__global__ void __launch_bounds__(kScanThreads) prefill_scan_kernel(PrefillPlanParams p, RequestStarts* starts) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  ScanCarry carry{0, 0, 0};
  for (int64_t base = 0; base < p.batch; base += kScanThreads) {
    const RequestStarts s = scan_tile(p, base, carry);
    if (base + threadIdx.x < p.batch) starts[base + threadIdx.x] = s;
  }
  if (threadIdx.x == 0) {
    RequestStarts total{};
    total.start_c = int32_t(carry.c);
    total.start_w = int32_t(carry.w);
    starts[p.batch] = total;
  }
}

// Larger batches, second launch: one thread per plan row.
__global__ void __launch_bounds__(kRowThreads) prefill_emit_kernel(PrefillPlanParams p, const RequestStarts* starts) {
  pdl_wait_dependencies();  // the scan kernel's starts
  pdl_launch_dependents();
  const int64_t row = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  const RequestStarts total = starts[p.batch];
  emit_rows(p, starts, total.start_c, total.start_w, row);
}

// Host-input path: rewrites the stage-0 rows copied from the host.
__global__ void __launch_bounds__(kRowThreads) prefill_stage1_kernel(PrefillPlanParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  const int64_t row = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  if (row < p.rows_c) {
    CompressEntry e = load_entry(p.plan_c + row);
    if (e.seq_len != kInvalidPlanWord) {
      finalize_compress_entry(e, p.req_pool_indices[e.read_page_1], p.lookup, p.geometry.ratio);
      store_entry(p.plan_c + row, e);
    }
  }
  if (row < p.rows_w) {
    WriteEntry e = load_entry(p.plan_w + row);
    if (e.word0 != kInvalidPlanWord) {
      finalize_write_entry(e, p.req_pool_indices[stage0_batch(e)], p.lookup);
      store_entry(p.plan_w + row, e);
    }
  }
}

unsigned blocks_for(int64_t n, int64_t per_block) { return unsigned((n + per_block - 1) / per_block); }

}  // namespace

void decode_plan_cuda(const DecodePlanParams& p, cudaStream_t stream) {
  if (p.batch == 0) return;
  launch_kernel(decode_plan_kernel, dim3(blocks_for(p.batch, kRowThreads)), dim3(kRowThreads), 0, stream,
                "plan_compress_decode", p);
}

void prefill_stage1_cuda(const PrefillPlanParams& p, cudaStream_t stream) {
  const int64_t rows = p.rows_c > p.rows_w ? p.rows_c : p.rows_w;
  if (rows == 0) return;
  launch_kernel(prefill_stage1_kernel, dim3(blocks_for(rows, kRowThreads)), dim3(kRowThreads), 0, stream,
                "plan_compress_prefill (stage 1)", p);
}

int64_t prefill_scratch_words(int64_t batch) {
  return batch <= kScanThreads ? 0 : (batch + 1) * int64_t(sizeof(RequestStarts) / sizeof(int32_t));
}

void prefill_plan_cuda(const PrefillPlanParams& p, int32_t* scratch, cudaStream_t stream) {
  const int64_t rows = p.rows_c > p.rows_w ? p.rows_c : p.rows_w;
  if (rows == 0) return;
  if (p.batch <= kScanThreads) {
    launch_kernel(prefill_plan_fused_kernel, dim3(blocks_for(rows, int64_t(kScanThreads) * kFusedRowsPerThread)),
                  dim3(kScanThreads), 0, stream, "plan_compress_prefill", p);
    return;
  }
  auto* starts = reinterpret_cast<RequestStarts*>(scratch);
  launch_kernel(prefill_scan_kernel, dim3(1), dim3(kScanThreads), 0, stream, "plan_compress_prefill (scan)", p,
                starts);
  launch_kernel(prefill_emit_kernel, dim3(blocks_for(rows, kRowThreads)), dim3(kRowThreads), 0, stream,
                "plan_compress_prefill (emit)", p, static_cast<const RequestStarts*>(starts));
}

}  // namespace dsv4
