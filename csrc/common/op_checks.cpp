// Implementation of the shared host-side argument checks (see op_checks.h).
#include "op_checks.h"

#include <torch/csrc/stable/device.h>

#include <cmath>

namespace dsv4 {

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Byte: return "uint8";
    case ScalarType::Char: return "int8";
    case ScalarType::Short: return "int16";
    case ScalarType::Int: return "int32";
    case ScalarType::Long: return "int64";
    case ScalarType::Half: return "float16";
    case ScalarType::Float: return "float32";
    case ScalarType::Double: return "float64";
    case ScalarType::BFloat16: return "bfloat16";
    case ScalarType::Bool: return "bool";
    case ScalarType::ComplexFloat: return "complex64";
    default: return "an unsupported dtype";
  }
}

std::string device_name(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  std::ostringstream s;
  s << (t.is_cuda() ? "cuda:" : "device:") << static_cast<int>(t.get_device_index());
  return s.str();
}

void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  const bool same = t.is_cuda() == ref.is_cuda() && t.is_cpu() == ref.is_cpu() &&
                    (!t.is_cuda() || t.get_device_index() == ref.get_device_index());
  DSV4_CHECK(same, op, name, " must be on ", device_name(ref), ", got ", device_name(t));
}

void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim) {
  DSV4_CHECK(t.dim() == dim, op, name, " must be ", dim, "-D, got ", t.dim(), "-D");
}

void check_dtype(const char* op, const char* name, const Tensor& t, ScalarType expected) {
  DSV4_CHECK(t.scalar_type() == expected, op, name, " must be ", dtype_name(expected), ", got ",
             dtype_name(t.scalar_type()));
}

void check_index_vector(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  check_same_device(op, name, t, ref);
  const ScalarType d = t.scalar_type();
  DSV4_CHECK(d == ScalarType::Int || d == ScalarType::Long, op, name,
             " must be int32 or int64, got ", dtype_name(d));
  check_dim(op, name, t, 1);
  DSV4_CHECK(t.numel() <= 1 || t.stride(0) == 1, op, name, " must be contiguous");
}

void check_activation(const char* op, const char* name, const Tensor& t, int64_t width,
                      const Tensor& ref) {
  check_same_device(op, name, t, ref);
  const ScalarType d = t.scalar_type();
  DSV4_CHECK(d == ScalarType::BFloat16 || d == ScalarType::Float, op, name,
             " must be bfloat16 or float32, got ", dtype_name(d));
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(1) == width, op, name, " must have ", width, " columns, got ", t.size(1));
  DSV4_CHECK(t.stride(1) == 1, op, name, " must have stride(1) == 1, got ", t.stride(1));
}

void check_page_size(const char* op, int64_t page_size) {
  DSV4_CHECK(page_size >= 1 && page_size <= 1024 && (page_size & (page_size - 1)) == 0, op,
             "page_size must be a power of two in [1, 1024], got ", page_size);
}

int page_bits_of(int64_t page_size) {
  int bits = 0;
  while ((int64_t(1) << bits) < page_size) ++bits;
  return bits;
}

PagedCache check_cache(const char* op, const char* name, const Tensor& cache,
                       const FormatTraits& traits, int64_t page_size, int align) {
  check_page_size(op, page_size);
  check_dtype(op, name, cache, ScalarType::Byte);
  check_dim(op, name, cache, 2);
  const int64_t num_pages = cache.size(0);
  const int64_t width = cache.size(1);
  const int64_t need = page_bytes(traits, page_size);
  DSV4_CHECK(cache.stride(1) == 1 || width <= 1, op, name, " must have stride(1) == 1, got ",
             cache.stride(1));
  DSV4_CHECK(width >= need, op, name, " rows hold ", width, " bytes, but a page of ", page_size,
             " tokens needs ", need);
  if (num_pages >= 2) {
    DSV4_CHECK(cache.stride(0) >= width, op, name, " stride(0) ", cache.stride(0),
               " is smaller than its width ", width);
    DSV4_CHECK(cache.stride(0) % align == 0, op, name, " stride(0) ", cache.stride(0),
               " must be a multiple of ", align);
  }
  const auto addr = reinterpret_cast<uintptr_t>(cache.data_ptr());
  DSV4_CHECK(num_pages == 0 || addr % align == 0, op, name, " data pointer must be ", align,
             "-byte aligned");
  PagedCache view{};
  view.base = static_cast<uint8_t*>(cache.data_ptr());
  view.page_stride = num_pages >= 2 ? cache.stride(0) : 0;
  view.num_pages = num_pages;
  view.page_bits = page_bits_of(page_size);
  view.data_bytes = traits.data_bytes;
  view.scale_bytes = traits.scale_bytes;
  view.compact = view.capacity() <= INT32_MAX && view.page_stride <= int64_t(UINT32_MAX);
  return view;
}

FormatTraits checked_layout_traits(const char* op, int64_t layout) {
  DSV4_CHECK(is_known_kv_layout(static_cast<int>(layout)) && layout == int64_t(int(layout)), op,
             "layout must be a KVLayout id (0 = V4, 1 = V41, 2 = V41_FP4), got ", layout);
  return kv_layout_traits(static_cast<KVLayout>(layout));
}

void check_norm_weight(const char* op, const char* name, const Tensor& t, int64_t width,
                       const Tensor& ref) {
  check_same_device(op, name, t, ref);
  const ScalarType d = t.scalar_type();
  DSV4_CHECK(d == ScalarType::BFloat16 || d == ScalarType::Float, op, name,
             " must be bfloat16 or float32, got ", dtype_name(d));
  check_dim(op, name, t, 1);
  DSV4_CHECK(t.size(0) == width, op, name, " must have ", width, " elements, got ", t.size(0));
  DSV4_CHECK(t.stride(0) == 1, op, name, " must be contiguous");
}

float checked_eps(const char* op, const char* name, double eps) {
  const float rounded = static_cast<float>(eps);
  DSV4_CHECK(std::isfinite(eps) && eps >= 0.0 && std::isfinite(rounded), op, name,
             " must be finite and >= 0, got ", eps);
  return rounded;
}

void check_rope_table(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  check_same_device(op, name, t, ref);
  check_dtype(op, name, t, ScalarType::Float);
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(0) >= 1 && t.size(1) == kRopeDim, op, name, " must be [max_pos >= 1, ", kRopeDim,
             "], got [", t.size(0), ", ", t.size(1), "]");
  DSV4_CHECK(t.is_contiguous(), op, name, " must be contiguous");
}

void check_plan(const char* op, const char* name, const Tensor& t, int64_t rows, const Tensor& ref) {
  check_same_device(op, name, t, ref);
  check_dtype(op, name, t, ScalarType::Byte);
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(0) == rows && t.size(1) == 16, op, name, " must be [", rows, ", 16] (one entry per kv row), got [",
             t.size(0), ", ", t.size(1), "]");
  DSV4_CHECK(t.is_contiguous(), op, name, " must be contiguous");
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  DSV4_CHECK(rows == 0 || addr % 16 == 0, op, name, " data pointer must be 16-byte aligned");
}

}  // namespace dsv4
