// CUDA kernels of the ratio-1 and ratio-2 decode compressors. c1: one token per warp, 4 warps per
// block, lane l owns latent dims [16l, 16l+16). c2: one row per block of 4 warps, which pool the pair
// 4 dims per thread; warp 0 then normalizes and stores the latent with the same lane layout as c1.
#include "low_ratio_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/pair_pool.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"
#include "dsv4/warp_rope.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

__device__ __forceinline__ int64_t broadcast(int64_t v) {
  return __shfl_sync(kFullMask, static_cast<long long>(v), 0);
}

// This lane's 16 weight values as loaded (fp32 bits, or bf16 bits), widened by weight_value only where
// the norm needs them. A warp stalls at the first instruction that reads a pending load and issues nothing
// behind it, so widening right after the load would hold the index loads, or the pooling, behind the weight.
__device__ __forceinline__ void load_weight_bits(const LowRatioParams& p, int lane, uint32_t* bits) {
  const int first = lane * kLaneDims;
  if (p.weight_fp32) {
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) bits[i] = __ldg(static_cast<const uint32_t*>(p.weight) + first + i);
  } else {
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) bits[i] = __ldg(static_cast<const uint16_t*>(p.weight) + first + i);
  }
}

__device__ __forceinline__ float weight_value(const LowRatioParams& p, uint32_t bits) {
  return p.weight_fp32 ? __uint_as_float(bits) : bf16_to_f32(uint16_t(bits));
}

// The (cos, sin) pair of the RoPE table row that this lane rotates with (warp_rope.cuh).
__device__ __forceinline__ float2 load_table_lane(const LowRatioParams& p, int64_t position, int lane) {
  return load_table_pair(p.freqs + position * kRopeDim, lane);
}

// Plain (coherent) loads for the state ring, which this kernel also writes; __ldg is kept for the
// read-only inputs.
__device__ __forceinline__ void load_state4(const float* src, float* out) {
  if (aligned16(src)) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = src[i];
  }
}

__device__ __forceinline__ uint16_t* latent_lane(const LowRatioParams& p, int64_t token, int lane) {
  return p.latent + token * kMainDim + lane * kLaneDims;
}

// Zeros latent dims [dim, dim + 4) of the row (8 bytes).
__device__ __forceinline__ void store_zero_latent4(const LowRatioParams& p, int64_t token, int dim) {
  uint16_t* dst = p.latent + token * kMainDim + dim;
  if ((reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(0u, 0u);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = 0;
  }
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

// §5.4: t = bf16(rope_tail(latent)) (each lane rotates tail pair `lane` with its table pair cs, through
// the warp's `tail` buffer); V41_FP4 stores t, V41 and V4 store fake_quant_compressed_kv(t), whose
// 16-value tiles are exactly a lane's dims. All lanes must call (tile amax reductions).
template <KVLayout L>
__device__ __forceinline__ void store_latent_lane(const LowRatioParams& p, int lane, float* v, float2 cs,
                                                  float2* tail, int64_t slot) {
  static_assert(LayoutTraits<KVLayout::V41_FP4>::kTile == kLaneDims, "one fake-quant tile per lane");
  rotate_tail_across_warp<true>(v, cs, lane, tail);
  if constexpr (L != KVLayout::V41_FP4) fake_quant_compressed_tile(v, kLaneDims);
  quantize_main_lane<L>(v, lane, p.cache.data_row(slot), p.cache.scale_row(slot));
}

// The row and the weight do not depend on the indices, so their loads are issued before lane 0's index
// loads and the two latencies overlap; both are widened only after the index loads are out (a warp
// stalls at the first instruction that reads a pending load).
template <KVLayout L>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) c1_decode_kernel(LowRatioParams p) {
  __shared__ __align__(16) float2 tails[kWarpsPerBlock][kRopeDim / 2];
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const uint16_t* row = static_cast<const uint16_t*>(p.kv.data) + token * p.kv.row_stride;
  RawElements<kLaneDims, false> row_raw;
  load_raw(row + lane * kLaneDims, row_raw);
  uint32_t weight_bits[kLaneDims];
  load_weight_bits(p, lane, weight_bits);
  int64_t slot = -1, position = -1;
  if (lane == 0) {
    position = p.positions[token];
    slot = c1_store_slot(p.out_loc[token], position, p.cache.capacity(), p.max_pos);
  }
  slot = broadcast(slot);
  position = broadcast(position);
  float2 cs = {};
  if (slot >= 0) cs = load_table_lane(p, position, lane);
  pdl_launch_dependents();

  float x[kLaneDims], w[kLaneDims], v[kLaneDims];
  widen_raw<kLaneDims, false>(row_raw, x);
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) w[i] = weight_value(p, weight_bits[i]);
  norm_to_latent(p, token, lane, x, w, v);
  if (slot >= 0) store_latent_lane<L>(p, lane, v, cs, tails[threadIdx.x >> 5], slot);
}

