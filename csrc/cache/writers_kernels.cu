// CUDA kernels of the norm + RoPE cache writers, 4 warps per block. Main rows: one per warp, lane l owns
// dims [16l, 16l+16) (lanes 28..31 the RoPE tail) for the norm and the quantizer, and rotates RoPE pair
// l; indexer rows: four per warp, lane s of a row's 8 owns dims [16s, 16s+16). Every lane of a row
// resolves its slot and position (from out_loc/positions or the plan entry).
#include <algorithm>

#include "writers_launch.h"
#include "dsv4/bulk_copy.cuh"
#include "dsv4/hadamard.cuh"
#include "dsv4/launch.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/packed_lane.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"
#include "dsv4/warp_rope.cuh"
#include "dsv4/writer_rows.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;

// Where a row's slot and RoPE position come from.
enum class RowSource { KWriter, CompressDecode, CompressPrefill };

struct RowTarget {
  int64_t slot;
  int64_t position;
};

// A row's index loads: the slot and position (K writer), or the plan entry (compress writers; a decode
// row's slot is out_loc[row], one entry per plan row as the op checks, so it is loaded with the entry
// instead of after it). Every lane of the row loads the same addresses (one broadcast access per load)
// and resolves the row itself: a leader lane with shuffles cost about 20 more instructions per row.
struct RowIndices {
  long long slot = -1;
  long long position = -1;
  uint2 entry = make_uint2(0u, 0u);
};

template <RowSource S>
__device__ __forceinline__ RowIndices load_row_indices(const NormRopeParams& p, int64_t token) {
  RowIndices r;
  if constexpr (S == RowSource::KWriter) {
    r.slot = p.out_loc[token];
    r.position = p.positions[token];
  } else {
    if constexpr (S == RowSource::CompressDecode) r.slot = p.out_loc[token];
    r.entry = *reinterpret_cast<const uint2*>(p.plan + token * kPlanEntryBytes);
  }
  return r;
}

// A prefill row's slot is a load that depends on its plan entry, so its RoPE table load goes out with that
// load (from resolve_row) rather than after the slot test, a third dependent DRAM trip. The other rows have
// their slot and position together and load the table after the test, as the caller does.
constexpr bool loads_table_in_resolve(RowSource s) { return s == RowSource::CompressPrefill; }

// Resolves a row from its loaded indices (a prefill row's slot load from out_loc happens here, and its
// load_table(position)); returns whether the row is written. Row-uniform.
template <RowSource S, class LoadTable>
__device__ __forceinline__ bool resolve_row(const NormRopeParams& p, int64_t token, const RowIndices& r,
                                            RowTarget& t, LoadTable&& load_table) {
  if constexpr (S == RowSource::KWriter) {
    t.slot = r.slot;
    t.position = r.position;
    return p.cache.valid(t.slot) && position_in_table(t.position, p.max_pos);
  } else {
    const bool decode = S == RowSource::CompressDecode;
    const CompressRowPick pick = p.compress_rows.pick(decode, r.entry.x, r.entry.y, token);
    if (!pick.take) return false;
    t.slot = decode ? r.slot : p.out_loc[pick.out_loc_index];
    t.position = pick.position;
    if constexpr (loads_table_in_resolve(S)) load_table(t.position);
    return p.cache.valid(t.slot);
  }
}

// The K writer and the prefill compress writer store every row but padding, so their row loads go
// out right behind the index loads, before the row is resolved, and the two latencies overlap. A decode
// compress row is written only when its request closes a window (one step in `ratio`), so it is
// resolved first.
constexpr bool loads_rows_ahead(RowSource s) { return s != RowSource::CompressDecode; }

template <int N>
__device__ __forceinline__ void load_weight(const NormRopeParams& p, int first, float* w) {
  if (p.weight_fp32) {
    load_widen<N, true>(static_cast<const float*>(p.weight) + first, w);
  } else {
    load_widen<N, false>(static_cast<const uint16_t*>(p.weight) + first, w);
  }
}

