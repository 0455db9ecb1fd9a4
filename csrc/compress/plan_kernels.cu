// CUDA planners for c4/c128: the decode planner (one thread per request), the GPU-input prefill
// planner (deterministic block scans of E', n_c, n_w; each request's first rows written by owner lanes,
// one row each, every other row by one thread that finds its request by binary search) and the stage-1
// kernel of the host-input path.
#include "plan_launch.h"
#include "dsv4/launch.cuh"

namespace dsv4 {

namespace {

// Batches up to this size are planned in one launch with (at least) one thread per request; larger ones
// are scanned in tiles of this size.
constexpr int kScanTile = 1024;
constexpr int kRowThreads = 256;  // rows are latency chains: spread them over blocks
// The one-launch planner writes each request's first rows from owner lanes, which start their table
// lookups before the scans: for a slice of kOwnerSlice requests, two blocks, whose lanes j < kOwnerLanes
// serve request j / kOwnedSlots: lane k (= j % kOwnedSlots) writes WritePlan row k (even block), or looks
// up one of the two slots of CompressPlan row k / 2 (odd block; the even lane writes the row). That covers
// every row of a verify or extend step of up to 8 tokens. One row per lane keeps each lane's chain at one
// lookup: a thread that planned its request's eight rows itself issued ~950 instructions at bs 1, and its
// chain, not the loads, set the time. Slices spread a large batch's lookups over several SMs; a slice of
// 16 requests is 4 owner warps per block, one per scheduler beside the scanning warps (H200, bs 256 verify
// steps: c4 2.96 -> 2.70, c128 2.32 -> 2.14 us against slices of 32).
constexpr int kOwnedSlots = 8;
constexpr int kOwnedWrites = kOwnedSlots;
constexpr int kOwnedCompress = kOwnedSlots / 2;
constexpr int kOwnerSlice = 16;
constexpr int kOwnerLanes = kOwnerSlice * kOwnedSlots;

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
  warm_params(p, p.plan);
  pdl_wait_dependencies();
  pdl_launch_dependents();
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  store_entry(p.plan + b, decode_entry(p.seq_lens[b], p.req_pool_indices[b], p.lookup, p.ratio));
}

// ---- block scan ----

struct ScanPair {
  int32_t x, y;
};

__device__ __forceinline__ ScanPair operator+(ScanPair a, ScanPair b) { return ScanPair{a.x + b.x, a.y + b.y}; }
__device__ __forceinline__ ScanPair operator-(ScanPair a, ScanPair b) { return ScanPair{a.x - b.x, a.y - b.y}; }
__device__ __forceinline__ int32_t shfl_up(int32_t v, int d) { return __shfl_up_sync(0xFFFFFFFFu, v, d); }
__device__ __forceinline__ ScanPair shfl_up(ScanPair v, int d) { return ScanPair{shfl_up(v.x, d), shfl_up(v.y, d)}; }
__device__ __forceinline__ int32_t shfl(int32_t v, int lane) { return __shfl_sync(0xFFFFFFFFu, v, lane); }
__device__ __forceinline__ ScanPair shfl(ScanPair v, int lane) { return ScanPair{shfl(v.x, lane), shfl(v.y, lane)}; }
__device__ __forceinline__ uint32_t shfl_up(uint32_t v, int d) { return __shfl_up_sync(0xFFFFFFFFu, v, d); }
__device__ __forceinline__ uint32_t shfl(uint32_t v, int lane) { return __shfl_sync(0xFFFFFFFFu, v, lane); }
__device__ __forceinline__ int32_t warp_sum(int32_t v) { return __reduce_add_sync(0xFFFFFFFFu, v); }
__device__ __forceinline__ uint32_t warp_sum(uint32_t v) { return __reduce_add_sync(0xFFFFFFFFu, v); }
__device__ __forceinline__ ScanPair warp_sum(ScanPair v) { return ScanPair{warp_sum(v.x), warp_sum(v.y)}; }

// A request's ragged tokens and its (compress, write) rows at ragged offset 0, scanned together, the rows
// packed into one word (compress rows from bit kPackedWriteBits): a word fewer to shuffle. The packed sums
// are read only when no request is cut short, and then they are at most num_q_tokens / 4 + batch < 2^15
// compress rows (ratio >= 4, batch <= kScanTile) and num_q_tokens <= 2^16 write rows: no field carries
// into the other. (Cut short, they may wrap; unsigned, so that is defined.)
constexpr int kPackedWriteBits = 17;
static_assert(kMaxPlanTokens < (int64_t(1) << kPackedWriteBits) &&
                  kMaxPlanTokens / 4 + kScanTile < (int64_t(1) << (32 - kPackedWriteBits)),
              "packed row sums fit their fields");

struct ScanTokensRows {
  int32_t tokens;
  uint32_t rows;

