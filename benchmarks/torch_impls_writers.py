"""Idiomatic torch implementations of the norm + RoPE cache writers: what an engine developer would
write without this library (mean/rsqrt RMSNorm, interleaved RoPE, a Hadamard matmul, then the store of
torch_impls_cache). The benchmarks compile them once per format with torch.compile(dynamic=True).
They aim at speed comparisons, not at the exact rounding rules (reference/ does that).
"""
from __future__ import annotations

import torch

from .torch_impls_cache import store_indexer, store_main


def _rms_norm(x, weight, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def _rope(v, rows):
    """GPT-J rotation of v [..., 64] by table rows (cos, sin interleaved)."""
    re, im = v[..., 0::2], v[..., 1::2]
    c, s = rows[..., 0::2], rows[..., 1::2]
    return torch.stack([re * c - im * s, re * s + im * c], -1).flatten(-2)


def hadamard_matrix(device):
    """The orthonormal 128-point Sylvester Hadamard matrix (a model would keep it as a buffer)."""
    h = torch.ones(1, 1)
    while h.shape[0] < 128:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / 128**0.5).to(device)


def _norm_rope_main(kv, weight, eps, rows, layout, round_nope):
    y = _rms_norm(kv, weight, eps)
    if layout != 0:
        y = y.to(torch.bfloat16).float()
    nope, tail = y[:, :448], _rope(y[:, 448:], rows)
    if layout != 0:
        tail = tail.to(torch.bfloat16).float()
    elif round_nope:
        nope = nope.to(torch.bfloat16).float()
    return torch.cat([nope, tail], 1)


def k_norm_rope(kv, weight, eps, freqs, positions, out_loc, cache, page_size, layout):
    in_table = (positions >= 0) & (positions < freqs.shape[0])
    rows = freqs[positions.clamp(0, freqs.shape[0] - 1)]
    y = _norm_rope_main(kv, weight, eps, rows, layout, round_nope=False)
    store_main(y, cache, torch.where(in_table, out_loc, -1), page_size, layout)


def _decode_plan_targets(plan, out_loc, ratio, max_pos):
    seq_len = plan[:, :4].contiguous().view(torch.int32).squeeze(-1).long() & 0xFFFFFFFF
    position = seq_len - ratio
    write = (seq_len % ratio == 0) & (position >= 0) & (position < max_pos)
    return torch.where(write, out_loc.long(), -1), position.clamp(0, max_pos - 1)


def compress_norm_rope_store(kv, plan, weight, eps, freqs, out_loc, cache, page_size, ratio, layout, use_fp4,
                             hadamard=None):
    """Decode plans (one row per request; written when seq_len closes a block). The indexer variant
    (kv [N, 128]) takes the Hadamard matrix."""
    slots, position = _decode_plan_targets(plan, out_loc, ratio, freqs.shape[0])
    rows = freqs[position]
    if kv.shape[1] == 128:
        y = _rms_norm(kv, weight, eps)
        y = torch.cat([y[:, :64], _rope(y[:, 64:], rows)], 1) @ hadamard
        store_indexer(y, cache, slots, page_size, use_fp4)
    else:
        store_main(_norm_rope_main(kv, weight, eps, rows, layout, round_nope=True), cache, slots, page_size, layout)
