// CUDA kernels of compress_forward. c4: one thread per 4 channels of an entry (D/4 threads), all 8
// window slots in registers. c128 decode: a block per (rows, 16-channel chunk), so that a closing window's
// 508 KiB of ring rows is read by 32 blocks on many SMs; its 256 threads split the window's slots and pool
// them in two passes (the exact max, then fixed-order sums), in pool blocks apart from the blocks that copy
// the rows to the state. c128 prefill: a warp per (window, 32-channel chunk) folding its slots into a
// running softmax. Prefill writes run in a second launch.
#include <type_traits>

#include "forward_launch.h"
#include "dsv4/divider.cuh"
#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"

namespace dsv4 {

namespace {

constexpr int kC4Threads = 128;
constexpr int kC128Threads = 256;
constexpr int kC128Warps = kC128Threads / 32;
// Channels per c128 block. A decode step closes a window about once in 128 rows and waits for it: 16
// channels spread a window's 508 KiB of ring rows over 32 blocks (D 512) instead of 16. H200, decode chunks
// of 32 / 16 / 8 channels (pooling in the copy blocks then): 64 requests with one window closing 3.6 / 3.2 /
// 3.2 us. A prefill warp covers 32 channels (eight 16-byte quads: a 128-byte segment per row and load).
constexpr int kC128PrefillChunk = 32;
// Window slots a prefill lane loads before folding them (its registers in flight: 3 x kC128PrefillSlots
// float4).
constexpr int kC128PrefillSlots = 4;
constexpr int kC128DecodeChunk = 16;
constexpr int kC128DecodeItemsPerRow = 2 * kC128DecodeChunk / 4;  // float4 items of a row's (kv, s) chunk
// Rows of a decode copy block: one copy item per thread. H200, fp32, copy blocks of 32 rows against the
// earlier rows / 16 (at most 32, 512 blocks up to 512 rows): 8 / 64 / 256 / 1024 requests 1.32 / 2.23 / 4.40 /
// 7.93 us against 1.38 / 2.38 / 4.49 / 7.86; 8 rows: 1024 requests 10.3 us.
constexpr int kC128CopyRows = kC128Threads / kC128DecodeItemsPerRow;
static_assert(kC128CopyRows <= 32, "a copy block's entries are warp 0's");
// Decode closing rows one pool block handles at most (c128_pool_blocks).
constexpr int kC128MaxPooledRows = 64;
constexpr int kWriteWarps = 8;

__device__ __forceinline__ float4 neg_inf4() {
  const float n = __int_as_float(0xFF800000);
  return make_float4(n, n, n, n);
}

// The softmax's exponents are taken against the channel's max m, or against 0 when m is -inf (every slot so far
// pad): pads then add exp(-inf) = 0, never NaN, while a NaN score (which fmaxf skips) still makes the sums NaN, as
// the reference's softmax does.
__device__ __forceinline__ float exp_shift(float m) { return m == __int_as_float(0xFF800000) ? 0.f : m; }

// The pooled value a / l of a channel's softmax sums: l >= 1 (the max slot's term) unless every slot is pad
// (l = 0: the channel is 0) or a score is NaN (NaN, kept).
__device__ __forceinline__ float pooled_value(float a, float l) { return l == 0.f ? 0.f : a / l; }

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// Four consecutive bf16 or fp32 elements starting at element i, widened. Vec (chosen at launch from
// the alignment of every base pointer and row stride) selects one 16-B / 8-B access over four scalar
// ones. No branches: a load whose result merges with another path's value at a join would force a
// wait for it, which serialises the window's loads.
template <bool Bf16, bool Vec>
__device__ __forceinline__ float4 load4(const void* base, int64_t i) {
  if constexpr (Bf16) {
    const uint16_t* s = static_cast<const uint16_t*>(base) + i;
    if constexpr (Vec) {
      const uint2 v = *reinterpret_cast<const uint2*>(s);
      return make_float4(bf16_to_f32(uint16_t(v.x & 0xFFFFu)), bf16_to_f32(uint16_t(v.x >> 16)),
                         bf16_to_f32(uint16_t(v.y & 0xFFFFu)), bf16_to_f32(uint16_t(v.y >> 16)));
    } else {
      return make_float4(bf16_to_f32(s[0]), bf16_to_f32(s[1]), bf16_to_f32(s[2]), bf16_to_f32(s[3]));
    }
  } else {
    const float* s = static_cast<const float*>(base) + i;
    if constexpr (Vec) {
      return *reinterpret_cast<const float4*>(s);
    } else {
      return make_float4(s[0], s[1], s[2], s[3]);
    }
  }
}

// Rounds (RNE) to bf16 or stores fp32, at element i.
template <bool Bf16, bool Vec>
__device__ __forceinline__ void store4(void* base, int64_t i, float4 v) {
  if constexpr (Bf16) {
    uint16_t* d = static_cast<uint16_t*>(base) + i;
    const uint16_t h[4] = {f32_to_bf16(v.x), f32_to_bf16(v.y), f32_to_bf16(v.z), f32_to_bf16(v.w)};
    if constexpr (Vec) {
      *reinterpret_cast<uint2*>(d) = make_uint2(h[0] | (uint32_t(h[1]) << 16), h[2] | (uint32_t(h[3]) << 16));
    } else {
      d[0] = h[0]; d[1] = h[1]; d[2] = h[2]; d[3] = h[3];
    }
  } else {
    float* d = static_cast<float*>(base) + i;
    if constexpr (Vec) {
      *reinterpret_cast<float4*>(d) = v;
    } else {
      d[0] = v.x; d[1] = v.y; d[2] = v.z; d[3] = v.w;
    }
  }
}

__device__ __forceinline__ DecodeEntry load_decode_entry(const uint8_t* row) {
  const uint4 v = *reinterpret_cast<const uint4*>(row);
  return DecodeEntry{v.x, int32_t(v.y), int32_t(v.z), int32_t(v.w)};
}

__device__ __forceinline__ CompressEntry load_compress_entry(const uint8_t* row) {
  const uint4 v = *reinterpret_cast<const uint4*>(row);
  return CompressEntry{v.x, uint16_t(v.y & 0xFFFFu), uint16_t(v.y >> 16), int32_t(v.z), int32_t(v.w)};
}

// The loads of window slot k for channels [c, c+4): issued here and resolved (pad selects, ape added)
// by resolve() once every slot of the group is in flight. With equal state and input dtypes a slot is
// one load pair from a selected row (pad slots read the state's pad row and are masked afterwards);
// otherwise the input loads are predicated into separate registers.
template <bool InBf16, bool StBf16>
struct SlotLoads {
  float4 value, score;        // the selected row's (equal dtypes) or the state row's
  float4 in_value, in_score;  // the input row's (mixed dtypes only)
  float4 bias;
  SlotKind kind;

