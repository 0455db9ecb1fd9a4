// CUDA kernels of the ratio-1 and ratio-2 compressors: one row per block of 128 threads, thread t owns latent
// dims [4t, 4t+4) through the pooling (c2), the norm, RoPE and the quantizer; c2 prefill then parks its
// requests' tail rows in the ring in a second launch.
#include "low_ratio_launch.h"
#include "dsv4/e2m1_pairs.cuh"
#include "dsv4/launch.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/pair_pool.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"

namespace dsv4 {

namespace {

// A decode batch leaves a few rows per SM, so a row's time is its chain of dependent instructions: 128
// threads of 4 dims each keep that chain short. One warp per row with 16 dims per lane (~790 instructions
// issued ~8 cycles apart) took c1 at 1024 rows 4.6-4.9 us on an H200; this layout takes 3.7-4.1.
constexpr int kRowThreads = 128;
constexpr int kThreadDims = kMainDim / kRowThreads;  // 4: one float4 of a fp32 half row, 8 bytes of bf16
static_assert(kThreadDims == 4, "a thread moves one float4 per fp32 half row");
constexpr int kNormGroup = kMainDim / 32;               // 16 dims per group of §1.2
constexpr int kQuadThreads = kNormGroup / kThreadDims;  // 4 threads per group (and per fake-quant tile)

// N weight values from dim `first` as loaded (fp32 bits, or bf16 bits), widened by weight_value only where
// the norm needs them. A warp stalls at the first instruction that reads a pending load and issues nothing
// behind it, so widening right after the load would hold the index loads, or the pooling, behind the weight.
template <int N>
__device__ __forceinline__ void load_weight_bits(const LowRatioParams& p, int first, uint32_t* bits) {
  if (p.weight_fp32) {
#pragma unroll
    for (int i = 0; i < N; ++i) bits[i] = load_input(static_cast<const uint32_t*>(p.weight) + first + i);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) bits[i] = load_input(static_cast<const uint16_t*>(p.weight) + first + i);
  }
}

__device__ __forceinline__ float weight_value(const LowRatioParams& p, uint32_t bits) {
  return p.weight_fp32 ? __uint_as_float(bits) : bf16_to_f32(uint16_t(bits));
}

// Writes latent dims [dim, dim + 4) of the row (8 bytes of bf16 bits).
__device__ __forceinline__ void store_latent4(const LowRatioParams& p, int64_t token, int dim, const uint16_t* bits) {
  uint16_t* dst = p.latent + token * kMainDim + dim;
  if ((reinterpret_cast<uintptr_t>(dst) & 7) == 0) {
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(bits[0] | (uint32_t(bits[1]) << 16), bits[2] | (uint32_t(bits[3]) << 16));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i] = bits[i];
  }
}

// Before the wait (see prefetch_l2) a block prefetches its row, each thread its part, and thread 0 the row's
// index words: their addresses need no load. A row's loads are otherwise two DRAM trips in series after the
// wait (the indices, then the RoPE table row or the c2 partner they name). H200, cold inputs under graph
// replay: c2 at 256 rows 3.3-3.5 -> 3.0-3.2 us, c1 at 1024 rows 3.4-3.8 -> 3.3-3.7 us.
__device__ __forceinline__ void prefetch_indices(const LowRatioParams& p, bool with_request) {
  if (threadIdx.x == 0) {
    const int64_t token = blockIdx.x;
    prefetch_l2(p.positions.address(token));
    prefetch_l2(p.out_loc.address(token));
    if (with_request) prefetch_l2(p.req_pool_indices.address(token));
  }
}

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

// Whether thread-owned dims [dim, dim + 4) are RoPE dims (448..511: the last 16 threads, two pairs each).
__device__ __forceinline__ bool rope_dims(int dim) { return dim >= kV4NopeDim; }

// The table entries (cos, sin, cos, sin) of the thread's two RoPE pairs at `position`.
__device__ __forceinline__ void load_table4(const LowRatioParams& p, int64_t position, int dim, float* cs) {
  load_widen4<true>(p.freqs + position * kRopeDim + (dim - kV4NopeDim), cs);
}

