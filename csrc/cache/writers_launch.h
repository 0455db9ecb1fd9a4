// Plain-C++ parameter block and entry points of the norm + RoPE cache writers
// (fused_k_norm_rope_flashmla, compress_norm_rope_store). No torch types: writers_ops.cpp validates
// the tensors and fills the block; writers_kernels.cu and writers_cpu.cpp consume it.
#pragma once

#include <cstdint>

#include "cache_launch.h"
#include "dsv4/writer_rows.cuh"

namespace dsv4 {

struct NormRopeParams {
  RowInput kv;                 // [n, 512] (main) or [n, 128] (indexer), bf16 or fp32
  const void* weight;          // [D] norm weight
  bool weight_fp32;            // else bf16
  float eps;
  const float* freqs;          // RoPE table [max_pos, 64]
  int64_t max_pos;
  IndexInput positions;        // [n], K writer only
  IndexInput out_loc;
  const uint8_t* plan;         // [n, 16], compress writer only
  CompressRowRule compress_rows;  // compress writers only
  bool is_decode;
  PagedCache cache;
  int64_t n;
};

// CPU implementations (writers_cpu.cpp).
void k_norm_rope_cpu(KVLayout layout, const NormRopeParams& p);
void compress_main_cpu(KVLayout layout, const NormRopeParams& p);
void compress_indexer_cpu(IndexerFormat fmt, const NormRopeParams& p);

#ifdef USE_CUDA
// CUDA launchers (writers_kernels.cu).
void k_norm_rope_cuda(KVLayout layout, const NormRopeParams& p, cudaStream_t stream);
void compress_main_cuda(KVLayout layout, const NormRopeParams& p, cudaStream_t stream);
void compress_indexer_cuda(IndexerFormat fmt, const NormRopeParams& p, cudaStream_t stream);
#endif

}  // namespace dsv4