  __device__ __forceinline__ void resolve(float4& v, float4& s) const {
    if (kind == SlotKind::Pad) {
      v = make_float4(0.f, 0.f, 0.f, 0.f);
      s = neg_inf4();
      return;
    }
    const bool from_input = InBf16 != StBf16 && kind == SlotKind::Input;
    v = from_input ? in_value : value;
    s = add4(from_input ? in_score : score, bias);
  }
};

template <int kRatio, bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ SlotLoads<InBf16, StBf16> issue_slot(const ForwardParams& p, const PoolWindow& w, int k,
                                                               int64_t c, int64_t state_pages) {
  const int64_t D = p.head_dim;
  const int64_t W = state_row_width(kRatio, D);
  const SlotSource s = slot_source(w, k, kRatio, state_pages, p.input_rows);
  const int64_t vc = value_column(kRatio, k, D) + c, sc = score_column(kRatio, k, D) + c;
  SlotLoads<InBf16, StBf16> l;
  l.kind = s.kind;
  const bool input = s.kind == SlotKind::Input;
  const int64_t state_row = (s.kind == SlotKind::State ? s.row : p.state_rows - 1) * W;
  if constexpr (InBf16 == StBf16) {
    const void* base = input ? p.input : static_cast<const void*>(p.state);
    const int64_t row = input ? s.row * p.input_stride : state_row;
    l.value = load4<StBf16, Vec>(base, row + vc);
    l.score = load4<StBf16, Vec>(base, row + sc);
  } else {
    l.value = load4<StBf16, Vec>(p.state, state_row + vc);
    l.score = load4<StBf16, Vec>(p.state, state_row + sc);
    if (input) {
      l.in_value = load4<InBf16, Vec>(p.input, s.row * p.input_stride + vc);
      l.in_score = load4<InBf16, Vec>(p.input, s.row * p.input_stride + sc);
    }
  }
  l.bias = load4<false, Vec>(p.ape, int64_t(k) * D + c);
  return l;
}

// (m, Σ exp(s − m), Σ v·exp(s − m)) over N slots of one channel, m the slots' max; l = 0 if all are pad
// (s = −inf). A max pass, then a sum pass: no data-dependent branch per slot.
struct SoftmaxPartial {
  float m, l, a;
};

template <int N>
__device__ __forceinline__ SoftmaxPartial softmax_partial(const float* s, const float* v) {
  float m = s[0];
#pragma unroll
  for (int k = 1; k < N; ++k) m = fmaxf(m, s[k]);  // one instruction; a compare and select agree but on NaN
  SoftmaxPartial r{m, 0.f, 0.f};
  const float shift = exp_shift(m);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const float e = expf(s[k] - shift);
    r.l += e;
    r.a += v[k] * e;
  }
  return r;
}

// Σ v·exp(s − m) / Σ exp(s − m) over N slots for one channel (0 if all are pad).
template <int N>
__device__ __forceinline__ float softmax_pool(const float* s, const float* v) {
  const SoftmaxPartial r = softmax_partial<N>(s, v);
  return pooled_value(r.a, r.l);
}

// softmax_pool of four channels over N slots given as float4 (channel j in component j).
template <int N>
__device__ __forceinline__ float4 softmax_pool4(const float4 (&score)[N], const float4 (&value)[N]) {
  float s[4][N], v[4][N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    s[0][k] = score[k].x; s[1][k] = score[k].y; s[2][k] = score[k].z; s[3][k] = score[k].w;
    v[0][k] = value[k].x; v[1][k] = value[k].y; v[2][k] = value[k].z; v[3][k] = value[k].w;
  }
  return make_float4(softmax_pool<N>(s[0], v[0]), softmax_pool<N>(s[1], v[1]), softmax_pool<N>(s[2], v[2]),
                     softmax_pool<N>(s[3], v[3]));
}

// c4: the 8-slot window for channels [c, c+4).
template <bool InBf16, bool StBf16, bool Vec>
__device__ float4 pool_c4(const ForwardParams& p, const PoolWindow& w, int64_t c) {
  constexpr int kWindow = 8;
  const int64_t pages = p.state_rows / 4;
  SlotLoads<InBf16, StBf16> l[kWindow];
#pragma unroll
  for (int k = 0; k < kWindow; ++k) l[k] = issue_slot<4, InBf16, StBf16, Vec>(p, w, k, c, pages);
  float4 value[kWindow], score[kWindow];
#pragma unroll
  for (int k = 0; k < kWindow; ++k) l[k].resolve(value[k], score[k]);
  return softmax_pool4<kWindow>(score, value);
}

// c4, a window whose 8 slots are all input rows src − 7 .. src (no ring slot, no pad: every prefill window
// but a request's first and those that read the ring): the rows one stride apart and each slot's columns
// fixed, instead of slot_source's per-slot search and the pad and ring selects, which took more instructions
// than the pooling itself.
template <bool InBf16, bool Vec>
__device__ float4 pool_c4_input(const ForwardParams& p, const PoolWindow& w, int64_t c) {
  using T = typename std::conditional<InBf16, uint16_t, float>::type;
  constexpr int kWindow = 8;
  const int64_t D = p.head_dim;
  const T* first = static_cast<const T*>(p.input) + (w.src - (kWindow - 1)) * p.input_stride + c;
  float4 value[kWindow], score[kWindow];
#pragma unroll
  for (int k = 0; k < kWindow; ++k) {
    const T* row = first + k * p.input_stride;
    value[k] = load4<InBf16, Vec>(row, value_column(4, k, D));
    score[k] = add4(load4<InBf16, Vec>(row, score_column(4, k, D)), load4<false, Vec>(p.ape, int64_t(k) * D + c));
  }
  return softmax_pool4<kWindow>(score, value);
}

// Per-warp partials of a c128 window over a block's kChunk channels.
template <int kChunk>
struct C128Partials {
  alignas(16) float m[kC128Warps][kChunk];  // max
  alignas(16) float l[kC128Warps][kChunk];  // Σ exp(s − max)
  alignas(16) float a[kC128Warps][kChunk];  // Σ v·exp(s − max)
};

// c128 slot layout: thread t pools channels chunk + 4·(t % Q) + [0, 4) of window slots
// [S·(t / Q), S·(t / Q) + S), Q = kChunk / 4 threads per slot and S = 128·Q / 256 slots per thread.
template <int kChunk>
struct C128Layout {
  static constexpr int kQuads = kChunk / 4, kSlots = 128 * kQuads / kC128Threads;
  static_assert(kSlots >= 1 && 128 % kSlots == 0, "a thread's slots tile the window");
  __device__ __forceinline__ static int quad() { return threadIdx.x % kQuads; }
  __device__ __forceinline__ static int first_slot() { return threadIdx.x / kQuads * kSlots; }
};

// A decode window: slots 0..126 are rows of page read_page_1 (pad if the page is invalid) and slot 127 is
// the current token, input row w.src. Only a thread's last slot can be slot 127 (a thread's slots start
// at a multiple of kSlots). With equal dtypes that slot's loads take the input row's address; with mixed
// dtypes they need registers of their own, and slot 127's ring row is loaded and discarded. (prefill's
// gather predicates an input load on every slot: with bf16 input and fp32 state the decode kernel took 85
// registers, two blocks per SM.)
template <int kChunk, bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ void gather_c128_decode(const ForwardParams& p, const PoolWindow& w, int64_t chunk,
                                                   float (&s)[4][C128Layout<kChunk>::kSlots],
                                                   float (&v)[4][C128Layout<kChunk>::kSlots]) {
  using L = C128Layout<kChunk>;
  constexpr int kLast = L::kSlots - 1;
  constexpr bool kSameDtype = InBf16 == StBf16;
  static_assert(127 % L::kSlots == kLast, "slot 127 is a thread's last slot");
  const int64_t D = p.head_dim, W = state_row_width(128, D), pages = p.state_rows / 128;
  const int64_t c = chunk + 4 * L::quad();
  const bool page_ok = w.read_page_1 >= 0 && w.read_page_1 < pages;
  const int64_t page_row = (page_ok ? int64_t(w.read_page_1) * 128 : p.state_rows - 1) * W;
  const bool holds_current = L::first_slot() + kLast == 127;
  float4 value[L::kSlots], score[L::kSlots], bias[L::kSlots], current_value, current_score;
#pragma unroll
  for (int i = 0; i < L::kSlots; ++i) {
    const int k = L::first_slot() + i;
    const bool from_input = kSameDtype && i == kLast && holds_current;
    const void* base = from_input ? p.input : static_cast<const void*>(p.state);
    const int64_t row = from_input ? w.src * p.input_stride : (page_ok ? page_row + k * W : page_row);
    value[i] = load4<StBf16, Vec>(base, row + value_column(128, k, D) + c);
    score[i] = load4<StBf16, Vec>(base, row + score_column(128, k, D) + c);
    bias[i] = load4<false, Vec>(p.ape, int64_t(k) * D + c);
  }
  if (!kSameDtype && holds_current) {
    current_value = load4<InBf16, Vec>(p.input, w.src * p.input_stride + value_column(128, 127, D) + c);
    current_score = load4<InBf16, Vec>(p.input, w.src * p.input_stride + score_column(128, 127, D) + c);
  }
#pragma unroll
  for (int i = 0; i < L::kSlots; ++i) {
    const bool is_current = i == kLast && holds_current;
    const bool separate = !kSameDtype && is_current;
    float4 kv = separate ? current_value : value[i];
    float4 sc = add4(separate ? current_score : score[i], bias[i]);
    if (!is_current && !page_ok) {  // pad
      kv = make_float4(0.f, 0.f, 0.f, 0.f);
      sc = neg_inf4();
    }
    s[0][i] = sc.x; s[1][i] = sc.y; s[2][i] = sc.z; s[3][i] = sc.w;
    v[0][i] = kv.x; v[1][i] = kv.y; v[2][i] = kv.z; v[3][i] = kv.w;
  }
}

// c128: pools the block's kChunk channels of one window from the thread's gathered slots (C128Layout) in
// two passes: the channel's max over all 128 slots (exact in any order), then Σ exp(s − max) and
// Σ v·exp(s − max) in a fixed order (the thread's slots in index order, a butterfly over the warp's slot
// groups, whose two lanes of a pair add the same two values, then the warps in index order), so no
// partial needs rescaling. Every thread of the block must call it; the result is valid in threads
// 0..Q-1 (4 channels each).
template <int kChunk>
__device__ float4 pool_c128(const float (&s)[4][C128Layout<kChunk>::kSlots],
                            const float (&v)[4][C128Layout<kChunk>::kSlots], C128Partials<kChunk>& part) {
  constexpr int kQuads = C128Layout<kChunk>::kQuads, kSlots = C128Layout<kChunk>::kSlots;
  const int quad = C128Layout<kChunk>::quad();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The max is exact in any order: fmaxf (one instruction; it skips a NaN score, whose exp still makes the sums
  // NaN), and the warps' maxima combine as a tree.
  float m[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    m[j] = s[j][0];
#pragma unroll
    for (int i = 1; i < kSlots; ++i) m[j] = fmaxf(m[j], s[j][i]);
#pragma unroll
    for (int d = kQuads; d < 32; d <<= 1) m[j] = fmaxf(m[j], __shfl_xor_sync(0xFFFFFFFFu, m[j], d));
  }
  if (lane < kQuads) *reinterpret_cast<float4*>(&part.m[warp][4 * lane]) = make_float4(m[0], m[1], m[2], m[3]);
  __syncthreads();
  float4 warp_max[kC128Warps];
#pragma unroll
  for (int k = 0; k < kC128Warps; ++k) warp_max[k] = *reinterpret_cast<const float4*>(&part.m[k][4 * quad]);
#pragma unroll
  for (int h = kC128Warps / 2; h >= 1; h /= 2) {
#pragma unroll
    for (int k = 0; k < h; ++k) {
      warp_max[k] = make_float4(fmaxf(warp_max[k].x, warp_max[k + h].x), fmaxf(warp_max[k].y, warp_max[k + h].y),
                                fmaxf(warp_max[k].z, warp_max[k + h].z), fmaxf(warp_max[k].w, warp_max[k + h].w));
    }
  }
  m[0] = warp_max[0].x; m[1] = warp_max[0].y; m[2] = warp_max[0].z; m[3] = warp_max[0].w;
  float sum[4], weighted[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    sum[j] = 0.f;
    weighted[j] = 0.f;
    const float shift = exp_shift(m[j]);
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const float e = expf(s[j][i] - shift);
      sum[j] += e;
      weighted[j] += v[j][i] * e;
    }
#pragma unroll
    for (int d = kQuads; d < 32; d <<= 1) {
      sum[j] += __shfl_xor_sync(0xFFFFFFFFu, sum[j], d);
      weighted[j] += __shfl_xor_sync(0xFFFFFFFFu, weighted[j], d);
    }
  }
  if (lane < kQuads) {
    *reinterpret_cast<float4*>(&part.l[warp][4 * lane]) = make_float4(sum[0], sum[1], sum[2], sum[3]);
    *reinterpret_cast<float4*>(&part.a[warp][4 * lane]) = make_float4(weighted[0], weighted[1], weighted[2],
                                                                      weighted[3]);
  }
  __syncthreads();
  // The next window's first writes (part.m) follow this window's last reads of part.m, and its part.l / a
  // writes follow its first barrier, which the readers below must reach first: no third barrier.
  float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
  if (threadIdx.x < kQuads) {
    float total[4] = {0.f, 0.f, 0.f, 0.f}, pooled[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int k = 0; k < kC128Warps; ++k) {
      const float4 lk = *reinterpret_cast<const float4*>(&part.l[k][4 * threadIdx.x]);
      const float4 ak = *reinterpret_cast<const float4*>(&part.a[k][4 * threadIdx.x]);
      total[0] += lk.x; total[1] += lk.y; total[2] += lk.z; total[3] += lk.w;
      pooled[0] += ak.x; pooled[1] += ak.y; pooled[2] += ak.z; pooled[3] += ak.w;
    }
    out.x = pooled_value(pooled[0], total[0]);
    out.y = pooled_value(pooled[1], total[1]);
    out.z = pooled_value(pooled[2], total[2]);
    out.w = pooled_value(pooled[3], total[3]);
  }
  return out;
}

// ---- c4 ----

// Channels [i, i + N) of a bf16 or fp32 row as floats, N = 1 or 2 (Vec: one access; see load4).
template <int N, bool Bf16, bool Vec>
__device__ __forceinline__ void load_n(const void* base, int64_t i, float (&out)[N]) {
  static_assert(N == 1 || N == 2, "one or two channels");
  if constexpr (N == 2 && Vec && Bf16) {
    const uint32_t v = *reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(base) + i);
    out[0] = bf16_to_f32(uint16_t(v & 0xFFFFu));
    out[1] = bf16_to_f32(uint16_t(v >> 16));
  } else if constexpr (N == 2 && Vec) {
    const float2 v = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + i);
    out[0] = v.x; out[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      out[j] = Bf16 ? bf16_to_f32(static_cast<const uint16_t*>(base)[i + j]) : static_cast<const float*>(base)[i + j];
    }
  }
}

