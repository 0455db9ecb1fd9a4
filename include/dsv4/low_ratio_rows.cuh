// What one row of the ratio-1 / ratio-2 decode compressors touches (compressors.md §5.1-5.3): the
// cache slot it stores, and for c2 the pair-state ring row it writes and where its partner comes
// from. The padding and skip rules live here once, for the CPU and CUDA kernels; plain integers only.
#pragma once

#include <cstdint>

#include "dsv4/divider.cuh"
#include "dsv4/kv_layout.cuh"
#include "dsv4/writer_rows.cuh"

namespace dsv4 {

// c1 row: the slot it stores, or -1. out_loc <= 0 marks a padded CUDA-graph row (slot 0 is the
// reserved dummy); slots past the cache and positions outside the RoPE table are skipped too.
DSV4_HD int64_t c1_store_slot(int64_t out_loc, int64_t position, int64_t capacity, int64_t max_pos) {
  const bool store = out_loc > 0 && out_loc < capacity && position_in_table(position, max_pos);
  return store ? out_loc : -1;
}

// The high 64 bits of the 128-bit product a * b.
DSV4_HD uint64_t mul_hi_u64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __umul64hi(a, b);
#else
  return uint64_t((unsigned __int128)a * b >> 64);
#endif
}

// The pair-state ring of c2: `ring` rows per request slot, `owners` = state rows / ring request
// slots (a request is in range iff (req + 1) * ring <= rows, i.e. req < owners). Built by make_pair_ring.
struct PairRing {
  int64_t ring;
  int64_t owners;
  int64_t draft_len;      // 0: decode; >= 1: verify blocks of draft_len rows
  uint64_t ring_inverse;  // ceil(2^64 / ring) mod 2^64

  // position % ring for position >= 0. A GPU has no integer divider: a 64-bit remainder is a long
  // subroutine and even a 32-bit one starts with a dependent float reciprocal of ring, all of it
  // between c2's index loads and its partner load. For 32-bit operands the remainder is instead
  // ((ring_inverse * position mod 2^64) * ring) >> 64, exact since 64 >= 32 + log2(ring) (Lemire,
  // Kaser, Kurz, "Faster remainder by direct computation", 2019), with ring_inverse computed on the host.
  DSV4_HD int64_t offset_of(int64_t position) const {
    if ((uint64_t(position) | uint64_t(ring)) >> 32 == 0) {
      return int64_t(mul_hi_u64(ring_inverse * uint64_t(position), uint64_t(ring)));
    }
    return position % ring;
  }

  DSV4_HD int64_t row_of(int64_t req, int64_t position) const {
    return req >= 0 && req < owners ? req * ring + offset_of(position) : -1;
  }
};

// ring >= 1.
inline PairRing make_pair_ring(int64_t ring, int64_t owners, int64_t draft_len) {
  return PairRing{ring, owners, draft_len, ~uint64_t(0) / uint64_t(ring) + 1};
}

// One c2 row. A row with p < 0 is padding whatever its raw slot: it reads and writes nothing and
// returns a zero latent (active == false). An even row returns a zero latent and, when live
// (raw_out_loc > 0), parks its (kv, score) in the ring. An odd row pools with its partner and
// returns the latent; when live, it also stores the cache at raw_out_loc >> 1.
struct PairRowPlan {
  bool active;            // p >= 0
  bool emits;             // odd p >= 0: pools and returns a latent
  int64_t ring_write;     // ring row the (even, live) row stores into, or -1
  int64_t partner_input;  // input row holding the partner (verify, block offset > 0), or -1
  int64_t partner_ring;   // ring row holding the partner, or -1 (input partner, or the pad value)
  int64_t slot;           // cache slot of the pooled entry, or -1
  int64_t rope_position;  // p - 1
};

