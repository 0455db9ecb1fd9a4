// Torch-facing glue of the c4/c128 planners: argument validation (compressors.md §3.7; the host half
// of the fakes in _fake_compress.py), path selection from devices (§3.6), output allocation and
// dispatch to the host planner, the host-input CUDA path or the GPU-input path.
#include <torch/csrc/stable/ops.h>

#include <optional>
#include <tuple>

#include "plan_launch.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

namespace {

IndexView index_view(const Tensor& t) { return IndexView{t.data_ptr(), is_int64(t)}; }

IndexView optional_index_view(const std::optional<Tensor>& t) {
  return t.has_value() ? index_view(*t) : IndexView{nullptr, false};
}

struct PlanConfig {
  int ratio;
  bool paged;
  SlotLookup lookup;
};

// Ratio, ring and mode checks plus the tables (§3.7); tables live on `anchor`'s device.
PlanConfig check_plan_config(const char* op, int64_t ratio, int64_t swa_page_size, int64_t ring,
                             bool use_req_ring, const std::optional<Tensor>& req_to_token,
                             const std::optional<Tensor>& full_to_swa, const Tensor& anchor) {
  DSV4_CHECK(ratio == 4 || ratio == 128, op, "compress_ratio must be 4 or 128, got ", ratio);
  const int window = compress_window(int(ratio));
  DSV4_CHECK(ring >= window && ring % ratio == 0 && ring <= kMaxSeqLen, op, "ring_size must be a multiple of ",
             ratio, " and >= the window of ", window, " rows, got ", ring);
  PlanConfig c{};
  c.ratio = int(ratio);
  c.paged = ratio == 4 && !use_req_ring;  // c128 always uses request rings
  c.lookup.ring = make_divider(uint32_t(ring));
  c.lookup.paged = c.paged;
  c.lookup.req_to_token = optional_index_view(req_to_token);
  c.lookup.has_req_to_token = req_to_token.has_value();
  if (c.paged) {
    // The planners' slot and band arithmetic is 32-bit, as for ring_size.
    DSV4_CHECK(swa_page_size > 0 && swa_page_size % ring == 0 && swa_page_size <= kMaxSeqLen, op,
               "swa_page_size must be a positive multiple of ring_size=", ring,
               " and at most 2^31 - 1 in paged mode, got ", swa_page_size);
    DSV4_CHECK(req_to_token.has_value(), op, "req_to_token is required in paged mode (use_req_ring=False)");
    DSV4_CHECK(full_to_swa.has_value(), op, "full_to_swa is required in paged mode (use_req_ring=False)");
    c.lookup.swa_page = make_divider(uint32_t(swa_page_size));
  } else {
    c.lookup.swa_page = c.lookup.ring;  // unused
  }
  if (req_to_token.has_value()) {
    const Tensor& t = *req_to_token;
    check_same_device(op, "req_to_token", t, anchor);
    DSV4_CHECK(t.scalar_type() == ScalarType::Int || t.scalar_type() == ScalarType::Long, op,
               "req_to_token must be int32 or int64, got ", dtype_name(t.scalar_type()));
    check_dim(op, "req_to_token", t, 2);
    DSV4_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, "req_to_token must have stride(1) == 1, got ", t.stride(1));
    DSV4_CHECK(t.size(0) <= 1 || t.stride(0) >= t.size(1), op, "req_to_token row stride ", t.stride(0),
               " overlaps rows");
    c.lookup.r2t_rows = t.size(0);
    c.lookup.r2t_cols = t.size(1);
    c.lookup.r2t_stride = t.size(0) > 1 ? t.stride(0) : t.size(1);
  }
  if (c.paged) {
    const Tensor& t = *full_to_swa;
    check_index_vector(op, "full_to_swa", t, anchor);
    c.lookup.full_to_swa = index_view(t);
    c.lookup.f2s_len = t.size(0);
  }
  return c;
}

void check_batch_vector(const char* op, const char* name, const Tensor& t, int64_t batch, const Tensor& anchor) {
  check_index_vector(op, name, t, anchor);
  DSV4_CHECK(t.size(0) == batch, op, name, " must have ", batch, " entries (one per request), got ", t.size(0));
}

// A caller-owned plan buffer: uint8 [rows, width], contiguous, 16-byte aligned, on `anchor`'s device.
void check_plan_buffer(const char* op, const char* name, const Tensor& t, int64_t rows, int64_t width,
                       const Tensor& anchor) {
  check_same_device(op, name, t, anchor);
  check_dtype(op, name, t, ScalarType::Byte);
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(0) == rows && t.size(1) == width, op, name, " must be [", rows, ", ", width, "], got [",
             t.size(0), ", ", t.size(1), "]");
  DSV4_CHECK(t.is_contiguous(), op, name, " must be contiguous");
  DSV4_CHECK(rows == 0 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, op, name,
             " data pointer must be 16-byte aligned");
}

