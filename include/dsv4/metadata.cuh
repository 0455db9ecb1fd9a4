// Integer rules of the metadata ops (spec/metadata.md §1.2 and §2-§6), written once for the CPU
// implementation and the CUDA kernels: int32 wrap, truncating and flooring divisions by powers of
// two, the per-row formulas and the split math of the paged-MQA schedule. No torch headers.
#pragma once

#include <cstdint>

#include "dsv4/kv_layout.cuh"  // DSV4_HD

namespace dsv4 {

// The full-KV page of DSV4 and the unit of work of the paged-MQA schedule (tokens).
constexpr int kSplitTokens = 256;
constexpr int kSplitBits = 8;

// Two's-complement narrowing, like Tensor.to(torch.int32).
DSV4_HD int32_t wrap_i32(int64_t v) { return static_cast<int32_t>(static_cast<uint32_t>(v)); }

// C `/` by 2^bits without a hardware divide: a negative x is biased by 2^bits - 1 so the shift
// rounds toward zero (valid for INT32_MIN: the bias never overflows a negative value).
DSV4_HD int32_t trunc_div_pow2(int32_t x, int bits) {
  return (x + ((x >> 31) & ((int32_t(1) << bits) - 1))) >> bits;
}
DSV4_HD int64_t trunc_div_pow2(int64_t x, int bits) {
  return (x + ((x >> 63) & ((int64_t(1) << bits) - 1))) >> bits;
}

DSV4_HD int log2_pow2(int64_t pow2) {
  int bits = 0;
  while ((int64_t(1) << bits) < pow2) ++bits;
  return bits;
}

DSV4_HD int32_t max_i32(int32_t a, int32_t b) { return a > b ? a : b; }
DSV4_HD int32_t min_i32(int32_t a, int32_t b) { return a < b ? a : b; }

// Slot k of a paged compressed pool with 2^spp_bits slots per page: page * spp + k % spp in int32
// wrap arithmetic (a hostile page id may overflow; the result then wraps like the oracle's cast).
DSV4_HD int32_t paged_slot(int32_t page_id, int spp_bits, int64_t k) {
  const uint32_t within = static_cast<uint32_t>(k & ((int64_t(1) << spp_bits) - 1));
  return static_cast<int32_t>((static_cast<uint32_t>(page_id) << spp_bits) + within);
}

// ---- build_page_table_positions_small (§2) ----

// Causal position of a query token whose KV length is L (int32 wrap for INT32_MIN).
DSV4_HD int32_t position_of_length(int32_t L) { return wrap_i32(int64_t(L) - 1); }

// ---- build_low_ratio_metadata (§3): floor semantics, by arithmetic shifts ----

struct LowRatioRow {
  int64_t c1_out_loc;
  int32_t c1_seq_len;
  int32_t c1_sparse_len;
  int64_t c2_out_loc;
  int32_t c2_seq_len;
  int32_t c2_sparse_len;
};

DSV4_HD LowRatioRow low_ratio_row(int32_t L, int64_t loc, int32_t topk) {
  LowRatioRow row;
  row.c1_out_loc = loc;
  row.c1_seq_len = max_i32(L, 1);
  row.c1_sparse_len = min_i32(row.c1_seq_len, topk);
  row.c2_out_loc = (L & 1) == 0 ? (loc >> 1) : int64_t(-1);
  row.c2_seq_len = max_i32(L >> 1, 1);
  row.c2_sparse_len = min_i32(row.c2_seq_len, topk);
  return row;
}

// ---- init_compression_metadata (§5): truncation, round-down by masking ----

struct CompressionRow {
  int64_t out_loc;     // written only for rows that also have a raw write slot
  int32_t position;
  int32_t seq_len_raw;
  int32_t seq_len_clamp1;
};

// Ratio 2^ratio_bits. The zero-remainder test on the low bits is sign-independent, so it equals
// the truncating `s % r == 0`; 0 (not -1) marks a row that closes no group.
DSV4_HD CompressionRow compression_row(int32_t s, int32_t pos, int64_t loc, int ratio_bits) {
  const int32_t mask = (int32_t(1) << ratio_bits) - 1;
  CompressionRow row;
  row.out_loc = (s & mask) == 0 ? trunc_div_pow2(loc, ratio_bits) : int64_t(0);
  row.position = pos & ~mask;
  row.seq_len_raw = trunc_div_pow2(s, ratio_bits);
  row.seq_len_clamp1 = max_i32(row.seq_len_raw, 1);
  return row;
}

// ---- get_paged_mqa_logits_metadata (§6) ----

// 256-token splits of one request; negative lengths count as 0. No int32 overflow: <= 2^23.
DSV4_HD int32_t split_count(int32_t L) {
  return L <= 0 ? 0 : (L >> kSplitBits) + ((L & (kSplitTokens - 1)) != 0 ? 1 : 0);
}

// S splits over num_sms SMs: q each, and the last `rem` SMs (those from pivot on) take one more.
struct SplitPlan {
  int64_t per_sm;  // q
  int64_t pivot;   // num_sms - rem
};

DSV4_HD SplitPlan split_plan(int64_t total, int num_sms) {
  SplitPlan plan;
  plan.per_sm = total / num_sms;
  plan.pivot = num_sms - (total - plan.per_sm * num_sms);
  return plan;
}

// First split of SM i (i in [0, num_sms]; SM num_sms starts at S).
DSV4_HD int64_t sm_start(int64_t i, const SplitPlan& plan) {
  return i * plan.per_sm + (i > plan.pivot ? i - plan.pivot : 0);
}

// #{j < n : prefix(j) <= value} for a non-decreasing sequence (an upper-bound binary search).
template <class Prefix>
DSV4_HD int64_t count_not_above(const Prefix& prefix, int64_t n, int64_t value) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + ((hi - lo) >> 1);
    if (prefix(mid) <= value) lo = mid + 1; else hi = mid;
  }
  return lo;
}

}  // namespace dsv4