// Rounds (RNE) to bf16 or stores fp32, channels [i, i + N), N = 1 or 2.
template <int N, bool Bf16, bool Vec>
__device__ __forceinline__ void store_n(void* base, int64_t i, const float (&v)[N]) {
  static_assert(N == 1 || N == 2, "one or two channels");
  if constexpr (N == 2 && Vec && Bf16) {
    *reinterpret_cast<uint32_t*>(static_cast<uint16_t*>(base) + i) =
        f32_to_bf16(v[0]) | (uint32_t(f32_to_bf16(v[1])) << 16);
  } else if constexpr (N == 2 && Vec) {
    *reinterpret_cast<float2*>(static_cast<float*>(base) + i) = make_float2(v[0], v[1]);
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (Bf16) {
        static_cast<uint16_t*>(base)[i + j] = f32_to_bf16(v[j]);
      } else {
        static_cast<float*>(base)[i + j] = v[j];
      }
    }
  }
}

// c4 decode: N = 1 or 2 channels per thread. An emitting row is a chain of dependent steps (plan row,
// window loads, 8 exps per channel, the store) and a small batch leaves a row or two per SM, so fewer
// channels per thread shorten the pooling's share of the chain; a large batch needs more rows resident per
// SM, which fewer threads per row give. H200, D 512, N = 1 / 2 / 4 (4 as the earlier kernel had): 64 rows
// 1.95 / 2.05 / 2.27 us, 256 rows 3.73 / 3.79 / 4.08, 1024 rows 9.45 / 8.48 / 8.76; D 128 at 1024 rows
// 3.49 / 3.65 / 3.91 (blocks of 512 channels then).
// A block's threads cover consecutive channels of the batch's rows laid end to end. With one channel per
// thread, D 512 rows take blocks of 128 threads (a row over four blocks, so a small batch spreads its
// pooling over four times the SMs) and D 128 rows blocks of 256. H200, cold rings, blocks of 512 / 256 /
// 128 threads: D 512 at 1 / 8 / 64 / 256 rows 1.23-1.25 / 1.67-1.70 / 2.38-2.41 / 3.55-3.56, 1.16-1.20 /
// 1.50-1.54 / 2.35-2.38 / 3.41-3.42, 1.11-1.15 / 1.40-1.44 / 2.31-2.39 / 3.37-3.43 us; D 128 at 8 / 64 /
// 1024 rows 1.36-1.37 / 1.57-1.58 / 3.30-3.32, 1.21 / 1.50 / 3.31-3.32, 1.35-1.39 / 1.44-1.49 / 3.42-3.50 us.
constexpr int kC4DecodeMaxThreads = 256;
__host__ __device__ constexpr int c4_decode_threads(int channels_per_thread, int64_t head_dim) {
  return channels_per_thread == 1 && head_dim == kMainDim ? 128 : kC4DecodeMaxThreads;
}
constexpr int64_t kC4DecodeOneChannelMax = 256 * int64_t(kMainDim);  // rows x head_dim up to which N = 1