  __device__ __forceinline__ static uint32_t pack(ScanPair rows) {
    return (uint32_t(rows.x) << kPackedWriteBits) | uint32_t(rows.y);
  }
  __device__ __forceinline__ ScanPair unpacked_rows() const {
    return ScanPair{int32_t(rows >> kPackedWriteBits), int32_t(rows & ((1u << kPackedWriteBits) - 1))};
  }
};

__device__ __forceinline__ ScanTokensRows operator+(ScanTokensRows a, ScanTokensRows b) {
  return ScanTokensRows{a.tokens + b.tokens, a.rows + b.rows};
}
__device__ __forceinline__ ScanTokensRows operator-(ScanTokensRows a, ScanTokensRows b) {
  return ScanTokensRows{a.tokens - b.tokens, a.rows - b.rows};
}
__device__ __forceinline__ ScanTokensRows shfl_up(ScanTokensRows v, int d) {
  return ScanTokensRows{shfl_up(v.tokens, d), shfl_up(v.rows, d)};
}
__device__ __forceinline__ ScanTokensRows shfl(ScanTokensRows v, int lane) {
  return ScanTokensRows{shfl(v.tokens, lane), shfl(v.rows, lane)};
}
__device__ __forceinline__ ScanTokensRows warp_sum(ScanTokensRows v) {
  return ScanTokensRows{warp_sum(v.tokens), warp_sum(v.rows)};
}

// Exclusive prefix sums in thread order over the block (a whole number of warps), and the block total.
// Warp shuffles, then every warp sums the warp totals before its own, and all of them, by single-instruction
// warp reductions (redux.sync; one barrier, no second round through shared memory). Integer sums are exact
// in any order, so the result is deterministic. When every value past the first warp is zero (one_warp,
// block-uniform: a decode-size batch), the first warp's sums are the block's and need neither shared
// memory nor barriers; the total is then valid in the first warp only. Each T has its own warp totals:
// a caller that scans the same T again must put a barrier between the scans. Callers keep every sum
// below 2^31.
template <class T>
__device__ T block_exclusive_scan(T v, T& total, bool one_warp) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  T inc = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const T up = shfl_up(inc, d);
    if (lane >= d) inc = inc + up;
  }
  if (one_warp) {
    total = shfl(inc, 31);
    return inc - v;
  }
  __shared__ T warp_totals[32];
  if (lane == 31) warp_totals[warp] = inc;
  __syncthreads();
  const T own = lane < warps ? warp_totals[lane] : T{};
  total = warp_sum(own);
  return warp_sum(lane < warp ? own : T{}) + inc - v;
}

// ---- per-request scans ----

// view[index] as its bits zero-extended to 64. No instruction touches the loaded value here (a sign
// extension would stall the warp until the load returns), so it flies until the caller needs it; widen()
// gives the value.
__device__ __forceinline__ uint64_t load_bits(const IndexView& view, int64_t index) {
  return view.is_int64 ? static_cast<const uint64_t*>(view.data)[index]
                       : uint64_t(static_cast<const uint32_t*>(view.data)[index]);
}

