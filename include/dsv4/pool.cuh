// Where each window slot of a c4/c128 compression reads from (compressors.md §4.1-4.3): the ring
// page row, the input row or the pad value, and which columns of the row hold its kv and score.
// Shared by the CPU and CUDA compressors; plain integers only.
#pragma once

#include <cstdint>

#include "dsv4/plan.cuh"

namespace dsv4 {

// One compression, from a DecodePlan or a CompressPlan row.
struct PoolWindow {
  bool emits;
  int64_t p;          // position of the emitting token (seq_len - 1)
  int64_t src;        // input row of the emitting token
  int64_t buffer_len; // window slots [0, buffer_len) come from the ring
  int32_t read_page_0, read_page_1;
};

// Whether a decode row of this seq_len word closes a chunk (emits a compressed row).
DSV4_HD bool decode_emits(uint32_t seq_len, int ratio) {
  return seq_len != kInvalidPlanWord && seq_len != 0 && seq_len % uint32_t(ratio) == 0;
}

// Decode row b: the current token is input row b, every earlier window slot is in the ring.
DSV4_HD PoolWindow decode_window(const DecodeEntry& e, int64_t b, int ratio) {
  PoolWindow w{};
  w.emits = decode_emits(e.seq_len, ratio);
  w.p = int64_t(e.seq_len) - 1;
  w.src = b;
  w.buffer_len = compress_window(ratio) - 1;
  w.read_page_0 = e.read_page_0;
  w.read_page_1 = e.read_page_1;
  return w;
}

DSV4_HD PoolWindow prefill_window(const CompressEntry& e) {
  PoolWindow w{};
  w.emits = e.seq_len != kInvalidPlanWord && e.seq_len != 0;
  w.p = int64_t(e.seq_len) - 1;
  w.src = e.ragged_id;
  w.buffer_len = e.buffer_len;
  w.read_page_0 = e.read_page_0;
  w.read_page_1 = e.read_page_1;
  return w;
}

enum class SlotKind : int { Pad = 0, State = 1, Input = 2 };

struct SlotSource {
  SlotKind kind;
  int64_t row;  // state row or input row
};

// Window slot k holds position p - window + 1 + k. c4 slots 0..3 are the previous chunk (page
// read_page_0, masked for the first chunk), c4 slots 4..7 and every c128 slot the current chunk
// (page read_page_1); a page holds positions at row position % ratio.
DSV4_HD SlotSource slot_source(const PoolWindow& w, int k, int ratio, int64_t state_pages, int64_t input_rows) {
  const int window = compress_window(ratio);
  const bool overlap = ratio == 4 && k < ratio;
  if (overlap && w.p < window - 1) return SlotSource{SlotKind::Pad, 0};
  if (k < w.buffer_len) {
    const int64_t page = overlap ? w.read_page_0 : w.read_page_1;
    if (page < 0 || page >= state_pages) return SlotSource{SlotKind::Pad, 0};
    return SlotSource{SlotKind::State, page * ratio + k % ratio};
  }
  const int64_t row = w.src - (window - 1) + k;
  if (row < 0 || row >= input_rows) return SlotSource{SlotKind::Pad, 0};
  return SlotSource{SlotKind::Input, row};
}

// Row width W and the columns of slot k's value and score: c4 rows are (kv_ov, kv, s_ov, s),
// c128 rows (kv, s), each head_dim wide.
DSV4_HD int64_t state_row_width(int ratio, int64_t head_dim) { return (ratio == 4 ? 4 : 2) * head_dim; }
DSV4_HD int64_t value_column(int ratio, int k, int64_t head_dim) {
  return (ratio == 4 && k >= ratio) ? head_dim : 0;
}
DSV4_HD int64_t score_column(int ratio, int k, int64_t head_dim) {
  return ratio == 4 ? (k >= ratio ? 3 * head_dim : 2 * head_dim) : head_dim;
}

// State writes never touch the trailing pad page.
DSV4_HD bool writable_state_row(int64_t row, int64_t state_rows, int ratio) {
  return row >= 0 && row < state_rows - ratio;
}

}  // namespace dsv4
