// Torch-facing glue of the ratio-1 and ratio-2 compressors (c1_decode_norm_rope_store,
// c2_decode_or_verify_norm_rope_store, c2_prefill_norm_rope_store): argument validation (the host half of the
// fakes in _fake.py), allocation of the fresh latent and dispatch to the CPU implementation or the CUDA launcher.
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "low_ratio_launch.h"
#include "../cache/tensor_args.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

namespace {

// Checks shared by both ops; fills the cache, weight, eps and table fields.
void check_common(const char* op, LowRatioParams& p, const Tensor& k_cache, int64_t page_size, int64_t layout,
                  const Tensor& norm_weight, double eps, const Tensor& freqs_cis) {
  const FormatTraits traits = checked_layout_traits(op, layout);
  p.cache = check_cache(op, "k_cache", k_cache, traits, page_size, kMainCacheAlign);
  check_norm_weight(op, "norm_weight", norm_weight, kMainDim, k_cache);
  p.eps = checked_eps(op, "eps", eps);
  check_rope_table(op, "freqs_cis", freqs_cis, k_cache);
  p.weight = norm_weight.data_ptr();
  p.weight_fp32 = is_fp32(norm_weight);
  p.freqs = static_cast<const float*>(freqs_cis.data_ptr());
  p.max_pos = freqs_cis.size(0);
}

void check_row_count(const char* op, const Tensor& kv_input) {
  DSV4_CHECK(kv_input.size(0) <= kMaxLowRatioRows, op, "kv_input has ", kv_input.size(0), " rows; at most ",
             kMaxLowRatioRows, " are supported (one block of the rows launch each)");
}

void check_rows_input(const char* op, const char* name, const Tensor& t, int64_t n) {
  DSV4_CHECK(t.size(0) == n, op, name, " must have ", n, " entries (one per kv_input row), got ", t.size(0));
}

}  // namespace

Tensor c1_decode_norm_rope_store(Tensor kv_input, Tensor norm_weight, Tensor positions, Tensor out_loc,
                                 double eps, Tensor freqs_cis, Tensor k_cache, int64_t page_size,
                                 int64_t layout) {
  constexpr const char* op = "c1_decode_norm_rope_store";
  LowRatioParams p{};
  check_common(op, p, k_cache, page_size, layout, norm_weight, eps, freqs_cis);
  check_dtype(op, "kv_input", kv_input, ScalarType::BFloat16);
  check_activation(op, "kv_input", kv_input, kMainDim, k_cache);
  check_row_count(op, kv_input);
  check_index_vector(op, "positions", positions, k_cache);
  check_index_vector(op, "out_loc", out_loc, k_cache);
  const int64_t n = kv_input.size(0);
  check_rows_input(op, "positions", positions, n);
  check_rows_input(op, "out_loc", out_loc, n);
  check_written_disjoint(op, {arg("k_cache", k_cache)},
                         {arg("kv_input", kv_input), arg("norm_weight", norm_weight), arg("positions", positions),
                          arg("out_loc", out_loc), arg("freqs_cis", freqs_cis)});

  Tensor latent = torch::stable::new_empty(kv_input, {n, kMainDim}, ScalarType::BFloat16);
  if (n == 0) return latent;
  p.kv = row_input(kv_input);
  p.positions = index_input(positions);
  p.out_loc = index_input(out_loc);
  p.latent = static_cast<uint16_t*>(latent.data_ptr());
  p.n = n;
  const auto kv_layout = static_cast<KVLayout>(layout);
  run_on_device(
      op, k_cache, [&] { c1_decode_cpu(kv_layout, p); },
      [&](auto stream) { c1_decode_cuda(kv_layout, p, stream); });
  return latent;
}

namespace {

// Checks of the c2 ops' row inputs, pair-state ring and ring size; fills their fields (the latent excepted).
void check_c2_rows(const char* op, LowRatioParams& p, const Tensor& kv_input, const Tensor& kv_state,
                   const Tensor& positions, const Tensor& req_pool_indices, const Tensor& raw_out_loc,
                   const Tensor& k_cache, int64_t ring_size, int64_t draft_len) {
  check_dtype(op, "kv_input", kv_input, ScalarType::Float);
  check_activation(op, "kv_input", kv_input, kPairRowWidth, k_cache);
  check_row_count(op, kv_input);
  check_dtype(op, "kv_state", kv_state, ScalarType::Float);
  check_activation(op, "kv_state", kv_state, kPairRowWidth, k_cache);
  DSV4_CHECK(kv_state.size(0) <= 1 || kv_state.stride(0) >= kPairRowWidth, op, "kv_state row stride ",
             kv_state.stride(0), " overlaps rows (the ring is written)");
  check_index_vector(op, "positions", positions, k_cache);
  check_index_vector(op, "req_pool_indices", req_pool_indices, k_cache);
  check_index_vector(op, "raw_out_loc", raw_out_loc, k_cache);
  const int64_t n = kv_input.size(0);
  check_rows_input(op, "positions", positions, n);
  check_rows_input(op, "req_pool_indices", req_pool_indices, n);
  check_rows_input(op, "raw_out_loc", raw_out_loc, n);
  DSV4_CHECK(ring_size >= 1, op, "ring_size must be >= 1, got ", ring_size);
  const int64_t state_rows = kv_state.size(0);
  DSV4_CHECK(state_rows >= ring_size, op, "kv_state must hold at least ring_size=", ring_size,
             " rows, got ", state_rows);
  p.kv = row_input(kv_input);
  p.positions = index_input(positions);
  p.out_loc = index_input(raw_out_loc);
  p.req_pool_indices = index_input(req_pool_indices);
  p.state = static_cast<float*>(kv_state.data_ptr());
  p.state_row_stride = state_rows > 1 ? kv_state.stride(0) : kPairRowWidth;
  p.ring = make_pair_ring(ring_size, state_rows / ring_size, draft_len);
  p.ring32 = make_pair_ring32(p.ring, p.cache.capacity(), p.max_pos);
  p.n = n;
}

}  // namespace