__device__ __forceinline__ int64_t widen(const IndexView& view, uint64_t bits) {
  return view.is_int64 ? int64_t(bits) : int64_t(int32_t(uint32_t(bits)));
}

// A request's lengths as planned (clamped into int32, §3.3) and its id; zeros past the batch.
struct RequestInput {
  int32_t seq_len, extend_len;
  int64_t rid;
  bool live;
};

// A request's input words in flight (load_bits): issue() returns at once, finish() waits for them. A warp
// that loads two requests issues both before it finishes either, so that it waits one round trip.
struct RequestLoads {
  uint64_t seq_len, extend_len, rid;
  bool live;

  __device__ __forceinline__ void issue(const PrefillPlanParams& p, int64_t b) {
    live = b < p.batch;
    seq_len = live ? load_bits(p.seq_lens, b) : 0;
    extend_len = live ? load_bits(p.extend_lens, b) : 0;
    rid = live ? load_bits(p.req_pool_indices, b) : 0;
  }

  __device__ __forceinline__ RequestInput finish(const PrefillPlanParams& p) const {
    RequestInput in{0, 0, 0, live};
    if (live) {
      in.seq_len = int32_t(planned_seq_len(widen(p.seq_lens, seq_len)));
      in.extend_len = int32_t(planned_extend_len(widen(p.extend_lens, extend_len)));
      in.rid = widen(p.req_pool_indices, rid);
    }
    return in;
  }
};

__device__ __forceinline__ RequestInput load_request(const PrefillPlanParams& p, int64_t b) {
  RequestLoads loads;
  loads.issue(p, b);
  return loads.finish(p);
}

// What the row emitters need per request: its first row in each plan and the inputs of plan_request.
struct RequestStarts {
  int32_t start_c, start_w;
  int32_t seq_len, extend_len;  // as planned
  int32_t off;                  // ragged offset, saturated at num_q_tokens (a request at or past it plans nothing)
  int32_t pad_;
  int64_t rid;                  // req_pool_indices[b]
};

// Sums over the tiles scanned so far; each stays at most num_q_tokens (with one_warp scans: in the first
// warp only).
struct ScanCarry {
  int32_t off, c, w;
};

// First scan: the request's ragged offset. Each term is clamped to num_q_tokens (<= 2^16) first, which
// keeps a tile's sums below 2^31 and leaves min(offset, num_q_tokens), all that plan_request needs, exact.
__device__ int32_t scan_offset(const PrefillPlanParams& p, const RequestInput& in, ScanCarry& carry) {
  const int32_t nq = int32_t(p.geometry.num_q_tokens);
  int32_t total;
  const int32_t ex = block_exclusive_scan(min(in.extend_len, nq), total, false);
  const int32_t off = min(carry.off + ex, nq);
  carry.off = min(carry.off + total, nq);
  return off;
}

// The request's counts at ragged offset `off`, given its plan at offset 0. They are equal when all its
// tokens fit below num_q_tokens; only a request cut short by an underfilled num_q_tokens (and every
// later one, which plans nothing) needs plan_request again.
__device__ ScanPair counts_at(const PrefillPlanParams& p, const RequestInput& in, const RequestPlan& rp0,
                              int32_t off) {
  if (in.extend_len <= p.geometry.num_q_tokens - off) return ScanPair{int32_t(rp0.n_c), int32_t(rp0.n_w)};
  const RequestPlan rp = plan_request(p.geometry, in.seq_len, in.extend_len, off);
  return ScanPair{int32_t(rp.n_c), int32_t(rp.n_w)};
}

// Second scan: the request's first plan rows, from its counts. A request plans at most its share of the
// num_q_tokens ragged tokens, so every sum is at most num_q_tokens.
__device__ RequestStarts scan_starts(const RequestInput& in, int32_t off, ScanPair counts, ScanCarry& carry,
                                     bool one_warp) {
  ScanPair total;
  const ScanPair ex = block_exclusive_scan(counts, total, one_warp);
  const RequestStarts s{carry.c + ex.x, carry.w + ex.y, in.seq_len, in.extend_len, off, 0, in.rid};
  carry.c += total.x;
  carry.w += total.y;
  return s;
}