// c2: one row per block. A single warp spent most of an emitting row issuing the 512 accurate
// exp + IEEE divisions of pair_pool back to back (decode batches leave about one warp per scheduler,
// so nothing hides that latency); 128 threads pool 4 dims each instead. Warp 0 then finishes the row
// exactly like the one-warp kernel did, so the bits are unchanged.
// The row's (kv, score), the weight and the row's indices do not depend on each other, so their loads are
// issued together (the weight as raw bits, see load_weight_bits). Every thread resolves the row's plan
// itself (the index loads of a warp hit one address; the arithmetic is a few dozen instructions): the
// partner load then follows the index loads directly instead of waiting for one thread's plan and a block
// barrier. The partner's pooling runs the four channels side by side (pair_pool_channels).
constexpr int kC2Threads = kWarpsPerBlock * 32;
constexpr int kC2ThreadDims = kMainDim / kC2Threads;  // 4: one float4 of kv and one of score
static_assert(kC2ThreadDims == 4, "phase A moves one float4 per half row and thread");

template <KVLayout L>
__global__ void __launch_bounds__(kC2Threads) c2_decode_or_verify_kernel(LowRatioParams p) {
  __shared__ __align__(16) float pooled[kMainDim];
  __shared__ __align__(16) float2 tail[kRopeDim / 2];
  const int64_t token = blockIdx.x;  // grid = n blocks
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int dim = threadIdx.x * kC2ThreadDims;
  pdl_wait_dependencies();
  const float* row = static_cast<const float*>(p.kv.data) + token * p.kv.row_stride;
  float kv[4], score[4];
  load_widen4<true>(row + dim, kv);
  load_widen4<true>(row + kMainDim + dim, score);
  // Only warp 0 (phase B) uses the weight. Loading it in every warp (so that no branch precedes the index
  // loads) measured 0.3 us slower at 256 rows and 1.4 us at 1024: the other warps' 16 loads per lane cost
  // more issue slots than the branch costs latency.
  uint32_t weight_bits[kLaneDims];
  if (warp == 0) load_weight_bits(p, lane, weight_bits);
  const PairRowPlan plan = plan_pair_row(token, p.positions[token], p.req_pool_indices[token], p.out_loc[token],
                                         p.ring, p.cache.capacity(), p.max_pos);

  if (!plan.emits) {
    // Padding (p < 0) or an even row: a zero latent, and a live even row parks (kv, score).
    pdl_launch_dependents();
    store_zero_latent4(p, token, dim);
    if (plan.ring_write >= 0) {
      float* dst = p.state + plan.ring_write * p.state_row_stride;
      store_f32<4>(dst + dim, kv);
      store_f32<4>(dst + kMainDim + dim, score);
    }
    return;
  }

  // Phase A (all threads): pool this thread's 4 dims with the partner's.
  float k_even[4], s_even[4];
  if (plan.partner_input >= 0) {
    const float* partner = static_cast<const float*>(p.kv.data) + plan.partner_input * p.kv.row_stride;
    load_widen4<true>(partner + dim, k_even);
    load_widen4<true>(partner + kMainDim + dim, s_even);
  } else if (plan.partner_ring >= 0) {
    const float* partner = p.state + plan.partner_ring * p.state_row_stride;
    load_state4(partner + dim, k_even);
    load_state4(partner + kMainDim + dim, s_even);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      k_even[i] = 0.0f;
      s_even[i] = kPadScore;
    }
  }
  // Warp 0's table row, issued before the pooling so that its latency hides behind it and the norm.
  float2 cs = {};
  if (warp == 0 && plan.slot >= 0) cs = load_table_lane(p, plan.rope_position, lane);
  pdl_launch_dependents();
  float x4[4];
  pair_pool_channels<4>(k_even, s_even, kv, score, x4);
#pragma unroll
  for (int i = 0; i < 4; ++i) x4[i] = round_to_bf16(x4[i]);
  *reinterpret_cast<float4*>(pooled + dim) = make_float4(x4[0], x4[1], x4[2], x4[3]);
  __syncthreads();
  if (warp != 0) return;

  // Phase B (warp 0): RMSNorm needs the whole row, and warp_rms_norm's fixed reduction order is
  // defined on the 16-dims-per-lane layout, so one warp finishes the row as c1 does.
  float x[kLaneDims], w[kLaneDims], v[kLaneDims];
#pragma unroll
  for (int i = 0; i < kLaneDims; i += 4) {
    const float4 q = *reinterpret_cast<const float4*>(pooled + lane * kLaneDims + i);
    x[i] = q.x; x[i + 1] = q.y; x[i + 2] = q.z; x[i + 3] = q.w;
  }
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) w[i] = weight_value(p, weight_bits[i]);
  norm_to_latent(p, token, lane, x, w, v);
  if (plan.slot >= 0) store_latent_lane<L>(p, lane, v, cs, tail, plan.slot);
}

dim3 token_grid(int64_t n) { return dim3(unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

template <KVLayout L>
void launch_c1(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c1_decode_kernel<L>, token_grid(p.n), dim3(kWarpsPerBlock * 32), 0, stream,
                "c1_decode_norm_rope_store", p);
}

template <KVLayout L>
void launch_c2(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c2_decode_or_verify_kernel<L>, dim3(unsigned(p.n)), dim3(kC2Threads), 0, stream,
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