// The rest of a row once its (pooled) input x is known, on every thread of the block: latent =
// bf16(RMSNorm(x) * w) to the output, then, for a row that stores (slot >= 0), §5.4 on the latent:
// t = bf16(rope_tail(latent)); V41_FP4 stores t, V41 and V4 store fake_quant_compressed_kv(t), whose
// 16-value tiles are quads of threads. Every thread must call (a block barrier); slot is block-uniform.
template <KVLayout L>
__device__ __forceinline__ void norm_rope_store4(const LowRatioParams& p, int64_t token, int dim, const float* x,
                                                 const uint32_t* weight_bits, float* cs, int64_t slot,
                                                 float* group_partials) {
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
  if (slot < 0) return;
  if (rope_dims(dim)) {
    rotate_pair(v[0], v[1], cs[0], cs[1]);
    rotate_pair(v[2], v[3], cs[2], cs[3]);
    round_pair_to_bf16(v[0], v[1]);
    round_pair_to_bf16(v[2], v[3]);
  }
  // Every thread of the block gets here (slot is block-uniform), so the tile shuffles name whole warps.
  if constexpr (L != KVLayout::V41_FP4) {
    fake_quant_compressed_bf16_values<4>(v, warp_max_xor(abs_max<4>(v), kQuadThreads, 0xFFFFFFFFu));
  }
  quantize_main_lane<L, true, kThreadDims, true>(v, threadIdx.x, p.cache.data_row(slot), p.cache.scale_row(slot));
}

// c1: the row and the weight do not depend on the indices, so their loads are issued before the index
// loads and the latencies overlap; the row is widened only after the index loads are out (a warp stalls
// at the first instruction that reads a pending load).
template <KVLayout L>
__global__ void __launch_bounds__(kRowThreads) c1_decode_kernel(LowRatioParams p) {
  __shared__ __align__(16) float group_partials[kMainDim / kNormGroup];
  const int64_t token = blockIdx.x;  // grid = n blocks
  const int dim = threadIdx.x * kThreadDims;
  const uint16_t* src = static_cast<const uint16_t*>(p.kv.data) + token * p.kv.row_stride + dim;
  prefetch_l2(src);
  prefetch_indices(p, false);
  warm_params(p, src);
  pdl_wait_dependencies();
  // c1 reads no state, so compressors.md §4.6 lets it trigger at once: the next kernel's prologue then overlaps
  // this one's loads. H100, graph replay (benchmarks.ab_decode), against the trigger after the table load: V4 at
  // 8 / 64 / 256 rows 2.01-2.10 / 1.89 / 2.32 -> 1.80 / 1.86 / 2.30 us.
  pdl_launch_dependents();
  const bool vector = (reinterpret_cast<uintptr_t>(src) & 7) == 0;
  uint2 raw = {};
  if (vector) raw = load_input(reinterpret_cast<const uint2*>(src));
  uint32_t weight_bits[kThreadDims];
  load_weight_bits<kThreadDims>(p, dim, weight_bits);
  const int64_t position = p.positions[token];
  const int64_t slot = c1_store_slot(p.out_loc[token], position, p.cache.capacity(), p.max_pos);
  float cs[4] = {};
  if (rope_dims(dim) && slot >= 0) load_table4(p, position, dim, cs);
  float x[4];
  if (vector) {
    x[0] = bits_f32(raw.x << 16); x[1] = bits_f32(raw.x & 0xFFFF0000u);
    x[2] = bits_f32(raw.y << 16); x[3] = bits_f32(raw.y & 0xFFFF0000u);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = bf16_to_f32(load_input(src + i));
  }
  norm_rope_store4<L>(p, token, dim, x, weight_bits, cs, slot, group_partials);
}

// The 64-bit plan, out of line: only rows whose indices do not fit int32 (or rings of 2^31 rows) take it.
__device__ __noinline__ PairRowPlan plan_pair_row_wide(int64_t token, int64_t position, int64_t req,
                                                       int64_t raw_out_loc, PairRing ring, int64_t capacity,
                                                       int64_t max_pos) {
  return plan_pair_row(token, position, req, raw_out_loc, ring, capacity, max_pos);
}

__device__ __forceinline__ bool fits_int32(int64_t v) { return v == int64_t(int32_t(v)); }