// A decode window's ring slots for channels [c, c + N): slots 0..3 are the overlap halves of the previous
// chunk (page read_page_0; pad before the first full window), slots 4..6 the current chunk's earlier
// rows (page read_page_1); slot 7 is the input row itself. slot_source's rules for a decode plan row
// (buffer_len 7, src = b), with two page bases instead of a per-slot search; the loads of a pad slot
// read the pad page and are masked in pool().
template <int N, bool StBf16, bool Vec>
struct C4DecodeWindow {
  float value[7][N], score[7][N], bias[8][N];
  bool overlap_ok, current_ok;

  __device__ __forceinline__ void issue(const ForwardParams& p, const PoolWindow& w, int64_t c) {
    const int64_t D = p.head_dim, W = state_row_width(4, D), pages = p.state_rows / 4;
    overlap_ok = w.p >= compress_window(4) - 1 && w.read_page_0 >= 0 && w.read_page_0 < pages;
    current_ok = w.read_page_1 >= 0 && w.read_page_1 < pages;
    const int64_t overlap_row = (overlap_ok ? int64_t(w.read_page_0) : pages - 1) * 4 * W;
    const int64_t current_row = (current_ok ? int64_t(w.read_page_1) : pages - 1) * 4 * W;
#pragma unroll
    for (int k = 0; k < 7; ++k) {
      const int64_t at = (k < 4 ? overlap_row + k * W : current_row + (k - 4) * W) + c;
      load_n<N, StBf16, Vec>(p.state, at + value_column(4, k, D), value[k]);
      load_n<N, StBf16, Vec>(p.state, at + score_column(4, k, D), score[k]);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) load_n<N, false, Vec>(p.ape, int64_t(k) * D + c, bias[k]);
  }

  // The pooled channels, given the input row's kv and score (slot 7).
  __device__ __forceinline__ void pool(const float (&kv)[N], const float (&score_in)[N], float (&out)[N]) const {
    float s[N][8], v[N][8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const bool pad = k < 4 ? !overlap_ok : (k < 7 && !current_ok);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        v[j][k] = pad ? 0.f : (k < 7 ? value[k][j] : kv[j]);
        s[j][k] = pad ? __int_as_float(0xFF800000) : (k < 7 ? score[k][j] : score_in[j]) + bias[k][j];
      }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = softmax_pool<8>(s[j], v[j]);
  }
};

// Decode: one request per D/N threads; pools on boundary rows, writes the input row on every row.
template <int N, bool InBf16, bool StBf16, bool Vec>
__global__ void __launch_bounds__(kC4DecodeMaxThreads) c4_decode_kernel(ForwardParams p) {
  const int64_t D = p.head_dim;
  // The thread's first channel over the batch's rows laid end to end; D (512 or 128) is a power of two.
  const int64_t first = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * N;
  const int64_t b = first >> (__ffsll(D) - 1), c = first & (D - 1);
  warm_params(p, p.plan);
  pdl_wait_dependencies();
  if (b >= p.plan_rows) return;
  const DecodeEntry e = load_decode_entry(p.plan + b * kPlanRowBytes);
  float row[4][N];  // kv_ov, kv, s_ov, s of the input row
#pragma unroll
  for (int part = 0; part < 4; ++part) load_n<N, InBf16, Vec>(p.input, b * p.input_stride + part * D + c, row[part]);
  const PoolWindow w = decode_window(e, b, 4);
  C4DecodeWindow<N, StBf16, Vec> window;
  if (w.emits) window.issue(p, w, c);  // before the state write: its loads need only the plan row
  // The write goes to the ring row of p, which this window never reads (it takes p from the input).
  if (e.seq_len != kInvalidPlanWord && writable_state_row(e.write_loc, p.state_rows, 4)) {
    const int64_t base = int64_t(e.write_loc) * 4 * D;
#pragma unroll
    for (int part = 0; part < 4; ++part) store_n<N, StBf16, Vec>(p.state, base + part * D + c, row[part]);
  }
  // The window's loads, the last reads of the state (§4.6), are out: the next grid may start its prologue
  // during the pooling. After the pooling instead: 4-7 % slower at 1-64 rows (H100, graph replay).
  pdl_launch_dependents();
  float out[N] = {};
  if (w.emits) window.pool(row[1], row[3], out);
  store_n<N, InBf16, Vec>(p.out, b * D + c, out);
}

