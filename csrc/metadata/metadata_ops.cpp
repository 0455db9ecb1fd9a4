// Torch-facing glue of the metadata ops (spec/metadata.md): argument validation naming op and
// argument (the host half of the fakes in _fake.py), output allocation from shapes and int
// arguments only (never from values: no host sync), and dispatch to the CPU or CUDA implementation.
#include <torch/csrc/stable/ops.h>

#include <climits>
#include <optional>
#include <tuple>

#include "metadata_launch.h"
#include "../common/cuda_context.h"
#include "../common/op_checks.h"
#include "../common/overlap_checks.h"

namespace dsv4 {

namespace {

// Grid x and the int32 row ids of the outputs bound every row count.
constexpr int64_t kMaxRows = INT32_MAX;

void check_int_dtype(const char* op, const char* name, const Tensor& t) {
  const ScalarType d = t.scalar_type();
  DSV4_CHECK(d == ScalarType::Int || d == ScalarType::Long, op, name, " must be int32 or int64, got ",
             dtype_name(d));
}

// A 1-D int32/int64 input of any stride on ref's device.
StridedIndex int_vector(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  check_same_device(op, name, t, ref);
  check_int_dtype(op, name, t);
  check_dim(op, name, t, 1);
  DSV4_CHECK(t.size(0) <= kMaxRows, op, name, " has ", t.size(0), " entries; at most ", kMaxRows,
             " are supported");
  return StridedIndex{t.data_ptr(), t.size(0) > 1 ? t.stride(0) : 0, is_int64(t)};
}

// A 2-D int32/int64 table on ref's device: any row stride, unit column stride.
IndexTable int_table(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  check_same_device(op, name, t, ref);
  check_int_dtype(op, name, t);
  check_dim(op, name, t, 2);
  DSV4_CHECK(t.size(1) <= 1 || t.stride(1) == 1, op, name, " must have stride(1) == 1, got ",
             t.stride(1));
  return IndexTable{t.data_ptr(), t.size(0) > 1 ? t.stride(0) : 0, t.size(0), t.size(1), is_int64(t)};
}

// A caller-owned output buffer: fixed dtype, exact shape, contiguous, on ref's device.
template <class T>
T* out_buffer(const char* op, const char* name, const Tensor& t, const Tensor& ref, ScalarType dtype,
              std::initializer_list<int64_t> shape) {
  check_same_device(op, name, t, ref);
  check_dtype(op, name, t, dtype);
  check_dim(op, name, t, int64_t(shape.size()));
  int64_t dim = 0;
  for (const int64_t size : shape) {
    DSV4_CHECK(t.size(dim) == size, op, name, " must have size ", size, " in dim ", dim, ", got ",
               t.size(dim));
    ++dim;
  }
  DSV4_CHECK(t.is_contiguous(), op, name, " must be contiguous");
  return static_cast<T*>(t.data_ptr());
}

bool is_pow2(int64_t v) { return v >= 1 && (v & (v - 1)) == 0; }

int64_t round_up_64(int64_t v) { return (v + 63) / 64 * 64; }

// ceil(a / b) for a >= 0 and b >= 1, without the overflow of (a + b - 1) / b when a is near INT64_MAX (a
// zero-row req_to_token or page table may have any width).
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Runs name##_cpu(p) or name##_cuda(p, stream) on the device of `anchor`.
#define DSV4_RUN(op, anchor, p, name) \
  run_on_device(op, anchor, [&] { name##_cpu(p); }, [&](auto stream) { name##_cuda(p, stream); })

// ---- build_page_table_positions_small ----

PageTablePositionsParams page_table_params(const char* op, const Tensor& req_to_token,
                                           const Tensor& req_pool_indices, const Tensor& seq_lens,
                                           int64_t page_size, int64_t swa_window) {
  PageTablePositionsParams p{};
  p.req_to_token = int_table(op, "req_to_token", req_to_token, req_to_token);
  p.seq_lens = int_vector(op, "seq_lens", seq_lens, req_to_token);
  p.req_pool_indices = int_vector(op, "req_pool_indices", req_pool_indices, req_to_token);
  p.rows = seq_lens.size(0);
  DSV4_CHECK(req_pool_indices.size(0) == p.rows, op, "req_pool_indices must have ", p.rows,
             " entries (one per seq_lens row), got ", req_pool_indices.size(0));
  check_page_size(op, page_size);
  p.page_bits = log2_pow2(page_size);
  DSV4_CHECK(swa_window >= 1, op, "swa_window must be >= 1, got ", swa_window);
  p.swa_window = int32_t(swa_window < INT32_MAX ? swa_window : INT32_MAX);
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> build_page_table_positions_small(
    Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int64_t max_seq_len,
    int64_t page_size, int64_t swa_window) {
  constexpr const char* op = "build_page_table_positions_small";
  PageTablePositionsParams p =
      page_table_params(op, req_to_token, req_pool_indices, seq_lens, page_size, swa_window);
  const int64_t capacity = req_to_token.size(1);
  DSV4_CHECK(max_seq_len >= 0 && max_seq_len <= capacity, op, "max_seq_len must be in [0, ", capacity,
             "] (req_to_token.size(1)), got ", max_seq_len);
  p.pages = ceil_div(max_seq_len, page_size);
  Tensor seq_lens_out = torch::stable::new_empty(req_to_token, {p.rows}, ScalarType::Int);
  Tensor positions = torch::stable::new_empty(req_to_token, {p.rows}, ScalarType::Int);
  Tensor page_table = torch::stable::new_empty(req_to_token, {p.rows, p.pages}, ScalarType::Int);
  Tensor swa_lengths = torch::stable::new_empty(req_to_token, {p.rows}, ScalarType::Int);
  p.seq_lens_out = static_cast<int32_t*>(seq_lens_out.data_ptr());
  p.positions = static_cast<int32_t*>(positions.data_ptr());
  p.page_table = static_cast<int32_t*>(page_table.data_ptr());
  p.swa_lengths = static_cast<int32_t*>(swa_lengths.data_ptr());
  if (p.rows > 0) DSV4_RUN(op, req_to_token, p, build_page_table_positions);
  return {seq_lens_out, positions, page_table, swa_lengths};
}

void build_page_table_positions_small_out(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens,
                                          int64_t page_size, int64_t swa_window, Tensor seq_lens_out,
                                          Tensor positions, Tensor page_table, Tensor swa_lengths) {
  constexpr const char* op = "build_page_table_positions_small_out";
  PageTablePositionsParams p =
      page_table_params(op, req_to_token, req_pool_indices, seq_lens, page_size, swa_window);
  check_dim(op, "page_table", page_table, 2);
  p.pages = page_table.size(1);
  const int64_t capacity = req_to_token.size(1);
  // (pages - 1) * page_size < capacity, compared without the product (it overflows for huge zero-row tables).
  const int64_t capacity_pages = ceil_div(capacity, page_size);
  DSV4_CHECK(p.pages <= capacity_pages, op, "page_table has ", p.pages, " columns, but req_to_token.size(1) = ",
             capacity, " holds only ", capacity_pages, " pages of ", page_size);
  p.seq_lens_out = out_buffer<int32_t>(op, "seq_lens_out", seq_lens_out, req_to_token, ScalarType::Int, {p.rows});
  p.positions = out_buffer<int32_t>(op, "positions", positions, req_to_token, ScalarType::Int, {p.rows});
  p.page_table =
      out_buffer<int32_t>(op, "page_table", page_table, req_to_token, ScalarType::Int, {p.rows, p.pages});
  p.swa_lengths = out_buffer<int32_t>(op, "swa_lengths", swa_lengths, req_to_token, ScalarType::Int, {p.rows});
  check_written_disjoint(op,
                         {arg("seq_lens_out", seq_lens_out), arg("positions", positions),
                          arg("page_table", page_table), arg("swa_lengths", swa_lengths)},
                         {arg("req_to_token", req_to_token), arg("req_pool_indices", req_pool_indices),
                          arg("seq_lens", seq_lens)});
  if (p.rows > 0) DSV4_RUN(op, req_to_token, p, build_page_table_positions);
}

// ---- build_low_ratio_metadata ----

namespace {

constexpr int64_t kMaxTopk = int64_t(1) << 30;

LowRatioParams low_ratio_params(const char* op, const Tensor& seq_lens, const Tensor& out_loc, int64_t topk) {
  LowRatioParams p{};
  p.seq_lens = int_vector(op, "seq_lens", seq_lens, seq_lens);
  p.out_loc = int_vector(op, "out_loc", out_loc, seq_lens);
  p.rows = seq_lens.size(0);
  DSV4_CHECK(out_loc.size(0) == p.rows, op, "out_loc must have ", p.rows,
             " entries (one per seq_lens row), got ", out_loc.size(0));
  DSV4_CHECK(topk >= 1 && topk <= kMaxTopk, op, "topk must be in [1, ", kMaxTopk, "], got ", topk);
  p.topk = int32_t(topk);
  p.padded = round_up_64(topk);
  return p;
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_low_ratio_metadata(
    Tensor seq_lens, Tensor out_loc, int64_t topk) {
  constexpr const char* op = "build_low_ratio_metadata";
  LowRatioParams p = low_ratio_params(op, seq_lens, out_loc, topk);
  Tensor t[8];
  for (int k = 0; k < 2; ++k) {
    t[4 * k] = torch::stable::new_empty(seq_lens, {p.rows}, ScalarType::Long);
    t[4 * k + 1] = torch::stable::new_empty(seq_lens, {p.rows}, ScalarType::Int);
    t[4 * k + 2] = torch::stable::new_empty(seq_lens, {p.rows}, ScalarType::Int);
    t[4 * k + 3] = torch::stable::new_empty(seq_lens, {p.rows, p.padded}, ScalarType::Int);
    p.out_locs[k] = static_cast<int64_t*>(t[4 * k].data_ptr());
    p.seq_lens_out[k] = static_cast<int32_t*>(t[4 * k + 1].data_ptr());
    p.sparse_lens[k] = static_cast<int32_t*>(t[4 * k + 2].data_ptr());
    p.page_indices[k] = static_cast<int32_t*>(t[4 * k + 3].data_ptr());
  }
  if (p.rows > 0) DSV4_RUN(op, seq_lens, p, build_low_ratio_metadata);
  return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]};
}

void build_low_ratio_metadata_out(Tensor seq_lens, Tensor out_loc, int64_t topk, Tensor c1_out_loc,
                                  Tensor c1_seq_lens, Tensor c1_sparse_lens, Tensor c1_page_indices,
                                  Tensor c2_out_loc, Tensor c2_seq_lens, Tensor c2_sparse_lens,
                                  Tensor c2_page_indices) {
  constexpr const char* op = "build_low_ratio_metadata_out";
  LowRatioParams p = low_ratio_params(op, seq_lens, out_loc, topk);
  const int64_t rows = p.rows;
  p.out_locs[0] = out_buffer<int64_t>(op, "c1_out_loc", c1_out_loc, seq_lens, ScalarType::Long, {rows});
  p.seq_lens_out[0] = out_buffer<int32_t>(op, "c1_seq_lens", c1_seq_lens, seq_lens, ScalarType::Int, {rows});
  p.sparse_lens[0] = out_buffer<int32_t>(op, "c1_sparse_lens", c1_sparse_lens, seq_lens, ScalarType::Int, {rows});
  p.page_indices[0] = out_buffer<int32_t>(op, "c1_page_indices", c1_page_indices, seq_lens, ScalarType::Int,
                                          {rows, p.padded});
  p.out_locs[1] = out_buffer<int64_t>(op, "c2_out_loc", c2_out_loc, seq_lens, ScalarType::Long, {rows});
  p.seq_lens_out[1] = out_buffer<int32_t>(op, "c2_seq_lens", c2_seq_lens, seq_lens, ScalarType::Int, {rows});
  p.sparse_lens[1] = out_buffer<int32_t>(op, "c2_sparse_lens", c2_sparse_lens, seq_lens, ScalarType::Int, {rows});
  p.page_indices[1] = out_buffer<int32_t>(op, "c2_page_indices", c2_page_indices, seq_lens, ScalarType::Int,
                                          {rows, p.padded});
  check_written_disjoint(op,
                         {arg("c1_out_loc", c1_out_loc), arg("c1_seq_lens", c1_seq_lens),
                          arg("c1_sparse_lens", c1_sparse_lens), arg("c1_page_indices", c1_page_indices),
                          arg("c2_out_loc", c2_out_loc), arg("c2_seq_lens", c2_seq_lens),
                          arg("c2_sparse_lens", c2_sparse_lens), arg("c2_page_indices", c2_page_indices)},
                         {arg("seq_lens", seq_lens), arg("out_loc", out_loc)});
  if (p.rows > 0) DSV4_RUN(op, seq_lens, p, build_low_ratio_metadata);
}

// ---- fill_all_compressed_indices ----

void fill_all_compressed_indices(Tensor page_table, Tensor compressed_seq_lens, Tensor page_indices,
                                 int64_t compress_ratio, int64_t page_size,
                                 std::optional<Tensor> raw_indices) {
  constexpr const char* op = "fill_all_compressed_indices";
  FillCompressedParams p{};
  p.page_table = int_table(op, "page_table", page_table, page_table);
  p.lens = int_vector(op, "compressed_seq_lens", compressed_seq_lens, page_table);
  p.rows = compressed_seq_lens.size(0);
  DSV4_CHECK(page_table.size(0) == p.rows, op, "page_table must have ", p.rows,
             " rows (one per compressed_seq_lens entry), got ", page_table.size(0));
  DSV4_CHECK(is_pow2(compress_ratio), op, "compress_ratio must be a power of two, got ", compress_ratio);
  check_page_size(op, page_size);
  DSV4_CHECK(page_size % compress_ratio == 0, op, "page_size ", page_size,
             " must be a multiple of compress_ratio ", compress_ratio);
  p.spp_bits = log2_pow2(page_size / compress_ratio);
  check_dim(op, "page_indices", page_indices, 2);
  p.width = page_indices.size(1);
  p.page_indices = out_buffer<int32_t>(op, "page_indices", page_indices, page_table, ScalarType::Int,
                                       {p.rows, p.width});
  if (raw_indices.has_value()) {
    p.raw_indices = out_buffer<int32_t>(op, "raw_indices", *raw_indices, page_table, ScalarType::Int,
                                        {p.rows, p.width});
  }
  check_written_disjoint(op, {arg("page_indices", page_indices), arg("raw_indices", raw_indices)},
                         {arg("page_table", page_table), arg("compressed_seq_lens", compressed_seq_lens)});
  if (p.rows > 0 && p.width > 0) DSV4_RUN(op, page_table, p, fill_all_compressed_indices);
}

// ---- init_compression_metadata ----

namespace {

constexpr int64_t kMinC128PageSize = 128;
constexpr int64_t kMaxC128PageSize = int64_t(1) << 16;

CompressionParams compression_params(const char* op, const Tensor& seq_lens, const Tensor& positions,
                                     const Tensor& raw_out_loc) {
  CompressionParams p{};
  p.seq_lens = int_vector(op, "seq_lens", seq_lens, seq_lens);
  p.positions = int_vector(op, "positions", positions, seq_lens);
  p.raw_out_loc = int_vector(op, "raw_out_loc", raw_out_loc, seq_lens);
  p.bs = seq_lens.size(0);
  DSV4_CHECK(positions.size(0) == p.bs, op, "positions must have ", p.bs,
             " entries (one per seq_lens row), got ", positions.size(0));
  p.num_locs = raw_out_loc.size(0);
  DSV4_CHECK(p.num_locs <= p.bs, op, "raw_out_loc has ", p.num_locs, " entries, more than the ", p.bs,
             " seq_lens rows");
  return p;
}

// The c128 page-index geometry; returns the page-index width ceil(cps * max_pages / 64) * 64.
int64_t c128_page_geometry(const char* op, CompressionParams& p, const std::optional<Tensor>& page_table,
                           int64_t page_size, const Tensor& ref) {
  DSV4_CHECK(page_table.has_value(), op, "page_table is required to compute the c128 page indices");
  p.page_table = int_table(op, "page_table", *page_table, ref);
  DSV4_CHECK(page_table->size(0) == p.bs, op, "page_table must have ", p.bs,
             " rows (one per seq_lens row), got ", page_table->size(0));
  DSV4_CHECK(is_pow2(page_size) && page_size >= kMinC128PageSize && page_size <= kMaxC128PageSize, op,
             "page_size must be a power of two in [", kMinC128PageSize, ", ", kMaxC128PageSize,
             "] to compute the c128 page indices, got ", page_size);
  p.cps_bits = log2_pow2(page_size / kMinC128PageSize);
  // cps * max_pages, rounded up to 64, must fit int64 (only a zero-row table can be that wide).
  const int64_t max_pages = page_table->size(1);
  const int64_t most_pages = (INT64_MAX - 63) >> p.cps_bits;
  DSV4_CHECK(max_pages <= most_pages, op, "page_table has ", max_pages, " columns; at most ", most_pages,
             " are supported at page_size ", page_size, " (the page-index width must fit int64)");
  p.cap = max_pages << p.cps_bits;
  return round_up_64(p.cap);
}

void set_compression_outputs(CompressionParams& p, Tensor* t) {
  for (int k = 0; k < 2; ++k) {
    p.out_locs[k] = static_cast<int64_t*>(t[4 * k].data_ptr());
    p.positions_out[k] = static_cast<int32_t*>(t[4 * k + 1].data_ptr());
    p.seq_lens_raw[k] = static_cast<int32_t*>(t[4 * k + 2].data_ptr());
    p.seq_lens_clamp1[k] = static_cast<int32_t*>(t[4 * k + 3].data_ptr());
  }
  p.c128_page_indices = static_cast<int32_t*>(t[8].data_ptr());
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> init_compression_metadata(
    Tensor seq_lens, Tensor positions, Tensor raw_out_loc, std::optional<Tensor> page_table, int64_t page_size,
    bool compute_page_indices) {
  constexpr const char* op = "init_compression_metadata";
  CompressionParams p = compression_params(op, seq_lens, positions, raw_out_loc);
  p.width = compute_page_indices ? c128_page_geometry(op, p, page_table, page_size, seq_lens) : 0;
  Tensor t[9];
  for (int k = 0; k < 2; ++k) {
    t[4 * k] = torch::stable::new_empty(seq_lens, {p.num_locs}, ScalarType::Long);
    for (int j = 1; j < 4; ++j) t[4 * k + j] = torch::stable::new_empty(seq_lens, {p.bs}, ScalarType::Int);
  }
  t[8] = torch::stable::new_empty(seq_lens, {p.bs, p.width}, ScalarType::Int);
  set_compression_outputs(p, t);
  if (p.bs > 0) DSV4_RUN(op, seq_lens, p, init_compression_metadata);
  return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]};
}

void init_compression_metadata_out(Tensor seq_lens, Tensor positions, Tensor raw_out_loc,
                                   std::optional<Tensor> page_table, int64_t page_size, Tensor c4_out_loc,
                                   Tensor c4_positions, Tensor c4_seq_lens_raw, Tensor c4_seq_lens_clamp1,
                                   Tensor c128_out_loc, Tensor c128_positions, Tensor c128_seq_lens_raw,
                                   Tensor c128_seq_lens_clamp1, Tensor c128_page_indices) {
  constexpr const char* op = "init_compression_metadata_out";
  CompressionParams p = compression_params(op, seq_lens, positions, raw_out_loc);
  check_dim(op, "c128_page_indices", c128_page_indices, 2);
  // Width 0 means "no page indices": the page table and page_size are then unused.
  p.width = c128_page_indices.size(1);
  if (p.width > 0) {
    const int64_t width = c128_page_geometry(op, p, page_table, page_size, seq_lens);
    DSV4_CHECK(p.width == width, op, "c128_page_indices must have 0 or ", width,
               " columns (ceil(page_size / 128 * max_pages / 64) * 64), got ", p.width);
  }
  Tensor t[9] = {c4_out_loc,     c4_positions,      c4_seq_lens_raw,      c4_seq_lens_clamp1, c128_out_loc,
                 c128_positions, c128_seq_lens_raw, c128_seq_lens_clamp1, c128_page_indices};
  const char* names[9] = {"c4_out_loc",   "c4_positions",   "c4_seq_lens_raw",   "c4_seq_lens_clamp1",
                          "c128_out_loc", "c128_positions", "c128_seq_lens_raw", "c128_seq_lens_clamp1",
                          "c128_page_indices"};
  for (int k = 0; k < 2; ++k) {
    out_buffer<int64_t>(op, names[4 * k], t[4 * k], seq_lens, ScalarType::Long, {p.num_locs});
    for (int j = 1; j < 4; ++j) {
      out_buffer<int32_t>(op, names[4 * k + j], t[4 * k + j], seq_lens, ScalarType::Int, {p.bs});
    }
  }
  out_buffer<int32_t>(op, names[8], t[8], seq_lens, ScalarType::Int, {p.bs, p.width});
  check_written_disjoint(
      op,
      {arg(names[0], t[0]), arg(names[1], t[1]), arg(names[2], t[2]), arg(names[3], t[3]), arg(names[4], t[4]),
       arg(names[5], t[5]), arg(names[6], t[6]), arg(names[7], t[7]), arg(names[8], t[8])},
      {arg("seq_lens", seq_lens), arg("positions", positions), arg("raw_out_loc", raw_out_loc),
       arg("page_table", page_table)});
  set_compression_outputs(p, t);
  if (p.bs > 0) DSV4_RUN(op, seq_lens, p, init_compression_metadata);
}

// ---- get_paged_mqa_logits_metadata ----

namespace {

constexpr int64_t kMaxNumSms = 1024;

ScheduleParams schedule_params(const char* op, const Tensor& context_lens, int64_t block_kv) {
  check_int_dtype(op, "context_lens", context_lens);
  const bool column = context_lens.dim() == 2 && context_lens.size(1) == 1;
  DSV4_CHECK(context_lens.dim() == 1 || column, op,
             "context_lens must be [B] or [B, 1] (next_n == 1), got a ", context_lens.dim(), "-D tensor",
             context_lens.dim() == 2 ? " with more than one column" : "");
  const int64_t batch = context_lens.size(0);
  DSV4_CHECK(batch <= kMaxRows, op, "context_lens has ", batch, " requests; at most ", kMaxRows,
             " are supported");
  DSV4_CHECK(block_kv == 64 || block_kv == 128, op, "block_kv must be 64 or 128, got ", block_kv);
  ScheduleParams p{};
  p.lens = StridedIndex{context_lens.data_ptr(), batch > 1 ? context_lens.stride(0) : 0, is_int64(context_lens)};
  p.batch = batch;
  return p;
}

void check_num_sms(const char* op, const char* what, int64_t num_sms) {
  DSV4_CHECK(num_sms >= 1 && num_sms <= kMaxNumSms, op, what, " must be in [1, ", kMaxNumSms, "], got ",
             num_sms);
}

void run_schedule(const char* op, const Tensor& context_lens, ScheduleParams& p) {
  if (context_lens.is_cuda()) {
#ifdef USE_CUDA
    // The large path's workspace comes from the caching allocator (capture-safe; size from B only).
    Tensor workspace;
    if (schedule_uses_workspace(p.batch)) {
      workspace = torch::stable::new_empty(context_lens, {schedule_workspace_elems(p.batch)}, ScalarType::Long);
      p.workspace = static_cast<int64_t*>(workspace.data_ptr());
    }
    CudaContext ctx(context_lens);
    paged_mqa_schedule_cuda(p, ctx.stream());
#else
    fail_no_cuda(op);
#endif
  } else {
    paged_mqa_schedule_cpu(p);
  }
}

}  // namespace

Tensor get_paged_mqa_logits_metadata(Tensor context_lens, int64_t block_kv, int64_t num_sms) {
  constexpr const char* op = "get_paged_mqa_logits_metadata";
  ScheduleParams p = schedule_params(op, context_lens, block_kv);
  check_num_sms(op, "num_sms", num_sms);
  p.num_sms = int(num_sms);
  Tensor out = torch::stable::new_empty(context_lens, {num_sms + 1, 2}, ScalarType::Int);
  p.out = static_cast<int32_t*>(out.data_ptr());
  run_schedule(op, context_lens, p);
  return out;
}

void get_paged_mqa_logits_metadata_out(Tensor context_lens, int64_t block_kv, Tensor out) {
  constexpr const char* op = "get_paged_mqa_logits_metadata_out";
  ScheduleParams p = schedule_params(op, context_lens, block_kv);
  check_dim(op, "out", out, 2);
  check_num_sms(op, "out.size(0) - 1 (num_sms)", out.size(0) - 1);
  p.num_sms = int(out.size(0) - 1);
  p.out = out_buffer<int32_t>(op, "out", out, context_lens, ScalarType::Int, {out.size(0), 2});
  check_written_disjoint(op, {arg("out", out)}, {arg("context_lens", context_lens)});
  run_schedule(op, context_lens, p);
}

}  // namespace dsv4
