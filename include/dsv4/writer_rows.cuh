// Which rows the norm + RoPE writers write, and where: the compress plan entry fields they read
// (cache-writers.md §4) and the common skip rule on slot and RoPE position (§0). Shared by the
// CPU and CUDA kernels; plain integers only.
#pragma once

#include <cstdint>

#include "dsv4/divider.cuh"
#include "dsv4/kv_layout.cuh"

namespace dsv4 {

// Bytes of one plan entry; the writer reads only bytes 0..7.
constexpr int kPlanEntryBytes = 16;
// seq_len of a padding entry in a prefill plan.
constexpr uint32_t kPlanSentinelSeqLen = 0xFFFFFFFFu;

// What one plan entry asks of the compress writer: whether to write (the entry closes a block, and its
// RoPE position indexes the table), which out_loc entry holds the slot, and the position. The slot's
// own skip rule is the caller's (PagedCache::valid).
struct CompressRowPick {
  bool take;
  int64_t out_loc_index;
  uint32_t position;
};

// The §4 row rule of the compress writers with 32-bit operations, prepared once per call on the host:
// the spec's int64 arithmetic costs a device thread a 64-bit modulo (about 20 instructions and a
// slow-path call) and 64-bit compares per row. Nothing is lost: seq_len and ragged_id are 32- and 16-bit,
// a position seq_len - ratio is negative whenever seq_len < ratio (so every row is skipped when
// compress_ratio >= 2^32), and is below 2^32 otherwise.
struct CompressRowRule {
  uint32_t ratio;             // compress_ratio, when below 2^32
  uint32_t table_rows;        // min(max_pos, 2^32 - 1), or 0 when compress_ratio >= 2^32: no position is valid
  uint32_t out_loc_len;       // min(out_loc.size(0), 2^16): ragged ids are below 2^16
  DivisibilityTest closes_block;  // decode: ratio divides seq_len

  // seq_len = bytes 0..3, word1 = bytes 4..7 (prefill: ragged_id in its low 16 bits). Decode: row b
  // closes a block iff seq_len % ratio == 0, slot out_loc[b]. Prefill: every non-padding entry closes a
  // block, slot out_loc[ragged_id] if that index exists. Both: position = seq_len - ratio, which must be
  // in [0, max_pos). `take` combines its tests with & rather than &&: a few plain ALU operations cost the
  // device less than the predication of a short-circuit.
  DSV4_HD CompressRowPick pick(bool is_decode, uint32_t seq_len, uint32_t word1, int64_t row) const {
    CompressRowPick pick{};
    pick.position = seq_len - ratio;
    const bool in_table = seq_len >= ratio && pick.position < table_rows;
    if (is_decode) {
      pick.out_loc_index = row;
      pick.take = in_table & closes_block.divides(seq_len);
    } else {
      const uint32_t ragged_id = word1 & 0xFFFFu;
      pick.out_loc_index = ragged_id;
      pick.take = in_table & (seq_len != kPlanSentinelSeqLen) & (ragged_id < out_loc_len);
    }
    return pick;
  }
};

// Host side: compress_ratio >= 1, max_pos >= 0, out_loc_len >= 0.
inline CompressRowRule make_compress_row_rule(int64_t compress_ratio, int64_t max_pos, int64_t out_loc_len) {
  constexpr int64_t kU32Max = 0xFFFFFFFF;
  const bool ratio_fits = compress_ratio <= kU32Max;
  CompressRowRule rule{};
  rule.ratio = uint32_t(ratio_fits ? compress_ratio : kU32Max);
  rule.table_rows = ratio_fits ? uint32_t(max_pos < kU32Max ? max_pos : kU32Max) : 0u;
  rule.out_loc_len = uint32_t(out_loc_len < 0x10000 ? out_loc_len : 0x10000);
  rule.closes_block = make_divisibility_test(rule.ratio);
  return rule;
}

// The RoPE position must index a row of the [max_pos, 64] table.
DSV4_HD bool position_in_table(int64_t position, int64_t max_pos) {
  return position >= 0 && position < max_pos;
}

}  // namespace dsv4