// A row's plan, where partner_input() names the input row holding an odd row's partner, or -1 for the ring
// (called for odd rows only, so that even and padded rows skip its work).
template <class PartnerInput>
DSV4_HD PairRowPlan plan_pair_row_with(int64_t position, int64_t req, int64_t raw_out_loc, PartnerInput partner_input,
                                       const PairRing& ring, int64_t capacity, int64_t max_pos) {
  PairRowPlan plan{false, false, -1, -1, -1, -1, -1};
  if (position < 0) return plan;
  plan.active = true;
  const bool live = raw_out_loc > 0;
  // The pair (2k, 2k + 1) has one ring row: the even row parks there and the odd row reads it.
  const int64_t pair_ring_row = ring.row_of(req, position & ~int64_t(1));
  if ((position & 1) == 0) {
    if (live) plan.ring_write = pair_ring_row;
    return plan;
  }
  plan.emits = true;
  const int64_t input_row = partner_input();
  if (input_row >= 0) {
    plan.partner_input = input_row;
  } else {
    plan.partner_ring = pair_ring_row;
  }
  plan.rope_position = position - 1;
  const int64_t slot = raw_out_loc >> 1;
  if (live && slot < capacity && position_in_table(plan.rope_position, max_pos)) plan.slot = slot;
  return plan;
}

// Decode and verify. In verify mode only a block's first row reads the ring: nothing orders a later row after its
// in-block partner's ring write, so it takes the partner from the input row before it.
DSV4_HD PairRowPlan plan_pair_row(int64_t row, int64_t position, int64_t req, int64_t raw_out_loc,
                                  const PairRing& ring, int64_t capacity, int64_t max_pos) {
  auto in_block = [&] { return ring.draft_len > 0 && row % ring.draft_len != 0 ? row - 1 : int64_t(-1); };
  return plan_pair_row_with(position, req, raw_out_loc, in_block, ring, capacity, max_pos);
}

// The ring row an even, live row parks its (kv, score) in, or -1.
DSV4_HD int64_t parked_ring_row(int64_t position, int64_t req, int64_t raw_out_loc, const PairRing& ring) {
  return plan_pair_row_with(position, req, raw_out_loc, [] { return int64_t(-1); }, ring, 0, 0).ring_write;
}

// Whether a row at `position` of request `req` continues the run of the input row before it, at prev_position of
// prev_req (a request's rows are contiguous, at consecutive positions).
DSV4_HD bool continues_run(int64_t position, int64_t req, int64_t prev_position, int64_t prev_req) {
  return position > 0 && prev_position == position - 1 && prev_req == req;
}

// Prefill (compressors.md §5.5): an odd row whose input predecessor continues its run (continues(), see
// continues_run) pools with that row; a run's first row pools with the ring. The ring writes are left to the
// requests' tails (prefill_tail), after every ring read of the call.
template <class Continues>
DSV4_HD PairRowPlan plan_prefill_pair_row(int64_t row, int64_t position, int64_t req, int64_t raw_out_loc,
                                          Continues continues, const PairRing& ring, int64_t capacity,
                                          int64_t max_pos) {
  auto predecessor = [&] { return row > 0 && continues() ? row - 1 : int64_t(-1); };
  PairRowPlan plan = plan_pair_row_with(position, req, raw_out_loc, predecessor, ring, capacity, max_pos);
  plan.ring_write = -1;
  return plan;
}

// Rows [first, end) of a prefill request that park their (kv, score): its last lcm(2, ring) rows. At consecutive
// positions, their even positions fall on distinct ring rows and each is the newest of the request's positions on
// its ring row, which is what running the decode op row by row leaves there. Empty for a request whose rows do not
// lie within the n input rows.
struct PrefillTail {
  int64_t first, end;
};

DSV4_HD PrefillTail prefill_tail(int64_t start, int64_t len, int64_t n, int64_t ring) {
  if (start < 0 || len < 0 || start > n || len > n - start) return PrefillTail{0, 0};
  const int64_t period = ring % 2 == 0 ? ring : 2 * ring;
  const int64_t end = start + len;
  return PrefillTail{len > period ? end - period : start, end};
}