// Where this lane's input values of a row start (dim `first`).
template <bool KvFp32>
__device__ __forceinline__ const void* lane_input(const NormRopeParams& p, int64_t token, int first) {
  constexpr size_t kElem = KvFp32 ? 4 : 2;
  return static_cast<const char*>(p.kv.data) + (token * p.kv.row_stride + first) * kElem;
}

// Before the wait (see prefetch_l2): the row's index words (by one lane) and, for the K writer's rows, this
// lane's input values: their DRAM trip overlaps the previous grid (H200, graph replay, 1024 rows: K writer
// 3.0 -> 2.6 us, compress writer 3.3 -> 3.1 us). Prefill-plan rows prefetch nothing: those calls are large
// (65536 rows: 2-4 % slower with the prefetch, which most blocks, started after the previous grid ended,
// issue just before the same loads).
template <RowSource S, bool KvFp32>
__device__ __forceinline__ void prefetch_row(const NormRopeParams& p, int64_t token, int first, bool index_lane) {
  if constexpr (S == RowSource::KWriter) {
    if (index_lane) {
      prefetch_l2(p.out_loc.address(token));
      prefetch_l2(p.positions.address(token));
    }
    prefetch_l2(lane_input<KvFp32>(p, token, first));
  } else if constexpr (S == RowSource::CompressDecode) {
    if (index_lane) {
      prefetch_l2(p.out_loc.address(token));
      prefetch_l2(p.plan + token * kPlanEntryBytes);
    }
  }
}

// Loads this lane's N input values (from dim `first`, not yet widened) and their weights, and
// resolves the row, issuing the row loads before or after the resolution as loads_rows_ahead(S) says
// (and load_table as loads_table_in_resolve(S) says). Returns whether the row is written.
template <RowSource S, bool KvFp32, int N, class LoadTable>
__device__ __forceinline__ bool load_and_resolve_row(const NormRopeParams& p, int64_t token, int first,
                                                     RawElements<N, KvFp32>& raw, float* w, RowTarget& t,
                                                     LoadTable&& load_table) {
  // The index loads go first either way: the resolution waits on them, and issued behind the row loads
  // they queued behind a whole wave's rows (H200, 65536 prefill-plan rows: 67 us, 58 us index loads first).
  const RowIndices indices = load_row_indices<S>(p, token);
  if constexpr (loads_rows_ahead(S)) {
    load_raw(lane_input<KvFp32>(p, token, first), raw);
    load_weight<N>(p, first, w);
  }
  if (!resolve_row<S>(p, token, indices, t, load_table)) return false;
  if constexpr (!loads_rows_ahead(S)) {
    load_raw(lane_input<KvFp32>(p, token, first), raw);
    load_weight<N>(p, first, w);
  }
  return true;
}

__device__ __forceinline__ void round_lane_to_bf16(float* v) {
#pragma unroll
  for (int i = 0; i < kLaneDims; i += 2) round_pair_to_bf16(v[i], v[i + 1]);
}