// The request's plan at ragged offset 0 (empty past the batch).
__device__ __forceinline__ RequestPlan plan_at_zero(const PrefillPlanParams& p, const RequestInput& in) {
  return in.live ? plan_request(p.geometry, in.seq_len, in.extend_len, 0) : RequestPlan{};
}

// ---- rows found by binary search ----

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

// Final bytes of plan row `row` of both plans: a sentinel past the totals, else row k of its request,
// except the first owned_c / owned_w rows of each request, which the request's own thread writes.
__device__ void emit_rows(const PrefillPlanParams& p, const RequestStarts* starts, int32_t total_c,
                          int32_t total_w, int64_t row, int owned_c, int owned_w) {
  const PlanGeometry& g = p.geometry;
  if (row < p.rows_c) {
    CompressEntry e = invalid_compress_entry();
    bool mine = true;  // false for a row that its request's own thread writes
    if (row < total_c) {
      const int64_t b = find_request<false>(starts, p.batch, row);
      const RequestStarts s = starts[b];
      const int32_t k = int32_t(row) - s.start_c;
      mine = k >= owned_c;
      if (mine) {
        e = compress_entry_stage0(g, plan_request(g, s.seq_len, s.extend_len, s.off), k, b);
        finalize_compress_entry(e, s.rid, p.lookup, g.ratio);
      }
    }
    if (mine) store_entry(p.plan_c + row, e);
  }
  if (row < p.rows_w) {
    WriteEntry e = invalid_write_entry();
    bool mine = true;  // false for a row that its request's own thread writes
    if (row < total_w) {
      const int64_t b = find_request<true>(starts, p.batch, row);
      const RequestStarts s = starts[b];
      const int32_t k = int32_t(row) - s.start_w;
      mine = k >= owned_w;
      if (mine) {
        e = write_entry_stage0(g, plan_request(g, s.seq_len, s.extend_len, s.off), k, b);
        finalize_write_entry(e, s.rid, p.lookup);
      }
    }
    if (mine) store_entry(p.plan_w + row, e);
  }
}

// The sentinels of plan row `row`, when every row below the totals is written by its request's thread.
__device__ __forceinline__ void emit_sentinels(const PrefillPlanParams& p, int32_t total_c, int32_t total_w,
                                               int64_t row) {
  if (row >= total_c && row < p.rows_c) store_entry(p.plan_c + row, invalid_compress_entry());
  if (row >= total_w && row < p.rows_w) store_entry(p.plan_w + row, invalid_write_entry());
}

// ---- rows written by owner lanes ----

// The state slot of one position of a request. A paged lookup is two dependent loads (req_to_token,
// then full_to_swa); each round issues one, and the caller runs a block scan before the next round.
// Request-ring slots need no load.
struct SlotPrefetch {
  uint64_t bits;  // paged: the entry loaded by the last round; request ring: the slot
  bool loaded;    // paged: bits were loaded (an invalid step of the chain skips the load)

  // Round 1, for position pos (-1: none; the slot is then -1).
  __device__ __forceinline__ void start(const SlotLookup& s, int64_t rid, int32_t pos) {
    if (!s.paged) {
      bits = uint64_t(ring_slot(s, rid, pos));
      return;
    }
    const int64_t index = token_index(s, rid, pos);
    loaded = index >= 0;
    bits = loaded ? load_bits(s.req_to_token, index) : 0;
  }

  // Round 2: waits for round 1's load.
  __device__ __forceinline__ void advance(const SlotLookup& s) {
    if (!s.paged) return;
    const int64_t loc = checked_loc(s, loaded ? widen(s.req_to_token, bits) : -1);
    loaded = loc >= 0;
    bits = loaded ? load_bits(s.full_to_swa, loc) : 0;
  }

