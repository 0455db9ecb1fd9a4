// The single definition of the paged cache formats: main-KV layouts (V4, V41, V41_FP4), indexer
// formats (FP8, FP4), their per-token geometry and the PagedKV slot -> byte-offset arithmetic.
// Usable from host C++, CPU kernels and device code; no torch headers. Python mirrors it in kv_layout.py.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DSV4_HD __host__ __device__ __forceinline__
#else
#define DSV4_HD inline
#endif

namespace dsv4 {

enum class KVLayout : int { V4 = 0, V41 = 1, V41_FP4 = 2 };
enum class IndexerFormat : int { FP8 = 0, FP4 = 1 };

constexpr int kNumKVLayouts = 3;
constexpr int kNumIndexerFormats = 2;

// Per-token geometry of one cache format. num_scales counts the scale bytes a writer stores
// (V4: 7 of its 8), tile the number of elements one scale covers.
struct FormatTraits {
  int bytes_per_token;
  int data_bytes;
  int scale_bytes;
  int tile;
  int num_scales;
  int page_align;
};

constexpr FormatTraits kV4Traits{584, 576, 8, 64, 7, 576};
constexpr FormatTraits kV41Traits{528, 512, 16, 32, 16, 512};
constexpr FormatTraits kV41Fp4Traits{288, 256, 32, 16, 32, 256};
constexpr FormatTraits kIndexerFp8Traits{132, 128, 4, 128, 1, 1};
constexpr FormatTraits kIndexerFp4Traits{68, 64, 4, 32, 4, 1};

// Width of the main latent and of the indexer key (elements).
constexpr int kMainDim = 512;
constexpr int kIndexerDim = 128;
// V4 keeps the last 64 dims (the RoPE dims) as bf16.
constexpr int kRopeDim = 64;
constexpr int kV4NopeDim = kMainDim - kRopeDim;

DSV4_HD constexpr bool is_known_kv_layout(int id) { return id >= 0 && id < kNumKVLayouts; }
DSV4_HD constexpr bool is_known_indexer_format(int id) { return id >= 0 && id < kNumIndexerFormats; }

DSV4_HD constexpr FormatTraits kv_layout_traits(KVLayout layout) {
  return layout == KVLayout::V4 ? kV4Traits : layout == KVLayout::V41 ? kV41Traits : kV41Fp4Traits;
}

DSV4_HD constexpr FormatTraits indexer_format_traits(IndexerFormat fmt) {
  return fmt == IndexerFormat::FP8 ? kIndexerFp8Traits : kIndexerFp4Traits;
}

// A page is P data rows, then P scale rows, padded up to a multiple of page_align.
DSV4_HD constexpr int64_t page_bytes(const FormatTraits& t, int64_t page_size) {
  return (page_size * t.bytes_per_token + t.page_align - 1) / t.page_align * t.page_align;
}
DSV4_HD constexpr int64_t scale_offset(const FormatTraits& t, int64_t page_size) {
  return page_size * t.data_bytes;
}

// Base-pointer / page-stride alignment the kernels rely on for vector accesses.
constexpr int kMainCacheAlign = 16;
constexpr int kIndexerCacheAlign = 4;

// (main, extra) pairs a pool may combine: the same layout, or a V41 main cache with V41_FP4 extras.
DSV4_HD constexpr bool is_valid_kv_layout_pair(KVLayout main, KVLayout extra) {
  return main == extra || (main == KVLayout::V41 && extra == KVLayout::V41_FP4);
}

template <KVLayout L>
struct LayoutTraits {
  static constexpr FormatTraits kTraits = kv_layout_traits(L);
  static constexpr int kDataBytes = kTraits.data_bytes;
  static constexpr int kScaleBytes = kTraits.scale_bytes;
  static constexpr int kTile = kTraits.tile;
  static constexpr int kNumScales = kTraits.num_scales;
};

template <IndexerFormat F>
struct IndexerTraits {
  static constexpr FormatTraits kTraits = indexer_format_traits(F);
  static constexpr int kDataBytes = kTraits.data_bytes;
  static constexpr int kScaleBytes = kTraits.scale_bytes;
  static constexpr int kTile = kTraits.tile;
  static constexpr int kNumScales = kTraits.num_scales;
};

// PagedKV address arithmetic for one cache tensor. All products are 64-bit: page * page_stride
// passes 2^31 for large V4 caches.
struct PagedCache {
  uint8_t* base;
  int64_t page_stride;  // bytes, cache.stride(0)
  int64_t num_pages;
  int page_bits;        // log2(page_size)
  int data_bytes;
  int scale_bytes;
  // capacity() <= INT32_MAX and page_stride <= UINT32_MAX (set by the host check; true of every real
  // cache: 2^31 slots of the smallest format take 146 GB), so rows_of can use 32-bit offsets.
  bool compact;

  DSV4_HD int64_t capacity() const { return num_pages << page_bits; }
  // slot in [0, capacity()) as one unsigned compare: a negative slot wraps above any capacity.
  DSV4_HD bool valid(int64_t slot) const { return uint64_t(slot) < uint64_t(capacity()); }
  DSV4_HD int64_t page_base(int64_t slot) const { return (slot >> page_bits) * page_stride; }
  DSV4_HD int64_t row(int64_t slot) const { return slot & ((int64_t(1) << page_bits) - 1); }
  DSV4_HD int64_t data_offset(int64_t slot) const {
    return page_base(slot) + row(slot) * data_bytes;
  }
  DSV4_HD int64_t scale_offset(int64_t slot) const {
    return page_base(slot) + (int64_t(data_bytes) << page_bits) + row(slot) * scale_bytes;
  }
  DSV4_HD uint8_t* data_row(int64_t slot) const { return base + data_offset(slot); }
  DSV4_HD uint8_t* scale_row(int64_t slot) const { return base + scale_offset(slot); }

  // data_row and scale_row of a valid slot. On a compact cache the page base takes one 32 x 32 -> 64-bit
  // multiply and the in-page offsets 32-bit products (about 15 fewer instructions per row than the
  // 64-bit shifts and products); the branch is uniform across a launch.
  struct RowPointers {
    uint8_t* data;
    uint8_t* scale;
  };
  DSV4_HD RowPointers compact_rows_of(uint32_t slot) const {
    const uint32_t row = slot & ((1u << page_bits) - 1u);
    uint8_t* page = base + uint64_t(slot >> page_bits) * uint32_t(page_stride);
    return {page + row * uint32_t(data_bytes),
            page + ((uint32_t(data_bytes) << page_bits) + row * uint32_t(scale_bytes))};
  }
  DSV4_HD RowPointers rows_of(int64_t slot) const {
    return compact ? compact_rows_of(uint32_t(slot)) : RowPointers{data_row(slot), scale_row(slot)};
  }
};

}  // namespace dsv4