// Normalizes, rotates and quantizes one main row (this lane's input values x and weights w; cs = its
// RoPE table pair) into `slot` (CompactSlots: the cache is compact). V4 quantizes the nope dims of y
// (rounded to bf16 first on the compress path) and stores the rotated fp32 tail as bf16, a pair per lane;
// V41 / V41_FP4 round y to bf16, rotate the bf16 tail, round again and quantize all 512 values (§1.6), on
// packed bf16 words from the first rounding.
template <KVLayout L, RowSource S, bool CompactSlots = false>
__device__ __forceinline__ void norm_rope_quantize_row(const NormRopeParams& p, const float* x, const float* w,
                                                       float2 cs, int64_t slot, int lane, uint32_t tail_at) {
  // The row pointers are formed where they are used: formed before the arithmetic, they held four more
  // registers across it (under the one-row kernel's 48-register bound) and the compress writer ran 5-20 %
  // slower.
  auto rows = [&] {
    return CompactSlots ? p.cache.compact_rows_of(uint32_t(slot)) : p.cache.rows_of(slot);
  };
  float y[kLaneDims];
  warp_rms_norm<kLaneDims>(x, w, p.eps, y);
  if constexpr (L == KVLayout::V4) {
    if (S != RowSource::KWriter && lane < kRopeFirstLane) round_lane_to_bf16(y);
    const PagedCache::RowPointers target = rows();
    rotate_tail_to_bf16_across_warp(y, cs, lane, tail_at, target.data + kV4NopeDim);
    // Both kernels' rows leave their warps whole, so the tile-amax shuffles name the whole warp (WholeWarp).
    quantize_main_lane<L, false, kLaneDims, true, true>(y, lane, target.data, target.scale);
  } else {
    uint32_t words[kLaneWords];
    pack_lane_bf16(y, words);
    rotate_packed_tail_across_warp(words, cs, lane, tail_at);
    quantize_packed_lane<L>(words, lane, rows());
  }
}

template <KVLayout L, bool KvFp32, RowSource S>
__device__ __forceinline__ void write_main_row(const NormRopeParams& p, const RawElements<kLaneDims, KvFp32>& raw,
                                               const float* w, float2 cs, const RowTarget& t, int lane,
                                               uint32_t tail_at) {
  float x[kLaneDims];
  widen_raw<kLaneDims, KvFp32>(raw, x);
  norm_rope_quantize_row<L, S>(p, x, w, cs, t.slot, lane, tail_at);
}

// K writer (S == KWriter) and compress main writer, one row per warp. The bound of 10 blocks per SM
// (48 registers) keeps the V41_FP4 variants at full occupancy, with no spills. (Half a warp per row,
// 32 dims per lane, issued 21 % fewer instructions per row but needed 94 registers: half the
// occupancy, and the K writer ran 35 % slower.)
template <KVLayout L, bool KvFp32, RowSource S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 10) norm_rope_main_kernel(NormRopeParams p) {
  __shared__ __align__(16) float2 tails[kWarpsPerBlock][kRopeDim / 2];
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (token < p.n) prefetch_row<S, KvFp32>(p, token, lane * kLaneDims, lane == 0);
  warm_params(p, p.kv.data);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  RawElements<kLaneDims, KvFp32> row;
  float w[kLaneDims];
  RowTarget t;
  float2 cs;  // this lane's RoPE table pair
  auto load_table = [&](int64_t position) { cs = load_table_pair(p.freqs + position * kRopeDim, lane); };
  if (!load_and_resolve_row<S, KvFp32, kLaneDims>(p, token, lane * kLaneDims, row, w, t, load_table)) {
    return;
  }
  pdl_launch_dependents();
  if constexpr (!loads_table_in_resolve(S)) load_table(t.position);
  write_main_row<L, KvFp32, S>(p, row, w, cs, t, lane, shared_address(tails[threadIdx.x >> 5]));
}

// ---- K writer at large N: rows prefetched by bulk copies ----
//
// At large N the one-row-per-warp kernel waits on its row loads for about 40 % of its cycles: a warp has
// one row in flight, and the registers cap the warps per SM. Here a warp takes a run of consecutive rows (about
// kPipelineRows; pipelined_split) and keeps kPipelineStages of them in flight through shared memory: its
// first lane issues one bulk copy per row (no registers held, one instruction), refilling a stage as soon as
// the warp has read it.
// The rows' slots and positions are loaded once (lane j: row j), and each row's RoPE table pair is loaded
// one row ahead. The weight is widened once per warp. Same per-row arithmetic, so the same bytes.
constexpr int kPipelineRows = 16;    // rows per warp at large n (pipelined_split)
constexpr int kSpreadLastWave = 2;   // a last wave at most half full is spread: at most 16 + 8 rows a warp
// Rows in flight per warp. H100: three stages were 3-6 % slower than two at 16384-32768 rows and no faster
// elsewhere; four slower still. H200, three alternating rounds: three stages 3-10 % slower at 16384 rows, 1-2 %
// at 65536-131072, level at 2^20.
constexpr int kPipelineStages = 2;
constexpr int64_t kPipelineMinRows = 4096;

