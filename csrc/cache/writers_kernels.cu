// CUDA kernels of the norm + RoPE cache writers, 4 warps per block. Main rows: one per warp, lane l owns
// dims [16l, 16l+16) (lanes 28..31 the RoPE tail) for the norm and the quantizer, and rotates RoPE pair
// l; indexer rows: four per warp, lane s of a row's 8 owns dims [16s, 16s+16). A row's first lane
// resolves its slot and position (from out_loc/positions or the plan entry).
#include "writers_launch.h"
#include "dsv4/hadamard.cuh"
#include "dsv4/launch.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"
#include "dsv4/warp_rope.cuh"
#include "dsv4/writer_rows.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Where a row's slot and RoPE position come from.
enum class RowSource { KWriter, CompressDecode, CompressPrefill };

struct RowTarget {
  int64_t slot;
  int64_t position;
};

// The first lane of the row's lanes (an aligned group of `width` lanes named by `mask`: the warp, or 8
// lanes of an indexer row) reads the row's indices (and plan entry), the others receive them by
// shuffle; returns whether the row is written.
template <RowSource S>
__device__ __forceinline__ bool resolve_row(const NormRopeParams& p, int64_t token, int lane, unsigned mask,
                                            int width, RowTarget& t) {
  const bool leader = lane % width == 0;
  long long slot = -1, position = -1;
  if (leader) {
    if constexpr (S == RowSource::KWriter) {
      slot = p.out_loc[token];
      position = p.positions[token];
    } else if constexpr (S == RowSource::CompressDecode) {
      // A decode row's slot is out_loc[row] (one entry per plan row, checked by the op), so its load
      // goes out together with the plan entry's instead of after it.
      const long long row_slot = p.out_loc[token];
      const uint2 entry = *reinterpret_cast<const uint2*>(p.plan + token * kPlanEntryBytes);
      const CompressRowPick pick = pick_compress_row(true, entry.x, entry.y, token, p.compress_ratio,
                                                     p.out_loc_len);
      if (pick.take) {
        slot = row_slot;
        position = pick.position;
      }
    } else {
      const uint2 entry = *reinterpret_cast<const uint2*>(p.plan + token * kPlanEntryBytes);
      const CompressRowPick pick = pick_compress_row(false, entry.x, entry.y, token, p.compress_ratio,
                                                     p.out_loc_len);
      if (pick.take) {
        slot = p.out_loc[pick.out_loc_index];
        position = pick.position;
      }
    }
  }
  const int take = leader && p.cache.valid(slot) && position_in_table(position, p.max_pos);
  t.slot = __shfl_sync(mask, slot, 0, width);
  t.position = __shfl_sync(mask, position, 0, width);
  return __shfl_sync(mask, take, 0, width) != 0;
}

// The K writer and the prefill compress writer store every row but padding, so their row and weight
// loads go out before the index loads and the two latencies overlap. A decode compress row is
// written only when its request closes a window (one step in `ratio`), so it is resolved first.
constexpr bool loads_before_indices(RowSource s) { return s != RowSource::CompressDecode; }

__device__ __forceinline__ void round_lane_to_bf16(float* v) {
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) v[i] = round_to_bf16(v[i]);
}

template <int N>
__device__ __forceinline__ void load_weight(const NormRopeParams& p, int first, float* w) {
  if (p.weight_fp32) {
    load_widen<N, true>(static_cast<const float*>(p.weight) + first, w);
  } else {
    load_widen<N, false>(static_cast<const uint16_t*>(p.weight) + first, w);
  }
}

// Loads this lane's N input values (from dim `first`) and their weights, and resolves the row (its lanes:
// `mask`, `width`), issuing the loads before or after the index loads as loads_before_indices(S) says.
// Returns whether the row is written.
template <RowSource S, bool KvFp32, int N>
__device__ __forceinline__ bool load_and_resolve_row(const NormRopeParams& p, int64_t token, int lane,
                                                     unsigned mask, int width, int first, float* x, float* w,
                                                     RowTarget& t) {
  constexpr size_t kElem = KvFp32 ? 4 : 2;
  const char* row = static_cast<const char*>(p.kv.data) + (token * p.kv.row_stride + first) * kElem;
  const auto load_row_and_weight = [&] {
    load_widen<N, KvFp32>(row, x);
    load_weight<N>(p, first, w);
  };
  if constexpr (loads_before_indices(S)) load_row_and_weight();
  if (!resolve_row<S>(p, token, lane, mask, width, t)) return false;
  if constexpr (!loads_before_indices(S)) load_row_and_weight();
  return true;
}

