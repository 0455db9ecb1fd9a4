// Warp-level row quantizers of the CUDA writers. Main layouts: one token per warp, lane l holds dims
// [16l, 16l+16) (lanes 28..31 hold the 64 RoPE dims); indexer formats: a row on 128 / LaneDims adjacent
// lanes. Every lane of the row must call these (tile amax uses shuffles).
#pragma once

#include <cstdint>

#include "dsv4/e2m1_pairs.cuh"
#include "dsv4/kv_layout.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/shared_io.cuh"
#include "dsv4/vec_io.cuh"

namespace dsv4 {

// max |x_i| over N (a power of two) values as a tree of depth log2(N) rather than a chain of N
// dependent steps; each step is one FMNMX with absolute-value operands. Exact (max is), equal to the
// sequential fmax_f32 / fabs_f32 scan on finite values; NaN/Inf inputs are outside the writers' and
// the store's contract (bytes unspecified), where the two may differ.
template <int N>
__device__ __forceinline__ float abs_max(const float* x) {
  float m[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) m[i] = fmaxf(fabsf(x[2 * i]), fabsf(x[2 * i + 1]));
#pragma unroll
  for (int h = N / 4; h >= 1; h /= 2) {
#pragma unroll
    for (int i = 0; i < h; ++i) m[i] = fmaxf(m[i], m[i + h]);
  }
  return m[0];
}

constexpr int kLaneDims = kMainDim / 32;                // 16
constexpr int kRopeFirstLane = kV4NopeDim / kLaneDims;  // 28: lanes 28..31 own the RoPE dims
// Indexer rows are short (128 dims), so a warp takes four: 8 lanes x 16 dims each, which keeps enough
// bytes in flight and amortizes the per-row index and reduction work.
constexpr int kIndexerGroupLanes = 8;
constexpr int kIndexerGroupLaneDims = kIndexerDim / kIndexerGroupLanes;  // 16
constexpr int kIndexerRowsPerWarp = 32 / kIndexerGroupLanes;             // 4

// Stores Bytes (2, 4, 8, 16 or 32) bytes of `words` (little-endian, bits 0..15 of words[0] for 2) at a
// destination aligned to min(Bytes, 16).
template <int Bytes>
__device__ __forceinline__ void store_words(uint8_t* dst, const uint32_t* words) {
  if constexpr (Bytes == 2) {
    *reinterpret_cast<uint16_t*>(dst) = uint16_t(words[0]);
  } else if constexpr (Bytes == 4) {
    *reinterpret_cast<uint32_t*>(dst) = words[0];
  } else if constexpr (Bytes == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  } else {
    static_assert(Bytes % 16 == 0, "2, 4, 8 or a multiple of 16 bytes");
#pragma unroll
    for (int k = 0; k < Bytes / 16; ++k) {
      reinterpret_cast<uint4*>(dst)[k] = make_uint4(words[4 * k], words[4 * k + 1], words[4 * k + 2], words[4 * k + 3]);
    }
  }
}

// Stores N values as the e4m3 codes of x * 2^(127 - scale_byte) (the V4 / V41 data bytes) at dst.
template <int N>
__device__ __forceinline__ void store_e4m3_lane(const float* x, uint8_t scale_byte, uint8_t* dst) {
  const float inv = inverse_scale_of_byte(scale_byte);
  uint32_t w[N / 4];
#pragma unroll
  for (int k = 0; k < N / 4; ++k) {
    const uint32_t lo = e4m3x2_encode(x[4 * k] * inv, x[4 * k + 1] * inv);
    const uint32_t hi = e4m3x2_encode(x[4 * k + 2] * inv, x[4 * k + 3] * inv);
    w[k] = lo | (hi << 16);
  }
  store_words<N>(dst, w);
}

// Stores V4's RoPE dims as bf16 at `dst` (the row's 128 RoPE bytes, 4-byte aligned) when lanes 28..31 hold
// them, 16 each: the tail lanes put their packed pairs in the warp's 128-byte exchange area at `tail_at`
// (16-byte aligned), and lane l stores word l, one coalesced 128-byte store. Stored by the tail lanes
// themselves, 32 bytes each in two 16-byte halves 32 bytes apart, each of the four sectors took two partial
// writes from two instructions, and V4 rows were the slow ones (H100, KV store of 65536 rows: 43.0 -> 38.0 us,
// V41 34.7). Same roundings, so the same bytes. All lanes must call; the opening barrier orders this call's
// writes to the area after every lane's read of the previous call's.
__device__ __forceinline__ void store_v4_tail_across_warp(const float* x, int lane, uint32_t tail_at,
                                                          uint8_t* dst) {
  __syncwarp();
  if (lane >= kRopeFirstLane) {
    const uint32_t at = tail_at + (lane - kRopeFirstLane) * kLaneDims * 2;
#pragma unroll
    for (int j = 0; j < kLaneDims; j += 8) {
      store_shared_u4(at + 2 * j, make_uint4(pack_bf16x2(x[j], x[j + 1]), pack_bf16x2(x[j + 2], x[j + 3]),
                                             pack_bf16x2(x[j + 4], x[j + 5]), pack_bf16x2(x[j + 6], x[j + 7])));
    }
  }
  __syncwarp();
  reinterpret_cast<uint32_t*>(dst)[lane] = load_shared_u32(tail_at + 4 * lane);
}

// Quantizes this lane's LaneDims values of a main row (held by 512 / LaneDims lanes of aligned groups;
// `sub` = this lane's index in the row: dims [LaneDims * sub, LaneDims * (sub + 1))) into the layout's data
// and scale rows. A tile's amax is reduced over the lanes that share it (16 dims per lane: V4 4 lanes, V41
// 2, V41_FP4 1; 4 dims per lane: 16, 8, 4). V4's RoPE lanes store their values as bf16 (a tile never mixes
// nope and RoPE dims, so their lanes take no part in the nope lanes' reductions).
// Bf16Values: every x is bf16-representable, which lets V41_FP4 encode pairs (e2m1_pairs.cuh); same bytes.
// WholeWarp: every lane of the warp makes this call, so the tile-amax shuffles name the whole warp (a constant
// mask spares the convergence check that the compiler puts before shuffles with a computed mask).
// V4TailStored: the caller has stored V4's RoPE dims (rotate_tail_to_bf16_across_warp, store_v4_tail_across_warp);
// their lanes store nothing.
template <KVLayout L, bool Bf16Values, int LaneDims = kLaneDims, bool WholeWarp = false, bool V4TailStored = false>
__device__ __forceinline__ void quantize_main_lane(const float* x, int sub, uint8_t* data, uint8_t* scale) {
  constexpr int kTile = LayoutTraits<L>::kTile;
  static_assert(LaneDims % 4 == 0 && kTile % LaneDims == 0, "a lane holds whole words of one tile");
  constexpr int kLanesPerTile = kTile / LaneDims;
  // Every lane takes part in the shuffles before any returns (the RoPE lanes reduce among themselves).
  const float lane_amax = abs_max<LaneDims>(x);
  const float amax = WholeWarp ? warp_max_xor(lane_amax, kLanesPerTile, 0xFFFFFFFFu)
                               : warp_max_xor(lane_amax, kLanesPerTile);
  if (L == KVLayout::V4 && sub >= kV4NopeDim / LaneDims) {
    if constexpr (!V4TailStored) {
      uint32_t w[LaneDims / 2];
#pragma unroll
      for (int k = 0; k < LaneDims / 2; ++k) w[k] = pack_bf16x2(x[2 * k], x[2 * k + 1]);
      store_words<2 * LaneDims>(data + kV4NopeDim + 2 * LaneDims * (sub - kV4NopeDim / LaneDims), w);
    }
    return;
  }
  uint8_t scale_byte;
  if constexpr (L == KVLayout::V41_FP4) {
    scale_byte = Bf16Values ? v41_fp4_scale_byte_of_bf16(amax) : v41_fp4_scale_byte(amax);
    uint32_t packed[(LaneDims + 7) / 8] = {};  // eight codes per word
    if constexpr (Bf16Values) {
      encode_e2m1_pairs<LaneDims>(E2m1Bf16PairEncoder(e4m3_decode_finite(scale_byte)), x, packed);
    } else {
      const E2m1RneThresholds encoder(e4m3_decode_finite(scale_byte));
#pragma unroll
      for (int i = 0; i < LaneDims; ++i) packed[i / 8] |= uint32_t(encoder.encode(x[i])) << (4 * (i % 8));
    }
    store_words<LaneDims / 2>(data + LaneDims / 2 * sub, packed);
  } else {
    scale_byte = L == KVLayout::V4 ? v4_scale_byte(amax) : v41_scale_byte(amax);
    store_e4m3_lane<LaneDims>(x, scale_byte, data + LaneDims * sub);
  }
  if (sub % kLanesPerTile == 0) scale[sub / kLanesPerTile] = scale_byte;
}

// Quantizes this lane's LaneDims values of an indexer row held by 128 / LaneDims adjacent lanes
// (`sub` = the lane's index among them). fp8: one tile of 128, its fp32 scale stored by sub-lane 0;
// fp4: tiles of 32, each scale byte stored by the tile's first lane. The data row is only 4-byte
// aligned in general (indexer caches), so wide stores are chosen from the address. Every lane of the
// warp that has not exited must call this (the tile amax shuffles name the whole warp).
template <IndexerFormat F, int LaneDims>
__device__ __forceinline__ void quantize_indexer_lane(const float* x, int sub, uint8_t* data,
                                                      uint8_t* scale) {
  static_assert(LaneDims % 4 == 0 && LaneDims <= 32, "a lane holds whole 4-element words");
  constexpr int kLanesPerRow = kIndexerDim / LaneDims;
  float amax = abs_max<LaneDims>(x);
  uint32_t words[LaneDims / 4];  // fp8: 4 codes per word; fp4: 8 codes per word (first half used)
  if constexpr (F == IndexerFormat::FP8) {
    amax = warp_max_xor(amax, kLanesPerRow, 0xFFFFFFFFu);
    const float s = __fdiv_rn(fmax_f32(amax, amax_floor()), kE4m3Max);
    const float inv = __fdiv_rn(1.0f, s);
#pragma unroll
    for (int k = 0; k < LaneDims / 4; ++k) {
      words[k] = uint32_t(e4m3x2_encode(x[4 * k] * inv, x[4 * k + 1] * inv)) |
                 (uint32_t(e4m3x2_encode(x[4 * k + 2] * inv, x[4 * k + 3] * inv)) << 16);
    }
    uint8_t* dst = data + LaneDims * sub;
    bool stored = false;
    if constexpr (LaneDims == 16) {
      if (aligned16(dst)) {
        *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
        stored = true;
      }
    }
    if (!stored) {
#pragma unroll
      for (int k = 0; k < LaneDims / 4; ++k) reinterpret_cast<uint32_t*>(dst)[k] = words[k];
    }
    if (sub == 0) *reinterpret_cast<float*>(scale) = s;
  } else {
    constexpr int kTile = IndexerTraits<F>::kTile;
    constexpr int kLanesPerTile = kTile / LaneDims;
    static_assert(kTile % LaneDims == 0, "a lane's values lie in one tile");
    amax = warp_max_xor(amax, kLanesPerTile, 0xFFFFFFFFu);
    const uint8_t b = indexer_fp4_scale_byte(amax);
    const float inv = inverse_scale_of_byte(b);
    float q[LaneDims];
#pragma unroll
    for (int i = 0; i < LaneDims; ++i) q[i] = x[i] * inv;
    encode_e2m1_pairs<LaneDims>(E2m1ThresholdPairEncoder{}, q, words);
    uint8_t* dst = data + (LaneDims / 2) * sub;
    if constexpr (LaneDims == 4) {
      *reinterpret_cast<uint16_t*>(dst) = uint16_t(words[0]);
    } else {
#pragma unroll
      for (int k = 0; k < LaneDims / 8; ++k) reinterpret_cast<uint32_t*>(dst)[k] = words[k];
    }
    if (sub % kLanesPerTile == 0) scale[sub / kLanesPerTile] = b;
  }
}

}  // namespace dsv4