template <bool KvFp32>
constexpr uint32_t pipeline_row_bytes() {
  return uint32_t(kMainDim) * (KvFp32 ? 4u : 2u);
}

// This lane's kLaneDims input values of a row held in shared memory, as loaded.
template <bool KvFp32>
__device__ __forceinline__ RawElements<kLaneDims, KvFp32> read_lane_from_shared(const uint8_t* row, int lane) {
  RawElements<kLaneDims, KvFp32> raw;
  const uint4* src = reinterpret_cast<const uint4*>(row) + lane * RawElements<kLaneDims, KvFp32>::kVectors;
#pragma unroll
  for (int k = 0; k < RawElements<kLaneDims, KvFp32>::kVectors; ++k) raw.v[k] = src[k];
  return raw;
}

// How the pipelined K writer's rows fall to its warps: warp w takes `rows` rows, plus one when w < extra,
// consecutive from w * rows + min(w, extra) (the last warp fewer when they run out). Formed on the host, so a
// warp finds its rows without a division.
struct PipelinedSplit {
  int64_t warps;
  int32_t rows;   // <= kPipelineRows + kPipelineRows / kSpreadLastWave, and one less when extra > 0 (lane j < 32
                  // holds row j's indices)
  int32_t extra;  // < warps
};

// Eight blocks per SM (64 registers) for every layout. Before the warp index was uniform (below), bounding V4 and
// V41_FP4 to 64 registers cost them 13-14 instructions per row (the thread index re-read and lane-dependent values
// re-derived inside the loop), so they ran at seven blocks; with it they fit 64 registers with fewer instructions
// than at seven (V41_FP4 loop 348 -> 346 a row). H100, three alternating rounds against seven blocks: V41_FP4 at
// 65536 rows 39.5-39.7 -> 38.8-39.0 us, level elsewhere. More warps were slower everywhere (nine blocks
// 5-15 %, ten 20-40 %: spills, and more DRAM streams at once).
template <KVLayout L, bool KvFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32, 8)
    k_writer_pipelined_kernel(NormRopeParams p, PipelinedSplit split) {
  constexpr uint32_t kRowBytes = pipeline_row_bytes<KvFp32>();
  constexpr unsigned kAll = 0xFFFFFFFFu;
  __shared__ __align__(128) uint8_t rows[kWarpsPerBlock][kPipelineStages][kRowBytes];
  __shared__ __align__(8) uint64_t arrived[kWarpsPerBlock][kPipelineStages];   // the stage's row has landed
  __shared__ __align__(16) float2 tails[kWarpsPerBlock][kRopeDim / 2];
  // The warp index through a warp reduction, whose result the compiler holds in a uniform register: it then knows
  // that the warp's rows, its loop and its early exit are warp-uniform, and drops the convergence checks and
  // WARPSYNC fallbacks it wrapped around every shuffle and the bulk copies (threadIdx.x >> 5 is uniform too, but
  // not to the compiler). Loop instructions a row, V41 / V41_FP4: 320 / 366 -> 292 / 348 (seven blocks;
  // V4 18 fewer). H100, three alternating rounds: 65536 rows V41 40.8-41.3 -> 39.9-40.4 us, V41_FP4 40.6-41.0 ->
  // 39.5-39.7; both 3-4 % faster at 16384 rows and within 1 % at 131072-2^20; V4 within 1 % (2 % slower at 4096).
  const int lane = threadIdx.x & 31, warp = int(__reduce_max_sync(kAll, threadIdx.x >> 5));
  const int64_t warp_index = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  const int64_t first = warp_index * split.rows + min(warp_index, int64_t(split.extra));
  const int count = int(min(int64_t(split.rows + (warp_index < split.extra ? 1 : 0)), p.n - first));
  pdl_wait_dependencies();
  if (warp_index >= split.warps || count <= 0) return;  // the whole warp
  // Shared addresses of stage 0 (stage s: + s * its size), computed once for the whole loop.
  const uint32_t rows_at = shared_address(rows[warp][0]);
  const uint32_t arrived_at = shared_address(&arrived[warp][0]);
  const uint32_t tail_at = opaque_shared_address(tails[warp]);
  // Lane 0 copies the warp's rows in order, each into the next stage (round robin).
  const int64_t source_stride = p.kv.row_stride * (KvFp32 ? 4 : 2);
  const char* next_source = static_cast<const char*>(p.kv.data) + first * source_stride;
  auto fetch = [&](int stage) {
    mbarrier_arrive_expect_tx(arrived_at + 8 * stage, kRowBytes);
    bulk_copy_to_shared(rows_at + kRowBytes * stage, next_source, kRowBytes, arrived_at + 8 * stage);
    next_source += source_stride;
  };
  // Lane j: row j's slot and position, and every lane's weight bits, loaded before the first bulk copies go
  // out (behind a wave's copies, these loads queued).
  int64_t slot_loaded = -1, position_loaded = -1;
  if (lane < count) {
    slot_loaded = p.out_loc[first + lane];
    position_loaded = p.positions[first + lane];
  }
  // The weight, once per warp, element by element (any alignment), as raw bits widened after the copies are
  // out: load_weight's misaligned fallback keeps a buffer in local memory, and with it in the kernel the
  // compiler kept V41's packed words in local memory too (a store of them on every row).
  uint32_t weight_bits[kLaneDims];
#pragma unroll
  for (int k = 0; k < kLaneDims; ++k) {
    weight_bits[k] = p.weight_fp32 ? load_input(static_cast<const uint32_t*>(p.weight) + lane * kLaneDims + k)
                                   : load_input(static_cast<const uint16_t*>(p.weight) + lane * kLaneDims + k);
  }
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < kPipelineStages; ++s) mbarrier_init(&arrived[warp][s], 1);
    fence_mbarrier_init();
    fetch(0);  // count >= 1
  }
  __syncwarp();
  // Lane j: row j's slot (-1 when the row is skipped) and position (0 then: the table has a row 0); both
  // fit int32 (host check).
  int32_t slot_j = -1, position_j = 0;
  if (lane < count && p.cache.valid(slot_loaded) && position_in_table(position_loaded, p.max_pos)) {
    slot_j = int32_t(slot_loaded);
    position_j = int32_t(position_loaded);
  }
  // This lane's RoPE table pair of row i (the table is 8-byte aligned: host check).
  const float2* lane_table = reinterpret_cast<const float2*>(p.freqs) + lane;
  auto table_pair = [&](int i) {
    const int32_t position = __shfl_sync(kAll, position_j, i);
    return load_input(lane_table + int64_t(position) * (kRopeDim / 2));
  };
  float2 cs_next = table_pair(0);
  // The other stages' copies go out only now: issued with the first, they put a wave's copies (12 MB at 65536
  // bf16 rows) ahead of the first table pairs, which every warp's first row waits for. H200, 65536 rows, V4 /
  // V41 / V41_FP4: 37.5-37.8 / 39.0-39.4 / 45.7-46.1 -> 37.2 / 38.4-38.6 / 45.1-45.2 us.
  if (lane == 0) {
    for (int i = 1; i < count && i < kPipelineStages; ++i) fetch(i);
  }
  float w[kLaneDims];
