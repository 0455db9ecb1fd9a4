// CPU implementation of fake_quant_compressed_kv (V41_FP4 tile round trip) and fake_quant_fp4
// (power-of-two scaled e2m1 round trip).
#include "cache_launch.h"
#include "element_io.h"
#include "dsv4/row_quant.h"

namespace dsv4 {

namespace {
template <typename BlockFn>
void for_each_block(const FakeQuantParams& p, BlockFn&& quantize_block) {
  float x[128];
  for (int64_t r = 0; r < p.rows; ++r) {
    const int64_t in_base = p.in_rows.row_offset(r);
    for (int64_t b = 0; b < p.width; b += p.block_size) {
      for (int i = 0; i < p.block_size; ++i) x[i] = load_element(p.in, in_base + b + i, p.type);
      quantize_block(x, p.block_size);
      for (int i = 0; i < p.block_size; ++i) store_element(p.out, r * p.width + b + i, p.type, x[i]);
    }
  }
}
}  // namespace

void fake_quant_compressed_kv_cpu(const FakeQuantParams& p) {
  for_each_block(p, fake_quant_compressed_tile);
}

void fake_quant_fp4_cpu(const FakeQuantParams& p) {
  for_each_block(p, [](float* x, int n) {
    const uint8_t b = fp4_pow2_scale_byte(tile_amax(x, n));
    const float inv = pow2f(127 - int(b));
    const float scale = pow2f(int(b) - 127);
    for (int i = 0; i < n; ++i) x[i] = e2m1_decode(e2m1_encode_rne(x[i] * inv)) * scale;
  });
}

}  // namespace dsv4
