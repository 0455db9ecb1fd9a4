// CPU implementation of dequantize_k_cache_paged for the three main layouts: each stored element decoded
// on its own, the same bytes the CUDA kernels (dequant_kernels.cu) produce.
#include "cache_launch.h"
#include "dsv4/quant.cuh"

namespace dsv4 {

namespace {
// Element e of a stored row, before the final bf16 rounding (V4 RoPE dims are handled apart).
float dequant_element(KVLayout layout, const uint8_t* data, const uint8_t* scale, int e) {
  if (layout == KVLayout::V41_FP4) {
    const uint8_t byte = data[e / 2];
    const uint8_t code = (e & 1) ? uint8_t(byte >> 4) : uint8_t(byte & 0xF);
    return e2m1_decode(code) * e4m3_decode(scale[e / kv_layout_traits(layout).tile]);
  }
  return e4m3_decode(data[e]) * ue8m0_to_f32(scale[e / kv_layout_traits(layout).tile]);
}
}  // namespace

void dequantize_cpu(KVLayout layout, const DequantParams& p) {
  for (int64_t i = 0; i < p.n; ++i) {
    uint16_t* out = p.out + i * p.out_row_stride;
    const int64_t slot = p.slots[i];
    if (!p.cache.valid(slot)) {
      for (int e = 0; e < kMainDim; ++e) out[e] = 0;
      continue;
    }
    const uint8_t* data = p.cache.data_row(slot);
    const uint8_t* scale = p.cache.scale_row(slot);
    const int quantized = layout == KVLayout::V4 ? kV4NopeDim : kMainDim;
    for (int e = 0; e < quantized; ++e) {
      out[e] = f32_to_bf16_canonical(dequant_element(layout, data, scale, e));
    }
    for (int e = quantized; e < kMainDim; ++e) {  // V4 RoPE dims: stored bf16, copied verbatim
      const int j = e - kV4NopeDim;
      out[e] = uint16_t(data[kV4NopeDim + 2 * j] | (data[kV4NopeDim + 2 * j + 1] << 8));
    }
  }
}

}  // namespace dsv4