// K writer (S == KWriter) and compress main writer. V4 quantizes the nope dims of y (rounded to
// bf16 first on the compress path) and stores the rotated fp32 tail as bf16; V41 / V41_FP4 round y
// to bf16, rotate the bf16 tail, round again and quantize all 512 values (§1.6).
template <KVLayout L, bool KvFp32, RowSource S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) norm_rope_main_kernel(NormRopeParams p) {
  __shared__ __align__(16) float2 tails[kWarpsPerBlock][kRopeDim / 2];
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  float x[kLaneDims], w[kLaneDims];
  RowTarget t;
  const int first = lane * kLaneDims;
  if (!load_and_resolve_row<S, KvFp32, kLaneDims>(p, token, lane, kFullMask, 32, first, x, w, t)) return;
  const float2 cs = load_table_pair(p.freqs + t.position * kRopeDim, lane);
  pdl_launch_dependents();

  float y[kLaneDims];
  warp_rms_norm<kLaneDims>(x, w, p.eps, y);
  const bool round_first = L != KVLayout::V4 || (S != RowSource::KWriter && lane < kRopeFirstLane);
  if (round_first) round_lane_to_bf16(y);
  // V4 stores the rotated fp32 tail as bf16 itself; V41 / V41_FP4 round it here.
  rotate_tail_across_warp<L != KVLayout::V4>(y, cs, lane, tails[threadIdx.x >> 5]);
  quantize_main_lane<L>(y, lane, p.cache.data_row(t.slot), p.cache.scale_row(t.slot));
}

// Compress indexer writer: RMSNorm, rotation of dims 64..127 and the Hadamard transform in fp32
// (no bf16 rounding anywhere), then the indexer quantizer. Four rows per warp, 8 lanes x 16 dims each
// (one row per warp left 4 dims of work per lane against the per-row index, reduction and shuffle
// costs). A row's lanes leave together, and every shuffle names only them.

template <IndexerFormat F, bool KvFp32, RowSource S>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) norm_rope_indexer_kernel(NormRopeParams p) {
  constexpr int D = kIndexerGroupLaneDims;  // 16
  const int lane = threadIdx.x & 31;
  const int sub = lane % kIndexerGroupLanes;
  const unsigned mask = ((1u << kIndexerGroupLanes) - 1u) << (lane & ~(kIndexerGroupLanes - 1));
  const int64_t token = (int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * kIndexerRowsPerWarp +
                        lane / kIndexerGroupLanes;
  pdl_wait_dependencies();
  if (token >= p.n) return;
  constexpr int kRopeFirstSub = (kIndexerDim - kRopeDim) / D;  // 4: lanes 4..7 hold dims 64..127
  float x[D], w[D], f[D];
  RowTarget t;
  if (!load_and_resolve_row<S, KvFp32, D>(p, token, lane, mask, kIndexerGroupLanes, sub * D, x, w, t)) return;
  const bool rope_lane = sub >= kRopeFirstSub;
  if (rope_lane) load_widen<D, true>(p.freqs + t.position * kRopeDim + (sub - kRopeFirstSub) * D, f);
  pdl_launch_dependents();

  float y[D];
  group_rms_norm128(x, w, p.eps, mask, y);
  if (rope_lane) {
#pragma unroll
    for (int j = 0; j < D; j += 2) rotate_pair(y[j], y[j + 1], f[j], f[j + 1]);
  }
  group_hadamard128(y, sub, mask);
  quantize_indexer_lane<F, D>(y, sub, p.cache.data_row(t.slot), p.cache.scale_row(t.slot));
}

// One warp per unit of work (a main row, or four indexer rows).
dim3 token_grid(int64_t warps) { return dim3(unsigned((warps + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

template <KVLayout L, RowSource S>
void launch_main(const NormRopeParams& p, cudaStream_t stream, const char* name) {
  const bool fp32 = p.kv.type == ElemType::FP32;
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
