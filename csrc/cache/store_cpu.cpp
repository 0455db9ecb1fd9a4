// CPU implementation of fused_store_cache: one row at a time through the row quantizers (row_quant.h), which
// the CUDA store kernels match byte for byte.
#include "cache_launch.h"
#include "element_io.h"
#include "dsv4/rope.cuh"
#include "dsv4/row_quant.h"

namespace dsv4 {

void store_main_cpu(KVLayout layout, const StoreParams& p) {
  float x[kMainDim];
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t slot = p.slots[i];
    if (!p.cache.valid(slot)) continue;
    load_row(p.input, i, kMainDim, x);
    if (p.freqs != nullptr) {
      // Rotate the tail with this row's table entry, then round to the activation dtype.
      const float* f = p.freqs + i * kRopeDim;
      for (int j = 0; j < kRopeDim / 2; ++j) {
        float& re = x[kV4NopeDim + 2 * j];
        float& im = x[kV4NopeDim + 2 * j + 1];
        rotate_pair(re, im, f[2 * j], f[2 * j + 1]);
        re = round_to_type(re, p.input.type);
        im = round_to_type(im, p.input.type);
      }
    }
    quantize_main_row(layout, x, p.cache.data_row(slot), p.cache.scale_row(slot));
  }
}

void store_indexer_cpu(IndexerFormat fmt, const StoreParams& p) {
  float x[kIndexerDim];
  for (int64_t i = 0; i < p.n; ++i) {
    const int64_t slot = p.slots[i];
    if (!p.cache.valid(slot)) continue;
    load_row(p.input, i, kIndexerDim, x);
    quantize_indexer_row(fmt, x, p.cache.data_row(slot), p.cache.scale_row(slot));
  }
}

}  // namespace dsv4
