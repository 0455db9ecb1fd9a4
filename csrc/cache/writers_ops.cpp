// Torch-facing glue of the norm + RoPE cache writers (fused_k_norm_rope_flashmla,
// compress_norm_rope_store): argument validation (the host half of the fakes in _fake.py) and
// dispatch to the CPU implementation or the CUDA launcher.
#include <torch/csrc/stable/tensor.h>

#include "tensor_args.h"
#include "writers_launch.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

void fused_k_norm_rope_flashmla(Tensor kv, Tensor weight, double eps, Tensor freqs, Tensor positions,
                                Tensor out_loc, Tensor kvcache, int64_t page_size, int64_t layout) {
  constexpr const char* op = "fused_k_norm_rope_flashmla";
  const FormatTraits traits = checked_layout_traits(op, layout);
  NormRopeParams p{};
  p.cache = check_cache(op, "kvcache", kvcache, traits, page_size, kMainCacheAlign);
  check_activation(op, "kv", kv, kMainDim, kvcache);
  check_norm_weight(op, "weight", weight, kMainDim, kvcache);
  p.eps = checked_eps(op, "eps", eps);
  check_rope_table(op, "freqs", freqs, kvcache);
  check_index_vector(op, "positions", positions, kvcache);
  check_index_vector(op, "out_loc", out_loc, kvcache);
  const int64_t n = kv.size(0);
  DSV4_CHECK(positions.size(0) == n, op, "positions must have ", n, " entries (one per kv row), got ",
             positions.size(0));
  DSV4_CHECK(out_loc.size(0) == n, op, "out_loc must have ", n, " entries (one per kv row), got ",
             out_loc.size(0));
  check_written_disjoint(op, {arg("kvcache", kvcache)},
                         {arg("kv", kv), arg("weight", weight), arg("freqs", freqs), arg("positions", positions),
                          arg("out_loc", out_loc)});
  if (n == 0) return;
  p.kv = row_input(kv);
  p.weight = weight.data_ptr();
  p.weight_fp32 = is_fp32(weight);
  p.freqs = static_cast<const float*>(freqs.data_ptr());
  p.max_pos = freqs.size(0);
  p.positions = index_input(positions);
  p.out_loc = index_input(out_loc);
  p.n = n;
  const auto kv_layout = static_cast<KVLayout>(layout);
  run_on_device(
      op, kvcache, [&] { k_norm_rope_cpu(kv_layout, p); },
      [&](auto stream) { k_norm_rope_cuda(kv_layout, p, stream); });
}

void compress_norm_rope_store(Tensor kv, Tensor plan, Tensor norm_weight, double norm_eps, Tensor freqs,
                              Tensor out_loc, Tensor kvcache, int64_t page_size, int64_t compress_ratio,
                              bool is_decode, int64_t layout, bool use_fp4) {
  constexpr const char* op = "compress_norm_rope_store";
  const FormatTraits layout_traits = checked_layout_traits(op, layout);
  check_dim(op, "kv", kv, 2);
  const int64_t dim = kv.size(1);
  DSV4_CHECK(dim == kMainDim || dim == kIndexerDim, op, "kv must have ", kMainDim, " (main) or ",
             kIndexerDim, " (indexer) columns, got ", dim);
  const bool indexer = dim == kIndexerDim;
  const auto fmt = use_fp4 ? IndexerFormat::FP4 : IndexerFormat::FP8;
  if (indexer) {
    DSV4_CHECK(layout == 0, op, "layout must be 0 (V4) for the indexer variant (kv with ", kIndexerDim,
               " columns), got ", layout);
  } else {
    DSV4_CHECK(!use_fp4, op, "use_fp4=True requires the indexer variant (kv with ", kIndexerDim,
               " columns)");
  }
  NormRopeParams p{};
  p.cache = check_cache(op, "kvcache", kvcache, indexer ? indexer_format_traits(fmt) : layout_traits,
                        page_size, indexer ? kIndexerCacheAlign : kMainCacheAlign);
  check_activation(op, "kv", kv, dim, kvcache);
  const int64_t n = kv.size(0);
  check_plan(op, "plan", plan, n, kvcache);
  check_norm_weight(op, "norm_weight", norm_weight, dim, kvcache);
  p.eps = checked_eps(op, "norm_eps", norm_eps);
  check_rope_table(op, "freqs", freqs, kvcache);
  check_index_vector(op, "out_loc", out_loc, kvcache);
  DSV4_CHECK(compress_ratio >= 1, op, "compress_ratio must be >= 1, got ", compress_ratio);
  if (is_decode) {
    DSV4_CHECK(out_loc.size(0) == n, op, "out_loc must have ", n,
               " entries (one per plan row) when is_decode=True, got ", out_loc.size(0));
  }
  check_written_disjoint(op, {arg("kvcache", kvcache)},
                         {arg("kv", kv), arg("plan", plan), arg("norm_weight", norm_weight), arg("freqs", freqs),
                          arg("out_loc", out_loc)});
  if (n == 0) return;
  p.kv = row_input(kv);
  p.weight = norm_weight.data_ptr();
  p.weight_fp32 = is_fp32(norm_weight);
  p.freqs = static_cast<const float*>(freqs.data_ptr());
  p.max_pos = freqs.size(0);
  p.out_loc = index_input(out_loc);
  p.plan = static_cast<const uint8_t*>(plan.data_ptr());
  p.compress_rows = make_compress_row_rule(compress_ratio, p.max_pos, out_loc.size(0));
  p.is_decode = is_decode;
  p.n = n;
  const auto kv_layout = static_cast<KVLayout>(layout);
  run_on_device(
      op, kvcache, [&] { indexer ? compress_indexer_cpu(fmt, p) : compress_main_cpu(kv_layout, p); },
      [&](auto stream) {
        indexer ? compress_indexer_cuda(fmt, p, stream) : compress_main_cuda(kv_layout, p, stream);
      });
}

}  // namespace dsv4
