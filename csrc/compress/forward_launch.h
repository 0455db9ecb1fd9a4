// Plain-C++ parameter block and entry points of compress_forward (c4/c128 pooling and the state
// ring writes). No torch types: forward_ops.cpp validates tensors and fills the block;
// forward_cpu.cpp and forward_kernels.cu consume it.
#pragma once

#include <cstdint>

#include "dsv4/pool.cuh"

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dsv4 {

struct ForwardParams {
  void* state;             // contiguous [state_rows, W]; the last `ratio` rows are the pad page
  bool state_bf16;         // else fp32
  int64_t state_rows;
  const void* input;       // [input_rows, W], row stride input_stride elements
  bool input_bf16;         // else fp32; also the output dtype
  int64_t input_rows;
  int64_t input_stride;
  const float* ape;        // [window, head_dim]
  const uint8_t* plan;     // DecodePlan or CompressPlan rows
  int64_t plan_rows;
  const uint8_t* plan_w;   // WritePlan rows (prefill only)
  int64_t plan_w_rows;
  void* out;               // contiguous [plan_rows, head_dim]
  int ratio;
  int head_dim;
  bool is_decode;
};

void compress_forward_cpu(const ForwardParams& p);

#ifdef USE_CUDA
void compress_forward_cuda(const ForwardParams& p, cudaStream_t stream);
#endif

}  // namespace dsv4
