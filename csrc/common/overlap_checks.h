// Host-side check that an op's written tensors share no memory with its other tensor arguments (.cpp only).
// A kernel that reads a tensor while writing into the same bytes produces results that depend on thread order,
// so such calls are rejected with "dsv4.<op>: <written> shares memory with <other>".
#pragma once

#include <torch/csrc/stable/tensor.h>

#include <initializer_list>
#include <optional>

namespace dsv4 {

// One tensor argument by name; `tensor` null for an absent optional argument.
struct TensorArg {
  const char* name;
  const torch::stable::Tensor* tensor;
};

inline TensorArg arg(const char* name, const torch::stable::Tensor& t) { return {name, &t}; }
inline TensorArg arg(const char* name, const std::optional<torch::stable::Tensor>& t) {
  return {name, t.has_value() ? &*t : nullptr};
}

// Every tensor in `written` is disjoint from every other tensor of `written` and from every tensor of `read`;
// tensors of `read` may overlap one another. Call it after the per-argument checks (same device, shapes).
// Exact for every layout whose bytes are equally spaced runs (all dense and row-strided tensors); a layout that
// is not (spaced dimensions that do not collapse into one, or more than 16 dimensions that move through memory)
// is not checked rather than rejected. At most 16 arguments in all.
void check_written_disjoint(const char* op, std::initializer_list<TensorArg> written,
                            std::initializer_list<TensorArg> read);

}  // namespace dsv4
