// CUDA kernels of the ratio-1 and ratio-2 decode compressors: one token per warp, 4 warps per block;
// lane l owns dims [16l, 16l+16) of the latent, and the same dims of the kv and score halves of a c2
// row. Lane 0 resolves the row's indices (and c2 ring rows) and broadcasts them by shuffle.
#include "low_ratio_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/pair_pool.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ int64_t broadcast(int64_t v) {
  return __shfl_sync(kFullMask, static_cast<long long>(v), 0);
}

__device__ __forceinline__ void load_weight_lane(const LowRatioParams& p, int lane, float* w) {
  if (p.weight_fp32) {
    load_widen<kLaneDims, true>(static_cast<const float*>(p.weight) + lane * kLaneDims, w);
  } else {
    load_widen<kLaneDims, false>(static_cast<const uint16_t*>(p.weight) + lane * kLaneDims, w);
  }
}

// The 64 B of the RoPE table row that a tail lane rotates with.
__device__ __forceinline__ void load_table_lane(const LowRatioParams& p, int64_t position, int lane, float* f) {
  load_widen<kLaneDims, true>(p.freqs + position * kRopeDim + (lane - kRopeFirstLane) * kLaneDims, f);
}

// Plain (coherent) loads for the state ring, which this kernel also writes; __ldg is kept for the
// read-only inputs.
__device__ __forceinline__ void load_state(const float* src, float* out) {
  if (aligned16(src)) {
#pragma unroll
    for (int i = 0; i < kLaneDims; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + i);
      out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) out[i] = src[i];
  }
}

__device__ __forceinline__ uint16_t* latent_lane(const LowRatioParams& p, int64_t token, int lane) {
  return p.latent + token * kMainDim + lane * kLaneDims;
}

__device__ __forceinline__ void store_zero_latent(const LowRatioParams& p, int64_t token, int lane) {
  const uint16_t zeros[kLaneDims] = {};
  store_u16<kLaneDims>(latent_lane(p, token, lane), zeros);
}

// latent = bf16(RMSNorm(x) * w) for this lane's 16 dims, written to the output row and returned
// widened in `v`. All lanes must call (the sum of squares is a warp reduction).
__device__ __forceinline__ void norm_to_latent(const LowRatioParams& p, int64_t token, int lane,
                                               const float* x, const float* w, float* v) {
  float y[kLaneDims];
  warp_rms_norm<kLaneDims>(x, w, p.eps, y);
  uint16_t bits[kLaneDims];
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) {
    bits[i] = f32_to_bf16(y[i]);
    v[i] = bf16_to_f32(bits[i]);
  }
  store_u16<kLaneDims>(latent_lane(p, token, lane), bits);
}

// §5.4: t = bf16(rope_tail(latent)) (tail lanes rotate with their table values f); V41_FP4 stores t,
// V41 and V4 store fake_quant_compressed_kv(t), whose 16-value tiles are exactly a lane's dims.
// All lanes must call (tile amax reductions).
template <KVLayout L>
__device__ __forceinline__ void store_latent_lane(const LowRatioParams& p, int lane, float* v, const float* f,
                                                  int64_t slot) {
  static_assert(LayoutTraits<KVLayout::V41_FP4>::kTile == kLaneDims, "one fake-quant tile per lane");
  if (lane >= kRopeFirstLane) {
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 2) rotate_pair(v[j], v[j + 1], f[j], f[j + 1]);
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) v[i] = round_to_bf16(v[i]);
  }
  if constexpr (L != KVLayout::V41_FP4) fake_quant_compressed_tile(v, kLaneDims);
  quantize_main_lane<L>(v, lane, p.cache.data_row(slot), p.cache.scale_row(slot));
}

// The row and the weight do not depend on the indices, so their loads are issued before lane 0's index
// loads and the two latencies overlap.
template <KVLayout L>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) c1_decode_kernel(LowRatioParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  float x[kLaneDims], w[kLaneDims], f[kLaneDims] = {};
  const uint16_t* row = static_cast<const uint16_t*>(p.kv.data) + token * p.kv.row_stride;
  load_widen<kLaneDims, false>(row + lane * kLaneDims, x);
  load_weight_lane(p, lane, w);
  int64_t slot = -1, position = -1;
  if (lane == 0) {
    position = p.positions[token];
    slot = c1_store_slot(p.out_loc[token], position, p.cache.capacity(), p.max_pos);
  }
  slot = broadcast(slot);
  position = broadcast(position);
  if (slot >= 0 && lane >= kRopeFirstLane) load_table_lane(p, position, lane, f);
  pdl_launch_dependents();

  float v[kLaneDims];
  norm_to_latent(p, token, lane, x, w, v);
  if (slot >= 0) store_latent_lane<L>(p, lane, v, f, slot);
}

