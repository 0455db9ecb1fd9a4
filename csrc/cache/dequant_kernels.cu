// CUDA kernel of dequantize_k_cache_paged: one token per warp, lane l produces output dims
// [16l, 16l+16), stored through shared memory in whole sectors. Invalid slots give +0.0 rows; NaNs are written
// as the canonical 0x7FC0.
#include "cache_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/shared_io.cuh"
#include "dsv4/vec_io.cuh"
#include "dsv4/warp_quant.cuh"  // lane geometry of a row

namespace dsv4 {

namespace {

constexpr int kWarpsPerBlock = 4;

template <KVLayout L>
__device__ __forceinline__ void dequant_lane(const uint8_t* data, const uint8_t* scale, int lane,
                                             uint16_t* out) {
  if constexpr (L == KVLayout::V41_FP4) {
    const uint2 codes = load_input(reinterpret_cast<const uint2*>(data + 8 * lane));
    const float s = e4m3_decode(load_input(scale + lane));
    // e2m1 value times an e4m3 scale has at most 6 significant bits, so the bf16 result is the
    // top half of the exact fp32 product; only a NaN scale needs the canonical NaN.
    const bool nan_tile = is_nan_f32(s);
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) {
      const uint32_t word = i < 8 ? codes.x : codes.y;
      const uint8_t code = uint8_t((word >> (4 * (i % 8))) & 0xF);
      out[i] = nan_tile ? kBf16CanonicalNaN : uint16_t(f32_bits(e2m1_decode(code) * s) >> 16);
    }
  } else {
    if (L == KVLayout::V4 && lane >= kRopeFirstLane) {
      // Stored bf16 RoPE dims are copied verbatim.
      const uint4* src = reinterpret_cast<const uint4*>(data + kV4NopeDim + 32 * (lane - kRopeFirstLane));
      const uint4 a = load_input(src), b = load_input(src + 1);
      const uint32_t w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        out[2 * k] = uint16_t(w[k] & 0xFFFF);
        out[2 * k + 1] = uint16_t(w[k] >> 16);
      }
      return;
    }
    constexpr int kLanesPerTile = LayoutTraits<L>::kTile / kLaneDims;
    const uint4 q = load_input(reinterpret_cast<const uint4*>(data + 16 * lane));
    const float s = ue8m0_to_f32(load_input(scale + lane / kLanesPerTile));
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float lo, hi;
      e4m3x2_decode(uint16_t(w[k / 2] >> (16 * (k % 2))), lo, hi);
      out[2 * k] = f32_to_bf16_canonical(lo * s);
      out[2 * k + 1] = f32_to_bf16_canonical(hi * s);
    }
  }
}

template <KVLayout L>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) dequant_kernel(DequantParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t token = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  pdl_wait_dependencies();
  if (token >= p.n) return;
  const int64_t slot = p.slots[token];
  uint16_t out[kLaneDims];
  if (p.cache.valid(slot)) {
    dequant_lane<L>(p.cache.data_row(slot), p.cache.scale_row(slot), lane, out);
  } else {
#pragma unroll
    for (int i = 0; i < kLaneDims; ++i) out[i] = 0;
  }
  pdl_launch_dependents();
  uint16_t* row = p.out + token * p.out_row_stride;
  if (!aligned16(row)) {
    store_u16<kLaneDims>(row + lane * kLaneDims, out);  // element by element
    return;
  }
  // The row goes out through shared memory as two 512-byte halves, lane l storing 16 bytes of each. A lane's own
  // 32 bytes, stored as two 16-byte halves 32 bytes apart, wrote every sector of the row in two partial writes
  // from two instructions (as the KV store's V4 tail did). H100, 65536 rows: V4 / V41 / V41_FP4 38.6-38.8 /
  // 37.1-37.6 / 32.2-32.3 -> 37.6-37.7 / 34.9-35.0 / 31.8-32.0 us; 2^20 rows V41 1 % faster, V41_FP4 0.5 % slower.
  __shared__ __align__(16) uint16_t rows[kWarpsPerBlock][kMainDim];
  const uint32_t at = shared_address(rows[threadIdx.x >> 5]);
  store_shared_u4(at + 32 * lane, pack_u16x8(out));
  store_shared_u4(at + 32 * lane + 16, pack_u16x8(out + 8));
  __syncwarp();
  uint4* dst = reinterpret_cast<uint4*>(row);
  dst[lane] = load_shared_u4(at + 16 * lane);
  dst[32 + lane] = load_shared_u4(at + 512 + 16 * lane);
}

template <KVLayout L>
void launch_dequant(const DequantParams& p, cudaStream_t stream) {
  const dim3 grid(unsigned((p.n + kWarpsPerBlock - 1) / kWarpsPerBlock));
  launch_kernel(dequant_kernel<L>, grid, dim3(kWarpsPerBlock * 32), 0, stream,
                "dequantize_k_cache_paged", p);
}

}  // namespace

void dequantize_cuda(KVLayout layout, const DequantParams& p, cudaStream_t stream) {
  switch (layout) {
    case KVLayout::V4: launch_dequant<KVLayout::V4>(p, stream); break;
    case KVLayout::V41: launch_dequant<KVLayout::V41>(p, stream); break;
    case KVLayout::V41_FP4: launch_dequant<KVLayout::V41_FP4>(p, stream); break;
  }
}

}  // namespace dsv4