Tensor c2_decode_or_verify_norm_rope_store(Tensor kv_input, Tensor kv_state, Tensor norm_weight, Tensor positions,
                                           Tensor req_pool_indices, Tensor raw_out_loc, double eps,
                                           Tensor freqs_cis, Tensor k_cache, int64_t page_size, int64_t ring_size,
                                           int64_t draft_len, int64_t layout) {
  constexpr const char* op = "c2_decode_or_verify_norm_rope_store";
  LowRatioParams p{};
  check_common(op, p, k_cache, page_size, layout, norm_weight, eps, freqs_cis);
  DSV4_CHECK(draft_len >= 0, op, "draft_len must be >= 0, got ", draft_len);
  check_c2_rows(op, p, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, k_cache, ring_size, draft_len);
  if (draft_len > 0) {
    DSV4_CHECK(ring_size > draft_len, op, "ring_size must be wider than the draft length (ring_size=",
               ring_size, ", draft_len=", draft_len, ")");
    DSV4_CHECK(p.n % draft_len == 0, op, "kv_input rows (", p.n, ") must be a multiple of draft_len=", draft_len,
               " in verify mode (request-major blocks)");
  }
  check_written_disjoint(op, {arg("kv_state", kv_state), arg("k_cache", k_cache)},
                         {arg("kv_input", kv_input), arg("norm_weight", norm_weight), arg("positions", positions),
                          arg("req_pool_indices", req_pool_indices), arg("raw_out_loc", raw_out_loc),
                          arg("freqs_cis", freqs_cis)});

  Tensor latent = torch::stable::new_empty(kv_input, {p.n, kMainDim}, ScalarType::BFloat16);
  if (p.n == 0) return latent;
  p.latent = static_cast<uint16_t*>(latent.data_ptr());
  const auto kv_layout = static_cast<KVLayout>(layout);
  run_on_device(
      op, k_cache, [&] { c2_decode_or_verify_cpu(kv_layout, p); },
      [&](auto stream) { c2_decode_or_verify_cuda(kv_layout, p, stream); });
  return latent;
}

Tensor c2_prefill_norm_rope_store(Tensor kv_input, Tensor kv_state, Tensor norm_weight, Tensor positions,
                                  Tensor req_pool_indices, Tensor raw_out_loc, double eps, Tensor freqs_cis,
                                  Tensor k_cache, Tensor extend_starts, Tensor extend_lens, int64_t page_size,
                                  int64_t ring_size, int64_t layout) {
  constexpr const char* op = "c2_prefill_norm_rope_store";
  LowRatioParams p{};
  check_common(op, p, k_cache, page_size, layout, norm_weight, eps, freqs_cis);
  check_c2_rows(op, p, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, k_cache, ring_size, 0);
  check_index_vector(op, "extend_starts", extend_starts, k_cache);
  check_index_vector(op, "extend_lens", extend_lens, k_cache);
  const C2PrefillRequests q{index_input(extend_starts), index_input(extend_lens), extend_starts.size(0)};
  DSV4_CHECK(extend_lens.size(0) == q.requests, op, "extend_lens must have one entry per request (",
             q.requests, " extend_starts), got ", extend_lens.size(0));
  DSV4_CHECK(q.requests <= kMaxC2PrefillRequests, op, "extend_starts has ", q.requests, " requests; at most ",
             kMaxC2PrefillRequests, " are supported (one block of the ring-park launch each)");
  check_written_disjoint(op, {arg("kv_state", kv_state), arg("k_cache", k_cache)},
                         {arg("kv_input", kv_input), arg("norm_weight", norm_weight), arg("positions", positions),
                          arg("req_pool_indices", req_pool_indices), arg("raw_out_loc", raw_out_loc),
                          arg("freqs_cis", freqs_cis), arg("extend_starts", extend_starts),
                          arg("extend_lens", extend_lens)});

  Tensor latent = torch::stable::new_empty(kv_input, {p.n, kMainDim}, ScalarType::BFloat16);
  if (p.n == 0) return latent;
  p.latent = static_cast<uint16_t*>(latent.data_ptr());
  const auto kv_layout = static_cast<KVLayout>(layout);
  run_on_device(
      op, k_cache, [&] { c2_prefill_cpu(kv_layout, p, q); },
      [&](auto stream) { c2_prefill_cuda(kv_layout, p, q, stream); });
  return latent;
}

}  // namespace dsv4