  // Waits for round 2's load.
  __device__ __forceinline__ int64_t slot(const SlotLookup& s) const {
    if (!s.paged) return int64_t(bits);
    return paged_slot(s, loaded ? widen(s.full_to_swa, bits) : -1);
  }
};

// Lane j < kOwnerLanes of a block of the pair that owns requests [base, base + kOwnerSlice): request
// base + j / kOwnedSlots, row (or slot) k = j % kOwnedSlots of it. Lanes without a request look up
// nothing and write nothing.
struct OwnerLane {
  bool compress;  // which plan's rows: the odd block of the pair
  bool live;      // the lane has a request
  int k;
  int64_t b;
  RequestInput in;
  RequestPlan rp0;
  SlotPrefetch slot;

  // Issues the loads of the lane's request.
  __device__ __forceinline__ RequestLoads issue_request(const PrefillPlanParams& p) {
    const int j = threadIdx.x;
    compress = blockIdx.x % 2 == 1;
    k = j % kOwnedSlots;
    b = int64_t(blockIdx.x / 2) * kOwnerSlice + j / kOwnedSlots;
    live = j < kOwnerLanes && b < p.batch;
    RequestLoads loads;
    loads.issue(p, live ? b : p.batch);
    return loads;
  }

  // Before the scans, so without the ragged offset: positions from the plan the request would have at
  // offset 0 (rp0). The real offset only lowers z, which cuts rows off the tail (§3.3 counts), so row k
  // of the real plan sits at the position of row k here.
  __device__ __forceinline__ void start_lookups(const PrefillPlanParams& p, const RequestLoads& loads) {
    const PlanGeometry& g = p.geometry;
    in = loads.finish(p);
    rp0 = plan_at_zero(p, in);
    int32_t pos = -1;
    if (compress) {
      if (k / 2 < rp0.n_c) {
        const CompressReads r = compress_reads(compress_entry_stage0(g, rp0, k / 2, b), g.ratio);
        pos = k % 2 == 0 ? r.p1 : r.p0;
      }
    } else if (k < rp0.n_w) {
      pos = write_position(g, rp0, k);
    }
    slot.start(p.lookup, in.rid, pos);
  }

  __device__ __forceinline__ void continue_lookups(const PrefillPlanParams& p) { slot.advance(p.lookup); }

  // After the scans (every thread of the warp, for the shuffle): the lane's row of the real plan, rp0 with
  // the real ragged offset and counts (see start_lookups), at its request's rows (start + k < total <=
  // num_q_tokens rows). A compress row takes read_page_1's slot from its even lane and read_page_0's
  // from the odd lane.
  __device__ __forceinline__ void write(const PrefillPlanParams& p, const RequestStarts* starts) const {
    const PlanGeometry& g = p.geometry;
    const int32_t mine = int32_t(slot.slot(p.lookup));  // in [-1, 2^31)
    const int32_t odd_lanes = __shfl_xor_sync(0xFFFFFFFFu, mine, 1);
    if (!live) return;
    const RequestStarts s = starts[b];
    const ScanPair counts = counts_at(p, in, rp0, s.off);
    RequestPlan rp = rp0;
    rp.off = s.off;
    rp.n_c = counts.x;
    rp.n_w = counts.y;
    if (compress) {
      if (k % 2 == 0 && k / 2 < rp.n_c) {
        CompressEntry e = compress_entry_stage0(g, rp, k / 2, b);
        set_compress_pages(e, mine, odd_lanes, g.ratio);
        store_entry(p.plan_c + s.start_c + k / 2, e);
      }
    } else if (k < rp.n_w) {
      WriteEntry e = write_entry_stage0(g, rp, k, b);
      set_write_slot(e, mine);
      store_entry(p.plan_w + s.start_w + k, e);
    }
  }
};

// ---- kernels ----

