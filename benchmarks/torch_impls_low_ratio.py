"""Idiomatic torch implementations of the ratio-1 and ratio-2 decode compressors: what an engine developer
would write without this library (RMSNorm, softmax pooling, RoPE, fake quant, then a masked cache store).
The benchmarks compile them once per layout with torch.compile(dynamic=True); they aim at speed comparisons,
not at the exact rounding rules (reference/ does that).
"""
from __future__ import annotations

import torch

from .torch_impls_cache import _E2M1_BOUNDS, _E2M1_VALUES, _constant, store_main


def _rms_norm(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope_tail(x, rows):
    """GPT-J rotation of the last 64 dims with interleaved (cos, sin) table rows."""
    n = x.shape[0]
    tail = x[:, 448:].view(n, 32, 2)
    c, s = rows[:, 0::2], rows[:, 1::2]
    re, im = tail[..., 0], tail[..., 1]
    rotated = torch.stack([re * c - im * s, re * s + im * c], dim=-1).view(n, 64)
    return torch.cat([x[:, :448], rotated], dim=1)


def _fake_quant_fp4(x):
    """e2m1 with an e4m3 scale per 16 values, quantized and dequantized."""
    n = x.shape[0]
    tiles = x.view(n, 32, 16)
    scale = (tiles.abs().amax(-1, keepdim=True) / 6.0).clamp(2**-9, 448.0).to(torch.float8_e4m3fn).float()
    q = tiles / scale
    values = _constant(_E2M1_VALUES, x.device)[torch.bucketize(q.abs(), _constant(_E2M1_BOUNDS, x.device))]
    return (torch.where(q < 0, -values, values) * scale).view(n, 512)


def _store_latent(latent, table, rope_positions, slots, cache, page_size, layout):
    valid_pos = (rope_positions >= 0) & (rope_positions < table.shape[0])
    rows = table[torch.where(valid_pos, rope_positions, 0)]
    t = _rope_tail(latent.float(), rows).to(torch.bfloat16).float()
    if layout != 2:
        t = _fake_quant_fp4(t)
    store_main(t, cache, torch.where(valid_pos, slots, -1), page_size, layout)


def _pool_and_store(kv, partner, weight, eps, table, positions, raw_out_loc, cache, page_size, layout):
    """The odd rows' 2-way softmax pool of (partner, kv), norm and cache store; zero latents for the even rows."""
    odd = (positions & 1) == 1
    weights = torch.softmax(torch.stack([partner[:, 512:], kv[:, 512:]]), dim=0)
    pooled = weights[0] * partner[:, :512] + weights[1] * kv[:, :512]
    latent = _rms_norm(pooled.to(torch.bfloat16), weight, eps).to(torch.bfloat16)
    latent = torch.where(odd[:, None], latent, torch.zeros_like(latent))
    slots = torch.where(odd & (raw_out_loc > 0), raw_out_loc >> 1, -1)
    _store_latent(latent, table, positions - 1, slots, cache, page_size, layout)
    return latent


def c1_decode(kv, weight, eps, table, positions, out_loc, cache, page_size, layout):
    latent = _rms_norm(kv, weight, eps).to(torch.bfloat16)
    slots = torch.where(out_loc > 0, out_loc, -1)
    _store_latent(latent, table, positions, slots, cache, page_size, layout)
    return latent


def c2_decode_or_verify(kv, state, weight, eps, table, positions, req, raw_out_loc, cache, page_size, ring,
                        draft_len, layout):
    """Decode (draft_len 0: every odd row reads its partner from the ring) or verify (request-major blocks of
    draft_len consecutive positions: an odd row pools with the input row before it, and a block's first row with
    the ring). Then every live even row parks its row (ring > draft_len: a block's rows park on distinct ring
    rows); padded and odd rows write the dummy row 0 instead, a masked scatter without data-dependent shapes."""
    partner = state[req * ring + (positions - 1).clamp_min(0) % ring]
    if draft_len > 1:
        block_first = torch.arange(positions.numel(), device=positions.device) % draft_len == 0
        partner = torch.where(block_first[:, None], partner, torch.roll(kv, 1, 0))
    latent = _pool_and_store(kv, partner, weight, eps, table, positions, raw_out_loc, cache, page_size, layout)
    park = ((positions & 1) == 0) & (raw_out_loc > 0) & (positions >= 0)
    state.index_copy_(0, torch.where(park, req * ring + positions % ring, 0).long(), kv)
    return latent


def c2_prefill(kv, state, weight, eps, table, positions, req, raw_out_loc, cache, page_size, ring, layout):
    """A chunk of whole requests, each a run of consecutive rows: an odd row pools with the row before when that row
    is its request's previous position, else with the ring; then each request's even live rows among its last
    `ring` positions park (the newest of each ring row; the others write the dummy row 0)."""
    continues = (torch.roll(positions, 1, 0) == positions - 1) & (torch.roll(req, 1, 0) == req)
    continues[0] = False
    from_ring = state[req * ring + (positions - 1).clamp_min(0) % ring]
    partner = torch.where(continues[:, None], torch.roll(kv, 1, 0), from_ring)
    latent = _pool_and_store(kv, partner, weight, eps, table, positions, raw_out_loc, cache, page_size, layout)
    last = torch.full((state.shape[0] // ring,), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, req.long(), positions, "amax")
    park = ((positions & 1) == 0) & (raw_out_loc > 0) & (positions >= 0) & (positions + ring > last[req])
    state.index_copy_(0, torch.where(park, req * ring + positions % ring, 0).long(), kv)
    return latent