// ---------------------------------------------------------------------------------------------
// Decode planner

DecodePlanParams check_decode(const char* op, const Tensor& req_pool_indices, const Tensor& seq_lens,
                              const std::optional<Tensor>& req_to_token, const std::optional<Tensor>& full_to_swa,
                              int64_t ratio, int64_t swa_page_size, int64_t ring, bool use_req_ring) {
  const PlanConfig c = check_plan_config(op, ratio, swa_page_size, ring, use_req_ring, req_to_token, full_to_swa,
                                         req_pool_indices);
  check_index_vector(op, "req_pool_indices", req_pool_indices, req_pool_indices);
  const int64_t batch = req_pool_indices.size(0);
  check_batch_vector(op, "seq_lens", seq_lens, batch, req_pool_indices);
  DecodePlanParams p{};
  p.req_pool_indices = index_view(req_pool_indices);
  p.seq_lens = index_view(seq_lens);
  p.batch = batch;
  p.lookup = c.lookup;
  p.ratio = c.ratio;
  if (seq_lens.is_cpu()) {
    for (int64_t b = 0; b < batch; ++b) {
      DSV4_CHECK(p.seq_lens[b] <= kMaxSeqLen, op, "seq_lens[", b, "]=", p.seq_lens[b], " exceeds 2^31 - 1");
    }
  }
  return p;
}

void run_decode(const char* op, DecodePlanParams p, const Tensor& anchor, const Tensor& plan) {
  if (p.batch == 0) return;
  p.plan = static_cast<DecodeEntry*>(plan.data_ptr());
  run_on_device(op, anchor, [&] { decode_plan_cpu(p); }, [&](auto stream) { decode_plan_cuda(p, stream); });
}

// ---------------------------------------------------------------------------------------------
// Prefill planner

enum class PrefillPath { Cpu, HostInput, GpuInput };

struct PrefillSetup {
  PrefillPlanParams params;
  PrefillPath path;
};

PrefillSetup check_prefill(const char* op, const Tensor& req_pool_indices, const Tensor& seq_lens,
                           const Tensor& extend_lens, const std::optional<Tensor>& req_to_token,
                           const std::optional<Tensor>& full_to_swa, int64_t num_q_tokens, int64_t ratio,
                           int64_t swa_page_size, int64_t ring, bool use_req_ring, bool allow_host_input) {
  DSV4_CHECK(num_q_tokens >= 0, op, "num_q_tokens must be >= 0, got ", num_q_tokens);
  DSV4_CHECK(num_q_tokens <= kMaxPlanTokens, op, "num_q_tokens=", num_q_tokens, " exceeds ", kMaxPlanTokens,
             " (ragged ids are uint16)");
  const PlanConfig c = check_plan_config(op, ratio, swa_page_size, ring, use_req_ring, req_to_token, full_to_swa,
                                         req_pool_indices);
  check_index_vector(op, "req_pool_indices", req_pool_indices, req_pool_indices);
  const int64_t batch = req_pool_indices.size(0);
  DSV4_CHECK(batch <= kMaxPlanBatch, op, "batch_size=", batch, " must be below ", kMaxPlanBatch + 1,
             " (batch ids are packed into 16 bits)");
  // seq_lens picks the path; extend_lens must sit with it.
  PrefillPath path = PrefillPath::Cpu;
  if (req_pool_indices.is_cuda()) {
    path = (allow_host_input && seq_lens.is_cpu()) ? PrefillPath::HostInput : PrefillPath::GpuInput;
  }
  const Tensor& lens_anchor = path == PrefillPath::HostInput ? seq_lens : req_pool_indices;
  check_batch_vector(op, "seq_lens", seq_lens, batch, lens_anchor);
  check_batch_vector(op, "extend_lens", extend_lens, batch, lens_anchor);

  PrefillSetup s{};
  PrefillPlanParams& p = s.params;
  s.path = path;
  p.req_pool_indices = index_view(req_pool_indices);
  p.seq_lens = index_view(seq_lens);
  p.extend_lens = index_view(extend_lens);
  p.batch = batch;
  p.lookup = c.lookup;
  p.geometry = plan_geometry(c.ratio, c.lookup, int32_t(num_q_tokens));
  if (path != PrefillPath::GpuInput) {
    // Host lengths: the §3.7 value checks.
    int64_t sum = 0;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t L = p.seq_lens[b], E = p.extend_lens[b];
      DSV4_CHECK(L >= 0 && L <= kMaxSeqLen, op, "seq_lens[", b, "]=", L, " must lie in [0, 2^31 - 1]");
      DSV4_CHECK(E >= 0 && E <= L, op, "extend_lens[", b, "]=", E, " must lie in [0, seq_lens[", b, "]=", L, "]");
      sum += E;
    }
    DSV4_CHECK(sum <= num_q_tokens, op, "sum(extend_lens)=", sum, " exceeds num_q_tokens=", num_q_tokens);
  }
  return s;
}