// The parameters with the geometry of compression ratio kRatio as compile-time constants (shifts, the
// window); c128 always uses request rings, so its band and paged lookups compile away.
template <int kRatio>
__device__ __forceinline__ PrefillPlanParams with_ratio(PrefillPlanParams p) {
  p.geometry.ratio = kRatio;
  p.geometry.window = compress_window(kRatio);
  if (kRatio != 4) {
    p.geometry.band = false;
    p.lookup.paged = false;
  }
  return p;
}

// Batches of at most kScanTile requests, one launch. A block has one thread per request, rounded up to a
// warp, and at least the owner lanes of its slice; every block plans and scans the whole batch
// (redundant: at 1024 requests this work sets c128's time, while c4's is set by its owner lanes' three
// dependent loads; a batch of one warp scans without barriers), then covers blockDim.x rows of each plan.
// The owner lanes write the requests' first rows: the positions need only the request's own lengths, so the
// table loads are issued before the scans and fly during them. A verify step then waits for about the decode
// planner's chain of loads, not for scans, then a search, then the loads; and as no request has further rows,
// the other rows are sentinels, found without a search.
template <int kRatio>
__global__ void __launch_bounds__(kScanTile) prefill_plan_fused_kernel(PrefillPlanParams params) {
  const PrefillPlanParams p = with_ratio<kRatio>(params);
  __shared__ RequestStarts starts[kScanTile];
  __shared__ ScanPair totals;
  warm_params(params, params.plan_c);
  pdl_wait_dependencies();
  pdl_launch_dependents();
  // Warp-uniform: the warps past the slice's owner lanes, and every warp of a block past the owner
  // blocks, skip the owner path whole (a batch of 1024 requests has 24 such warps per block).
  const bool owner_warp = int(threadIdx.x & ~31u) < kOwnerLanes && int64_t(blockIdx.x / 2) * kOwnerSlice < p.batch;
  const int b = threadIdx.x;
  // Both requests' loads (the owner lane's and the scanned one) go out before either is waited for.
  OwnerLane own;
  RequestLoads owner_loads, scan_loads;
  if (owner_warp) owner_loads = own.issue_request(p);
  scan_loads.issue(p, b);
  if (owner_warp) own.start_lookups(p, owner_loads);
  const bool one_warp = p.batch <= 32;
  const RequestInput in = scan_loads.finish(p);
  const RequestPlan rp0 = plan_at_zero(p, in);
  // One scan of the tokens and of the rows at ragged offset 0. Each token term is clamped to nq + 1
  // (sums stay below 2^31), so the total is at most nq exactly when every request fits below num_q_tokens
  // and plans its rows at offset 0: the common case needs no second scan.
  const int32_t nq = p.geometry.num_q_tokens;
  ScanPair counts{rp0.n_c, rp0.n_w};
  ScanTokensRows sum;
  const ScanTokensRows ex =
      block_exclusive_scan(ScanTokensRows{min(in.extend_len, nq + 1), ScanTokensRows::pack(counts)}, sum, one_warp);
  if (owner_warp) own.continue_lookups(p);
  const ScanPair ex_rows = ex.unpacked_rows();
  RequestStarts s{ex_rows.x, ex_rows.y, in.seq_len, in.extend_len, ex.tokens, 0, in.rid};
  ScanPair total = sum.unpacked_rows();
  if (sum.tokens > nq) {  // uniform: the total is the block's (or, with one_warp, the warp's)
    // A request cut short by an underfilled num_q_tokens: the offsets saturate there, and every row
    // count from that request on is planned again at its offset, then scanned.
    const int32_t off = min(ex.tokens, nq);
    counts = counts_at(p, in, rp0, off);
    ScanCarry carry{0, 0, 0};
    s = scan_starts(in, off, counts, carry, one_warp);
    total = ScanPair{carry.c, carry.w};
  }
  if (in.live) starts[b] = s;
  if (b == 0) totals = total;
  const bool unowned_rows = __syncthreads_or(counts.x > kOwnedCompress || counts.y > kOwnedWrites);
  if (owner_warp) own.write(p, starts);
  total = totals;
  const int64_t row = int64_t(blockIdx.x) * blockDim.x + b;
  if (unowned_rows) {
    emit_rows(p, starts, total.x, total.y, row, kOwnedCompress, kOwnedWrites);
  } else {
    emit_sentinels(p, total.x, total.y, row);
  }
}

