// Plain-C++ parameter blocks and CPU / CUDA entry points of the metadata ops (spec/metadata.md).
// No torch types: metadata_ops.cpp validates tensors and fills these; the *_kernels.cu files and
// metadata_cpu.cpp consume them.
#pragma once

#include <cstdint>

#include "dsv4/metadata.cuh"

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dsv4 {

// A 1-D int32 or int64 vector of any stride (elements).
struct StridedIndex {
  const void* data;
  int64_t stride;
  bool is_int64;
  DSV4_HD int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i * stride]
                    : int64_t(static_cast<const int32_t*>(data)[i * stride]);
  }
  // Lengths, positions, slots and page ids are narrowed to int32 on load (§1.3).
  DSV4_HD int32_t i32(int64_t i) const { return wrap_i32((*this)[i]); }
};

// A 2-D int32 or int64 table [rows, cols] with stride(1) == 1 and any row stride.
struct IndexTable {
  const void* data;
  int64_t row_stride;
  int64_t rows;
  int64_t cols;
  bool is_int64;
  DSV4_HD int32_t i32(int64_t row, int64_t col) const {
    const int64_t at = row * row_stride + col;
    return is_int64 ? wrap_i32(static_cast<const int64_t*>(data)[at])
                    : static_cast<const int32_t*>(data)[at];
  }
};

// build_page_table_positions_small (§2). Outputs are contiguous int32.
struct PageTablePositionsParams {
  IndexTable req_to_token;        // [R, C]
  StridedIndex req_pool_indices;  // [rows]
  StridedIndex seq_lens;          // [rows]
  int32_t* seq_lens_out;          // [rows]
  int32_t* positions;             // [rows]
  int32_t* page_table;            // [rows, pages]
  int32_t* swa_lengths;           // [rows]
  int64_t rows;
  int64_t pages;
  int page_bits;                  // log2(page_size)
  int32_t swa_window;             // >= 1, clamped to INT32_MAX (same min() for every int32 L)
};

// build_low_ratio_metadata (§3). Ratio X = 1, 2 at index X - 1.
struct LowRatioParams {
  StridedIndex seq_lens;          // [rows]
  StridedIndex out_loc;           // [rows]
  int64_t* out_locs[2];           // [rows]
  int32_t* seq_lens_out[2];       // [rows]
  int32_t* sparse_lens[2];        // [rows]
  int32_t* page_indices[2];       // [rows, padded], all -1
  int64_t rows;
  int64_t padded;                 // ceil(topk / 64) * 64
  int32_t topk;
};

// fill_all_compressed_indices (§4).
struct FillCompressedParams {
  IndexTable page_table;          // [rows, P]
  StridedIndex lens;              // [rows]
  int32_t* page_indices;          // [rows, width]
  int32_t* raw_indices;           // [rows, width] or null
  int64_t rows;
  int64_t width;
  int spp_bits;                   // log2(page_size / compress_ratio)
};

// init_compression_metadata (§5). Ratio 4 at index 0, ratio 128 at index 1.
struct CompressionParams {
  StridedIndex seq_lens;          // [bs]
  StridedIndex positions;         // [bs]
  StridedIndex raw_out_loc;       // [num_locs], num_locs <= bs
  IndexTable page_table;          // [bs, max_pages]; data null when width == 0
  int64_t* out_locs[2];           // [num_locs]
  int32_t* positions_out[2];      // [bs]
  int32_t* seq_lens_raw[2];       // [bs]
  int32_t* seq_lens_clamp1[2];    // [bs]
  int32_t* c128_page_indices;     // [bs, width]
  int64_t bs;
  int64_t num_locs;
  int64_t width;                  // 0: no page indices
  int64_t cap;                    // cps * max_pages
  int cps_bits;                   // log2(page_size / 128)
};

DSV4_HD int compression_ratio_bits(int k) { return k == 0 ? 2 : 7; }  // ratios 4 and 128

// get_paged_mqa_logits_metadata (§6).
struct ScheduleParams {
  StridedIndex lens;              // [B] (a [B, 1] input is read through its stride(0))
  int64_t batch;
  int num_sms;
  int32_t* out;                   // [num_sms + 1, 2]
  int64_t* workspace;             // large path only: schedule_workspace_elems(batch) int64
};

// The GPU schedule scans in one CTA up to this batch, and in 4096-request tiles above it.
constexpr int64_t kScheduleSingleCtaMaxBatch = 2048;
constexpr int64_t kScheduleTile = 4096;
inline bool schedule_uses_workspace(int64_t batch) { return batch > kScheduleSingleCtaMaxBatch; }
// Tile-local inclusive prefixes [B], then the tile totals [ceil(B / 4096)].
inline int64_t schedule_workspace_elems(int64_t batch) {
  return batch + (batch + kScheduleTile - 1) / kScheduleTile;
}

// CPU implementations (metadata_cpu.cpp).
void build_page_table_positions_cpu(const PageTablePositionsParams& p);
void build_low_ratio_metadata_cpu(const LowRatioParams& p);
void fill_all_compressed_indices_cpu(const FillCompressedParams& p);
void init_compression_metadata_cpu(const CompressionParams& p);
void paged_mqa_schedule_cpu(const ScheduleParams& p);

#ifdef USE_CUDA
// CUDA launchers (page_table_kernels.cu, compression_kernels.cu, schedule_kernels.cu).
void build_page_table_positions_cuda(const PageTablePositionsParams& p, cudaStream_t stream);
void fill_all_compressed_indices_cuda(const FillCompressedParams& p, cudaStream_t stream);
void build_low_ratio_metadata_cuda(const LowRatioParams& p, cudaStream_t stream);
void init_compression_metadata_cuda(const CompressionParams& p, cudaStream_t stream);
void paged_mqa_schedule_cuda(const ScheduleParams& p, cudaStream_t stream);
#endif

}  // namespace dsv4