// CPU op: stage 0 and stage 1 on the host, straight into the outputs.
void run_prefill_cpu(PrefillPlanParams p, const Tensor& plan_c, const Tensor& plan_w) {
  p.plan_c = static_cast<CompressEntry*>(plan_c.data_ptr());
  p.rows_c = plan_c.size(0);
  p.plan_w = static_cast<WriteEntry*>(plan_w.data_ptr());
  p.rows_w = plan_w.size(0);
  prefill_stage0_host(p);
  prefill_stage1_cpu(p);
}

#ifdef USE_CUDA
void run_prefill_gpu_input(PrefillPlanParams p, const Tensor& anchor, const Tensor& plan_c, const Tensor& plan_w) {
  CudaContext ctx(anchor);
  p.plan_c = static_cast<CompressEntry*>(plan_c.data_ptr());
  p.rows_c = plan_c.size(0);
  p.plan_w = static_cast<WriteEntry*>(plan_w.data_ptr());
  p.rows_w = plan_w.size(0);
  const int64_t words = prefill_scratch_words(p.batch);
  std::optional<Tensor> scratch;
  if (words > 0 && (p.rows_c > 0 || p.rows_w > 0)) {
    scratch = torch::stable::new_empty(anchor, {words}, ScalarType::Int);
  }
  prefill_plan_cuda(p, scratch.has_value() ? static_cast<int32_t*>(scratch->data_ptr()) : nullptr, ctx.stream());
}
#endif

}  // namespace

Tensor plan_compress_decode(Tensor req_pool_indices, Tensor seq_lens, std::optional<Tensor> req_to_token,
                            std::optional<Tensor> full_to_swa, int64_t compress_ratio, int64_t swa_page_size,
                            int64_t ring_size, bool use_req_ring) {
  constexpr const char* op = "plan_compress_decode";
  const DecodePlanParams p = check_decode(op, req_pool_indices, seq_lens, req_to_token, full_to_swa,
                                          compress_ratio, swa_page_size, ring_size, use_req_ring);
  Tensor plan = torch::stable::new_empty(req_pool_indices, {p.batch, kPlanRowBytes}, ScalarType::Byte);
  run_decode(op, p, req_pool_indices, plan);
  return plan;
}

void plan_compress_decode_out(Tensor req_pool_indices, Tensor seq_lens, std::optional<Tensor> req_to_token,
                              std::optional<Tensor> full_to_swa, int64_t compress_ratio, int64_t swa_page_size,
                              int64_t ring_size, bool use_req_ring, Tensor plan_d) {
  constexpr const char* op = "plan_compress_decode_out";
  const DecodePlanParams p = check_decode(op, req_pool_indices, seq_lens, req_to_token, full_to_swa,
                                          compress_ratio, swa_page_size, ring_size, use_req_ring);
  check_plan_buffer(op, "plan_d", plan_d, p.batch, kPlanRowBytes, req_pool_indices);
  check_written_disjoint(op, {arg("plan_d", plan_d)},
                         {arg("req_pool_indices", req_pool_indices), arg("seq_lens", seq_lens),
                          arg("req_to_token", req_to_token), arg("full_to_swa", full_to_swa)});
  run_decode(op, p, req_pool_indices, plan_d);
}

