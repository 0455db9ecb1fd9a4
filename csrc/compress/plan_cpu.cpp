// Host implementation of the c4/c128 planners: stage 0 from host lengths (the CPU op and the
// host-input CUDA path), stage 1 with host tables (CPU op) and the decode planner. Entries come from
// the shared rules of include/dsv4/plan.cuh, in batch order, so every path emits the same bytes.
#include "plan_launch.h"

namespace dsv4 {

namespace {

// Calls visit(b, request_plan) for every request, in batch order.
template <class Visit>
void for_each_request(const PrefillPlanParams& p, Visit&& visit) {
  int32_t off = 0;  // at most num_q_tokens: the host checks sum(extend_lens) <= num_q_tokens
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t extend = planned_extend_len(p.extend_lens[b]);
    visit(b, plan_request(p.geometry, planned_seq_len(p.seq_lens[b]), extend, off));
    off += extend;
  }
}

}  // namespace

PlanTotals prefill_totals_host(const PrefillPlanParams& p) {
  PlanTotals totals{0, 0};
  for_each_request(p, [&](int64_t, const RequestPlan& rp) {
    totals.n_c += rp.n_c;
    totals.n_w += rp.n_w;
  });
  return totals;
}

void prefill_stage0_host(const PrefillPlanParams& p) {
  int64_t row_c = 0, row_w = 0;
  for_each_request(p, [&](int64_t b, const RequestPlan& rp) {
    for (int32_t k = 0; k < rp.n_c && row_c < p.rows_c; ++k) {
      p.plan_c[row_c++] = compress_entry_stage0(p.geometry, rp, k, b);
    }
    for (int32_t k = 0; k < rp.n_w && row_w < p.rows_w; ++k) {
      p.plan_w[row_w++] = write_entry_stage0(p.geometry, rp, k, b);
    }
  });
  for (; row_c < p.rows_c; ++row_c) p.plan_c[row_c] = invalid_compress_entry();
  for (; row_w < p.rows_w; ++row_w) p.plan_w[row_w] = invalid_write_entry();
}

void prefill_stage1_cpu(const PrefillPlanParams& p) {
  const int ratio = p.geometry.ratio;
  for (int64_t i = 0; i < p.rows_c; ++i) {
    CompressEntry& e = p.plan_c[i];
    if (e.seq_len == kInvalidPlanWord) continue;
    finalize_compress_entry(e, p.req_pool_indices[e.read_page_1], p.lookup, ratio);
  }
  for (int64_t i = 0; i < p.rows_w; ++i) {
    WriteEntry& e = p.plan_w[i];
    if (e.word0 == kInvalidPlanWord) continue;
    finalize_write_entry(e, p.req_pool_indices[stage0_batch(e)], p.lookup);
  }
}

void decode_plan_cpu(const DecodePlanParams& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    p.plan[b] = decode_entry(p.seq_lens[b], p.req_pool_indices[b], p.lookup, p.ratio);
  }
}

}  // namespace dsv4