// plan_pair_row and plan_prefill_pair_row in 32-bit arithmetic, for rows whose position, req and raw_out_loc fit
// int32 (and row < 2^31): a multiply-high remainder, 32-bit products and compares and a divisibility test instead
// of 64-bit ones. The 64-bit plan is about a hundred dependent instructions between a c2 row's index loads and its
// partner load (H200, 256 rows under graph replay: decode 3.16-3.23 -> 3.01-3.07 us, verify 3.09-3.17 ->
// 2.87-2.94; prefill at 65536 tokens, V4: 133 -> 128 us).
// Built by make_pair_ring32; `usable` when every ring row fits int32 (ring and owners * ring below 2^31).
struct PairRing32 {
  bool usable;
  Divider ring;
  int32_t owners;
  bool verify;              // draft_len > 0
  DivisibilityTest draft;   // by min(draft_len, 2^32 - 1): the same answers for rows below 2^31
  int32_t capacity;         // min(capacity, 2^31 - 1): the same answers for slots below 2^30
  int32_t max_pos;          // min(max_pos, 2^31 - 1): the same answers for RoPE positions below 2^31 - 1

  // plan_pair_row_with in 32 bits: an odd row's partner is input row row - 1 when pairs_with_previous_row(),
  // else the ring row.
  template <class PairsWithPreviousRow>
  DSV4_HD PairRowPlan plan_row_with(int32_t row, int32_t position, int32_t req, int32_t raw_out_loc,
                                    PairsWithPreviousRow pairs_with_previous_row) const {
    PairRowPlan plan{false, false, -1, -1, -1, -1, -1};
    if (position < 0) return plan;
    plan.active = true;
    const bool live = raw_out_loc > 0;
    // req * ring + (position & ~1) % ring <= owners * ring - 1 < 2^31.
    const int32_t pair_ring_row =
        req >= 0 && req < owners ? req * int32_t(ring.divisor) + int32_t(ring.mod(uint32_t(position) & ~1u)) : -1;
    if ((position & 1) == 0) {
      if (live) plan.ring_write = pair_ring_row;
      return plan;
    }
    plan.emits = true;
    if (pairs_with_previous_row()) {
      plan.partner_input = row - 1;
    } else {
      plan.partner_ring = pair_ring_row;
    }
    plan.rope_position = position - 1;  // >= 0: position is odd
    const int32_t slot = raw_out_loc >> 1;
    if (live && slot < capacity && plan.rope_position < max_pos) plan.slot = slot;
    return plan;
  }

  // plan_pair_row (decode and verify).
  DSV4_HD PairRowPlan plan_row(int32_t row, int32_t position, int32_t req, int32_t raw_out_loc) const {
    return plan_row_with(row, position, req, raw_out_loc, [&] { return verify && !draft.divides(uint32_t(row)); });
  }

  // plan_prefill_pair_row, given whether the input row before continues the run (asked for rows > 0 only).
  template <class Continues>
  DSV4_HD PairRowPlan plan_prefill_row(int32_t row, int32_t position, int32_t req, int32_t raw_out_loc,
                                       Continues continues) const {
    PairRowPlan plan = plan_row_with(row, position, req, raw_out_loc, [&] { return row > 0 && continues(); });
    plan.ring_write = -1;
    return plan;
  }
};

inline PairRing32 make_pair_ring32(const PairRing& r, int64_t capacity, int64_t max_pos) {
  constexpr int64_t kMax = 0x7FFFFFFF;
  PairRing32 r32{};
  r32.usable = r.ring <= kMax && r.owners <= kMax / r.ring;  // owners * ring <= 2^31 - 1
  if (!r32.usable) return r32;
  r32.ring = make_divider(uint32_t(r.ring));
  r32.owners = int32_t(r.owners);
  r32.verify = r.draft_len > 0;
  r32.draft = make_divisibility_test(uint32_t(r.draft_len < 0xFFFFFFFF ? (r.draft_len > 0 ? r.draft_len : 1)
                                                                          : 0xFFFFFFFF));
  r32.capacity = int32_t(capacity < kMax ? capacity : kMax);
  r32.max_pos = int32_t(max_pos < kMax ? max_pos : kMax);
  return r32;
}

}  // namespace dsv4
