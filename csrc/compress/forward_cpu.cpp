// CPU implementation of compress_forward: every compression of the call first (plan order, fp32
// softmax with max subtraction, accurate expf, IEEE division), then every state write, so that no
// ring row is overwritten before a compression of the same call has read it (compressors.md §4.2).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "forward_launch.h"
#include "dsv4/quant.cuh"

namespace dsv4 {

namespace {

float load_value(const void* base, bool bf16, int64_t index) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[index]) : static_cast<const float*>(base)[index];
}

struct RowPointer {
  const void* base;  // null: the pad value
  bool bf16;
};

// Pools one window into out[0..head_dim).
void pool_window(const ForwardParams& p, const PoolWindow& w, float* out) {
  const int window = compress_window(p.ratio);
  const int64_t D = p.head_dim;
  const int64_t W = state_row_width(p.ratio, D);
  const int64_t pages = p.state_rows / p.ratio;
  std::vector<RowPointer> rows(window);
  for (int k = 0; k < window; ++k) {
    const SlotSource s = slot_source(w, k, p.ratio, pages, p.input_rows);
    if (s.kind == SlotKind::State) {
      const size_t elem = p.state_bf16 ? 2 : 4;
      rows[k] = RowPointer{static_cast<const char*>(p.state) + s.row * W * elem, p.state_bf16};
    } else if (s.kind == SlotKind::Input) {
      const size_t elem = p.input_bf16 ? 2 : 4;
      rows[k] = RowPointer{static_cast<const char*>(p.input) + s.row * p.input_stride * elem, p.input_bf16};
    } else {
      rows[k] = RowPointer{nullptr, false};
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> score(window), value(window);
  for (int64_t d = 0; d < D; ++d) {
    float m = neg_inf;
    for (int k = 0; k < window; ++k) {
      if (rows[k].base == nullptr) {
        score[k] = neg_inf;
        value[k] = 0.0f;
      } else {
        score[k] = load_value(rows[k].base, rows[k].bf16, score_column(p.ratio, k, D) + d) + p.ape[k * D + d];
        value[k] = load_value(rows[k].base, rows[k].bf16, value_column(p.ratio, k, D) + d);
      }
      m = score[k] > m ? score[k] : m;  // skips NaN, as the kernels' fmaxf
    }
    // With no finite max (every slot padding or -inf) the exponents are taken against 0: the sum stays 0 and the
    // channel is 0, as in the reference, while a NaN score still makes it NaN (as the reference's max would).
    const float shift = m == neg_inf ? 0.0f : m;
    float sum = 0.0f, acc = 0.0f;
    for (int k = 0; k < window; ++k) {
      const float e = std::exp(score[k] - shift);
      sum += e;
      const float weighted = value[k] * e;
      acc += weighted;
    }
    out[d] = sum == 0.0f ? 0.0f : acc / sum;
  }
}

void store_output_row(const ForwardParams& p, int64_t row, const float* values) {
  const int64_t D = p.head_dim;
  if (p.input_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(p.out) + row * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(values[d]);
  } else {
    std::memcpy(static_cast<float*>(p.out) + row * D, values, size_t(D) * sizeof(float));
  }
}

// Copies input row `src` to state row `dst` in the state dtype.
void write_state_row(const ForwardParams& p, int64_t src, int64_t dst) {
  const int64_t W = state_row_width(p.ratio, p.head_dim);
  for (int64_t i = 0; i < W; ++i) {
    const float v = load_value(p.input, p.input_bf16, src * p.input_stride + i);
    if (p.state_bf16) {
      static_cast<uint16_t*>(p.state)[dst * W + i] = p.input_bf16
          ? static_cast<const uint16_t*>(p.input)[src * p.input_stride + i]  // exact copy, NaN payloads too
          : f32_to_bf16(v);
    } else {
      static_cast<float*>(p.state)[dst * W + i] = v;
    }
  }
}

}  // namespace

void compress_forward_cpu(const ForwardParams& p) {
  std::vector<float> pooled(p.head_dim);
  std::vector<float> zeros(p.head_dim, 0.0f);
  for (int64_t row = 0; row < p.plan_rows; ++row) {
    const uint8_t* bytes = p.plan + row * kPlanRowBytes;
    PoolWindow w;
    if (p.is_decode) {
      DecodeEntry e;
      std::memcpy(&e, bytes, sizeof(e));
      w = decode_window(e, row, p.ratio);
    } else {
      CompressEntry e;
      std::memcpy(&e, bytes, sizeof(e));
      w = prefill_window(e);
    }
    if (w.emits) {
      pool_window(p, w, pooled.data());
      store_output_row(p, row, pooled.data());
    } else {
      store_output_row(p, row, zeros.data());
    }
  }
  // Writes only after every compression of the call has read the ring.
  if (p.is_decode) {
    for (int64_t b = 0; b < p.plan_rows; ++b) {
      DecodeEntry e;
      std::memcpy(&e, p.plan + b * kPlanRowBytes, sizeof(e));
      if (e.seq_len == kInvalidPlanWord || !writable_state_row(e.write_loc, p.state_rows, p.ratio)) continue;
      write_state_row(p, b, e.write_loc);
    }
  } else {
    for (int64_t i = 0; i < p.plan_w_rows; ++i) {
      WriteEntry e;
      std::memcpy(&e, p.plan_w + i * kWritePlanRowBytes, sizeof(e));
      if (e.word0 == kInvalidPlanWord || int64_t(e.word0) >= p.input_rows) continue;
      if (!writable_state_row(e.write_loc, p.state_rows, p.ratio)) continue;
      write_state_row(p, e.word0, e.write_loc);
    }
  }
}

}  // namespace dsv4