#pragma unroll
  for (int k = 0; k < kLaneDims; ++k) {
    w[k] = p.weight_fp32 ? __uint_as_float(weight_bits[k]) : bf16_to_f32(uint16_t(weight_bits[k]));
  }
  // Row i of the run, held in `stage` (a constant: the loop below is unrolled by the stages), whose current use
  // has parity `phase`. The unrolled loop with the __syncwarp release below (it replaced 32 mbarrier arrivals and
  // lane 0's wait on them) issued 320 / 366 instructions a V41 / V41_FP4 row instead of 335 / 379 (the uniform warp
  // index above then took them to 292 / 346). H200, three alternating rounds: 65536 rows V41 / V41_FP4 34.1-34.2 /
  // 42.1-42.6 -> 33.3-33.6 / 40.8-40.9 us, 2^20 rows 2 / 2.5 % faster, V4 within 1 %.
  auto process_row = [&](int i, int stage, uint32_t phase) {
    const int32_t slot = __shfl_sync(kAll, slot_j, i);
    const float2 cs = cs_next;
    cs_next = table_pair(min(i + 1, count - 1));  // the last row loads its own pair again: no branch
    mbarrier_wait(arrived_at + 8 * stage, phase);
    const RawElements<kLaneDims, KvFp32> raw = read_lane_from_shared<KvFp32>(rows[warp][stage], lane);
    // The refill of this stage must follow every lane's reads of it: each lane orders its reads before the
    // async proxy (a proxy fence: without one, on an H200, about one run in ten (V4) to nine in ten (V41_FP4)
    // of 5007 fp32 rows wrote a row from a partly refilled stage), and the warp barrier puts lane 0's copy
    // after all of them.
    fence_proxy_async_shared();
    __syncwarp();
    if (lane == 0 && i + kPipelineStages < count) fetch(stage);
    if (slot < 0) return;  // warp-uniform
    float x[kLaneDims];
    widen_raw<kLaneDims, KvFp32>(raw, x);
    norm_rope_quantize_row<L, RowSource::KWriter, true>(p, x, w, cs, slot, lane, tail_at);
  };
  uint32_t phase = 0;
  for (int i = 0; i < count; i += kPipelineStages, phase ^= 1u) {
#pragma unroll
    for (int stage = 0; stage < kPipelineStages; ++stage) {
      if (i + stage < count) process_row(i + stage, stage, phase);
    }
  }
  pdl_launch_dependents();  // after the warp's last global read
}

