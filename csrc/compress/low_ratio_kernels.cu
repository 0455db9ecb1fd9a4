// CUDA kernels of the ratio-1 and ratio-2 decode compressors. c1: one token per warp, 4 warps per
// block, lane l owns latent dims [16l, 16l+16). c2: one row per block of 4 warps, thread t owns dims
// [4t, 4t+4) for the pooling, the norm, RoPE and the quantizer.
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

// N weight values from dim `first` as loaded (fp32 bits, or bf16 bits), widened by weight_value only where
// the norm needs them. A warp stalls at the first instruction that reads a pending load and issues nothing
// behind it, so widening right after the load would hold the index loads, or the pooling, behind the weight.
template <int N>
__device__ __forceinline__ void load_weight_bits(const LowRatioParams& p, int first, uint32_t* bits) {
  if (p.weight_fp32) {
#pragma unroll
    for (int i = 0; i < N; ++i) bits[i] = __ldg(static_cast<const uint32_t*>(p.weight) + first + i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) bits[i] = __ldg(static_cast<const uint16_t*>(p.weight) + first + i);
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

// Writes latent dims [dim, dim + 4) of the row (8 bytes of bf16 bits).
__device__ __forceinline__ void store_latent4(const LowRatioParams& p, int64_t token, int dim, const uint16_t* bits) {
  uint16_t* dst = p.latent + token * kMainDim + dim;
  if ((reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(bits[0] | (uint32_t(bits[1]) << 16), bits[2] | (uint32_t(bits[3]) << 16));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = bits[i];
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
  load_weight_bits<kLaneDims>(p, lane * kLaneDims, weight_bits);
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
// so nothing hides that latency); 128 threads pool 4 dims each instead, and keep their 4 dims through
// the norm, RoPE and quantization (block_rms_inverse4 keeps the §1.2 summation order, so the bits are
// those of the one-warp kernel, whose ~1400 cycles of dependent arithmetic on warp 0 are now spread
// over four warps).
// The row's (kv, score), the weight and the row's indices do not depend on each other, so their loads are
// issued together (the weight as raw bits, see load_weight_bits). Every thread resolves the row's plan
// itself (the index loads of a warp hit one address; the arithmetic is a few dozen instructions): the
// partner load then follows the index loads directly instead of waiting for one thread's plan and a block
// barrier. The partner's pooling runs the four channels side by side (pair_pool_channels).
constexpr int kC2Threads = kWarpsPerBlock * 32;
constexpr int kC2ThreadDims = kMainDim / kC2Threads;  // 4: one float4 of kv and one of score
static_assert(kC2ThreadDims == 4, "phase A moves one float4 per half row and thread");
constexpr int kNormGroup = kMainDim / 32;                 // 16 dims per group of §1.2
constexpr int kQuadThreads = kNormGroup / kC2ThreadDims;  // 4 threads per group (and per fake-quant tile)

// 1 / sqrt(ss / 512 + eps) of the row held 4 dims per thread (x) by the block's 128 threads, in the §1.2
// order: step 1 inside each 16-dim group, whose quad of threads pairs thread a with a ^ 2 (level h = 8)
// and a ^ 1 (h = 4) by shuffles, each adding the same two partials in either order (fp32 add is
// commutative), then h = 2, 1 in the thread; step 2 over the 32 group partials, which every thread sums
// from shared memory in the same order. Every thread must call (a block barrier).
__device__ __forceinline__ float block_rms_inverse4(const float* x, float eps, float* group_partials) {
  float q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(x[i], x[i]);
#pragma unroll
  for (int m = 2; m >= 1; m /= 2) {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __fadd_rn(q[i], __shfl_xor_sync(0xFFFFFFFFu, q[i], m));
  }
  const float group = __fadd_rn(__fadd_rn(q[0], q[2]), __fadd_rn(q[1], q[3]));
  if (threadIdx.x % kQuadThreads == 0) group_partials[threadIdx.x / kQuadThreads] = group;
  __syncthreads();
  float s[kMainDim / kNormGroup];
#pragma unroll
  for (int g = 0; g < kMainDim / kNormGroup; g += 4) {
    const float4 v = *reinterpret_cast<const float4*>(group_partials + g);
    s[g] = v.x; s[g + 1] = v.y; s[g + 2] = v.z; s[g + 3] = v.w;
  }
  // Step 2 halves the 32 partials (h = 16, ..., 1) exactly as step 1 halves a group's squares.
  return rms_inverse(rms_group_partial<kMainDim / kNormGroup>(s), kMainDim, eps);
}

template <KVLayout L>
__global__ void __launch_bounds__(kC2Threads) c2_decode_or_verify_kernel(LowRatioParams p) {
  __shared__ __align__(16) float group_partials[kMainDim / kNormGroup];
  const int64_t token = blockIdx.x;  // grid = n blocks
  const int dim = threadIdx.x * kC2ThreadDims;
  pdl_wait_dependencies();
  const float* row = static_cast<const float*>(p.kv.data) + token * p.kv.row_stride;
  float kv[4], score[4];
  load_widen4<true>(row + dim, kv);
  load_widen4<true>(row + kMainDim + dim, score);
  uint32_t weight_bits[kC2ThreadDims];
  load_weight_bits<kC2ThreadDims>(p, dim, weight_bits);
  const PairRowPlan plan = plan_pair_row(token, p.positions[token], p.req_pool_indices[token], p.out_loc[token],
                                         p.ring, p.cache.capacity(), p.max_pos);

  if (!plan.emits) {
    // Padding (p < 0) or an even row: a zero latent, and a live even row parks (kv, score).
    pdl_launch_dependents();
    const uint16_t zeros[4] = {0, 0, 0, 0};
    store_latent4(p, token, dim, zeros);
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
  // The table entries of this thread's two RoPE pairs (dims 448..511: the last 16 threads), issued before
  // the pooling so that their latency hides behind it and the norm.
  float cs[4] = {};
  const bool rope_thread = dim >= kV4NopeDim;
  if (rope_thread && plan.slot >= 0) load_widen4<true>(p.freqs + plan.rope_position * kRopeDim + (dim - kV4NopeDim), cs);
  pdl_launch_dependents();
  float x[4];
  pair_pool_channels<4>(k_even, s_even, kv, score, x);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = round_to_bf16(x[i]);

  // Phase B (all threads, the same 4 dims): latent = bf16(RMSNorm(x) * w), then §5.4 on the latent.
  float w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = weight_value(p, weight_bits[i]);
  const float r = block_rms_inverse4(x, p.eps, group_partials);
  uint16_t bits[4];
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    bits[i] = f32_to_bf16(rms_scale(x[i], r, w[i]));
    v[i] = bf16_to_f32(bits[i]);
  }
  store_latent4(p, token, dim, bits);
  if (plan.slot < 0) return;
  // t = bf16(rope_tail(latent)): a thread holds two whole pairs.
  if (rope_thread) {
    rotate_pair(v[0], v[1], cs[0], cs[1]);
    rotate_pair(v[2], v[3], cs[2], cs[3]);
    round_pair_to_bf16(v[0], v[1]);
    round_pair_to_bf16(v[2], v[3]);
  }
  // V41_FP4 stores t; V41 and V4 store fake_quant_compressed_kv(t), whose 16-value tiles are quads of threads.
  if constexpr (L != KVLayout::V41_FP4) {
    fake_quant_compressed_values(v, 4, warp_max_xor(abs_max<4>(v), kQuadThreads));
  }
  quantize_main_lane<L, kC2ThreadDims>(v, threadIdx.x, p.cache.data_row(plan.slot), p.cache.scale_row(plan.slot));
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
