// CUDA kernels of build_page_table_positions_small (§2) and fill_all_compressed_indices (§4):
// row x column grids (row_tile.cuh) that rewrite every output element; table loads are indexed by
// request id / page number only after the bounds tests of the spec, so hostile values stay in bounds.
#include "dsv4/launch.cuh"
#include "metadata_launch.h"
#include "row_tile.cuh"

namespace dsv4 {

namespace {

__global__ void __launch_bounds__(kRowTileThreads)
page_table_positions_kernel(const PageTablePositionsParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();  // dependents still wait for this grid to complete before reading
  int64_t s;
  if (tile_scalar_row(p.rows, s)) {
    const int32_t L = p.seq_lens.i32(s);
    p.seq_lens_out[s] = L;
    p.positions[s] = position_of_length(L);
    p.swa_lengths[s] = min_i32(L, p.swa_window);
  }
  const int64_t r = tile_row();
  const int64_t first = tile_first_col();
  if (r >= p.rows || first >= p.pages) return;
  const int64_t q = p.req_pool_indices[r];
  const bool known_request = q >= 0 && q < p.req_to_token.rows;  // else page 0 (the dummy page)
  int32_t* row = p.page_table + r * p.pages;
  for (int64_t c = first; c < p.pages; c += tile_col_step()) {
    int32_t v[kColsPerThread];
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) {
      const int64_t col = c + k;
      v[k] = known_request && col < p.pages
                 ? trunc_div_pow2(p.req_to_token.i32(q, col << p.page_bits), p.page_bits)
                 : 0;
    }
    store_chunk(row, c, p.pages, v);
  }
}

__global__ void __launch_bounds__(kRowTileThreads)
fill_all_compressed_indices_kernel(const FillCompressedParams p) {
  pdl_wait_dependencies();
  pdl_launch_dependents();
  const int64_t r = tile_row();
  const int64_t first = tile_first_col();
  if (r >= p.rows || first >= p.width) return;
  const int32_t len = p.lens.i32(r);
  int32_t* pages = p.page_indices + r * p.width;
  int32_t* raw = p.raw_indices != nullptr ? p.raw_indices + r * p.width : nullptr;
  for (int64_t c = first; c < p.width; c += tile_col_step()) {
    int32_t v[kColsPerThread], w[kColsPerThread];
    // A chunk of 4 columns spans one page when spp >= 4: the repeated loads hit L1.
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) {
      const int64_t col = c + k;
      const int64_t page = col >> p.spp_bits;
      const bool valid = col < len && page < p.page_table.cols;
      v[k] = valid ? paged_slot(p.page_table.i32(r, page), p.spp_bits, col) : -1;
      w[k] = valid ? int32_t(col) : -1;
    }
    store_chunk(pages, c, p.width, v);
    if (raw != nullptr) store_chunk(raw, c, p.width, w);
  }
}

}  // namespace

void build_page_table_positions_cuda(const PageTablePositionsParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  const RowTile shape = row_tile_shape(p.rows, p.pages);
  launch_kernel(page_table_positions_kernel, shape.grid, shape.block, 0, stream,
                "build_page_table_positions_small", p);
}

void fill_all_compressed_indices_cuda(const FillCompressedParams& p, cudaStream_t stream) {
  if (p.rows == 0 || p.width == 0) return;
  const RowTile shape = row_tile_shape(p.rows, p.width);
  launch_kernel(fill_all_compressed_indices_kernel, shape.grid, shape.block, 0, stream,
                "fill_all_compressed_indices", p);
}

}  // namespace dsv4