// A c2 row's plan: PairRing32's 32-bit form where it applies (every row of a real batch), else the 64-bit one.
// The same plan either way.
__device__ __forceinline__ PairRowPlan plan_c2_row(const LowRatioParams& p, int64_t token, int64_t position,
                                                   int64_t req, int64_t raw_out_loc) {
  if (p.ring32.usable && fits_int32(position) && fits_int32(req) && fits_int32(raw_out_loc)) {
    return p.ring32.plan_row(int32_t(token), int32_t(position), int32_t(req), int32_t(raw_out_loc));
  }
  return plan_pair_row_wide(token, position, req, raw_out_loc, p.ring, p.cache.capacity(), p.max_pos);
}

// Whether prefill row `token` (> 0) continues the run of the input row before it.
__device__ __forceinline__ bool c2_prefill_continues(const LowRatioParams& p, int64_t token, int64_t position,
                                                     int64_t req) {
  return continues_run(position, req, p.positions[token - 1], p.req_pool_indices[token - 1]);
}

// The 64-bit prefill plan, out of line as plan_pair_row_wide (by value: a reference to the parameters would
// copy them to local memory in every thread).
__device__ __noinline__ PairRowPlan plan_c2_prefill_row_wide(int64_t token, int64_t position, int64_t req,
                                                             int64_t raw_out_loc, bool continues, PairRing ring,
                                                             int64_t capacity, int64_t max_pos) {
  return plan_prefill_pair_row(token, position, req, raw_out_loc, [=] { return continues; }, ring, capacity, max_pos);
}

// A c2 prefill row's plan (§5.5): an odd row's partner is the input row before when that row continues the run.
// 32-bit where it applies, as plan_c2_row (token < 2^31: the grid has one block per row).
__device__ __forceinline__ PairRowPlan plan_c2_prefill_row(const LowRatioParams& p, int64_t token) {
  const int64_t position = p.positions[token], req = p.req_pool_indices[token], raw_out_loc = p.out_loc[token];
  if (p.ring32.usable && fits_int32(position) && fits_int32(req) && fits_int32(raw_out_loc)) {
    auto continues = [&] { return c2_prefill_continues(p, token, position, req); };
    return p.ring32.plan_prefill_row(int32_t(token), int32_t(position), int32_t(req), int32_t(raw_out_loc),
                                     continues);
  }
  return plan_c2_prefill_row_wide(token, position, req, raw_out_loc,
                                  token > 0 && c2_prefill_continues(p, token, position, req), p.ring,
                                  p.cache.capacity(), p.max_pos);
}

// c2: a single warp spent most of an emitting row issuing the 512 accurate exp + IEEE divisions of
// pair_pool back to back; here each thread pools its 4 dims.
// The row's (kv, score), the weight and the row's indices do not depend on each other, so their loads are
// issued together (the weight as raw bits, see load_weight_bits). Every thread resolves the row's plan
// itself (the index loads of a warp hit one address; the arithmetic is a few dozen instructions): the
// partner load then follows the index loads directly instead of waiting for one thread's plan and a block
// barrier. The partner's pooling runs the four channels side by side (pair_pool_channels).
// kPrefill: the rows of c2_prefill_norm_rope_store, whose ring writes c2_prefill_park_kernel makes afterwards.
template <KVLayout L, bool kPrefill>
__global__ void __launch_bounds__(kRowThreads) c2_rows_kernel(LowRatioParams p) {
  __shared__ __align__(16) float group_partials[kMainDim / kNormGroup];
  const int64_t token = blockIdx.x;  // grid = n blocks
  const int dim = threadIdx.x * kThreadDims;
  const float* row = static_cast<const float*>(p.kv.data) + token * p.kv.row_stride;
  prefetch_l2(row + dim);
  prefetch_l2(row + kMainDim + dim);
  prefetch_indices(p, true);
  warm_params(p, row + dim);
  pdl_wait_dependencies();
  float kv[4], score[4];
  load_widen4<true>(row + dim, kv);
  load_widen4<true>(row + kMainDim + dim, score);
  uint32_t weight_bits[kThreadDims];
  load_weight_bits<kThreadDims>(p, dim, weight_bits);
  const PairRowPlan plan = kPrefill ? plan_c2_prefill_row(p, token)
                                    : plan_c2_row(p, token, p.positions[token], p.req_pool_indices[token],
                                                  p.out_loc[token]);

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

  float k_even[4], s_even[4];
  if (plan.partner_input >= 0) {
    const float* partner = static_cast<const float*>(p.kv.data) + plan.partner_input * p.kv.row_stride;
    load_widen4<true>(partner + dim, k_even);
    load_widen4<true>(partner + kMainDim + dim, s_even);
  } else if (plan.partner_ring >= 0) {
    const float* partner = p.state + plan.partner_ring * p.state_row_stride;
    load_widen4<true>(partner + dim, k_even);
    load_widen4<true>(partner + kMainDim + dim, s_even);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      k_even[i] = 0.0f;
      s_even[i] = kPadScore;
    }
  }
  // Issued before the pooling so that the table's latency hides behind it and the norm.
  float cs[4] = {};
  if (rope_dims(dim) && plan.slot >= 0) load_table4(p, plan.rope_position, dim, cs);
  pdl_launch_dependents();
  float x[4];
  pair_pool_channels<4>(k_even, s_even, kv, score, x);
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = round_to_bf16(x[i]);
  norm_rope_store4<L>(p, token, dim, x, weight_bits, cs, plan.slot, group_partials);
}