std::tuple<Tensor, Tensor> plan_compress_prefill(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens,
                                                 std::optional<Tensor> req_to_token,
                                                 std::optional<Tensor> full_to_swa, int64_t num_q_tokens,
                                                 int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size,
                                                 bool use_req_ring, bool use_cuda_graph) {
  constexpr const char* op = "plan_compress_prefill";
  const PrefillSetup s = check_prefill(op, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa,
                                       num_q_tokens, compress_ratio, swa_page_size, ring_size, use_req_ring, true);
  PrefillPlanParams p = s.params;
  if (s.path == PrefillPath::GpuInput) {
#ifdef USE_CUDA
    Tensor plan_c = torch::stable::new_empty(req_pool_indices, {num_q_tokens, kPlanRowBytes}, ScalarType::Byte);
    Tensor plan_w = torch::stable::new_empty(req_pool_indices, {num_q_tokens, kWritePlanRowBytes}, ScalarType::Byte);
    run_prefill_gpu_input(p, req_pool_indices, plan_c, plan_w);
    return std::make_tuple(plan_c, plan_w);
#else
    fail_no_cuda(op);
#endif
  }
  // Paths (a) and (b): sizes from the host lengths, or num_q_tokens rows of which the tail is sentinels.
  int64_t rows_c = num_q_tokens, rows_w = num_q_tokens;
  if (!use_cuda_graph) {
    const PlanTotals totals = prefill_totals_host(p);
    rows_c = totals.n_c;
    rows_w = totals.n_w;
  }
  Tensor plan_c = torch::stable::new_empty(req_pool_indices, {rows_c, kPlanRowBytes}, ScalarType::Byte);
  Tensor plan_w = torch::stable::new_empty(req_pool_indices, {rows_w, kWritePlanRowBytes}, ScalarType::Byte);
  if (s.path == PrefillPath::Cpu) {
    run_prefill_cpu(p, plan_c, plan_w);
    return std::make_tuple(plan_c, plan_w);
  }
#ifdef USE_CUDA
  // Host-input path (b): stage 0 into pinned host memory, a stream-ordered copy, then stage 1 on the GPU.
  CudaContext ctx(req_pool_indices);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  DSV4_CHECK(cudaStreamIsCapturing(ctx.stream(), &capture) == cudaSuccess, op, "cudaStreamIsCapturing failed");
  DSV4_CHECK(capture == cudaStreamCaptureStatusNone, op,
             "seq_lens on the CPU selects the host-input path, which cannot run under CUDA-graph capture; "
             "pass seq_lens and extend_lens on the GPU (or use plan_compress_prefill_out)");
  const torch::stable::Device host(torch::stable::DeviceType::CPU);
  Tensor host_c = torch::stable::empty({rows_c, kPlanRowBytes}, ScalarType::Byte, std::nullopt, host, true);
  Tensor host_w = torch::stable::empty({rows_w, kWritePlanRowBytes}, ScalarType::Byte, std::nullopt, host, true);
  p.plan_c = static_cast<CompressEntry*>(host_c.data_ptr());
  p.rows_c = rows_c;
  p.plan_w = static_cast<WriteEntry*>(host_w.data_ptr());
  p.rows_w = rows_w;
  prefill_stage0_host(p);
  // copy_ records the stream on the pinned blocks, so the host allocator keeps them until the copy ends.
  torch::stable::copy_(plan_c, host_c, true);
  torch::stable::copy_(plan_w, host_w, true);
  p.plan_c = static_cast<CompressEntry*>(plan_c.data_ptr());
  p.plan_w = static_cast<WriteEntry*>(plan_w.data_ptr());
  prefill_stage1_cuda(p, ctx.stream());
  return std::make_tuple(plan_c, plan_w);
#else
  fail_no_cuda(op);
#endif
}

void plan_compress_prefill_out(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens,
                               std::optional<Tensor> req_to_token, std::optional<Tensor> full_to_swa,
                               int64_t num_q_tokens, int64_t compress_ratio, int64_t swa_page_size,
                               int64_t ring_size, bool use_req_ring, Tensor plan_c, Tensor plan_w) {
  constexpr const char* op = "plan_compress_prefill_out";
  const PrefillSetup s = check_prefill(op, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa,
                                       num_q_tokens, compress_ratio, swa_page_size, ring_size, use_req_ring, false);
  check_plan_buffer(op, "plan_c", plan_c, num_q_tokens, kPlanRowBytes, req_pool_indices);
  check_plan_buffer(op, "plan_w", plan_w, num_q_tokens, kWritePlanRowBytes, req_pool_indices);
  check_written_disjoint(op, {arg("plan_c", plan_c), arg("plan_w", plan_w)},
                         {arg("req_pool_indices", req_pool_indices), arg("seq_lens", seq_lens),
                          arg("extend_lens", extend_lens), arg("req_to_token", req_to_token),
                          arg("full_to_swa", full_to_swa)});
  if (s.path == PrefillPath::Cpu) {
    run_prefill_cpu(s.params, plan_c, plan_w);
    return;
  }
#ifdef USE_CUDA
  run_prefill_gpu_input(s.params, req_pool_indices, plan_c, plan_w);
#else
  fail_no_cuda(op);
#endif
}

}  // namespace dsv4