// Prefill: one CompressPlan row per D/4 threads; invalid rows give zeros.
template <bool InBf16, bool StBf16, bool Vec>
__global__ void __launch_bounds__(kC4Threads) c4_prefill_kernel(ForwardParams p) {
  const int64_t D = p.head_dim;
  const int threads_per_row = int(D / 4);
  const int64_t k = int64_t(blockIdx.x) * (kC4Threads / threads_per_row) + threadIdx.x / threads_per_row;
  const int64_t c = 4 * int64_t(threadIdx.x % threads_per_row);
  pdl_wait_dependencies();
  if (k >= p.plan_rows) return;
  const PoolWindow w = prefill_window(load_compress_entry(p.plan + k * kPlanRowBytes));
  const bool all_input = w.buffer_len == 0 && w.p >= compress_window(4) - 1 && w.src >= compress_window(4) - 1 &&
                         w.src < p.input_rows;  // uniform in the row's threads: a warp or a block
  float4 out = make_float4(0.f, 0.f, 0.f, 0.f);
  if (w.emits) out = all_input ? pool_c4_input<InBf16, Vec>(p, w, c) : pool_c4<InBf16, StBf16, Vec>(p, w, c);
  pdl_launch_dependents();
  store4<InBf16, Vec>(p.out, k * D + c, out);
}

// ---- c128 ----

// Decode, pool blocks: pool block `pool` of channel chunk `chunk` finds the batch's closing rows in row
// order and pools, on that chunk, those whose rank is `pool` modulo pool_blocks, one after another. A batch closes
// about one row in 128, and c128_pool_blocks keeps the expected count per pool block below one: when the
// pooling was done by the blocks that copy the rows, two closing rows in one block were pooled serially
// (H200, fp32, 256 rows: one closing row 3.3 us, two in one block 5.4, two in different blocks 4.1; with
// pool blocks 3.2 / 3.5 / 3.4). pool_blocks comes as a host-made Divider: a closing row's path divides by it
// three times, a block's without one once.
template <bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ void c128_decode_pool(const ForwardParams& p, int64_t chunk, int pool,
                                                 const Divider& pool_blocks) {
  constexpr int kChunk = kC128DecodeChunk, kQuads = kChunk / 4;
  // A thread reads the seq_len words of rows base + t + 256·j, j < kRowsPerThread, all loads at once: a
  // batch of up to 1024 rows takes one round trip.
  constexpr int kRowsPerThread = 4;
  __shared__ uint32_t warp_counts[kRowsPerThread][kC128Warps];
  __shared__ int32_t mine[kC128MaxPooledRows];  // this block's closing rows, in row order
  __shared__ C128Partials<kChunk> part;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Closing rows of rank below r that are this block's (ranks pool, pool + P, ...). Rows, and so ranks, are
  // below 2^30 (a decode row's input alone is 4 KiB), so the Divider's dividends stay below 2^31.
  auto owned_below = [&](uint32_t r) {
    return r > uint32_t(pool) ? pool_blocks.div(r - pool + pool_blocks.divisor - 1) : 0u;
  };
  uint32_t seen = 0;  // closing rows in earlier slices
  for (int64_t base = 0; base < p.plan_rows; base += kRowsPerThread * kC128Threads) {
    uint32_t seq_len[kRowsPerThread];
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const int64_t row = base + j * kC128Threads + threadIdx.x;
      seq_len[j] = row < p.plan_rows ? *reinterpret_cast<const uint32_t*>(p.plan + row * kPlanRowBytes) : 0;
    }
    uint32_t mask[kRowsPerThread], any = 0;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      mask[j] = __ballot_sync(0xFFFFFFFFu, decode_emits(seq_len[j], 128));
      if (lane == 0) warp_counts[j][warp] = __popc(mask[j]);
      any |= mask[j];
    }
    // Most slices close no row (one row in 128 closes): they skip the ranking, and as no thread then reads
    // warp_counts or writes mine, they need no second barrier. H100, graph replay, 1 / 8 / 64 rows: 1.83 /
    // 1.78 / 2.69 -> 1.60 / 1.54 / 2.59 us.
    if (!__syncthreads_or(any != 0)) continue;
    uint32_t before = seen;  // closing rows before row base + j·256 + warp·32, at sub-slice j
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      // Sub-slices past the batch close nothing: a batch of up to 256 rows ranks one, which takes about 150
      // instructions off a closing call's chain (H100, 64 / 256 rows: 2.38 / 3.87 -> 2.32 / 3.80 us).
      if (base + j * kC128Threads >= p.plan_rows) break;  // block-uniform
      uint32_t rank = before;
#pragma unroll
      for (int k = 0; k < kC128Warps; ++k) {
        rank += k < warp ? warp_counts[j][k] : 0;
        before += warp_counts[j][k];
      }
      rank += __popc(mask[j] & ((1u << lane) - 1u));
      if ((mask[j] >> lane & 1u) && pool_blocks.mod(rank) == uint32_t(pool)) {
        mine[owned_below(rank)] = int32_t(base + j * kC128Threads + threadIdx.x);
      }
    }
    seen = before;
    __syncthreads();  // the next slice rewrites warp_counts; the pooling below reads mine
  }
  // owned_below(seen) <= ceil(rows / pool_blocks) <= kC128MaxPooledRows (c128_pool_blocks).
  const int count = int(owned_below(seen));
  if (count == 0) pdl_launch_dependents();  // it read no state
  for (int i = 0; i < count; ++i) {  // block-uniform
    const int64_t b = mine[i];
    const PoolWindow w = decode_window(load_decode_entry(p.plan + b * kPlanRowBytes), b, 128);
    float s[4][C128Layout<kChunk>::kSlots], v[4][C128Layout<kChunk>::kSlots];
    gather_c128_decode<kChunk, InBf16, StBf16, Vec>(p, w, chunk, s, v);
    // The last window's ring loads, the block's last reads of the state (§4.6), are out: the next grid may start
    // its prologue during the pooling.
    if (i == count - 1) pdl_launch_dependents();
    const float4 out = pool_c128<kChunk>(s, v, part);
    if (threadIdx.x < kQuads) store4<InBf16, Vec>(p.out, b * p.head_dim + chunk + 4 * threadIdx.x, out);
  }
}

