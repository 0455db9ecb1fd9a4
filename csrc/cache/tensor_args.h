// Torch-facing helpers (.cpp only) that turn validated tensors into the plain views of
// cache_launch.h: element type, row input and index input.
#pragma once

#include <torch/csrc/stable/tensor.h>

#include "cache_launch.h"
#include "../common/op_checks.h"

namespace dsv4 {

inline ElemType elem_type_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case ScalarType::BFloat16: return ElemType::BF16;
    case ScalarType::Half: return ElemType::FP16;
    default: return ElemType::FP32;
  }
}

inline IndexInput index_input(const Tensor& t) { return IndexInput{t.data_ptr(), is_int64(t)}; }

// A 2-D activation; a single row has no meaningful stride(0), so its width is used.
inline RowInput row_input(const Tensor& t) {
  return RowInput{t.data_ptr(), t.size(0) > 1 ? t.stride(0) : t.size(1), elem_type_of(t)};
}

}  // namespace dsv4