// c2 prefill, second launch: block r parks the tail rows of request r (prefill_tail) in the ring, each thread its
// 4 dims of kv and of score. It waits for the rows launch, whose ring reads must all come first.
__global__ void __launch_bounds__(kRowThreads) c2_prefill_park_kernel(LowRatioParams p, C2PrefillRequests q) {
  pdl_wait_dependencies();
  const int64_t r = blockIdx.x;
  const PrefillTail tail = prefill_tail(q.extend_starts[r], q.extend_lens[r], p.n, p.ring.ring);
  const int dim = threadIdx.x * kThreadDims;
  for (int64_t row = tail.first; row < tail.end; ++row) {  // block-uniform
    const int64_t ring_row = parked_ring_row(p.positions[row], p.req_pool_indices[row], p.out_loc[row], p.ring);
    if (ring_row < 0) continue;
    const float* src = static_cast<const float*>(p.kv.data) + row * p.kv.row_stride;
    float kv[4], score[4];
    load_widen4<true>(src + dim, kv);
    load_widen4<true>(src + kMainDim + dim, score);
    float* dst = p.state + ring_row * p.state_row_stride;
    store_f32<4>(dst + dim, kv);
    store_f32<4>(dst + kMainDim + dim, score);
  }
  pdl_launch_dependents();
}

template <KVLayout L>
void launch_c1(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c1_decode_kernel<L>, dim3(unsigned(p.n)), dim3(kRowThreads), 0, stream,
                "c1_decode_norm_rope_store", p);
}

template <KVLayout L>
void launch_c2(const LowRatioParams& p, cudaStream_t stream) {
  launch_kernel(c2_rows_kernel<L, false>, dim3(unsigned(p.n)), dim3(kRowThreads), 0, stream,
                "c2_decode_or_verify_norm_rope_store", p);
}

template <KVLayout L>
void launch_c2_prefill(const LowRatioParams& p, const C2PrefillRequests& q, cudaStream_t stream) {
  constexpr const char* op = "c2_prefill_norm_rope_store";
  if (p.n > 0) launch_kernel(c2_rows_kernel<L, true>, dim3(unsigned(p.n)), dim3(kRowThreads), 0, stream, op, p);
  if (q.requests > 0) {
    launch_kernel(c2_prefill_park_kernel, dim3(unsigned(q.requests)), dim3(kRowThreads), 0, stream, op, p, q);
  }
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

void c2_prefill_cuda(KVLayout layout, const LowRatioParams& p, const C2PrefillRequests& q, cudaStream_t stream) {
  switch (layout) {
    case KVLayout::V4: launch_c2_prefill<KVLayout::V4>(p, q, stream); break;
    case KVLayout::V41: launch_c2_prefill<KVLayout::V41>(p, q, stream); break;
    case KVLayout::V41_FP4: launch_c2_prefill<KVLayout::V41_FP4>(p, q, stream); break;
  }
}

}  // namespace dsv4
