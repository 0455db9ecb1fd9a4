// The single schema list of torch.ops.dsv4 and the registration of every implementation.
// Each op has one host function that validates its arguments and dispatches on the device of its
// tensors, so the same function is registered for CPU and CUDA. Fakes live in sgl_dsv4_kernels/_fake.py and
// _fake_compress.py.
#include <Python.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

using torch::stable::Tensor;

namespace dsv4 {
// KV I/O (csrc/cache/)
std::vector<int64_t> kv_layout_traits_op(int64_t layout);
std::vector<int64_t> indexer_format_traits_op(int64_t fmt);
std::vector<int64_t> page_geometry_op(std::string format, int64_t page_size);
bool kv_layout_pair_valid_op(int64_t main, int64_t extra);
void fused_store_cache(Tensor input, Tensor cache, Tensor indices, int64_t page_size, std::string type,
                       int64_t layout, bool use_fp4, std::optional<Tensor> freqs_cis);
Tensor dequantize_k_cache_paged(Tensor cache, Tensor slots, int64_t page_size, int64_t layout);
void dequantize_k_cache_paged_out(Tensor cache, Tensor slots, int64_t page_size, int64_t layout,
                                  Tensor out);
Tensor fake_quant_compressed_kv(Tensor x);
Tensor fake_quant_fp4(Tensor x, int64_t block_size);
// metadata (csrc/metadata/)
std::tuple<Tensor, Tensor, Tensor, Tensor> build_page_table_positions_small(
    Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int64_t max_seq_len, int64_t page_size,
    int64_t swa_window);
void build_page_table_positions_small_out(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens,
                                          int64_t page_size, int64_t swa_window, Tensor seq_lens_out,
                                          Tensor positions, Tensor page_table, Tensor swa_lengths);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_low_ratio_metadata(
    Tensor seq_lens, Tensor out_loc, int64_t topk);
void build_low_ratio_metadata_out(Tensor seq_lens, Tensor out_loc, int64_t topk, Tensor c1_out_loc,
                                  Tensor c1_seq_lens, Tensor c1_sparse_lens, Tensor c1_page_indices,
                                  Tensor c2_out_loc, Tensor c2_seq_lens, Tensor c2_sparse_lens,
                                  Tensor c2_page_indices);
void fill_all_compressed_indices(Tensor page_table, Tensor compressed_seq_lens, Tensor page_indices,
                                 int64_t compress_ratio, int64_t page_size, std::optional<Tensor> raw_indices);
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> init_compression_metadata(
    Tensor seq_lens, Tensor positions, Tensor raw_out_loc, std::optional<Tensor> page_table, int64_t page_size,
    bool compute_page_indices);
void init_compression_metadata_out(Tensor seq_lens, Tensor positions, Tensor raw_out_loc,
                                   std::optional<Tensor> page_table, int64_t page_size, Tensor c4_out_loc,
                                   Tensor c4_positions, Tensor c4_seq_lens_raw, Tensor c4_seq_lens_clamp1,
                                   Tensor c128_out_loc, Tensor c128_positions, Tensor c128_seq_lens_raw,
                                   Tensor c128_seq_lens_clamp1, Tensor c128_page_indices);
Tensor get_paged_mqa_logits_metadata(Tensor context_lens, int64_t block_kv, int64_t num_sms);
void get_paged_mqa_logits_metadata_out(Tensor context_lens, int64_t block_kv, Tensor out);
// Norm + RoPE writers (csrc/cache/writers_ops.cpp)
void fused_k_norm_rope_flashmla(Tensor kv, Tensor weight, double eps, Tensor freqs, Tensor positions,
                                Tensor out_loc, Tensor kvcache, int64_t page_size, int64_t layout);
void compress_norm_rope_store(Tensor kv, Tensor plan, Tensor norm_weight, double norm_eps, Tensor freqs,
                              Tensor out_loc, Tensor kvcache, int64_t page_size, int64_t compress_ratio,
                              bool is_decode, int64_t layout, bool use_fp4);
// Ratio-1 and ratio-2 compressors (csrc/compress/low_ratio_ops.cpp)
Tensor c1_decode_norm_rope_store(Tensor kv_input, Tensor norm_weight, Tensor positions, Tensor out_loc,
                                 double eps, Tensor freqs_cis, Tensor k_cache, int64_t page_size,
                                 int64_t layout);
Tensor c2_decode_or_verify_norm_rope_store(Tensor kv_input, Tensor kv_state, Tensor norm_weight, Tensor positions,
                                           Tensor req_pool_indices, Tensor raw_out_loc, double eps,
                                           Tensor freqs_cis, Tensor k_cache, int64_t page_size, int64_t ring_size,
                                           int64_t draft_len, int64_t layout);
Tensor c2_prefill_norm_rope_store(Tensor kv_input, Tensor kv_state, Tensor norm_weight, Tensor positions,
                                  Tensor req_pool_indices, Tensor raw_out_loc, double eps, Tensor freqs_cis,
                                  Tensor k_cache, Tensor extend_starts, Tensor extend_lens, int64_t page_size,
                                  int64_t ring_size, int64_t layout);
// c4 / c128 planners and compressor (csrc/compress/plan_ops.cpp, forward_ops.cpp)
Tensor plan_compress_decode(Tensor req_pool_indices, Tensor seq_lens, std::optional<Tensor> req_to_token,
                            std::optional<Tensor> full_to_swa, int64_t compress_ratio, int64_t swa_page_size,
                            int64_t ring_size, bool use_req_ring);
void plan_compress_decode_out(Tensor req_pool_indices, Tensor seq_lens, std::optional<Tensor> req_to_token,
                              std::optional<Tensor> full_to_swa, int64_t compress_ratio, int64_t swa_page_size,
                              int64_t ring_size, bool use_req_ring, Tensor plan_d);
std::tuple<Tensor, Tensor> plan_compress_prefill(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens,
                                                 std::optional<Tensor> req_to_token,
                                                 std::optional<Tensor> full_to_swa, int64_t num_q_tokens,
                                                 int64_t compress_ratio, int64_t swa_page_size, int64_t ring_size,
                                                 bool use_req_ring, bool use_cuda_graph);
void plan_compress_prefill_out(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens,
                               std::optional<Tensor> req_to_token, std::optional<Tensor> full_to_swa,
                               int64_t num_q_tokens, int64_t compress_ratio, int64_t swa_page_size,
                               int64_t ring_size, bool use_req_ring, Tensor plan_c, Tensor plan_w);
Tensor compress_forward(Tensor state, Tensor kv_score_input, Tensor ape, Tensor plan, std::optional<Tensor> plan_w,
                        int64_t head_dim, int64_t compress_ratio, bool is_decode);
}  // namespace dsv4

