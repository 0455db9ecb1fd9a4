"""Reference ratio-1 and ratio-2 decode compressors (compressors.md sections 1.5, 1.6 and 5):
`c1_decode_norm_rope_store` and `c2_decode_or_verify_norm_rope_store`, composed from the reference RMSNorm,
RoPE tail, fake quantization and slot stores. In place on k_cache / kv_state; each returns a fresh bf16 latent.
"""
from __future__ import annotations

import torch

from .norm_rope import rms_norm_fp32, rope_tail
from .quant import _layout_id, fake_quant_compressed_kv, store_k_cache

__all__ = ["c1_decode_norm_rope_store", "c2_decode_or_verify_norm_rope_store", "pair_pool"]

_V41_FP4 = 2
_D = 512  # latent width; a c2 projection row is kv [512] then score [512]


def _rope_table(freqs: torch.Tensor) -> torch.Tensor:
    """fp32 [max_pos, 64] from the fp32 table or complex64 freqs_cis [max_pos, 32]."""
    if freqs.is_complex():
        return torch.view_as_real(freqs).reshape(freqs.shape[0], -1)
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
    device = kv_input.device
    x = kv_input.to(torch.float32)
    p = positions.to(torch.int64)
    req = req_pool_indices.to(torch.int64)
    raw = raw_out_loc.to(torch.int64)
    owners = kv_state.shape[0] // ring_size
    active = p >= 0
    odd = active & ((p & 1) == 1)
    even = active & ~odd
    live = raw > 0
    req_ok = (req >= 0) & (req < owners)
    none = torch.full_like(p, -1)

    def ring_row(pos):
        return torch.where(req_ok, req * ring_size + pos.clamp_min(0) % ring_size, none)

    row = torch.arange(n, device=device)
    in_block = (row % draft_len != 0) if draft_len > 0 else torch.zeros_like(active)
    from_input = odd & in_block
    partner_ring = torch.where(odd & ~in_block, ring_row(p - 1), none)
    from_ring = partner_ring >= 0

    partner = torch.zeros(n, 2 * _D, dtype=torch.float32, device=device)
    partner[:, _D:] = float("-inf")  # the pad value: kv 0, score -inf
    partner[from_input] = x[(row - 1).clamp_min(0)][from_input]
    partner[from_ring] = kv_state[partner_ring[from_ring]].to(torch.float32)

    pooled = pair_pool(partner[:, :_D], partner[:, _D:], x[:, :_D], x[:, _D:])
    latent = _latent(pooled.to(torch.bfloat16), norm_weight, eps)
    latent = torch.where(odd.unsqueeze(-1), latent, torch.zeros_like(latent))

    slots = torch.where(odd & live, raw >> 1, none)
    _store_latents(k_cache, latent, slots, p - 1, freqs_cis, page_size, layout)
    parked = even & live & req_ok
    kv_state[ring_row(p)[parked]] = x[parked].to(kv_state.dtype)
    return latent
