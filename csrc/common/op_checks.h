// Host-side argument validation shared by every op's torch-facing glue (.cpp only). Each check
// raises std::runtime_error ("dsv4.<op>: <arg> ...", a RuntimeError in Python) naming op and argument.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

#include "dsv4/kv_layout.cuh"

namespace dsv4 {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

template <class... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::ostringstream msg;
  msg << "dsv4." << op << ": ";
  (msg << ... << parts);
  throw std::runtime_error(msg.str());
}

#define DSV4_CHECK(cond, op, ...)            \
  do {                                       \
    if (!(cond)) ::dsv4::fail(op, __VA_ARGS__); \
  } while (0)

const char* dtype_name(ScalarType t);
std::string device_name(const Tensor& t);

// `t` lives on the same device as `ref` (the op's anchor tensor, usually the cache).
void check_same_device(const char* op, const char* name, const Tensor& t, const Tensor& ref);
void check_dim(const char* op, const char* name, const Tensor& t, int64_t dim);
void check_dtype(const char* op, const char* name, const Tensor& t, ScalarType expected);
// 1-D, contiguous, int32 or int64.
void check_index_vector(const char* op, const char* name, const Tensor& t, const Tensor& ref);
// 2-D [rows, width] with stride(1) == 1, bf16 or fp32 (fp16 rejected); any row stride, overlapping or
// broadcast rows included (the ops only read their activations).
void check_activation(const char* op, const char* name, const Tensor& t, int64_t width,
                      const Tensor& ref);
void check_page_size(const char* op, int64_t page_size);
int page_bits_of(int64_t page_size);

// The cache tensor rule of kv-layouts-and-quant.md §2 for one format; returns its address view.
PagedCache check_cache(const char* op, const char* name, const Tensor& cache,
                       const FormatTraits& traits, int64_t page_size, int align);

FormatTraits checked_layout_traits(const char* op, int64_t layout);

// Norm weight: 1-D [width], contiguous, bf16 or fp32 (independently of the activation dtype).
void check_norm_weight(const char* op, const char* name, const Tensor& t, int64_t width,
                       const Tensor& ref);
// eps finite and >= 0 (also after rounding to fp32); returns it rounded to fp32.
float checked_eps(const char* op, const char* name, double eps);
// RoPE table: fp32 [max_pos, 64], contiguous, max_pos >= 1.
void check_rope_table(const char* op, const char* name, const Tensor& t, const Tensor& ref);
// Compress plan: uint8 [rows, 16], contiguous, 16-byte aligned.
void check_plan(const char* op, const char* name, const Tensor& t, int64_t rows, const Tensor& ref);

inline bool is_int64(const Tensor& t) { return t.scalar_type() == ScalarType::Long; }
inline bool is_fp32(const Tensor& t) { return t.scalar_type() == ScalarType::Float; }

}  // namespace dsv4
