// Plain-C++ parameter blocks and launcher/CPU entry points of the KV I/O family
// (fused_store_cache, dequantize_k_cache_paged, fake quantization). No torch types: the glue in
// cache_ops.cpp validates tensors and fills these; the .cu and *_cpu.cpp files consume them.
#pragma once

#include <cstdint>

#include "dsv4/kv_layout.cuh"

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dsv4 {

enum class ElemType : int { BF16 = 0, FP16 = 1, FP32 = 2 };

// Rows of a 2-D activation [n, width] with stride(1) == 1.
struct RowInput {
  const void* data;
  int64_t row_stride;  // elements
  ElemType type;
};

// A 1-D int32 or int64 index vector.
struct IndexInput {
  const void* data;
  bool is_int64;
  DSV4_HD int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i]
                    : int64_t(static_cast<const int32_t*>(data)[i]);
  }
  DSV4_HD const void* address(int64_t i) const {
    return static_cast<const char*>(data) + i * (is_int64 ? 8 : 4);
  }
};

struct StoreParams {
  RowInput input;        // [n, 512] (main) or [n, 128] (indexer)
  IndexInput slots;      // [n]
  const float* freqs;    // per-row rotation table [n, 64] (V41 / V41_FP4 only), or null
  PagedCache cache;
  int64_t n;
};

struct DequantParams {
  PagedCache cache;
  IndexInput slots;   // [n]
  uint16_t* out;      // bf16 bits, row i at out + i * out_row_stride
  int64_t out_row_stride;
  int64_t n;
};

// Rows of the last dim of an arbitrary-rank tensor: row r's offset is the dot product of its
// multi-index over the leading dims with their strides. The host merges what it can into kMaxDims dims
// and reads a tensor that still needs more from a contiguous copy (cache_ops.cpp).
struct LeadingDims {
  static constexpr int kMaxDims = 8;
  int ndim;                    // number of leading dims (rank - 1)
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];   // elements
  DSV4_HD int64_t row_offset(int64_t row) const {
    if (ndim == 1) return row * strides[0];  // the common [rows, width] case, no division
    int64_t offset = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t i = row % sizes[d];
      row /= sizes[d];
      offset += i * strides[d];
    }
    return offset;
  }
};

struct FakeQuantParams {
  const void* in;
  LeadingDims in_rows;
  void* out;            // contiguous [rows, width]
  ElemType type;
  int64_t rows;
  int64_t width;
  int block_size;       // 16 for fake_quant_compressed_kv (e4m3 scale); 16..128 for fake_quant_fp4
};

// CPU implementations (store_cpu.cpp / dequant_cpu.cpp / fake_quant_cpu.cpp).
void store_main_cpu(KVLayout layout, const StoreParams& p);
void store_indexer_cpu(IndexerFormat fmt, const StoreParams& p);
void dequantize_cpu(KVLayout layout, const DequantParams& p);
void fake_quant_compressed_kv_cpu(const FakeQuantParams& p);
void fake_quant_fp4_cpu(const FakeQuantParams& p);

#ifdef USE_CUDA
// CUDA launchers (store_kernels.cu / dequant_kernels.cu / fake_quant_kernels.cu).
void store_main_cuda(KVLayout layout, const StoreParams& p, cudaStream_t stream);
void store_indexer_cuda(IndexerFormat fmt, const StoreParams& p, cudaStream_t stream);
void dequantize_cuda(KVLayout layout, const DequantParams& p, cudaStream_t stream);
void fake_quant_compressed_kv_cuda(const FakeQuantParams& p, cudaStream_t stream);
void fake_quant_fp4_cuda(const FakeQuantParams& p, cudaStream_t stream);
#endif

}  // namespace dsv4
