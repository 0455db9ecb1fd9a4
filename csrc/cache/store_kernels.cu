// CUDA kernels of fused_store_cache: one token per warp. Main layouts: lane l owns dims
// [16l, 16l+16); indexer formats: lane l owns dims [4l, 4l+4). Invalid slots write nothing.
#include "cache_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/vec_io.cuh"

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kLaneDims = kMainDim / 32;            // 16
constexpr int kRopeFirstLane = kV4NopeDim / kLaneDims;  // 28: lanes 28..31 own the RoPE dims

__device__ __forceinline__ float round_to_input(float v, bool input_fp32) {
  return input_fp32 ? v : round_to_bf16(v);
}

// Quantizes this lane's 16 values of the row into the layout's data and scale rows. The tile
// amax is reduced over the lanes that share a tile (V4: 4, V41: 2, V41_FP4: 1).
template <KVLayout L>
__device__ __forceinline__ void quantize_main_lane(const float* x, int lane, uint8_t* data,
                                                   uint8_t* scale) {
  constexpr int kTile = LayoutTraits<L>::kTile;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kLaneDims; ++i) amax = fmax_f32(amax, fabs_f32(x[i]));
  amax = warp_max_xor(amax, kTile / kLaneDims);

  if constexpr (L == KVLayout::V41_FP4) {
    const uint8_t scale_byte = v41_fp4_scale_byte(amax);
    const E2m1RneThresholds encoder(e4m3_decode(scale_byte));
    uint32_t packed[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) packed[i / 8] |= uint32_t(encoder.encode(x[i])) << (4 * (i % 8));
    *reinterpret_cast<uint2*>(data + 8 * lane) = make_uint2(packed[0], packed[1]);
    scale[lane] = scale_byte;
  } else {
    if (L == KVLayout::V4 && lane >= kRopeFirstLane) {
      // RoPE dims stay bf16: 16 values = 32 bytes at 448 + 32 * (lane - 28).
      uint32_t w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = f32_to_bf16(x[2 * k]) | (uint32_t(f32_to_bf16(x[2 * k + 1])) << 16);
      uint4* dst = reinterpret_cast<uint4*>(data + kV4NopeDim + 32 * (lane - kRopeFirstLane));
      dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
      dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
      return;
    }
    const uint8_t b = L == KVLayout::V4 ? v4_scale_byte(amax) : v41_scale_byte(amax);
    const float inv = inverse_scale_of_byte(b);
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = e4m3x2_encode(x[4 * k] * inv, x[4 * k + 1] * inv);
      const uint32_t hi = e4m3x2_encode(x[4 * k + 2] * inv, x[4 * k + 3] * inv);
      w[k] = lo | (hi << 16);
    }
    *reinterpret_cast<uint4*>(data + 16 * lane) = make_uint4(w[0], w[1], w[2], w[3]);
    constexpr int kLanesPerTile = kTile / kLaneDims;
    if (lane % kLanesPerTile == 0) scale[lane / kLanesPerTile] = b;
  }
}

template <KVLayout L, bool InputFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) store_main_kernel(StoreParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const int64_t slot = p.slots[token];
  if (!p.cache.valid(slot)) return;

  const size_t elem = InputFp32 ? 4 : 2;
  const char* row = static_cast<const char*>(p.input.data) + token * p.input.row_stride * elem;
  float x[kLaneDims];
  load_widen<kLaneDims, InputFp32>(row + lane * kLaneDims * elem, x);
  if (p.freqs != nullptr && lane >= kRopeFirstLane) {
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
  quantize_main_lane<L>(x, lane, p.cache.data_row(slot), p.cache.scale_row(slot));
}

template <IndexerFormat F, bool InputFp32>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) store_indexer_kernel(StoreParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const int64_t slot = p.slots[token];
  if (!p.cache.valid(slot)) return;

  const size_t elem = InputFp32 ? 4 : 2;
  const char* row = static_cast<const char*>(p.input.data) + token * p.input.row_stride * elem;
  float x[4];
  load_widen4<InputFp32>(row + lane * 4 * elem, x);
  pdl_launch_dependents();

  uint8_t* data = p.cache.data_row(slot);
  uint8_t* scale = p.cache.scale_row(slot);
  float amax = fmax_f32(fmax_f32(fabs_f32(x[0]), fabs_f32(x[1])), fmax_f32(fabs_f32(x[2]), fabs_f32(x[3])));
  if constexpr (F == IndexerFormat::FP8) {
    amax = warp_max_xor(amax, 32);
    const float s = __fdiv_rn(fmax_f32(amax, amax_floor()), kE4m3Max);
    const float inv = __fdiv_rn(1.0f, s);
    const uint32_t lo = e4m3x2_encode(x[0] * inv, x[1] * inv);
    const uint32_t hi = e4m3x2_encode(x[2] * inv, x[3] * inv);
    *reinterpret_cast<uint32_t*>(data + 4 * lane) = lo | (hi << 16);
    if (lane == 0) *reinterpret_cast<float*>(scale) = s;
  } else {
    constexpr int kLanesPerTile = IndexerTraits<F>::kTile / 4;  // 8
    amax = warp_max_xor(amax, kLanesPerTile);
    const uint8_t b = indexer_fp4_scale_byte(amax);
    const float inv = inverse_scale_of_byte(b);
    const uint32_t codes = e2m1_encode_threshold(x[0] * inv) | (e2m1_encode_threshold(x[1] * inv) << 4) |
                           (e2m1_encode_threshold(x[2] * inv) << 8) | (e2m1_encode_threshold(x[3] * inv) << 12);
    *reinterpret_cast<uint16_t*>(data + 2 * lane) = uint16_t(codes);
    if (lane % kLanesPerTile == 0) scale[lane / kLanesPerTile] = b;
  }
}

dim3 token_grid(int64_t n) { return dim3(unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock)); }

template <KVLayout L>
void launch_store_main(const StoreParams& p, cudaStream_t stream) {
  const bool fp32 = p.input.type == ElemType::FP32;
  launch_kernel(fp32 ? store_main_kernel<L, true> : store_main_kernel<L, false>, token_grid(p.n),
                dim3(kWarpsPerBlock * 32), 0, stream, "fused_store_cache", p);
}

template <IndexerFormat F>
void launch_store_indexer(const StoreParams& p, cudaStream_t stream) {
  const bool fp32 = p.input.type == ElemType::FP32;
  launch_kernel(fp32 ? store_indexer_kernel<F, true> : store_indexer_kernel<F, false>,
                token_grid(p.n), dim3(kWarpsPerBlock * 32), 0, stream, "fused_store_cache", p);
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