STABLE_TORCH_LIBRARY(dsv4, m) {
  // ---- KV layouts (introspection) ----
  m.def("kv_layout_traits(int layout) -> int[]");
  m.def("indexer_format_traits(int fmt) -> int[]");
  m.def("page_geometry(str format, int page_size) -> int[]");
  m.def("kv_layout_pair_valid(int main, int extra) -> bool");
  // ---- KV I/O ----
  m.def("fused_store_cache(Tensor input, Tensor(a!) cache, Tensor indices, *, int page_size, "
        "str type=\"flashmla\", int layout=0, bool use_fp4=False, Tensor? freqs_cis=None) -> ()");
  m.def("dequantize_k_cache_paged(Tensor cache, Tensor slots, int page_size, int layout=0) -> Tensor");
  m.def("dequantize_k_cache_paged.out(Tensor cache, Tensor slots, int page_size, int layout=0, *, "
        "Tensor(a!) out) -> ()");
  m.def("fake_quant_compressed_kv(Tensor x) -> Tensor");
  m.def("fake_quant_fp4(Tensor x, *, int block_size=32) -> Tensor");
  // ---- metadata ----
  m.def("build_page_table_positions_small(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "int max_seq_len, int page_size, int swa_window) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("build_page_table_positions_small_out(Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, int page_size, int swa_window, Tensor(a!) seq_lens_out, Tensor(b!) positions, "
        "Tensor(c!) page_table, Tensor(d!) swa_lengths) -> ()");
  m.def("build_low_ratio_metadata(Tensor seq_lens, Tensor out_loc, int topk) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("build_low_ratio_metadata_out(Tensor seq_lens, Tensor out_loc, int topk, "
        "Tensor(a!) c1_out_loc, Tensor(b!) c1_seq_lens, Tensor(c!) c1_sparse_lens, "
        "Tensor(d!) c1_page_indices, Tensor(e!) c2_out_loc, Tensor(f!) c2_seq_lens, "
        "Tensor(g!) c2_sparse_lens, Tensor(h!) c2_page_indices) -> ()");
  m.def("fill_all_compressed_indices(Tensor page_table, Tensor compressed_seq_lens, "
        "Tensor(a!) page_indices, int compress_ratio, int page_size, Tensor(b!)? raw_indices=None) -> ()");
  m.def("init_compression_metadata(Tensor seq_lens, Tensor positions, Tensor raw_out_loc, "
        "Tensor? page_table=None, int page_size=0, bool compute_page_indices=True) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("init_compression_metadata_out(Tensor seq_lens, Tensor positions, Tensor raw_out_loc, "
        "Tensor? page_table, int page_size, Tensor(a!) c4_out_loc, Tensor(b!) c4_positions, "
        "Tensor(c!) c4_seq_lens_raw, Tensor(d!) c4_seq_lens_clamp1, Tensor(e!) c128_out_loc, "
        "Tensor(f!) c128_positions, Tensor(g!) c128_seq_lens_raw, Tensor(h!) c128_seq_lens_clamp1, "
        "Tensor(i!) c128_page_indices) -> ()");
  m.def("get_paged_mqa_logits_metadata(Tensor context_lens, int block_kv, int num_sms) -> Tensor");
  m.def("get_paged_mqa_logits_metadata_out(Tensor context_lens, int block_kv, Tensor(a!) out) -> ()");
  // ---- norm + RoPE writers ----
  m.def("fused_k_norm_rope_flashmla(Tensor kv, Tensor weight, float eps, Tensor freqs, Tensor positions, "
        "Tensor out_loc, Tensor(a!) kvcache, *, int page_size, int layout=0) -> ()");
  m.def("compress_norm_rope_store(Tensor kv, Tensor plan, Tensor norm_weight, float norm_eps, Tensor freqs, "
        "Tensor out_loc, Tensor(a!) kvcache, *, int page_size, int compress_ratio, bool is_decode, "
        "int layout=0, bool use_fp4=False) -> ()");
  // ---- ratio-1 / ratio-2 compressors ----
  m.def("c1_decode_norm_rope_store(Tensor kv_input, Tensor norm_weight, Tensor positions, Tensor out_loc, "
        "float eps, Tensor freqs_cis, Tensor(a!) k_cache, int page_size, int layout=0) -> Tensor");
  m.def("c2_decode_or_verify_norm_rope_store(Tensor kv_input, Tensor(a!) kv_state, Tensor norm_weight, "
        "Tensor positions, Tensor req_pool_indices, Tensor raw_out_loc, float eps, Tensor freqs_cis, "
        "Tensor(b!) k_cache, int page_size, int ring_size, int draft_len=0, int layout=0) -> Tensor");
  m.def("c2_prefill_norm_rope_store(Tensor kv_input, Tensor(a!) kv_state, Tensor norm_weight, "
        "Tensor positions, Tensor req_pool_indices, Tensor raw_out_loc, float eps, Tensor freqs_cis, "
        "Tensor(b!) k_cache, Tensor extend_starts, Tensor extend_lens, int page_size, int ring_size, "
        "int layout=0) -> Tensor");
  // ---- c4 / c128 planners and compressor ----
  m.def("plan_compress_decode(Tensor req_pool_indices, Tensor seq_lens, Tensor? req_to_token, "
        "Tensor? full_to_swa, int compress_ratio, int swa_page_size, int ring_size, bool use_req_ring=False) "
        "-> Tensor");
  m.def("plan_compress_decode_out(Tensor req_pool_indices, Tensor seq_lens, Tensor? req_to_token, "
        "Tensor? full_to_swa, int compress_ratio, int swa_page_size, int ring_size, bool use_req_ring, "
        "Tensor(a!) plan_d) -> ()");
  m.def("plan_compress_prefill(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens, "
        "Tensor? req_to_token, Tensor? full_to_swa, int num_q_tokens, int compress_ratio, int swa_page_size, "
        "int ring_size, bool use_req_ring=False, bool use_cuda_graph=False) -> (Tensor, Tensor)");
  m.def("plan_compress_prefill_out(Tensor req_pool_indices, Tensor seq_lens, Tensor extend_lens, "
        "Tensor? req_to_token, Tensor? full_to_swa, int num_q_tokens, int compress_ratio, int swa_page_size, "
        "int ring_size, bool use_req_ring, Tensor(a!) plan_c, Tensor(b!) plan_w) -> ()");
  m.def("compress_forward(Tensor(a!) state, Tensor kv_score_input, Tensor ape, Tensor plan, Tensor? plan_w, "
        "int head_dim, int compress_ratio, bool is_decode) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(dsv4, CompositeExplicitAutograd, m) {
  m.impl("kv_layout_traits", TORCH_BOX(&dsv4::kv_layout_traits_op));
  m.impl("indexer_format_traits", TORCH_BOX(&dsv4::indexer_format_traits_op));
  m.impl("page_geometry", TORCH_BOX(&dsv4::page_geometry_op));
  m.impl("kv_layout_pair_valid", TORCH_BOX(&dsv4::kv_layout_pair_valid_op));
}

// Tensor ops: one host function per op, registered for both backends.
#define DSV4_REGISTER_TENSOR_OPS(m)                                                                       \
  m.impl("fused_store_cache", TORCH_BOX(&dsv4::fused_store_cache));                                       \
  m.impl("dequantize_k_cache_paged", TORCH_BOX(&dsv4::dequantize_k_cache_paged));                         \
  m.impl("dequantize_k_cache_paged.out", TORCH_BOX(&dsv4::dequantize_k_cache_paged_out));                 \
  m.impl("fake_quant_compressed_kv", TORCH_BOX(&dsv4::fake_quant_compressed_kv));                         \
  m.impl("fake_quant_fp4", TORCH_BOX(&dsv4::fake_quant_fp4));                                             \
  m.impl("build_page_table_positions_small", TORCH_BOX(&dsv4::build_page_table_positions_small));         \
  m.impl("build_page_table_positions_small_out", TORCH_BOX(&dsv4::build_page_table_positions_small_out)); \
  m.impl("build_low_ratio_metadata", TORCH_BOX(&dsv4::build_low_ratio_metadata));                         \
  m.impl("build_low_ratio_metadata_out", TORCH_BOX(&dsv4::build_low_ratio_metadata_out));                 \
  m.impl("fill_all_compressed_indices", TORCH_BOX(&dsv4::fill_all_compressed_indices));                   \
  m.impl("init_compression_metadata", TORCH_BOX(&dsv4::init_compression_metadata));                       \
  m.impl("init_compression_metadata_out", TORCH_BOX(&dsv4::init_compression_metadata_out));               \
  m.impl("get_paged_mqa_logits_metadata", TORCH_BOX(&dsv4::get_paged_mqa_logits_metadata));               \
  m.impl("get_paged_mqa_logits_metadata_out", TORCH_BOX(&dsv4::get_paged_mqa_logits_metadata_out));       \
  m.impl("fused_k_norm_rope_flashmla", TORCH_BOX(&dsv4::fused_k_norm_rope_flashmla));                     \
  m.impl("compress_norm_rope_store", TORCH_BOX(&dsv4::compress_norm_rope_store));                         \
  m.impl("c1_decode_norm_rope_store", TORCH_BOX(&dsv4::c1_decode_norm_rope_store));                       \
  m.impl("c2_decode_or_verify_norm_rope_store", TORCH_BOX(&dsv4::c2_decode_or_verify_norm_rope_store));   \
  m.impl("c2_prefill_norm_rope_store", TORCH_BOX(&dsv4::c2_prefill_norm_rope_store));                     \
  m.impl("plan_compress_decode", TORCH_BOX(&dsv4::plan_compress_decode));                                 \
  m.impl("plan_compress_decode_out", TORCH_BOX(&dsv4::plan_compress_decode_out));                         \
  m.impl("plan_compress_prefill", TORCH_BOX(&dsv4::plan_compress_prefill));                               \
  m.impl("plan_compress_prefill_out", TORCH_BOX(&dsv4::plan_compress_prefill_out));                       \
  m.impl("compress_forward", TORCH_BOX(&dsv4::compress_forward));

STABLE_TORCH_LIBRARY_IMPL(dsv4, CPU, m) { DSV4_REGISTER_TENSOR_OPS(m) }
STABLE_TORCH_LIBRARY_IMPL(dsv4, CUDA, m) { DSV4_REGISTER_TENSOR_OPS(m) }

// An empty module: importing sgl_dsv4_kernels._C runs the static registrations above.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                   nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
