// Torch-facing glue of the KV I/O ops: argument validation (the host half of the fakes in
// _fake.py), output allocation and dispatch to the CPU implementation or the CUDA launcher.
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <string>
#include <vector>

#include "cache_launch.h"
#include "tensor_args.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

void fused_store_cache(Tensor input, Tensor cache, Tensor indices, int64_t page_size,
                       std::string type, int64_t layout, bool use_fp4,
                       std::optional<Tensor> freqs_cis) {
  constexpr const char* op = "fused_store_cache";
  DSV4_CHECK(type == "flashmla" || type == "indexer", op,
             "type must be \"flashmla\" or \"indexer\", got \"", type, "\"");
  const bool indexer = type == "indexer";
  const FormatTraits layout_traits = checked_layout_traits(op, layout);
  const auto kv_layout = static_cast<KVLayout>(layout);
  const auto fmt = use_fp4 ? IndexerFormat::FP4 : IndexerFormat::FP8;
  if (indexer) {
    DSV4_CHECK(layout == 0, op, "layout must be 0 (V4) when type=\"indexer\", got ", layout);
    DSV4_CHECK(!freqs_cis.has_value(), op, "freqs_cis must be None when type=\"indexer\"");
  } else {
    DSV4_CHECK(!use_fp4, op, "use_fp4=True requires type=\"indexer\"");
  }
  const FormatTraits traits = indexer ? indexer_format_traits(fmt) : layout_traits;
  StoreParams p{};
  p.cache = check_cache(op, "cache", cache, traits, page_size,
                        indexer ? kIndexerCacheAlign : kMainCacheAlign);
  check_activation(op, "input", input, indexer ? kIndexerDim : kMainDim, cache);
  check_index_vector(op, "indices", indices, cache);
  const int64_t n = input.size(0);
  DSV4_CHECK(indices.size(0) == n, op, "indices must have ", n, " entries (one per input row), got ",
             indices.size(0));
  if (freqs_cis.has_value()) {
    const Tensor& f = *freqs_cis;
    DSV4_CHECK(kv_layout != KVLayout::V4, op,
               "freqs_cis requires layout V41 or V41_FP4 (V4 keeps its RoPE dims in bf16)");
    check_same_device(op, "freqs_cis", f, cache);
    check_dtype(op, "freqs_cis", f, ScalarType::Float);
    check_dim(op, "freqs_cis", f, 2);
    DSV4_CHECK(f.size(0) == n && f.size(1) == kRopeDim, op, "freqs_cis must be [", n, ", ", kRopeDim,
               "], got [", f.size(0), ", ", f.size(1), "]");
    DSV4_CHECK(f.is_contiguous(), op, "freqs_cis must be contiguous");
    p.freqs = static_cast<const float*>(f.data_ptr());
  }
  check_written_disjoint(op, {arg("cache", cache)},
                         {arg("input", input), arg("indices", indices), arg("freqs_cis", freqs_cis)});
  if (n == 0) return;
  p.input = row_input(input);
  p.slots = index_input(indices);
  p.n = n;
  run_on_device(
      op, cache, [&] { indexer ? store_indexer_cpu(fmt, p) : store_main_cpu(kv_layout, p); },
      [&](auto stream) { indexer ? store_indexer_cuda(fmt, p, stream) : store_main_cuda(kv_layout, p, stream); });
}

namespace {

void check_dequant_out(const char* op, const Tensor& out, int64_t n, const Tensor& cache) {
  check_same_device(op, "out", out, cache);
  check_dtype(op, "out", out, ScalarType::BFloat16);
  check_dim(op, "out", out, 3);
  DSV4_CHECK(out.size(0) == n && out.size(1) == 1 && out.size(2) == kMainDim, op, "out must be [", n,
             ", 1, ", kMainDim, "], got [", out.size(0), ", ", out.size(1), ", ", out.size(2), "]");
  DSV4_CHECK(out.stride(2) == 1, op, "out must have stride(2) == 1, got ", out.stride(2));
  DSV4_CHECK(n <= 1 || out.stride(0) >= kMainDim, op, "out stride(0) must be >= ", kMainDim, ", got ",
             out.stride(0));
}

struct DequantArgs {
  PagedCache cache;
  KVLayout layout;
};

// Validation shared by both overloads.
DequantArgs check_dequant_args(const char* op, const Tensor& cache, const Tensor& slots,
                               int64_t page_size, int64_t layout) {
  const FormatTraits traits = checked_layout_traits(op, layout);
  const PagedCache view = check_cache(op, "cache", cache, traits, page_size, kMainCacheAlign);
  check_index_vector(op, "slots", slots, cache);
  return DequantArgs{view, static_cast<KVLayout>(layout)};
}

void run_dequantize(const char* op, const DequantArgs& args, const Tensor& cache,
                    const Tensor& slots, const Tensor& out) {
  const int64_t n = slots.size(0);
  if (n == 0) return;
  DequantParams p{};
  p.cache = args.cache;
  p.slots = index_input(slots);
  p.out = static_cast<uint16_t*>(out.data_ptr());
  p.out_row_stride = n > 1 ? out.stride(0) : kMainDim;
  p.n = n;
  run_on_device(
      op, cache, [&] { dequantize_cpu(args.layout, p); },
      [&](auto stream) { dequantize_cuda(args.layout, p, stream); });
}

}  // namespace