// Decode, copy blocks: copy block `group` of channel chunk `chunk` serves requests [group·R, group·R + R),
// R = kC128CopyRows: it copies that chunk of each input row (kv and s halves) to the state and writes the
// zero outputs of the rows that do not close a chunk. The writes go to the ring rows of the current
// positions, which no window of this call reads (each takes its current token from the input, and a pool
// block discards what it loads for slot 127), so they need not wait for the pool blocks.
template <bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ void c128_decode_copy(const ForwardParams& p, int64_t chunk, int64_t group) {
  constexpr int kChunk = kC128DecodeChunk, kQuads = kChunk / 4;
  __shared__ DecodeEntry entries[kC128CopyRows];
  const int64_t D = p.head_dim;
  const int64_t first = group * kC128CopyRows;
  if (threadIdx.x < kC128CopyRows && first + threadIdx.x < p.plan_rows) {
    entries[threadIdx.x] = load_decode_entry(p.plan + (first + threadIdx.x) * kPlanRowBytes);
  }
  // This thread's copy item: row r, the kv (half 0) or s (half 1) part of the chunk, 4 channels.
  // Input loads do not depend on the plan: issue them before the barrier.
  const int r_item = threadIdx.x / kC128DecodeItemsPerRow;
  const int half = (threadIdx.x / kQuads) % 2;
  const int64_t col = half * D + chunk + 4 * (threadIdx.x % kQuads);
  const bool has_item = first + r_item < p.plan_rows;
  float4 item = make_float4(0.f, 0.f, 0.f, 0.f);
  if (has_item) item = load4<InBf16, Vec>(p.input, (first + r_item) * p.input_stride + col);
  __syncthreads();
  if (!has_item) return;
  const DecodeEntry e = entries[r_item];
  if (e.seq_len != kInvalidPlanWord && writable_state_row(e.write_loc, p.state_rows, 128)) {
    store4<StBf16, Vec>(p.state, int64_t(e.write_loc) * 2 * D + col, item);
  }
  // The kv half's items cover the chunk's output channels.
  if (half == 0 && !decode_emits(e.seq_len, 128)) {
    store4<InBf16, Vec>(p.out, (first + r_item) * D + col, make_float4(0.f, 0.f, 0.f, 0.f));
  }
}

// Decode: block i is role i / chunks on channel chunk i % chunks; roles 0..pool_blocks-1 are the pool
// blocks, which a 1-D grid schedules first (theirs are the long chains), the rest the copy blocks.
template <bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ void c128_decode(const ForwardParams& p, const Divider& pool_blocks) {
  constexpr int kChunks = kMainDim / kC128DecodeChunk;  // c128 has head_dim 512
  const int role = int(blockIdx.x / kChunks);
  const int64_t chunk = int64_t(blockIdx.x % kChunks) * kC128DecodeChunk;
  pdl_wait_dependencies();
  if (role < int(pool_blocks.divisor)) {
    c128_decode_pool<InBf16, StBf16, Vec>(p, chunk, role, pool_blocks);  // triggers its dependents itself
  } else {
    c128_decode_copy<InBf16, StBf16, Vec>(p, chunk, role - int(pool_blocks.divisor));
    pdl_launch_dependents();
  }
}

// Equal dtypes take 48-51 registers on sm_90 (55-64 on sm_100). Any minimum-blocks bound made ptxas use 64-80
// and spill, so only mixed dtypes, which take about 75, get one (three blocks per SM; 80 registers, and on
// sm_100 a 4-byte spill): without it ptxas capped fp32 input with bf16 state at 64 registers and spilled 88
// bytes.
template <bool InBf16, bool Vec>
__global__ void __launch_bounds__(kC128Threads) c128_decode_kernel(ForwardParams p, Divider pool_blocks) {
  c128_decode<InBf16, InBf16, Vec>(p, pool_blocks);
}

template <bool InBf16, bool StBf16, bool Vec>
__global__ void __launch_bounds__(kC128Threads, 3) c128_decode_mixed_kernel(ForwardParams p, Divider pool_blocks) {
  c128_decode<InBf16, StBf16, Vec>(p, pool_blocks);
}

// Prefill: a warp pools window slots of one CompressPlan row on one 32-channel chunk. Lane = 8 channel
// quads x 4 slot lanes; slot lane j takes slots j, j + 4, j + 8, ..., so each load instruction reads four
// rows' 128-byte chunks. The warp folds its slots into a running softmax (max, Σ exp(s − max),
// Σ v·exp(s − max)) per channel, kC128PrefillSlots slots per lane at a time, and merges its slot lanes by
// shuffles. A lane pools up to 128 (channel, slot) pairs per window, so the per-window work (plan row,
// bounds, merge, division) is spread over 8x the pairs of the earlier block-per-window kernel, whose 256
// threads pooled 16 pairs each and merged through shared memory (ncu, 64K tokens: 47 M warp instructions
// against 23 M now; H200, 128K tokens, fp32: 160-165 -> 144-148 us, 80 -> 86-91 % of copy). A small prefill has too few
// windows to fill the GPU with one warp each: then the block's warps share a window's slots and merge
// through shared memory.
constexpr int kC128PrefillWarps = 4;
constexpr int kC128SlotLanes = 4;
constexpr int kC128Quads = kC128PrefillChunk / 4;

// Running softmax of four channels.
struct RunningSoftmax4 {
  float m[4], l[4], a[4];
};

// Channel j of a float4.
__device__ __forceinline__ float channel(const float4& x, int j) {
  return j == 0 ? x.x : j == 1 ? x.y : j == 2 ? x.z : x.w;
}

// Folds the scores (ape added) and values of a group of kSlots slots into r (per channel: the new max M,
// r rescaled by exp(m − M), then the group's terms), with exponents against exp_shift(M).
template <int kSlots>
__device__ __forceinline__ void fold_group(RunningSoftmax4& r, const float4 (&s)[kSlots], const float4 (&v)[kSlots]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float m = r.m[j];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) m = fmaxf(m, channel(s[i], j));  // one instruction (compare and select: two)
    const float shift = exp_shift(m);
    const float rescale = expf(r.m[j] - shift);
    float l = r.l[j] * rescale, a = r.a[j] * rescale;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const float e = expf(channel(s[i], j) - shift);
      l += e;
      a += channel(v[i], j) * e;
    }
    r.m[j] = m; r.l[j] = l; r.a[j] = a;
  }
}

// Loads and folds one group: the lane's slot i is row + i·kC128SlotLanes rows (`row_step` elements apart)
// with bias row bias + i·kC128SlotLanes·D. c128 has D = kMainDim, so a slot's score and bias offsets are
// constants. kTail: the lane holds only `slots_left` slots of the phase; the others are pad.
template <bool Bf16, bool Vec, bool kTail>
__device__ __forceinline__ void fold_slots(RunningSoftmax4& r, const void* row, int64_t row_step, const float* bias,
                                           int slots_left) {
  using T = typename std::conditional<Bf16, uint16_t, float>::type;
  constexpr int kSlots = kC128PrefillSlots;
  float4 v[kSlots], s[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    if (!kTail || kC128SlotLanes * i < slots_left) {
      const T* at = static_cast<const T*>(row) + i * row_step;
      v[i] = load4<Bf16, Vec>(at, 0);
      s[i] = add4(load4<Bf16, Vec>(at, kMainDim), load4<false, Vec>(bias, int64_t(i) * kC128SlotLanes * kMainDim));
    } else {
      v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      s[i] = neg_inf4();
    }
  }
  fold_group<kSlots>(r, s, v);
}

