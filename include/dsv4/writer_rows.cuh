// Which rows the norm + RoPE writers write, and where: the compress plan entry fields they read
// (cache-writers.md §4) and the common skip rule on slot and RoPE position (§0). Shared by the
// CPU and CUDA kernels; plain integers only.
#pragma once

#include <cstdint>

#include "dsv4/kv_layout.cuh"

namespace dsv4 {

// Bytes of one plan entry; the writer reads only bytes 0..7.
constexpr int kPlanEntryBytes = 16;
// seq_len of a padding entry in a prefill plan.
constexpr uint32_t kPlanSentinelSeqLen = 0xFFFFFFFFu;

// What one plan entry asks of the compress writer: whether to write, which out_loc entry holds
// the slot, and the RoPE position.
struct CompressRowPick {
  bool take;
  int64_t out_loc_index;
  int64_t position;
};

// seq_len = bytes 0..3, word1 = bytes 4..7 (prefill: ragged_id in its low 16 bits).
// Decode: row b closes a block iff seq_len % ratio == 0, slot out_loc[b]. Prefill: every
// non-padding entry closes a block, slot out_loc[ragged_id] if that index exists.
// Both: position = seq_len - ratio (negative for seq_len < ratio, rejected by the position rule).
DSV4_HD CompressRowPick pick_compress_row(bool is_decode, uint32_t seq_len, uint32_t word1,
                                          int64_t row, int64_t ratio, int64_t out_loc_len) {
  CompressRowPick pick{};
  pick.position = int64_t(seq_len) - ratio;
  if (is_decode) {
    pick.take = int64_t(seq_len) % ratio == 0;
    pick.out_loc_index = row;
  } else {
    pick.out_loc_index = int64_t(word1 & 0xFFFFu);
    pick.take = seq_len != kPlanSentinelSeqLen && pick.out_loc_index < out_loc_len;
  }
  return pick;
}

// The RoPE position must index a row of the [max_pos, 64] table.
DSV4_HD bool position_in_table(int64_t position, int64_t max_pos) {
  return position >= 0 && position < max_pos;
}

}  // namespace dsv4
