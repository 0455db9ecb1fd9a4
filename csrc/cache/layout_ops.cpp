// Introspection ops over include/dsv4/kv_layout.cuh, so that Python can check its mirror (T1).
#include <string>
#include <vector>

#include "../common/op_checks.h"

namespace dsv4 {

namespace {
std::vector<int64_t> traits_list(const FormatTraits& t) {
  return {t.bytes_per_token, t.data_bytes, t.scale_bytes, t.tile, t.num_scales, t.page_align};
}

KVLayout checked_layout(const char* op, const char* name, int64_t id) {
  DSV4_CHECK(is_known_kv_layout(static_cast<int>(id)) && id == int64_t(int(id)), op, name,
             " must be a KVLayout id (0 = V4, 1 = V41, 2 = V41_FP4), got ", id);
  return static_cast<KVLayout>(id);
}
}  // namespace

std::vector<int64_t> kv_layout_traits_op(int64_t layout) {
  return traits_list(checked_layout_traits("kv_layout_traits", layout));
}

std::vector<int64_t> indexer_format_traits_op(int64_t fmt) {
  DSV4_CHECK(is_known_indexer_format(static_cast<int>(fmt)) && fmt == int64_t(int(fmt)),
             "indexer_format_traits", "fmt must be an IndexerFormat id (0 = FP8, 1 = FP4), got ", fmt);
  return traits_list(indexer_format_traits(static_cast<IndexerFormat>(fmt)));
}

bool kv_layout_pair_valid_op(int64_t main, int64_t extra) {
  constexpr const char* op = "kv_layout_pair_valid";
  return is_valid_kv_layout_pair(checked_layout(op, "main", main), checked_layout(op, "extra", extra));
}

std::vector<int64_t> page_geometry_op(std::string format, int64_t page_size) {
  constexpr const char* op = "page_geometry";
  check_page_size(op, page_size);
  FormatTraits t{};
  if (format == "v4") t = kv_layout_traits(KVLayout::V4);
  else if (format == "v41") t = kv_layout_traits(KVLayout::V41);
  else if (format == "v41_fp4") t = kv_layout_traits(KVLayout::V41_FP4);
  else if (format == "indexer_fp8") t = indexer_format_traits(IndexerFormat::FP8);
  else if (format == "indexer_fp4") t = indexer_format_traits(IndexerFormat::FP4);
  else fail(op, "format must be one of v4, v41, v41_fp4, indexer_fp8, indexer_fp4, got \"", format, "\"");
  return {page_bytes(t, page_size), scale_offset(t, page_size)};
}

}  // namespace dsv4