// Larger batches, first launch: one block walks the batch tile by tile and stores every request's
// starts, and the totals after the last request.
__global__ void __launch_bounds__(kScanTile) prefill_scan_kernel(PrefillPlanParams p, RequestStarts* starts) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  ScanCarry carry{0, 0, 0};
  for (int64_t base = 0; base < p.batch; base += kScanTile) {
    const RequestInput in = load_request(p, base + threadIdx.x);
    const RequestPlan rp0 = plan_at_zero(p, in);
    const int32_t off = scan_offset(p, in, carry);
    const RequestStarts s = scan_starts(in, off, counts_at(p, in, rp0, off), carry, false);
    if (in.live) starts[base + threadIdx.x] = s;
    __syncthreads();  // the next tile's scans reuse the warp totals
  }
  if (threadIdx.x == 0) {
    RequestStarts total{};
    total.start_c = carry.c;
    total.start_w = carry.w;
    starts[p.batch] = total;
  }
}

// Larger batches, second launch: one thread per plan row. It triggers no dependent early: it reads the scratch,
// which the op frees when it returns, and a later kernel of another library launched under PDL could be handed
// that memory by the caching allocator and write it before its own wait.
__global__ void __launch_bounds__(kRowThreads) prefill_emit_kernel(PrefillPlanParams p, const RequestStarts* starts) {
  pdl_wait_dependencies();  // the scan kernel's starts
  const int64_t row = int64_t(blockIdx.x) * kRowThreads + threadIdx.x;
  const RequestStarts total = starts[p.batch];
  emit_rows(p, starts, total.start_c, total.start_w, row, 0, 0);
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
  return batch <= kScanTile ? 0 : (batch + 1) * int64_t(sizeof(RequestStarts) / sizeof(int32_t));
}

void prefill_plan_cuda(const PrefillPlanParams& p, int32_t* scratch, cudaStream_t stream) {
  const int64_t rows = p.rows_c > p.rows_w ? p.rows_c : p.rows_w;
  if (rows == 0) return;
  if (p.batch <= kScanTile) {
    // One thread per request and the slice's owner lanes, in whole warps; an empty batch (every row a
    // sentinel) runs one warp.
    const int64_t lanes = kOwnedSlots * (p.batch < kOwnerSlice ? p.batch : kOwnerSlice);
    const int64_t per_block = p.batch > lanes ? p.batch : lanes;
    const int threads = int((per_block > 0 ? per_block + 31 : 32) / 32 * 32);
    const unsigned row_blocks = blocks_for(rows, threads), owner_blocks = 2 * blocks_for(p.batch, kOwnerSlice);
    const unsigned blocks = row_blocks > owner_blocks ? row_blocks : owner_blocks;
    launch_kernel(p.geometry.ratio == 4 ? prefill_plan_fused_kernel<4> : prefill_plan_fused_kernel<128>,
                  dim3(blocks), dim3(threads), 0, stream, "plan_compress_prefill", p);
    return;
  }
  auto* starts = reinterpret_cast<RequestStarts*>(scratch);
  launch_kernel(prefill_scan_kernel, dim3(1), dim3(kScanTile), 0, stream, "plan_compress_prefill (scan)", p,
                starts);
  launch_kernel(prefill_emit_kernel, dim3(blocks_for(rows, kRowThreads)), dim3(kRowThreads), 0, stream,
                "plan_compress_prefill (emit)", p, static_cast<const RequestStarts*>(starts));
}

}  // namespace dsv4
