// CPU implementations of the five metadata ops, built on the shared integer rules of
// include/dsv4/metadata.cuh (the CUDA kernels use the same functions, so the two agree by construction).
#include <cstddef>
#include <vector>

#include "metadata_launch.h"

namespace dsv4 {

void build_page_table_positions_cpu(const PageTablePositionsParams& p) {
  const int64_t page_size = int64_t(1) << p.page_bits;
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t L = p.seq_lens.i32(r);
    p.seq_lens_out[r] = L;
    p.positions[r] = position_of_length(L);
    p.swa_lengths[r] = min_i32(L, p.swa_window);
    const int64_t q = p.req_pool_indices[r];
    const bool known_request = q >= 0 && q < p.req_to_token.rows;
    int32_t* row = p.page_table + r * p.pages;
    for (int64_t c = 0; c < p.pages; ++c) {
      row[c] = known_request ? trunc_div_pow2(p.req_to_token.i32(q, c * page_size), p.page_bits) : 0;
    }
  }
}

void build_low_ratio_metadata_cpu(const LowRatioParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const LowRatioRow row = low_ratio_row(p.seq_lens.i32(r), p.out_loc[r], p.topk);
    p.out_locs[0][r] = row.c1_out_loc;
    p.seq_lens_out[0][r] = row.c1_seq_len;
    p.sparse_lens[0][r] = row.c1_sparse_len;
    p.out_locs[1][r] = row.c2_out_loc;
    p.seq_lens_out[1][r] = row.c2_seq_len;
    p.sparse_lens[1][r] = row.c2_sparse_len;
  }
  for (int k = 0; k < 2; ++k) {
    for (int64_t i = 0; i < p.rows * p.padded; ++i) p.page_indices[k][i] = -1;
  }
}

void fill_all_compressed_indices_cpu(const FillCompressedParams& p) {
  for (int64_t r = 0; r < p.rows; ++r) {
    const int32_t len = p.lens.i32(r);
    int32_t* pages = p.page_indices + r * p.width;
    int32_t* raw = p.raw_indices != nullptr ? p.raw_indices + r * p.width : nullptr;
    for (int64_t c = 0; c < p.width; ++c) {
      const int64_t page = c >> p.spp_bits;
      const bool valid = c < len && page < p.page_table.cols;
      pages[c] = valid ? paged_slot(p.page_table.i32(r, page), p.spp_bits, c) : -1;
      if (raw != nullptr) raw[c] = valid ? int32_t(c) : -1;
    }
  }
}

void init_compression_metadata_cpu(const CompressionParams& p) {
  for (int64_t b = 0; b < p.bs; ++b) {
    const int32_t s = p.seq_lens.i32(b);
    const int32_t pos = p.positions.i32(b);
    const int64_t loc = b < p.num_locs ? p.raw_out_loc[b] : 0;
    CompressionRow rows[2];
    for (int k = 0; k < 2; ++k) {
      rows[k] = compression_row(s, pos, loc, compression_ratio_bits(k));
      if (b < p.num_locs) p.out_locs[k][b] = rows[k].out_loc;
      p.positions_out[k][b] = rows[k].position;
      p.seq_lens_raw[k][b] = rows[k].seq_len_raw;
      p.seq_lens_clamp1[k][b] = rows[k].seq_len_clamp1;
    }
    if (p.width == 0) continue;
    const int32_t live = rows[1].seq_len_raw;  // c128 groups of this row
    int32_t* out = p.c128_page_indices + b * p.width;
    for (int64_t j = 0; j < p.width; ++j) {
      const bool valid = j < live && j < p.cap;
      out[j] = valid ? paged_slot(p.page_table.i32(b, j >> p.cps_bits), p.cps_bits, j) : -1;
    }
  }
}

void paged_mqa_schedule_cpu(const ScheduleParams& p) {
  std::vector<int64_t> prefix(static_cast<size_t>(p.batch));
  int64_t total = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    total += split_count(p.lens.i32(b));
    prefix[b] = total;
  }
  const SplitPlan plan = split_plan(total, p.num_sms);
  const auto prefix_at = [&](int64_t j) { return prefix[j]; };
  for (int64_t i = 0; i <= p.num_sms; ++i) {
    const int64_t start = sm_start(i, plan);
    const int64_t b = count_not_above(prefix_at, p.batch, start);
    const bool sentinel = b >= p.batch;
    const int64_t before = sentinel || b == 0 ? 0 : prefix[b - 1];
    p.out[2 * i] = int32_t(b);
    p.out[2 * i + 1] = sentinel ? 0 : int32_t(start - before);
  }
}

}  // namespace dsv4
