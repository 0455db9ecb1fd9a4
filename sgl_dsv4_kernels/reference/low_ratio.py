"""Reference ratio-1 and ratio-2 compressors (compressors.md sections 1.5, 1.6 and 5):
`c1_decode_norm_rope_store`, `c2_decode_or_verify_norm_rope_store` and `c2_prefill_norm_rope_store`, composed
from the reference RMSNorm, RoPE tail, fake quantization and slot stores. In place on k_cache / kv_state; each
returns a fresh bf16 latent.
"""
from __future__ import annotations

import torch

from .norm_rope import rms_norm_fp32, rope_tail
from .quant import _layout_id, fake_quant_compressed_kv, store_k_cache

__all__ = ["c1_decode_norm_rope_store", "c2_decode_or_verify_norm_rope_store", "c2_prefill_norm_rope_store",
           "pair_pool"]

_V41_FP4 = 2
_D = 512  # latent width; a c2 projection row is kv [512] then score [512]


def _rope_table(freqs: torch.Tensor) -> torch.Tensor:
    """fp32 [max_pos, 64] from the fp32 table or complex64 freqs_cis [max_pos, 32]."""
    if freqs.is_complex():
        return torch.view_as_real(freqs).flatten(1)  # reshape(N, -1) fails for N = 0
    return freqs.to(torch.float32)