// Compress indexer writer: RMSNorm, rotation of dims 64..127 and the Hadamard transform in fp32
// (no bf16 rounding anywhere), then the indexer quantizer. Four rows per warp, 8 lanes x 16 dims each
// (one row per warp left 4 dims of work per lane against the per-row index, reduction and shuffle
// costs). A row's lanes leave together (they exit), and the shuffles exchange values only among them
// but name the whole warp: exited lanes are excused, and a constant full mask spares the convergence
// check the compiler wraps around shuffles with a computed mask (about 5 instructions each time).
// No minimum of blocks: bounded to nine or ten blocks per SM (56 / 48 registers, 8-172 bytes spilled) it ran
// 0.4-10 % / 17-56 % slower at 16384-2^20 rows (H100), so it keeps 64 registers and eight blocks.

template <IndexerFormat F, bool KvFp32, RowSource S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) norm_rope_indexer_kernel(NormRopeParams p) {
  constexpr int D = kIndexerGroupLaneDims;  // 16
  __shared__ __align__(16) float hadamard_rows[kWarpsPerBlock * kIndexerRowsPerWarp][kHadamardRowFloats];
  const int lane = threadIdx.x & 31;
  const int sub = lane % kIndexerGroupLanes;
  constexpr unsigned kWarp = 0xFFFFFFFFu;
  const int64_t token = (int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * kIndexerRowsPerWarp +
                        lane / kIndexerGroupLanes;
  if (token < p.n) prefetch_row<S, KvFp32>(p, token, sub * D, sub == 0);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  constexpr int kRopeFirstSub = (kIndexerDim - kRopeDim) / D;  // 4: lanes 4..7 hold dims 64..127
  RawElements<D, KvFp32> raw;
  float w[D], f[D];
  RowTarget t;
  // The table loads after the slot test here, for prefill rows too: early (loads_table_in_resolve) they
  // measured no faster (fp8) or 3 % slower (fp4) at 65536 rows, where the main rows gained 8-10 %.
  auto no_early_table = [](int64_t) {};
  if (!load_and_resolve_row<S, KvFp32, D>(p, token, sub * D, raw, w, t, no_early_table)) return;
  const bool rope_lane = sub >= kRopeFirstSub;
  if (rope_lane) load_widen<D, true>(p.freqs + t.position * kRopeDim + (sub - kRopeFirstSub) * D, f);
  pdl_launch_dependents();

  float x[D], y[D];
  widen_raw<D, KvFp32>(raw, x);
  lanes_rms_norm<kIndexerDim / 32, D / (kIndexerDim / 32)>(x, w, p.eps, kWarp, y);
  if (rope_lane) {
#pragma unroll
    for (int j = 0; j < D; j += 2) rotate_pair(y[j], y[j + 1], f[j], f[j + 1]);
  }
  group_hadamard128(y, sub, kWarp, hadamard_rows[threadIdx.x / kIndexerGroupLanes]);
  const PagedCache::RowPointers rows = p.cache.rows_of(t.slot);
  quantize_indexer_lane<F, D>(y, sub, rows.data, rows.scale);
}

// One warp per unit of work (a main row, or four indexer rows).
dim3 token_grid(int64_t warps) { return dim3(unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

// The pipelined K writer needs 16-byte aligned rows (bulk copies), a compact cache, a non-empty 8-byte
// aligned RoPE table whose positions fit int32, and enough rows to fill its warps.
bool k_writer_pipelined_fits(const NormRopeParams& p) {
  const int64_t row_bytes = p.kv.row_stride * (p.kv.type == ElemType::FP32 ? 4 : 2);
  return p.n >= kPipelineMinRows && reinterpret_cast<uintptr_t>(p.kv.data) % 16 == 0 && row_bytes % 16 == 0 &&
         p.cache.compact && p.max_pos >= 1 && p.max_pos <= INT32_MAX && reinterpret_cast<uintptr_t>(p.freqs) % 8 == 0;
}

// Warps of the pipelined K writer<L, KvFp32> that the current device holds at once (asked once per device:
// the occupancy query takes microseconds of host time).
template <KVLayout L, bool KvFp32>
int64_t pipelined_resident_warps() {
  static DeviceValueCache resident;
  return resident.get([](int device) {
    int sms = 0, blocks_per_sm = 0;
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, k_writer_pipelined_kernel<L, KvFp32>,
                                                             kWarpsPerBlock * 32, 0),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return std::max<int64_t>(1, int64_t(sms) * blocks_per_sm * kWarpsPerBlock);
  });
}

// The pipelined K writer's split of n rows, in waves of the warps the device holds at once. A warp's rows run one
// after another, so a call below one wave of kPipelineRows-row warps spreads its rows evenly over every resident
// warp (n / resident rows each, one more for the first n % resident). Larger calls take kPipelineRows-row
// warps, unless that would leave a last wave at most 1 / kSpreadLastWave full: a wave of few warps still takes
// about a warp's whole time, so those rows go to the whole waves' warps instead (at most kPipelineRows /
// kSpreadLastWave rows more each). H100, two stages: 70007 / 75000 / 90000 rows (a last wave 4 / 11 / 33 %
// full) 10-20 % faster than with 16-row warps for V4 and V41, 1-11 % for V41_FP4.
template <KVLayout L, bool KvFp32>
PipelinedSplit pipelined_split(int64_t n) {
  const int64_t resident = pipelined_resident_warps<L, KvFp32>();
  const int64_t wave_rows = resident * kPipelineRows;
  const int64_t full_waves = n / wave_rows;
  if (full_waves == 0 || n % wave_rows <= wave_rows / kSpreadLastWave) {
    const int64_t warps = full_waves == 0 ? std::min(resident, n) : full_waves * resident;
    return {warps, int32_t(n / warps), int32_t(n % warps)};
  }
  return {(n + kPipelineRows - 1) / kPipelineRows, kPipelineRows, 0};
}

template <KVLayout L, RowSource S>
void launch_main(const NormRopeParams& p, cudaStream_t stream, const char* name) {
  const bool fp32 = p.kv.type == ElemType::FP32;
  if (S == RowSource::KWriter && k_writer_pipelined_fits(p)) {
    const PipelinedSplit split = fp32 ? pipelined_split<L, true>(p.n) : pipelined_split<L, false>(p.n);
    launch_kernel(fp32 ? k_writer_pipelined_kernel<L, true> : k_writer_pipelined_kernel<L, false>,
                  token_grid(split.warps), dim3(kWarpsPerBlock * 32), 0, stream, name, p, split);
    return;
  }
  launch_kernel(fp32 ? norm_rope_main_kernel<L, true, S> : norm_rope_main_kernel<L, false, S>,
                token_grid(p.n), dim3(kWarpsPerBlock * 32), 0, stream, name, p);
}

template <RowSource S>
void launch_main_layout(KVLayout layout, const NormRopeParams& p, cudaStream_t stream, const char* name) {
  switch (layout) {
    case KVLayout::V4: launch_main<KVLayout::V4, S>(p, stream, name); break;
    case KVLayout::V41: launch_main<KVLayout::V41, S>(p, stream, name); break;
    case KVLayout::V41_FP4: launch_main<KVLayout::V41_FP4, S>(p, stream, name); break;
  }
}

template <IndexerFormat F, RowSource S>
void launch_indexer(const NormRopeParams& p, cudaStream_t stream) {
  const bool fp32 = p.kv.type == ElemType::FP32;
  const int64_t warps = (p.n + kIndexerRowsPerWarp - 1) / kIndexerRowsPerWarp;
  launch_kernel(fp32 ? norm_rope_indexer_kernel<F, true, S> : norm_rope_indexer_kernel<F, false, S>,
                token_grid(warps), dim3(kWarpsPerBlock * 32), 0, stream, "compress_norm_rope_store", p);
}

template <RowSource S>
void launch_indexer_format(IndexerFormat fmt, const NormRopeParams& p, cudaStream_t stream) {
  if (fmt == IndexerFormat::FP8) {
    launch_indexer<IndexerFormat::FP8, S>(p, stream);
  } else {
    launch_indexer<IndexerFormat::FP4, S>(p, stream);
  }
}

}  // namespace

void k_norm_rope_cuda(KVLayout layout, const NormRopeParams& p, cudaStream_t stream) {
  launch_main_layout<RowSource::KWriter>(layout, p, stream, "fused_k_norm_rope_flashmla");
}

void compress_main_cuda(KVLayout layout, const NormRopeParams& p, cudaStream_t stream) {
  constexpr const char* name = "compress_norm_rope_store";
  if (p.is_decode) {
    launch_main_layout<RowSource::CompressDecode>(layout, p, stream, name);
  } else {
    launch_main_layout<RowSource::CompressPrefill>(layout, p, stream, name);
  }
}

void compress_indexer_cuda(IndexerFormat fmt, const NormRopeParams& p, cudaStream_t stream) {
  if (p.is_decode) {
    launch_indexer_format<RowSource::CompressDecode>(fmt, p, stream);
  } else {
    launch_indexer_format<RowSource::CompressPrefill>(fmt, p, stream);
  }
}

}  // namespace dsv4
