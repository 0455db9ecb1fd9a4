// CPU implementation of the ratio-1 and ratio-2 decode compressors: one row at a time through the
// pair pooling, RMSNorm, rotation, fake quantization and row quantizers of include/dsv4 (the scalar
// functions the CUDA kernels use), with the rounding points of compressors.md §1.5-1.6 and §5.4.
#include <cstring>

#include "low_ratio_launch.h"
#include "../cache/element_io.h"
#include "dsv4/norm.cuh"
#include "dsv4/pair_pool.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/rope.cuh"
#include "dsv4/row_quant.h"

namespace dsv4 {

namespace {

void load_weight(const LowRatioParams& p, float* w) {
  for (int i = 0; i < kMainDim; ++i) {
    w[i] = load_element(p.weight, i, p.weight_fp32 ? ElemType::FP32 : ElemType::BF16);
  }
}

// latent = bf16(RMSNorm(x) * w), written to output row `row`; returned widened in `latent`.
void norm_to_latent(const LowRatioParams& p, int64_t row, const float* x, const float* w, float* latent) {
  float y[kMainDim];
  rms_norm_row<kMainDim>(x, w, p.eps, y);
  uint16_t* out = p.latent + row * kMainDim;
  for (int i = 0; i < kMainDim; ++i) {
    out[i] = f32_to_bf16(y[i]);
    latent[i] = bf16_to_f32(out[i]);
  }
}

// §5.4: t = bf16(rope_tail(latent)); V41_FP4 stores t, V41 and V4 store fake_quant_compressed_kv(t).
void store_latent(KVLayout layout, const LowRatioParams& p, const float* latent, int64_t slot,
                  int64_t position) {
  float t[kMainDim];
  std::memcpy(t, latent, sizeof(t));
  const float* table_row = p.freqs + position * kRopeDim;
  float* tail = t + kV4NopeDim;
  for (int j = 0; j < kRopeDim; j += 2) rotate_pair(tail[j], tail[j + 1], table_row[j], table_row[j + 1]);
  for (int i = 0; i < kRopeDim; ++i) tail[i] = round_to_bf16(tail[i]);
  if (layout != KVLayout::V41_FP4) {
    const int tile = kv_layout_traits(KVLayout::V41_FP4).tile;
    for (int i = 0; i < kMainDim; i += tile) fake_quant_compressed_tile(t + i, tile);
  }
  quantize_main_row(layout, t, p.cache.data_row(slot), p.cache.scale_row(slot));
}

void zero_latent(const LowRatioParams& p, int64_t row) {
  std::memset(p.latent + row * kMainDim, 0, kMainDim * sizeof(uint16_t));
}

}  // namespace

void c1_decode_cpu(KVLayout layout, const LowRatioParams& p) {
  float w[kMainDim], x[kMainDim], latent[kMainDim];
  load_weight(p, w);
  for (int64_t row = 0; row < p.n; ++row) {
    load_row(p.kv, row, kMainDim, x);
    norm_to_latent(p, row, x, w, latent);
    const int64_t position = p.positions[row];
    const int64_t slot = c1_store_slot(p.out_loc[row], position, p.cache.capacity(), p.max_pos);
    if (slot >= 0) store_latent(layout, p, latent, slot, position);
  }
}

namespace {

// The rows of a c2 call that emit (odd positions): pooling with the partner that plan_of names, the latent and
// the cache store. Reads the ring only; the callers write it afterwards, as the reference does. Valid batches
// never read a ring row the call writes (§5.3, §5.5), so the order only pins down the result of invalid ones.
template <class PlanOf>
void c2_emit_rows(KVLayout layout, const LowRatioParams& p, PlanOf plan_of) {
  float w[kMainDim], own[kPairRowWidth], partner[kPairRowWidth], x[kMainDim], latent[kMainDim];
  load_weight(p, w);
  const RowInput state{p.state, p.state_row_stride, ElemType::FP32};
  for (int64_t row = 0; row < p.n; ++row) {
    const PairRowPlan plan = plan_of(row);
    if (!plan.emits) {
      zero_latent(p, row);
      continue;
    }
    load_row(p.kv, row, kPairRowWidth, own);
    if (plan.partner_input >= 0) {
      load_row(p.kv, plan.partner_input, kPairRowWidth, partner);
    } else if (plan.partner_ring >= 0) {
      load_row(state, plan.partner_ring, kPairRowWidth, partner);
    } else {
      for (int i = 0; i < kMainDim; ++i) {
        partner[i] = 0.0f;
        partner[kMainDim + i] = kPadScore;
      }
    }
    for (int i = 0; i < kMainDim; ++i) {
      x[i] = round_to_bf16(pair_pool(partner[i], partner[kMainDim + i], own[i], own[kMainDim + i]));
    }
    norm_to_latent(p, row, x, w, latent);
    if (plan.slot >= 0) store_latent(layout, p, latent, plan.slot, plan.rope_position);
  }
}

// Parks input row `row` in ring row `ring_row` (>= 0).
void park_row(const LowRatioParams& p, int64_t row, int64_t ring_row) {
  float own[kPairRowWidth];
  load_row(p.kv, row, kPairRowWidth, own);
  std::memcpy(p.state + ring_row * p.state_row_stride, own, sizeof(own));
}

}  // namespace

void c2_decode_or_verify_cpu(KVLayout layout, const LowRatioParams& p) {
  auto plan_of = [&](int64_t row) {
    return plan_pair_row(row, p.positions[row], p.req_pool_indices[row], p.out_loc[row], p.ring,
                         p.cache.capacity(), p.max_pos);
  };
  c2_emit_rows(layout, p, plan_of);
  for (int64_t row = 0; row < p.n; ++row) {
    const PairRowPlan plan = plan_of(row);
    if (plan.ring_write >= 0) park_row(p, row, plan.ring_write);
  }
}

void c2_prefill_cpu(KVLayout layout, const LowRatioParams& p, const C2PrefillRequests& q) {
  c2_emit_rows(layout, p, [&](int64_t row) {
    const int64_t position = p.positions[row], req = p.req_pool_indices[row];
    auto continues = [&] { return continues_run(position, req, p.positions[row - 1], p.req_pool_indices[row - 1]); };
    return plan_prefill_pair_row(row, position, req, p.out_loc[row], continues, p.ring, p.cache.capacity(),
                                 p.max_pos);
  });
  for (int64_t r = 0; r < q.requests; ++r) {
    const PrefillTail tail = prefill_tail(q.extend_starts[r], q.extend_lens[r], p.n, p.ring.ring);
    for (int64_t row = tail.first; row < tail.end; ++row) {
      const int64_t ring_row = parked_ring_row(p.positions[row], p.req_pool_indices[row], p.out_loc[row], p.ring);
      if (ring_row >= 0) park_row(p, row, ring_row);
    }
  }
}

}  // namespace dsv4