def _latent(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16(RMSNorm(x) * w) with fp32 statistics (cache-writers section 1.2 order)."""
    return rms_norm_fp32(x, weight, eps).to(torch.bfloat16)


def _store_latents(k_cache, latent, slots, positions, freqs, page_size, layout) -> None:
    """Section 5.4: t = bf16(rope_tail(latent, freqs[pos])). V41_FP4 stores t; V41 and V4 store
    fake_quant_compressed_kv(t). Rows with slot < 0, slot >= capacity or pos outside the table store nothing."""
    lid = _layout_id(layout)
    if latent.shape[0] == 0:
        return
    table = _rope_table(freqs).to(latent.device)
    pos = positions.to(torch.int64)
    in_table = (pos >= 0) & (pos < table.shape[0])
    rows = table[torch.where(in_table, pos, torch.zeros_like(pos))]
    slots = torch.where(in_table, slots.to(torch.int64), torch.full_like(pos, -1))
    t = rope_tail(latent, rows).to(torch.bfloat16)
    if lid != _V41_FP4:
        t = fake_quant_compressed_kv(t)
    store_k_cache(k_cache, t.to(torch.float32), slots, page_size, lid)


def pair_pool(k_even, s_even, k_odd, s_odd) -> torch.Tensor:
    """Section 1.5, per channel in fp32: d = s_e - s_o, e = exp(-|d|); (k_e + e*k_o) / (1 + e) if d >= 0,
    else (e*k_e + k_o) / (1 + e). Separate torch ops (no FMA), IEEE division by a tensor divisor.

    e is the float64 exponential rounded once to fp32 (the correctly rounded expf), so the result does not
    depend on the device's fp32 exp; the kernels' accurate expf may differ from it in the last bit."""
    d = s_even - s_odd
    e = torch.exp((-d.abs()).to(torch.float64)).to(torch.float32)
    denominator = torch.ones_like(e) + e
    even_wins = (k_even + e * k_odd) / denominator
    odd_wins = (e * k_even + k_odd) / denominator
    return torch.where(d >= 0, even_wins, odd_wins)


def c1_decode_norm_rope_store(kv_input, norm_weight, positions, out_loc, eps, freqs_cis, k_cache, page_size,
                              layout=0) -> torch.Tensor:
    """Reference of dsv4::c1_decode_norm_rope_store (section 5.1).

    latent = bf16(RMSNorm(kv_input)); row i is stored at slot out_loc[i] rotated at positions[i], unless
    out_loc <= 0 (padded row), the slot is past the cache, or the position is outside the table.
    """
    latent = _latent(kv_input, norm_weight, eps)
    loc = out_loc.to(torch.int64)
    slots = torch.where(loc > 0, loc, torch.full_like(loc, -1))
    _store_latents(k_cache, latent, slots, positions, freqs_cis, page_size, layout)
    return latent


class _PairRows:
    """A c2 call's rows as the reference reads them (sections 5.2-5.3): positions p, request slots req, raw slots
    raw (int64), and the ring rows of their pairs."""

    def __init__(self, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, ring_size):
        self.x = kv_input.to(torch.float32)
        self.p = positions.to(torch.int64)
        self.req = req_pool_indices.to(torch.int64)
        self.raw = raw_out_loc.to(torch.int64)
        self.ring_size = ring_size
        self.row = torch.arange(self.p.shape[0], device=kv_input.device)
        active = self.p >= 0
        self.odd = active & ((self.p & 1) == 1)
        self.even = active & ~self.odd
        self.live = self.raw > 0
        self.req_ok = (self.req >= 0) & (self.req < kv_state.shape[0] // ring_size)

    def ring_row(self, pos):
        """req * ring + pos % ring, or -1 where req is out of range."""
        return torch.where(self.req_ok, self.req * self.ring_size + pos.clamp_min(0) % self.ring_size,
                           torch.full_like(self.p, -1))

    def emit(self, kv_state, norm_weight, eps, freqs_cis, k_cache, page_size, layout, from_input):
        """Odd rows: pooled with the input row before where `from_input`, else with their ring row (or the pad
        value kv 0 / score -inf when req is out of range); latent = bf16(RMSNorm(bf16(pooled))), stored at
        raw >> 1 rotated at p - 1 when live. Other rows get a zero latent. Reads the ring, writes none of it."""
        n = self.p.shape[0]
        partner_ring = torch.where(self.odd & ~from_input, self.ring_row(self.p - 1), torch.full_like(self.p, -1))
        from_ring = partner_ring >= 0
        partner = torch.zeros(n, 2 * _D, dtype=torch.float32, device=self.x.device)
        partner[:, _D:] = float("-inf")  # the pad value: kv 0, score -inf
        partner[from_input] = self.x[(self.row - 1).clamp_min(0)][from_input]
        partner[from_ring] = kv_state[partner_ring[from_ring]].to(torch.float32)
        pooled = pair_pool(partner[:, :_D], partner[:, _D:], self.x[:, :_D], self.x[:, _D:])
        latent = _latent(pooled.to(torch.bfloat16), norm_weight, eps)
        latent = torch.where(self.odd.unsqueeze(-1), latent, torch.zeros_like(latent))
        slots = torch.where(self.odd & self.live, self.raw >> 1, torch.full_like(self.p, -1))
        _store_latents(k_cache, latent, slots, self.p - 1, freqs_cis, page_size, layout)
        return latent

    def park(self, kv_state, rows):
        """Even live rows among `rows` (a mask) store their (kv, score) at their ring row."""
        parked = rows & self.even & self.live & self.req_ok
        kv_state[self.ring_row(self.p)[parked]] = self.x[parked].to(kv_state.dtype)


def c2_decode_or_verify_norm_rope_store(kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc,
                                        eps, freqs_cis, k_cache, page_size, ring_size, draft_len=0,
                                        layout=0) -> torch.Tensor:
    """Reference of dsv4::c2_decode_or_verify_norm_rope_store (sections 5.2 and 5.3).

    kv_input fp32 [N, 1024] = (kv, score). p < 0: padding, zero latent, nothing read or written. Even p: zero
    latent; when raw_out_loc > 0 the row is parked at ring row req*ring + p % ring. Odd p: pooled with its
    partner (verify rows at block offset > 0: the input row before; otherwise ring row req*ring + (p-1) % ring,
    or the pad value kv 0 / score -inf when req is out of range), latent = bf16(RMSNorm(bf16(pooled))); when
    raw_out_loc > 0 it is stored at slot raw_out_loc >> 1 rotated at p - 1. All ring reads precede ring writes.
    """
    op = "reference.c2_decode_or_verify_norm_rope_store"
    n = kv_input.shape[0]
    if ring_size < 1 or draft_len < 0:
        raise RuntimeError(f"{op}: ring_size must be >= 1 and draft_len >= 0")
    if draft_len > 0 and (ring_size <= draft_len or n % draft_len):
        raise RuntimeError(f"{op}: ring_size must be wider than the draft length and N a multiple of draft_len")
    rows = _PairRows(kv_input, kv_state, positions, req_pool_indices, raw_out_loc, ring_size)
    in_block = (rows.row % draft_len != 0) if draft_len > 0 else torch.zeros_like(rows.odd)
    latent = rows.emit(kv_state, norm_weight, eps, freqs_cis, k_cache, page_size, layout, rows.odd & in_block)
    rows.park(kv_state, torch.ones_like(rows.odd))
    return latent


def c2_prefill_norm_rope_store(kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc, eps,
                               freqs_cis, k_cache, extend_starts, extend_lens, page_size, ring_size,
                               layout=0) -> torch.Tensor:
    """Reference of dsv4::c2_prefill_norm_rope_store (section 5.5), by its rules: an odd row pools with the input
    row before it when that row is the same request's previous position, else with the ring; then each request
    r (rows [extend_starts[r], + extend_lens[r]) within the N rows) parks the even live rows among its last
    lcm(2, ring) rows. At consecutive positions this is running the decode op row by row in position order."""
    if ring_size < 1:
        raise RuntimeError("reference.c2_prefill_norm_rope_store: ring_size must be >= 1")
    rows = _PairRows(kv_input, kv_state, positions, req_pool_indices, raw_out_loc, ring_size)
    prev_p = torch.cat([rows.p.new_full((1,), -2), rows.p[:-1]])
    prev_req = torch.cat([rows.req.new_full((1,), -1), rows.req[:-1]])
    continues = (rows.row > 0) & (rows.p > 0) & (prev_p == rows.p - 1) & (prev_req == rows.req)
    latent = rows.emit(kv_state, norm_weight, eps, freqs_cis, k_cache, page_size, layout, rows.odd & continues)
    n = rows.p.shape[0]
    period = ring_size if ring_size % 2 == 0 else 2 * ring_size
    tail = torch.zeros_like(rows.odd)
    for start, length in zip(extend_starts.tolist(), extend_lens.tolist()):
        if start < 0 or length < 0 or start + length > n:
            continue
        tail[max(start, start + length - period):start + length] = True
    rows.park(kv_state, tail)
    return latent
