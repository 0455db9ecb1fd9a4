// CUDA kernels of build_low_ratio_metadata (§3, ratios 1 and 2) and init_compression_metadata
// (§5, ratios 4 and 128): per-row scalars from the shared rules of dsv4/metadata.cuh plus the
// fixed-width index rows (-1 fills, c128 page indices) on a row x column grid (row_tile.cuh).
#include "dsv4/launch.cuh"
#include "metadata_launch.h"
#include "row_tile.cuh"

namespace dsv4 {

namespace {

__global__ void __launch_bounds__(kRowTileThreads) low_ratio_metadata_kernel(const LowRatioParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();  // dependents still wait for this grid to complete before reading
  int64_t s;
  if (tile_scalar_row(p.rows, s)) {
    const LowRatioRow row = low_ratio_row(p.seq_lens.i32(s), p.out_loc[s], p.topk);
    p.out_locs[0][s] = row.c1_out_loc;
    p.seq_lens_out[0][s] = row.c1_seq_len;
    p.sparse_lens[0][s] = row.c1_sparse_len;
    p.out_locs[1][s] = row.c2_out_loc;
    p.seq_lens_out[1][s] = row.c2_seq_len;
    p.sparse_lens[1][s] = row.c2_sparse_len;
  }
  const int64_t r = tile_row();
  if (r >= p.rows) return;
  const int32_t fill[kColsPerThread] = {-1, -1, -1, -1};
  for (int64_t c = tile_first_col(); c < p.padded; c += tile_col_step()) {
    store_chunk(p.page_indices[0] + r * p.padded, c, p.padded, fill);
    store_chunk(p.page_indices[1] + r * p.padded, c, p.padded, fill);
  }
}

__global__ void __launch_bounds__(kRowTileThreads)
compression_metadata_kernel(const CompressionParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  int64_t s;
  if (tile_scalar_row(p.bs, s)) {
    const int32_t len = p.seq_lens.i32(s);
    const int32_t pos = p.positions.i32(s);
    const bool has_loc = s < p.num_locs;  // context parallelism pads metadata rows, not write rows
    const int64_t loc = has_loc ? p.raw_out_loc[s] : 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const CompressionRow row = compression_row(len, pos, loc, compression_ratio_bits(k));
      if (has_loc) p.out_locs[k][s] = row.out_loc;
      p.positions_out[k][s] = row.position;
      p.seq_lens_raw[k][s] = row.seq_len_raw;
      p.seq_lens_clamp1[k][s] = row.seq_len_clamp1;
    }
  }
  const int64_t b = tile_row();
  const int64_t first = tile_first_col();
  if (b >= p.bs || first >= p.width) return;
  const int32_t live = trunc_div_pow2(p.seq_lens.i32(b), compression_ratio_bits(1));
  int32_t* row = p.c128_page_indices + b * p.width;
  for (int64_t c = first; c < p.width; c += tile_col_step()) {
    int32_t v[kColsPerThread];
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) {
      const int64_t j = c + k;
      const bool valid = j < live && j < p.cap;
      v[k] = valid ? paged_slot(p.page_table.i32(b, j >> p.cps_bits), p.cps_bits, j) : -1;
    }
    store_chunk(row, c, p.width, v);
  }
}

}  // namespace

void build_low_ratio_metadata_cuda(const LowRatioParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const RowTile shape = row_tile_shape(p.rows, p.padded);
  launch_kernel(low_ratio_metadata_kernel, shape.grid, shape.block, 0, stream,
                "build_low_ratio_metadata", p);
}

void init_compression_metadata_cuda(const CompressionParams& p, cudaStream_t stream) {
  if (p.bs == 0) return;
  const RowTile shape = row_tile_shape(p.bs, p.width);
  launch_kernel(compression_metadata_kernel, shape.grid, shape.block, 0, stream,
                "init_compression_metadata", p);
}

}  // namespace dsv4
