// CPU implementation of the norm + RoPE cache writers: one row at a time through the whole-row
// RMSNorm, rotation, Hadamard transform and quantizers of include/dsv4 (the same scalar functions
// the CUDA kernels use), with the rounding points of cache-writers.md §1.6.
#include <cstring>

#include "element_io.h"
#include "writers_launch.h"
#include "dsv4/hadamard.cuh"
#include "dsv4/norm.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/row_quant.h"
#include "dsv4/writer_rows.cuh"

namespace dsv4 {

namespace {

struct RowTarget {
  int64_t slot;
  int64_t position;
};

bool k_writer_target(const NormRopeParams& p, int64_t row, RowTarget& t) {
  t.slot = p.out_loc[row];
  t.position = p.positions[row];
  return p.cache.valid(t.slot) && position_in_table(t.position, p.max_pos);
}

bool compress_target(const NormRopeParams& p, int64_t row, RowTarget& t) {
  uint32_t words[2];
  std::memcpy(words, p.plan + row * kPlanEntryBytes, sizeof(words));  // little-endian host
  const CompressRowPick pick = p.compress_rows.pick(p.is_decode, words[0], words[1], row);
  if (!pick.take) return false;
  t.slot = p.out_loc[pick.out_loc_index];
  t.position = pick.position;
  return p.cache.valid(t.slot);
}

void load_weight(const NormRopeParams& p, int dim, float* w) {
  for (int i = 0; i < dim; ++i) {
    w[i] = load_element(p.weight, i, p.weight_fp32 ? ElemType::FP32 : ElemType::BF16);
  }
}

// Rotates the pairs of v[0..64) with one table row.
void rotate_tail(float* v, const float* table_row) {
  for (int j = 0; j < kRopeDim / 2; ++j) rotate_pair(v[2 * j], v[2 * j + 1], table_row[2 * j], table_row[2 * j + 1]);
}

// RMSNorm, RoPE and quantization of one main row. V4 quantizes the nope dims of y, rounded to
// bf16 first on the compress path only, and stores the rotated fp32 tail as bf16; V41 / V41_FP4
// round y to bf16, rotate the bf16 tail, round it again and quantize all 512 values.
void write_main_row(KVLayout layout, bool round_v4_nope, const NormRopeParams& p, int64_t row,
                    const float* w, const RowTarget& t) {
  float x[kMainDim], y[kMainDim];
  load_row(p.kv, row, kMainDim, x);
  rms_norm_row<kMainDim>(x, w, p.eps, y);
  float* tail = y + kV4NopeDim;
  const float* table_row = p.freqs + t.position * kRopeDim;
  if (layout == KVLayout::V4) {
    if (round_v4_nope) {
      for (int i = 0; i < kV4NopeDim; ++i) y[i] = round_to_bf16(y[i]);
    }
    rotate_tail(tail, table_row);  // stored as bf16 by the quantizer
  } else {
    for (int i = 0; i < kMainDim; ++i) y[i] = round_to_bf16(y[i]);
    rotate_tail(tail, table_row);
    for (int i = 0; i < kRopeDim; ++i) tail[i] = round_to_bf16(tail[i]);
  }
  quantize_main_row(layout, y, p.cache.data_row(t.slot), p.cache.scale_row(t.slot));
}

}  // namespace

void k_norm_rope_cpu(KVLayout layout, const NormRopeParams& p) {
  float w[kMainDim];
  load_weight(p, kMainDim, w);
  RowTarget t{};
  for (int64_t row = 0; row < p.n; ++row) {
    if (k_writer_target(p, row, t)) write_main_row(layout, false, p, row, w, t);
  }
}

void compress_main_cpu(KVLayout layout, const NormRopeParams& p) {
  float w[kMainDim];
  load_weight(p, kMainDim, w);
  RowTarget t{};
  for (int64_t row = 0; row < p.n; ++row) {
    if (compress_target(p, row, t)) write_main_row(layout, true, p, row, w, t);
  }
}

void compress_indexer_cpu(IndexerFormat fmt, const NormRopeParams& p) {
  float w[kIndexerDim], x[kIndexerDim], y[kIndexerDim];
  load_weight(p, kIndexerDim, w);
  RowTarget t{};
  for (int64_t row = 0; row < p.n; ++row) {
    if (!compress_target(p, row, t)) continue;
    // No bf16 rounding anywhere on this path: norm, rotate, transform, quantize in fp32.
    load_row(p.kv, row, kIndexerDim, x);
    rms_norm_row<kIndexerDim>(x, w, p.eps, y);
    rotate_tail(y + kIndexerDim - kRopeDim, p.freqs + t.position * kRopeDim);
    hadamard128(y);
    quantize_indexer_row(fmt, y, p.cache.data_row(t.slot), p.cache.scale_row(t.slot));
  }
}

}  // namespace dsv4