// Folds window slots [lo, hi) into r, slot k read from row row0 + k of `base` (bf16 or fp32, `stride`
// elements per row; value at column c, score at column c + D). The lane's slots are lo + 4·i + slot_lane.
template <bool Bf16, bool Vec>
__device__ __forceinline__ void fold_rows(RunningSoftmax4& r, const float* ape, const void* base, int64_t row0,
                                          int64_t stride, int64_t c, int lo, int hi, int slot_lane) {
  using T = typename std::conditional<Bf16, uint16_t, float>::type;
  constexpr int kStep = kC128SlotLanes * kC128PrefillSlots;
  const T* row = static_cast<const T*>(base) + (row0 + lo + slot_lane) * stride + c;
  const float* bias = ape + int64_t(lo + slot_lane) * kMainDim + c;
  const int64_t row_step = kC128SlotLanes * stride;
  int k0 = lo;
  for (; k0 + kStep <= hi; k0 += kStep) {  // warp-uniform
    fold_slots<Bf16, Vec, false>(r, row, row_step, bias, 0);
    row += kStep * stride;
    bias += kStep * kMainDim;
  }
  if (k0 < hi) fold_slots<Bf16, Vec, true>(r, row, row_step, bias, hi - k0 - slot_lane);
}

// Merges the warp's four slot lanes into every lane: the warp's max, each lane's sums rescaled to it, then
// a butterfly whose two lanes of a pair add the same two values in either order (same bits).
__device__ __forceinline__ void merge_slot_lanes(RunningSoftmax4& r) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float m = r.m[j];
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 8));
    m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, 16));
    const float rescale = expf(r.m[j] - exp_shift(m));
    float l = r.l[j] * rescale, a = r.a[j] * rescale;
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 8);
    a += __shfl_xor_sync(0xFFFFFFFFu, a, 8);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 16);
    a += __shfl_xor_sync(0xFFFFFFFFu, a, 16);
    r.m[j] = m; r.l[j] = l; r.a[j] = a;
  }
}

// Folds the window's slots [lo, hi) into r: slot_source's rules as two ranges, slots [0, buffer_len) from
// ring page read_page_1 (none if the page is out of range), then slot k from input row src − 127 + k where
// that row exists; every other slot is pad.
template <bool InBf16, bool StBf16, bool Vec>
__device__ __forceinline__ void fold_window(RunningSoftmax4& r, const ForwardParams& p, const PoolWindow& w, int64_t c,
                                            int lo, int hi, int slot_lane) {
  const int64_t ring_end = w.buffer_len < hi ? w.buffer_len : hi;
  const bool page_ok = w.read_page_1 >= 0 && w.read_page_1 < p.state_rows / 128;
  if (page_ok && lo < ring_end) {
    fold_rows<StBf16, Vec>(r, p.ape, p.state, int64_t(w.read_page_1) * 128, 2 * kMainDim, c, lo, int(ring_end),
                           slot_lane);
  }
  const int64_t row0 = w.src - 127;
  int64_t input_lo = w.buffer_len > lo ? w.buffer_len : lo;
  input_lo = input_lo > -row0 ? input_lo : -row0;
  const int64_t input_hi = p.input_rows - row0 < hi ? p.input_rows - row0 : hi;
  if (input_lo < input_hi) {
    fold_rows<InBf16, Vec>(r, p.ape, p.input, row0, p.input_stride, c, int(input_lo), int(input_hi), slot_lane);
  }
}

// kSplits warps share a window, warp w taking slots [128 / kSplits · (w % kSplits), ...): 1 for large
// prefills, kC128PrefillWarps when one warp per window would leave most of the GPU idle. One warp per
// window is bounded to eight blocks per SM (64 registers, no spill on sm_90; unbounded, ptxas takes four more
// for fp32 and fits seven; on sm_100 the bound costs the fp32-input variants a 12-16-byte spill, unmeasured).
template <int kSplits, bool InBf16, bool StBf16, bool Vec>
__global__ void __launch_bounds__(kC128PrefillWarps * 32, kSplits == 1 ? 8 : 1) c128_prefill_kernel(ForwardParams p) {
  constexpr int kSpan = 128 / kSplits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slot_lane = lane / 8, quad = lane % 8;
  const int split = warp % kSplits;
  const int64_t k = int64_t(blockIdx.x) * (kC128PrefillWarps / kSplits) + warp / kSplits;
  const int64_t c = int64_t(blockIdx.y) * kC128PrefillChunk + 4 * quad;
  pdl_wait_dependencies();
  const bool live = k < p.plan_rows;  // with splits, not an early return: the block meets at a barrier
  if (kSplits == 1 && !live) return;
  const float ninf = __int_as_float(0xFF800000);
  RunningSoftmax4 r{{ninf, ninf, ninf, ninf}, {0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  const PoolWindow w = live ? prefill_window(load_compress_entry(p.plan + k * kPlanRowBytes)) : PoolWindow{};
  if (w.emits) fold_window<InBf16, StBf16, Vec>(r, p, w, c, split * kSpan, split * kSpan + kSpan, slot_lane);
  merge_slot_lanes(r);
  if constexpr (kSplits > 1) {
    __shared__ float4 part_m[kC128PrefillWarps][kC128Quads], part_l[kC128PrefillWarps][kC128Quads],
        part_a[kC128PrefillWarps][kC128Quads];
    if (slot_lane == 0) {
      part_m[warp][quad] = make_float4(r.m[0], r.m[1], r.m[2], r.m[3]);
      part_l[warp][quad] = make_float4(r.l[0], r.l[1], r.l[2], r.l[3]);
      part_a[warp][quad] = make_float4(r.a[0], r.a[1], r.a[2], r.a[3]);
    }
    __syncthreads();
    if (split == 0 && slot_lane == 0) {
      // The splits' partials in split order, each rescaled to their common max.
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float top = channel(part_m[warp][quad], j);
#pragma unroll
        for (int i = 1; i < kSplits; ++i) top = fmaxf(top, channel(part_m[warp + i][quad], j));
        const float shift = top == ninf ? 0.f : top;
        r.l[j] = 0.f; r.a[j] = 0.f;
#pragma unroll
        for (int i = 0; i < kSplits; ++i) {
          const float e = expf(channel(part_m[warp + i][quad], j) - shift);
          r.l[j] += channel(part_l[warp + i][quad], j) * e;
          r.a[j] += channel(part_a[warp + i][quad], j) * e;
        }
      }
    }
  }
  pdl_launch_dependents();
  if (live && split == 0 && slot_lane == 0) {
    float out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = pooled_value(r.a[j], r.l[j]);
    store4<InBf16, Vec>(p.out, k * kMainDim + c, make_float4(out[0], out[1], out[2], out[3]));
  }
}

// ---- prefill state writes (second launch) ----

// One warp per WritePlan row: copies the whole input row to its state row. Each lane issues all its
// loads before its first store: the compiler may not move a load above a store that could alias it, so a
// load-store loop waited one memory round trip per iteration (16 for a c4 D 512 fp32 row, about 9.5 us
// per prefill call on an H200). Nothing is read before the wait (§4.6): this launch may directly follow
// the planner (an empty CompressPlan skips the compress launch), whose last kernel may still be writing
// plan_w; after a compress launch, the wait also puts the state writes behind its ring reads.
// Before the wait, a warp's first lane prefetches its plan_w row into the L2 (no read; see prefetch_l2):
// the launch starts while the compress launch runs, so after the wait the chain is the input row's trip
// and the store (H200, prefills from scratch: 0.1-0.5 us per call, c128 at 4K tokens 13.1-13.3 ->
// 12.7-12.9 us).
template <bool InBf16, bool StBf16, bool Vec>
__global__ void __launch_bounds__(kWriteWarps * 32) state_write_kernel(ForwardParams p) {
  constexpr int kMaxChunks = 4 * kMainDim / (4 * 32);  // float4 chunks per lane of the widest row (c4, D 512)
  const int lane = threadIdx.x & 31;
  const int64_t i = int64_t(blockIdx.x) * kWriteWarps + (threadIdx.x >> 5);
  const int64_t width = state_row_width(p.ratio, p.head_dim);
  if (lane == 0 && i < p.plan_w_rows) prefetch_l2(p.plan_w + i * kWritePlanRowBytes);
  pdl_wait_dependencies();
  bool live = i < p.plan_w_rows;
  int64_t dst = -1;
  float4 chunk[kMaxChunks];
  if (live) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p.plan_w + i * kWritePlanRowBytes);
    const int64_t src = raw.x;
    dst = int32_t(raw.y);
    live = raw.x != kInvalidPlanWord && src < p.input_rows && writable_state_row(dst, p.state_rows, p.ratio);
    if (live) {
#pragma unroll
      for (int j = 0; j < kMaxChunks; ++j) {
        const int64_t col = 4 * (lane + 32 * j);
        if (col < width) chunk[j] = load4<InBf16, Vec>(p.input, src * p.input_stride + col);
      }
    }
  }
  if (!live) return;
