// Integer rules of the c4/c128 compression plans (compressors.md §2.2, §3): entry layouts and
// sentinels, the state-slot lookup, page(), stage-0 packing, per-request counts and the k-th entry of
// each plan. The CPU planner and the CUDA planner both build every byte from these functions. Positions,
// lengths and counts are 32-bit: the host checks and the planners' clamps keep them below 2^31.
#pragma once

#include <cstdint>

#include "dsv4/divider.cuh"
#include "dsv4/kv_layout.cuh"

namespace dsv4 {

// ---- entry layouts (§3.1); little-endian, so the structs are the bytes ----

// Word 0 of every invalid plan row.
constexpr uint32_t kInvalidPlanWord = 0xFFFFFFFFu;
constexpr int kPlanRowBytes = 16;       // DecodePlan and CompressPlan rows
constexpr int kWritePlanRowBytes = 8;   // WritePlan rows
// Ragged ids are zero-based uint16, so one prefill plan covers at most 2^16 tokens.
constexpr int64_t kMaxPlanTokens = int64_t(1) << 16;
// Batch ids are packed into 16 bits next to 0xFFFF; upstream keeps the batch below 0xFFFF.
constexpr int64_t kMaxPlanBatch = 0xFFFF - 1;
constexpr int64_t kMaxSeqLen = 0x7FFFFFFF;

struct DecodeEntry {
  uint32_t seq_len;
  int32_t write_loc;
  int32_t read_page_0;
  int32_t read_page_1;
};

struct CompressEntry {
  uint32_t seq_len;
  uint16_t ragged_id;
  uint16_t buffer_len;
  int32_t read_page_0;
  int32_t read_page_1;  // stage 0: the batch index
};

struct WriteEntry {
  uint32_t word0;     // stage 0: pack(batch, ragged_id); final: ragged_id
  int32_t write_loc;  // stage 0: p + 1; final: slot(rid, p)
};

static_assert(sizeof(DecodeEntry) == kPlanRowBytes, "DecodePlan row is 16 bytes");
static_assert(sizeof(CompressEntry) == kPlanRowBytes, "CompressPlan row is 16 bytes");
static_assert(sizeof(WriteEntry) == kWritePlanRowBytes, "WritePlan row is 8 bytes");

DSV4_HD DecodeEntry invalid_decode_entry() { return DecodeEntry{kInvalidPlanWord, -1, -1, -1}; }
DSV4_HD CompressEntry invalid_compress_entry() { return CompressEntry{kInvalidPlanWord, 0, 0, -1, -1}; }
DSV4_HD WriteEntry invalid_write_entry() { return WriteEntry{kInvalidPlanWord, -1}; }

DSV4_HD uint32_t pack_batch_ragged(int64_t batch, int64_t ragged) {
  return (uint32_t(batch) << 16) | uint32_t(ragged & 0xFFFF);
}

// ---- ratio geometry (§0, §2.1, §3.3) ----

DSV4_HD constexpr int compress_window(int ratio) { return ratio == 4 ? 2 * ratio : ratio; }

// Ring rows a verify may need beyond the window; 0 for a non-speculative ring (ring == window).
DSV4_HD constexpr int32_t mtp_pad(int ratio, int32_t ring) {
  return ring > compress_window(ratio) ? ring - compress_window(ratio) + 2 : 0;
}

// The ratio is 4 or 128 (checked on the host), so a chunk index is a shift, not a division.
DSV4_HD constexpr int ratio_log2(int ratio) { return ratio == 4 ? 2 : 7; }

// Index of the ratio-sized chunk holding position (or length) x >= 0.
DSV4_HD int32_t chunk_of(int32_t x, int ratio) { return int32_t(uint32_t(x) >> ratio_log2(ratio)); }

// ---- index tensors ----

// A read-only int32 or int64 vector (or matrix with a row stride); null when the tensor is absent.
struct IndexView {
  const void* data;
  bool is_int64;
  DSV4_HD int64_t operator[](int64_t i) const {
    return is_int64 ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

// ---- state slot lookup (§2.2) ----

struct SlotLookup {
  IndexView req_to_token;  // [r2t_rows, r2t_cols] (row stride r2t_stride); data null when absent or empty
  int64_t r2t_rows, r2t_cols, r2t_stride;
  // Whether req_to_token was given. Not `data != nullptr`: an empty table has no data but still bounds rids.
  bool has_req_to_token;
  IndexView full_to_swa;   // [f2s_len]; paged mode only
  int64_t f2s_len;
  Divider ring;            // ring_size (< 2^31, checked on the host)
  Divider swa_page;        // swa_page_size (< 2^31, checked on the host); paged mode only
  bool paged;              // paged c4; otherwise request rings
};

// A paged lookup is two dependent loads, req_to_token then full_to_swa. Its checks are split around the
// loads so that a caller can issue the first load of many lookups before using any loaded value:
// slot = paged_slot(full_to_swa[checked_loc(req_to_token[token_index(rid, p)])]), where each step turns
// an invalid lookup into -1 and a -1 skips the load that follows.

// Positions p passed to the lookups lie in [-1, 2^31 - 1).

// Element index of req_to_token[rid, p], or -1 outside the table.
DSV4_HD int64_t token_index(const SlotLookup& s, int64_t rid, int32_t p) {
  return (rid < 0 || p < 0 || rid >= s.r2t_rows || p >= s.r2t_cols) ? -1 : rid * s.r2t_stride + p;
}

// A full location read from req_to_token, or -1 outside full_to_swa.
DSV4_HD int64_t checked_loc(const SlotLookup& s, int64_t loc) { return (loc < 0 || loc >= s.f2s_len) ? -1 : loc; }

// paged_slot of an swa above 2^31 - 1 (int64 tables only). Out of line on the GPU: the 64-bit division is
// long and rare, and inlined at every lookup it would make up a fifth of the prefill planner's code.
#if defined(__CUDACC__)
__host__ __device__ __noinline__
#endif
inline int64_t wide_paged_slot(const SlotLookup& s, int64_t swa) {
  const int64_t slot = (swa / s.swa_page.divisor) * s.ring.divisor + swa % s.ring.divisor;
  return slot > kMaxSeqLen ? -1 : slot;
}

// State row of SWA location swa (one ring per SWA page). swa_page_size >= ring, so the slot never
// exceeds swa: below 2^31 it is valid and 32-bit arithmetic suffices.
DSV4_HD int64_t paged_slot(const SlotLookup& s, int64_t swa) {
  if (swa < 0) return -1;
  if (swa <= kMaxSeqLen) return int64_t(s.swa_page.div(uint32_t(swa)) * s.ring.divisor + s.ring.mod(uint32_t(swa)));
  return wide_paged_slot(s, swa);
}

// State row of position p of request rid in request-ring mode.
DSV4_HD int64_t ring_slot(const SlotLookup& s, int64_t rid, int32_t p) {
  if (rid < 0 || p < 0) return -1;
  if (s.has_req_to_token && rid >= s.r2t_rows) return -1;
  // A larger rid gives a slot above 2^31 - 1 anyway; below it, rid * ring fits in 64 bits (the host
  // checks keep ring below 2^31).
  if (rid > kMaxSeqLen) return -1;
  const int64_t slot = rid * s.ring.divisor + s.ring.mod(uint32_t(p));
  return slot > kMaxSeqLen ? -1 : slot;
}

// State row of position p of request rid, or -1 for an invalid lookup. Computed in 64 bits; a slot
// above 2^31 - 1 is invalid too.
DSV4_HD int64_t state_slot(const SlotLookup& s, int64_t rid, int32_t p) {
  if (!s.paged) return ring_slot(s, rid, p);
  const int64_t index = token_index(s, rid, p);
  const int64_t loc = index < 0 ? -1 : checked_loc(s, s.req_to_token[index]);
  return loc < 0 ? -1 : paged_slot(s, s.full_to_swa[loc]);
}

// page(slot): -1 for a failed lookup, never a truncated negative quotient.
// Slots come from state_slot, so they lie in [-1, 2^31).
DSV4_HD int32_t state_page(int64_t slot, int ratio) { return slot < 0 ? -1 : chunk_of(int32_t(slot), ratio); }

// ---- decode planner (§3.4) ----

DSV4_HD DecodeEntry decode_entry(int64_t seq_len, int64_t rid, const SlotLookup& s, int ratio) {
  if (seq_len <= 0) return invalid_decode_entry();
  const int32_t L = int32_t(seq_len > kMaxSeqLen ? kMaxSeqLen : seq_len);  // out of envelope: clamp, stay safe
  const int32_t p = L - 1;
  const int64_t slot = state_slot(s, rid, p);
  DecodeEntry e;
  e.seq_len = uint32_t(L);
  e.write_loc = int32_t(slot);
  e.read_page_1 = state_page(slot, ratio);
  e.read_page_0 = (ratio == 4 && L >= 2 * ratio) ? state_page(state_slot(s, rid, p - ratio), ratio) : -1;
  return e;
}

// ---- prefill planner (§3.3) ----

struct PlanGeometry {
  int ratio;
  int window;
  int32_t mtp_pad;
  Divider swa_page;   // swa_page_size; read only with band
  bool band;          // paged c4: the last 4 tokens of every SWA page are always written
  int32_t num_q_tokens;
};

DSV4_HD PlanGeometry plan_geometry(int ratio, const SlotLookup& s, int32_t num_q_tokens) {
  return PlanGeometry{ratio, compress_window(ratio), mtp_pad(ratio, int32_t(s.ring.divisor)), s.swa_page,
                      ratio == 4 && s.paged, num_q_tokens};
}

// seq_lens / extend_lens as the planners read them. Valid inputs pass unchanged; the GPU path, which
// never checks values, clamps out-of-envelope ones into int32.
DSV4_HD int32_t planned_seq_len(int64_t v) {
  return int32_t(v > kMaxSeqLen ? kMaxSeqLen : (v < -kMaxSeqLen - 1 ? -kMaxSeqLen - 1 : v));
}
DSV4_HD int32_t planned_extend_len(int64_t v) { return int32_t(v < 0 ? 0 : (v > kMaxSeqLen ? kMaxSeqLen : v)); }

// Positions of one request that the plans cover (§3.3 "Counts"); all zero for a request without rows.
struct RequestPlan {
  int32_t prefix;     // L - E'
  int32_t off;        // ragged offset of the request's first token
  int32_t a, z;       // tokens at positions [a, z) are planned
  int32_t t;          // every position in [t, z) is written
  int32_t band_base;  // band positions below a (f(a))
  int32_t n_c, n_w, n_band;
};

// Band positions (p % sps >= sps - 4) in [0, x), for 0 <= x < 2^31.
DSV4_HD int32_t band_positions_below(int32_t x, const Divider& sps) {
  const uint32_t pages = sps.div(uint32_t(x));  // one division for quotient and remainder
  const uint32_t in_page = uint32_t(x) - pages * sps.divisor, band_start = sps.divisor - 4;
  return int32_t(pages * 4 + (in_page > band_start ? in_page - band_start : 0));
}

// `seq_len` and `extend_len` as read (planned_*), `off` the sum of the earlier requests' extend_len,
// saturated at num_q_tokens (0 <= off <= num_q_tokens).
DSV4_HD RequestPlan plan_request(const PlanGeometry& g, int32_t seq_len, int32_t extend_len, int32_t off) {
  const int32_t L = seq_len;
  // L <= 0 leaves z <= 0 <= a: no rows. From here L >= 1 and 0 <= E' < 2^31, so L - E' fits in int32.
  if (L <= 0) return RequestPlan{};
  RequestPlan rp{};
  rp.prefix = L - extend_len;
  rp.off = off;
  rp.a = rp.prefix > 0 ? rp.prefix : 0;
  // z = min(L, prefix + room), written so that prefix + room is formed only when it is below L.
  const int32_t room = g.num_q_tokens - off;
  rp.z = extend_len <= room ? L : rp.prefix + room;
  if (rp.z <= rp.a) return RequestPlan{};
  // z > a >= 0: every value below is a position in [0, 2^31) or a count.
  const int32_t last_c = chunk_of(L, g.ratio) << ratio_log2(g.ratio);
  const int32_t overlap_chunk = g.ratio == 4 ? 4 : 0;
  const int32_t first_w = (last_c - overlap_chunk) < (L - g.mtp_pad) ? (last_c - overlap_chunk) : (L - g.mtp_pad);
  rp.t = rp.a > first_w ? rp.a : first_w;
  rp.n_c = chunk_of(rp.z, g.ratio) - chunk_of(rp.a, g.ratio);
  const int32_t band_end = rp.z < rp.t ? rp.z : rp.t;
  if (g.band) {
    rp.band_base = band_positions_below(rp.a, g.swa_page);
    rp.n_band = band_positions_below(band_end, g.swa_page) - rp.band_base;
  }
  rp.n_w = (rp.z > rp.t ? rp.z - rp.t : 0) + rp.n_band;
  return rp;
}

// The k-th CompressPlan entry of a request (k < n_c), stage 0: read_page_1 carries the batch index.
DSV4_HD CompressEntry compress_entry_stage0(const PlanGeometry& g, const RequestPlan& rp, int32_t k,
                                            int64_t batch) {
  const int32_t p = ((chunk_of(rp.a, g.ratio) + 1 + k) << ratio_log2(g.ratio)) - 1;
  const int32_t j = p - rp.prefix;  // < z - prefix <= num_q_tokens
  const int32_t in_window = j + 1 < g.window ? j + 1 : g.window;
  CompressEntry e;
  e.seq_len = uint32_t(p + 1);
  e.ragged_id = uint16_t(rp.off + j);
  e.buffer_len = uint16_t(g.window - in_window);
  e.read_page_0 = -1;
  e.read_page_1 = int32_t(batch);
  return e;
}

// Position of the k-th WritePlan entry of a request (k < n_w): band positions below t first, then [t, z).
DSV4_HD int32_t write_position(const PlanGeometry& g, const RequestPlan& rp, int32_t k) {
  if (k < rp.n_band) {
    const uint32_t m = uint32_t(rp.band_base + k), sps = g.swa_page.divisor;
    return int32_t((m / 4) * sps + (sps - 4) + m % 4);
  }
  return rp.t + (k - rp.n_band);
}

DSV4_HD WriteEntry write_entry_stage0(const PlanGeometry& g, const RequestPlan& rp, int32_t k, int64_t batch) {
  const int32_t p = write_position(g, rp, k);
  return WriteEntry{pack_batch_ragged(batch, rp.off + (p - rp.prefix)), int32_t(p + 1)};
}

// ---- stage 1 (§3.2): table lookups, in place ----

// Positions whose state slots give a compress entry's pages: read_page_1 from p = seq_len - 1 and
// read_page_0 from p - 4 (c4, p >= 7); -1 where the page is -1 without a lookup (state_slot(-1) is -1).
struct CompressReads {
  int32_t p1, p0;
};

DSV4_HD CompressReads compress_reads(const CompressEntry& e, int ratio) {
  if (e.seq_len == kInvalidPlanWord || e.buffer_len == 0) return CompressReads{-1, -1};
  const int32_t p = int32_t(e.seq_len) - 1;  // a valid entry's seq_len lies in [ratio, 2^31)
  return CompressReads{p, (ratio == 4 && p >= 2 * ratio - 1) ? p - ratio : -1};
}

// Stage 1 of a compress entry from the slots of its compress_reads positions.
DSV4_HD void set_compress_pages(CompressEntry& e, int64_t slot_1, int64_t slot_0, int ratio) {
  if (e.seq_len == kInvalidPlanWord) return;
  e.read_page_1 = state_page(slot_1, ratio);
  e.read_page_0 = state_page(slot_0, ratio);
}

DSV4_HD void finalize_compress_entry(CompressEntry& e, int64_t rid, const SlotLookup& s, int ratio) {
  const CompressReads r = compress_reads(e, ratio);
  set_compress_pages(e, state_slot(s, rid, r.p1), state_slot(s, rid, r.p0), ratio);
}

// `rid` must be req_pool_indices[stage0_batch(e)].
DSV4_HD int64_t stage0_batch(const WriteEntry& e) { return int64_t(e.word0 >> 16); }

// Stage 1 of a write entry from the slot of its position (stage-0 write_loc - 1).
DSV4_HD void set_write_slot(WriteEntry& e, int64_t slot) {
  if (e.word0 == kInvalidPlanWord) return;
  e.word0 &= 0xFFFFu;
  e.write_loc = int32_t(slot);
}

// A stage-0 write_loc is p + 1 >= 1.
DSV4_HD void finalize_write_entry(WriteEntry& e, int64_t rid, const SlotLookup& s) {
  set_write_slot(e, state_slot(s, rid, e.write_loc - 1));
}

}  // namespace dsv4
