// Torch-facing glue of compress_forward: validation of the state pool, projection rows, ape and
// plans (compressors.md §4.3; the host half of the fake in _fake_compress.py), output allocation
// and dispatch to the CPU implementation or the CUDA launcher.
#include <torch/csrc/stable/ops.h>

#include <optional>

#include "forward_launch.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

namespace {

bool is_float_or_bf16(const Tensor& t) {
  return t.scalar_type() == ScalarType::Float || t.scalar_type() == ScalarType::BFloat16;
}

void check_plan_rows(const char* op, const char* name, const Tensor& t, int64_t width, const Tensor& anchor) {
  check_same_device(op, name, t, anchor);
  check_dtype(op, name, t, ScalarType::Byte);
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(1) == width, op, name, " must be [rows, ", width, "], got [", t.size(0), ", ", t.size(1), "]");
  DSV4_CHECK(t.is_contiguous(), op, name, " must be contiguous");
  DSV4_CHECK(t.size(0) == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, name,
             " data pointer must be 16-byte aligned");
}

}  // namespace

Tensor compress_forward(Tensor state, Tensor kv_score_input, Tensor ape, Tensor plan, std::optional<Tensor> plan_w,
                        int64_t head_dim, int64_t compress_ratio, bool is_decode) {
  constexpr const char* op = "compress_forward";
  DSV4_CHECK(compress_ratio == 4 || compress_ratio == 128, op, "compress_ratio must be 4 or 128, got ",
             compress_ratio);
  const int ratio = int(compress_ratio);
  DSV4_CHECK(head_dim == kMainDim || (ratio == 4 && head_dim == kIndexerDim), op, "head_dim must be ", kMainDim,
             ratio == 4 ? " or 128 (indexer)" : "", " for compress_ratio=", ratio, ", got ", head_dim);
  const int64_t width = state_row_width(ratio, head_dim);
  const int window = compress_window(ratio);

  // state: [rows, W] or [pages, ratio, W], contiguous, rows a multiple of ratio including the pad page.
  DSV4_CHECK(is_float_or_bf16(state), op, "state must be float32 or bfloat16, got ", dtype_name(state.scalar_type()));
  DSV4_CHECK(state.dim() == 2 || (state.dim() == 3 && state.size(1) == ratio), op, "state must be [rows, ", width,
             "] or [pages, ", ratio, ", ", width, "], got a ", state.dim(), "-D tensor");
  DSV4_CHECK(state.size(state.dim() - 1) == width, op, "state rows must have ", width, " columns (",
             width / head_dim, " x head_dim), got ", state.size(state.dim() - 1));
  DSV4_CHECK(state.is_contiguous(), op, "state must be contiguous");
  const int64_t rows = state.dim() == 2 ? state.size(0) : state.size(0) * ratio;
  DSV4_CHECK(rows >= ratio && rows % ratio == 0, op, "state must have a positive multiple of ", ratio,
             " rows (the last ", ratio, " are the pad page), got ", rows);

  check_same_device(op, "kv_score_input", kv_score_input, state);
  DSV4_CHECK(is_float_or_bf16(kv_score_input), op, "kv_score_input must be float32 or bfloat16, got ",
             dtype_name(kv_score_input.scalar_type()));
  check_dim(op, "kv_score_input", kv_score_input, 2);
  DSV4_CHECK(kv_score_input.size(1) == width, op, "kv_score_input must have ", width, " columns (",
             width / head_dim, " x head_dim), got ", kv_score_input.size(1));
  // Any row stride, repeated (0) and overlapping rows included, as for every activation: the op only reads them.
  DSV4_CHECK(kv_score_input.stride(1) == 1, op, "kv_score_input must have stride(1) == 1, got ",
             kv_score_input.stride(1));

  check_same_device(op, "ape", ape, state);
  check_dtype(op, "ape", ape, ScalarType::Float);
  DSV4_CHECK(ape.dim() == 2 && ape.size(0) == window && ape.size(1) == head_dim, op, "ape must be [", window, ", ",
             head_dim, "]");
  DSV4_CHECK(ape.is_contiguous(), op, "ape must be contiguous");

  check_plan_rows(op, "plan", plan, kPlanRowBytes, state);
  const int64_t plan_rows = plan.size(0);
  if (is_decode) {
    DSV4_CHECK(!plan_w.has_value(), op, "plan_w must be None when is_decode=True");
    DSV4_CHECK(kv_score_input.size(0) == plan_rows, op, "kv_score_input must have ", plan_rows,
               " rows (one per decode plan row), got ", kv_score_input.size(0));
  } else {
    DSV4_CHECK(plan_w.has_value(), op, "plan_w is required when is_decode=False");
    check_plan_rows(op, "plan_w", *plan_w, kWritePlanRowBytes, state);
  }
  check_written_disjoint(op, {arg("state", state)},
                         {arg("kv_score_input", kv_score_input), arg("ape", ape), arg("plan", plan),
                          arg("plan_w", plan_w)});

  Tensor out = torch::stable::new_empty(kv_score_input, {plan_rows, head_dim});
  ForwardParams p{};
  p.state = state.data_ptr();
  p.state_bf16 = state.scalar_type() == ScalarType::BFloat16;
  p.state_rows = rows;
  p.input = kv_score_input.data_ptr();
  p.input_bf16 = kv_score_input.scalar_type() == ScalarType::BFloat16;
  p.input_rows = kv_score_input.size(0);
  p.input_stride = kv_score_input.size(0) > 1 ? kv_score_input.stride(0) : width;
  p.ape = static_cast<const float*>(ape.data_ptr());
  p.plan = static_cast<const uint8_t*>(plan.data_ptr());
  p.plan_rows = plan_rows;
  if (plan_w.has_value()) {
    p.plan_w = static_cast<const uint8_t*>(plan_w->data_ptr());
    p.plan_w_rows = plan_w->size(0);
  }
  p.out = out.data_ptr();
  p.ratio = ratio;
  p.head_dim = int(head_dim);
  p.is_decode = is_decode;
  if (plan_rows == 0 && p.plan_w_rows == 0) return out;
  run_on_device(
      op, state, [&] { compress_forward_cpu(p); }, [&](auto stream) { compress_forward_cuda(p, stream); });
  return out;
}

}  // namespace dsv4