#pragma unroll
  for (int j = 0; j < kMaxChunks; ++j) {
    const int64_t col = 4 * (lane + 32 * j);
    if (col < width) store4<StBf16, Vec>(p.state, dst * width + col, chunk[j]);
  }
}

unsigned blocks_for(int64_t n, int64_t per_block) { return unsigned((n + per_block - 1) / per_block); }

// Decode pool blocks per channel chunk: a block per kC128MaxPooledRows rows (a batch closes about one row
// in 128, so a block pools about half a window on average), at least two, at most one per row. Rounded
// up, so that no block owns more than kC128MaxPooledRows rows even if every row closes.
int c128_pool_blocks(int64_t rows) {
  const int64_t n = (rows + kC128MaxPooledRows - 1) / kC128MaxPooledRows;
  const int64_t at_least_two = n < 2 ? 2 : n;
  return int(at_least_two < rows ? at_least_two : rows);
}

// Whether c128 prefill windows are shared by a block's warps: while one warp per window would leave most
// of the GPU idle. H200, fp32, four warps per window against one: 4K tokens (32 windows) 12.6 against
// 23.6 us; 32K tokens (256 windows) 48.8 against 46.1 us.
bool c128_prefill_split(int64_t rows) { return rows <= 64; }

template <bool InBf16, bool StBf16, bool Vec>
void launch(const ForwardParams& p, cudaStream_t stream) {
  if (p.plan_rows > 0) {
    if (p.ratio == 4) {  // a c4 block covers consecutive channels of the plan's rows laid end to end
      const int64_t channels = p.plan_rows * p.head_dim;
      if (p.is_decode && channels <= kC4DecodeOneChannelMax) {
        const int threads = c4_decode_threads(1, p.head_dim);
        launch_kernel(c4_decode_kernel<1, InBf16, StBf16, Vec>, dim3(blocks_for(channels, threads)), dim3(threads), 0,
                      stream, "compress_forward", p);
      } else if (p.is_decode) {
        const int threads = c4_decode_threads(2, p.head_dim);
        launch_kernel(c4_decode_kernel<2, InBf16, StBf16, Vec>, dim3(blocks_for(channels, 2 * threads)), dim3(threads),
                      0, stream, "compress_forward", p);
      } else {
        launch_kernel(c4_prefill_kernel<InBf16, StBf16, Vec>, dim3(blocks_for(channels, 4 * kC4Threads)),
                      dim3(kC4Threads), 0, stream, "compress_forward", p);
      }
    } else {
      if (p.is_decode) {
        const int pool_blocks = c128_pool_blocks(p.plan_rows);
        const unsigned roles = unsigned(pool_blocks) + blocks_for(p.plan_rows, kC128CopyRows);
        const dim3 grid(roles * unsigned(kMainDim / kC128DecodeChunk));
        const Divider pool_divider = make_divider(uint32_t(pool_blocks));
        if constexpr (InBf16 == StBf16) {
          launch_kernel(c128_decode_kernel<InBf16, Vec>, grid, dim3(kC128Threads), 0, stream, "compress_forward", p,
                        pool_divider);
        } else {
          launch_kernel(c128_decode_mixed_kernel<InBf16, StBf16, Vec>, grid, dim3(kC128Threads), 0, stream,
                        "compress_forward", p, pool_divider);
        }
      } else {
        const unsigned chunks = unsigned(kMainDim / kC128PrefillChunk);
        if (c128_prefill_split(p.plan_rows)) {
          launch_kernel(c128_prefill_kernel<kC128PrefillWarps, InBf16, StBf16, Vec>,
                        dim3(unsigned(p.plan_rows), chunks), dim3(kC128PrefillWarps * 32), 0, stream,
                        "compress_forward", p);
        } else {
          launch_kernel(c128_prefill_kernel<1, InBf16, StBf16, Vec>,
                        dim3(blocks_for(p.plan_rows, kC128PrefillWarps), chunks), dim3(kC128PrefillWarps * 32), 0,
                        stream, "compress_forward", p);
        }
      }
    }
  }
  if (!p.is_decode && p.plan_w_rows > 0) {
    launch_kernel(state_write_kernel<InBf16, StBf16, Vec>, dim3(blocks_for(p.plan_w_rows, kWriteWarps)),
                  dim3(kWriteWarps * 32), 0, stream, "compress_forward (state write)", p);
  }
}

// Vector accesses need 16-B (fp32) / 8-B (bf16) aligned bases and row strides of every tensor touched.
bool vector_aligned(const ForwardParams& p) {
  auto ok = [](const void* ptr, size_t align) { return reinterpret_cast<uintptr_t>(ptr) % align == 0; };
  const size_t in_align = p.input_bf16 ? 8 : 16, st_align = p.state_bf16 ? 8 : 16;
  return ok(p.input, in_align) && p.input_stride % 4 == 0 && ok(p.state, st_align) && ok(p.ape, 16) &&
         ok(p.out, in_align);
}

template <bool InBf16, bool StBf16>
void launch_types(const ForwardParams& p, cudaStream_t stream) {
  if (vector_aligned(p)) launch<InBf16, StBf16, true>(p, stream); else launch<InBf16, StBf16, false>(p, stream);
}

}  // namespace

void compress_forward_cuda(const ForwardParams& p, cudaStream_t stream) {
  if (p.input_bf16) {
    if (p.state_bf16) launch_types<true, true>(p, stream); else launch_types<true, false>(p, stream);
  } else {
    if (p.state_bf16) launch_types<false, true>(p, stream); else launch_types<false, false>(p, stream);
  }
}

}  // namespace dsv4