Tensor dequantize_k_cache_paged(Tensor cache, Tensor slots, int64_t page_size, int64_t layout) {
  constexpr const char* op = "dequantize_k_cache_paged";
  const DequantArgs args = check_dequant_args(op, cache, slots, page_size, layout);
  const int64_t n = slots.size(0);
  Tensor out = torch::stable::new_empty(cache, {n, 1, kMainDim}, ScalarType::BFloat16);
  run_dequantize(op, args, cache, slots, out);
  return out;
}

void dequantize_k_cache_paged_out(Tensor cache, Tensor slots, int64_t page_size, int64_t layout,
                                  Tensor out) {
  constexpr const char* op = "dequantize_k_cache_paged";
  const DequantArgs args = check_dequant_args(op, cache, slots, page_size, layout);
  check_dequant_out(op, out, slots.size(0), cache);
  check_written_disjoint(op, {arg("out", out)}, {arg("cache", cache), arg("slots", slots)});
  run_dequantize(op, args, cache, slots, out);
}

namespace {

// Describes the rows of x's last dim: unit dims dropped, dims laid out contiguously with each other merged, so
// the common cases need no per-row division. False when more than LeadingDims::kMaxDims dims remain.
bool describe_rows(const Tensor& x, LeadingDims& rows) {
  int nd = 0;
  for (int64_t dim = 0; dim < x.dim() - 1; ++dim) {
    const int64_t size = x.size(dim);
    if (size == 1) continue;  // a unit dim contributes no offset
    if (nd > 0 && rows.strides[nd - 1] == x.stride(dim) * size) {
      rows.sizes[nd - 1] *= size;  // merge with the previous (outer) dim
      rows.strides[nd - 1] = x.stride(dim);
      continue;
    }
    if (nd == LeadingDims::kMaxDims) return false;
    rows.sizes[nd] = size;
    rows.strides[nd] = x.stride(dim);
    ++nd;
  }
  rows.ndim = nd;
  return true;
}

// Validates x for a fake-quant op; fills the sizes and the element type (the input comes from fake_quant_source,
// the output from run_fake_quant).
FakeQuantParams fake_quant_params(const char* op, const Tensor& x, int block_size) {
  const ScalarType d = x.scalar_type();
  DSV4_CHECK(d == ScalarType::BFloat16 || d == ScalarType::Half || d == ScalarType::Float, op,
             "x must be bfloat16, float16 or float32, got ", dtype_name(d));
  const int64_t rank = x.dim();
  DSV4_CHECK(rank >= 1, op, "x must have rank >= 1, got a 0-d tensor");
  const int64_t width = x.size(rank - 1);
  DSV4_CHECK(width <= 1 || x.stride(rank - 1) == 1, op, "x must have stride(-1) == 1, got ",
             x.stride(rank - 1));
  DSV4_CHECK(width % block_size == 0, op, "x.size(-1) = ", width, " must be a multiple of ", block_size);
  FakeQuantParams p{};
  p.type = elem_type_of(x);
  p.width = width;
  p.block_size = block_size;
  p.rows = 1;
  for (int64_t dim = 0; dim < rank - 1; ++dim) p.rows *= x.size(dim);
  return p;
}

// The tensor the kernels read: x itself, or, when x's leading dims do not fit the fixed-size LeadingDims of the
// kernel parameters (the spec bounds neither rank nor leading strides), a contiguous copy of x, whose rows have
// one stride. Fills p.in and p.in_rows; the caller keeps the result alive until the op has been launched.
Tensor fake_quant_source(const Tensor& x, FakeQuantParams& p) {
  Tensor source = x;
  if (!describe_rows(x, p.in_rows)) {
    source = torch::stable::contiguous(x);
    describe_rows(source, p.in_rows);
  }
  p.in = source.data_ptr();
  return source;
}

// Allocates the result and runs one fake-quant implementation on x's device.
template <class OnCpu, class OnCuda>
Tensor run_fake_quant(const char* op, const Tensor& x, FakeQuantParams p, OnCpu&& on_cpu, OnCuda&& on_cuda) {
  std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
  Tensor out = torch::stable::new_empty(x, sizes);
  if (p.rows == 0 || p.width == 0) return out;
  const Tensor source = fake_quant_source(x, p);
  p.out = out.data_ptr();
  run_on_device(op, x, [&] { on_cpu(p); }, [&](auto stream) { on_cuda(p, stream); });
  return out;
}

}  // namespace

Tensor fake_quant_compressed_kv(Tensor x) {
  constexpr const char* op = "fake_quant_compressed_kv";
  const FakeQuantParams p = fake_quant_params(op, x, kv_layout_traits(KVLayout::V41_FP4).tile);
  return run_fake_quant(
      op, x, p, [](const FakeQuantParams& q) { fake_quant_compressed_kv_cpu(q); },
      [](const FakeQuantParams& q, auto stream) { fake_quant_compressed_kv_cuda(q, stream); });
}

Tensor fake_quant_fp4(Tensor x, int64_t block_size) {
  constexpr const char* op = "fake_quant_fp4";
  DSV4_CHECK(block_size == 16 || block_size == 32 || block_size == 64 || block_size == 128, op,
             "block_size must be 16, 32, 64 or 128, got ", block_size);
  const FakeQuantParams p = fake_quant_params(op, x, int(block_size));
  return run_fake_quant(
      op, x, p, [](const FakeQuantParams& q) { fake_quant_fp4_cpu(q); },
      [](const FakeQuantParams& q, auto stream) { fake_quant_fp4_cuda(q, stream); });
}

}  // namespace dsv4
