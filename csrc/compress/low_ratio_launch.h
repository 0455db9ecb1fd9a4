// Plain-C++ parameter block and entry points of the ratio-1 and ratio-2 compressors (c1_decode_norm_rope_store,
// c2_decode_or_verify_norm_rope_store, c2_prefill_norm_rope_store). No torch types: low_ratio_ops.cpp
// validates the tensors and fills the block; low_ratio_kernels.cu and low_ratio_cpu.cpp consume it.
#pragma once

#include <cstdint>

#include "../cache/cache_launch.h"
#include "dsv4/low_ratio_rows.cuh"

namespace dsv4 {

// Width of a c2 projection row: kv (512) then score (512).
constexpr int kPairRowWidth = 2 * kMainDim;

struct LowRatioParams {
  RowInput kv;              // c1: bf16 [n, 512]; c2: fp32 [n, 1024] (kv | score)
  const void* weight;       // [512] norm weight
  bool weight_fp32;         // else bf16
  float eps;
  const float* freqs;       // RoPE table [max_pos, 64]
  int64_t max_pos;
  IndexInput positions;     // [n]
  IndexInput out_loc;       // [n]: c1 out_loc, c2 raw_out_loc (the raw full-KV slot)
  IndexInput req_pool_indices;  // [n], c2 only
  float* state;             // c2 pair-state ring rows [rows, 1024], c2 only
  int64_t state_row_stride; // elements
  PairRing ring;            // c2 only
  PairRing32 ring32;        // c2 only: its 32-bit plan
  PagedCache cache;
  uint16_t* latent;         // output bf16 bits [n, 512], contiguous
  int64_t n;
};

// The requests of a c2 prefill (rows [extend_starts[r], extend_starts[r] + extend_lens[r])), apart from
// LowRatioParams so that the decode kernels' parameter block stays as it was.
struct C2PrefillRequests {
  IndexInput extend_starts;  // [requests]
  IndexInput extend_lens;    // [requests]
  int64_t requests;
};

// The ring-park launch gives each request one block along grid x, whose limit is 2^31 - 1 blocks; the op rejects
// more requests before any launch (the rows launch, which writes the cache, comes first).
constexpr int64_t kMaxC2PrefillRequests = INT32_MAX;

// The rows launches (c1, c2) give each kv row one block along grid x: at most 2^31 - 1 rows, checked on the host
// (a broadcast kv_input of more rows costs no memory, and its index vectors fit a large GPU).
constexpr int64_t kMaxLowRatioRows = INT32_MAX;

// CPU implementations (low_ratio_cpu.cpp).
void c1_decode_cpu(KVLayout layout, const LowRatioParams& p);
void c2_decode_or_verify_cpu(KVLayout layout, const LowRatioParams& p);
void c2_prefill_cpu(KVLayout layout, const LowRatioParams& p, const C2PrefillRequests& q);

#ifdef USE_CUDA
// CUDA launchers (low_ratio_kernels.cu): one launch each; c2 prefill two (the rows, then the ring writes).
void c1_decode_cuda(KVLayout layout, const LowRatioParams& p, cudaStream_t stream);
void c2_decode_or_verify_cuda(KVLayout layout, const LowRatioParams& p, cudaStream_t stream);
void c2_prefill_cuda(KVLayout layout, const LowRatioParams& p, const C2PrefillRequests& q, cudaStream_t stream);
#endif

}  // namespace dsv4