// Every row that does anything needs its own (kv, score) values, so their loads (and the weight's) are
// issued before lane 0's index loads; only an odd row's partner and table loads wait for the indices.
template <KVLayout L>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) c2_decode_or_verify_kernel(LowRatioParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const int dim = lane * kLaneDims;
  const float* row = static_cast<const float*>(p.kv.data) + token * p.kv.row_stride;
  float kv[kLaneDims], score[kLaneDims];
  load_widen<kLaneDims, true>(row + dim, kv);
  load_widen<kLaneDims, true>(row + kMainDim + dim, score);
  float w[kLaneDims];
  load_weight_lane(p, lane, w);
  PairRowPlan plan{};
  if (lane == 0) {
    plan = plan_pair_row(token, p.positions[token], p.req_pool_indices[token], p.out_loc[token], p.ring,
                         p.cache.capacity(), p.max_pos);
  }
  const bool emits = __shfl_sync(kFullMask, int(plan.emits), 0) != 0;

  if (!emits) {
    // Padding (p < 0) or an even row: a zero latent, and a live even row parks (kv, score).
    const int64_t ring_write = broadcast(plan.ring_write);
    pdl_launch_dependents();
    store_zero_latent(p, token, lane);
    if (ring_write >= 0) {
      float* dst = p.state + ring_write * p.state_row_stride;
      store_f32<kLaneDims>(dst + dim, kv);
      store_f32<kLaneDims>(dst + kMainDim + dim, score);
    }
    return;
  }

  const int64_t partner_input = broadcast(plan.partner_input);
  const int64_t partner_ring = broadcast(plan.partner_ring);
  const int64_t slot = broadcast(plan.slot);
  const int64_t rope_position = broadcast(plan.rope_position);
  float k_even[kLaneDims], s_even[kLaneDims];
  if (partner_input >= 0) {
    const float* partner = static_cast<const float*>(p.kv.data) + partner_input * p.kv.row_stride;
    load_widen<kLaneDims, true>(partner + dim, k_even);
    load_widen<kLaneDims, true>(partner + kMainDim + dim, s_even);
  } else if (partner_ring >= 0) {
    const float* partner = p.state + partner_ring * p.state_row_stride;
    load_state(partner + dim, k_even);
    load_state(partner + kMainDim + dim, s_even);
  } else {
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) {
      k_even[i] = 0.0f;
      s_even[i] = kPadScore;
    }
  }
  float f[kLaneDims] = {};
  if (slot >= 0 && lane >= kRopeFirstLane) load_table_lane(p, rope_position, lane, f);
  pdl_launch_dependents();

  float x[kLaneDims], v[kLaneDims];
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) x[i] = round_to_bf16(pair_pool(k_even[i], s_even[i], kv[i], score[i]));
  norm_to_latent(p, token, lane, x, w, v);
  if (slot >= 0) store_latent_lane<L>(p, lane, v, f, slot);
}

dim3 token_grid(int64_t n) { return dim3(unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock)); }


template <KVLayout L>
void launch_c1(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c1_decode_kernel<L>, token_grid(p.n), dim3(kWarpsPerBlock * 32), 0, stream,
                "c1_decode_norm_rope_store", p);
}

template <KVLayout L>
void launch_c2(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c2_decode_or_verify_kernel<L>, token_grid(p.n), dim3(kWarpsPerBlock * 32), 0, stream,
                "c2_decode_or_verify_norm_rope_store", p);
}

}  // namespace

void c1_decode_cuda(KVLayout layout, const LowRatioParams& p, cudaStream_t stream) {
  switch (layout) {
    case KVLayout::V4: launch_c1<KVLayout::V4>(p, stream); break;
    case KVLayout::V41: launch_c1<KVLayout::V41>(p, stream); break;
    case KVLayout::V41_FP4: launch_c1<KVLayout::V41_FP4>(p, stream); break;
  }
}

void c2_decode_or_verify_cuda(KVLayout layout, const LowRatioParams& p, cudaStream_t stream) {
  switch (layout) {
    case KVLayout::V4: launch_c2<KVLayout::V4>(p, stream); break;
    case KVLayout::V41: launch_c2<KVLayout::V41>(p, stream); break;
    case KVLayout::V41_FP4: launch_c2<KVLayout::V41_FP4>(p, stream); break;
  }
}

}  // namespace dsv4
