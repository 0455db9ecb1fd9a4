// Current-stream lookup and device guard for launchers called from the torch-facing glue. The
// stream comes from the stable C shim, so kernels follow torch's current (and capturing) stream.
#pragma once

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/tensor.h>

#ifdef USE_CUDA
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <cuda_runtime_api.h>
#endif

#include "op_checks.h"

namespace dsv4 {

#ifdef USE_CUDA
// Sets the tensor's device as current for the guard's lifetime and exposes that device's
// current CUDA stream.
class CudaContext {
 public:
  explicit CudaContext(const Tensor& anchor)
      : guard_(anchor.get_device_index()), device_(anchor.get_device_index()) {
    void* raw = nullptr;
    if (aoti_torch_get_current_cuda_stream(device_, &raw) != AOTI_TORCH_SUCCESS) {
      throw std::runtime_error("dsv4: cannot query the current CUDA stream");
    }
    stream_ = static_cast<cudaStream_t>(raw);
  }
  cudaStream_t stream() const { return stream_; }

 private:
  torch::stable::accelerator::DeviceGuard guard_;
  int32_t device_;
  cudaStream_t stream_ = nullptr;
};
#endif

// Raised when a CUDA tensor reaches an op of a CPU-only build.
[[noreturn]] inline void fail_no_cuda(const char* op) {
  fail(op, "this build of sgl_dsv4_kernels has no CUDA support (rebuild with nvcc available)");
}

// Runs an op on the device of `anchor`: on_cpu() for CPU tensors, or on_cuda(stream) under a device
// guard on that device's current stream. on_cuda is a generic lambda (`[&](auto stream) {...}`), so a
// CPU-only build, which never calls it, never needs the CUDA launchers it names.
template <class OnCpu, class OnCuda>
void run_on_device(const char* op, const Tensor& anchor, OnCpu&& on_cpu, OnCuda&& on_cuda) {
  if (!anchor.is_cuda()) {
    on_cpu();
    return;
  }
#ifdef USE_CUDA
  CudaContext ctx(anchor);
  on_cuda(ctx.stream());
#else
  (void)on_cuda;
  fail_no_cuda(op);
#endif
}

}  // namespace dsv4
