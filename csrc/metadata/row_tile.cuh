// Launch shape and store helper shared by the row x column metadata kernels (page tables, index
// rows, -1 fills): a CTA of 256 threads covers blockDim.y rows and blockDim.x four-column chunks of
// each, so short rows pack many rows per CTA and long rows spread over grid.y (small-batch decode).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace dsv4 {

constexpr int kRowTileThreads = 256;
constexpr int kColsPerThread = 4;  // one 16-byte int32 store
constexpr int64_t kMaxGridY = 65535;

struct RowTile {
  dim3 grid;
  dim3 block;
};

// blockDim.x is the smallest power of two >= the chunks of a row (capped at 256); grid.y covers the
// rest of a long row, clamped to the grid.y limit (kernels stride over the remainder).
inline RowTile row_tile_shape(int64_t rows, int64_t cols) {
  const int64_t chunks = (cols + kColsPerThread - 1) / kColsPerThread;
  unsigned x = 1;
  while (x < unsigned(kRowTileThreads) && int64_t(x) < chunks) x <<= 1;
  const unsigned y = kRowTileThreads / x;
  const int64_t col_blocks = std::min(std::max<int64_t>((chunks + x - 1) / x, 1), kMaxGridY);
  return RowTile{dim3(unsigned((rows + y - 1) / y), unsigned(col_blocks)), dim3(x, y)};
}

__device__ __forceinline__ int64_t tile_row() { return int64_t(blockIdx.x) * blockDim.y + threadIdx.y; }
// First column of this thread's first chunk, and the column step of its stride loop.
__device__ __forceinline__ int64_t tile_first_col() {
  return (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kColsPerThread;
}
__device__ __forceinline__ int64_t tile_col_step() {
  return int64_t(gridDim.y) * blockDim.x * kColsPerThread;
}

// The per-row scalars of the CTA's rows are written by its first blockDim.y threads in linear
// order (CTA column 0 only), so consecutive rows go to consecutive lanes and the stores coalesce.
__device__ __forceinline__ bool tile_scalar_row(int64_t rows, int64_t& row) {
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  row = int64_t(blockIdx.x) * blockDim.y + t;
  return blockIdx.y == 0 && t < blockDim.y && row < rows;
}

// Stores v[0..4) at row[col..col+4), clipped to cols: one 16-byte store when the chunk is whole
// and aligned (col is a multiple of 4, so that is when the row start is 16-byte aligned).
__device__ __forceinline__ void store_chunk(int32_t* row, int64_t col, int64_t cols, const int32_t (&v)[4]) {
  int32_t* dst = row + col;
  if (col + kColsPerThread <= cols && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    *reinterpret_cast<int4*>(dst) = make_int4(v[0], v[1], v[2], v[3]);
    return;
  }
#pragma unroll
  for (int k = 0; k < kColsPerThread; ++k) {
    if (col + k < cols) dst[k] = v[k];
  }
}

}  // namespace dsv4
