// Plain-C++ parameter blocks and entry points of the c4/c128 planners (plan_compress_decode,
// plan_compress_prefill). No torch types: plan_ops.cpp validates tensors and fills these;
// plan_cpu.cpp and plan_kernels.cu consume them.
#pragma once

#include <cstdint>

#include "dsv4/plan.cuh"

#ifdef USE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace dsv4 {

struct DecodePlanParams {
  IndexView req_pool_indices;  // [batch]
  IndexView seq_lens;          // [batch]
  int64_t batch;
  SlotLookup lookup;
  int ratio;
  DecodeEntry* plan;           // [batch]
};

struct PrefillPlanParams {
  IndexView req_pool_indices;  // [batch], on the plans' device
  IndexView seq_lens;          // [batch]  (host on paths (a) and (b))
  IndexView extend_lens;       // [batch]
  int64_t batch;
  SlotLookup lookup;
  PlanGeometry geometry;
  CompressEntry* plan_c;       // [rows_c]
  int64_t rows_c;
  WriteEntry* plan_w;          // [rows_w]
  int64_t rows_w;
};

struct PlanTotals {
  int64_t n_c;
  int64_t n_w;
};

// Host (seq_lens and extend_lens in host memory): the §3.3 totals, and stage 0 into plan_c/plan_w
// (entries, then sentinels up to rows_c/rows_w).
PlanTotals prefill_totals_host(const PrefillPlanParams& p);
void prefill_stage0_host(const PrefillPlanParams& p);
// CPU op: stage 1 on the host (req_pool_indices and the tables in host memory).
void prefill_stage1_cpu(const PrefillPlanParams& p);
void decode_plan_cpu(const DecodePlanParams& p);

#ifdef USE_CUDA
void decode_plan_cuda(const DecodePlanParams& p, cudaStream_t stream);
// Host-input path (b): stage 1 over plans already holding stage-0 bytes on the device.
void prefill_stage1_cuda(const PrefillPlanParams& p, cudaStream_t stream);
// GPU-input path (c): rows_c == rows_w == num_q_tokens; `scratch` holds
// prefill_scratch_words(batch) int32 words (unused for small batches, may be null then).
int64_t prefill_scratch_words(int64_t batch);
void prefill_plan_cuda(const PrefillPlanParams& p, int32_t* scratch, cudaStream_t stream);
#endif

}  // namespace dsv4
