"""Idiomatic torch versions of the c4/c128 compressor: what an engine developer would write without
this library (decode the plan words, gather every window row, softmax, weighted sum, index_copy_ the
state rows). The benchmarks compile them once with torch.compile(dynamic=True). Speed comparisons
only; the exact semantics are in reference/.
"""
from __future__ import annotations

import torch


def _pool(kv, s, ape):
    return (torch.softmax(s + ape, dim=1) * kv).sum(1)


def compress_decode(state, x, ape, plan, head_dim: int, ratio: int):
    """Decode: every request gathers its window (emitting or not), the result is masked."""
    D = head_dim
    words = plan.view(torch.int32)
    seq, write_loc, page0, page1 = words[:, 0], words[:, 1], words[:, 2], words[:, 3]
    rows = state.shape[0]
    if ratio == 4:
        ov = state[(page0[:, None] * 4 + torch.arange(4, device=x.device)).clamp(0, rows - 1)].float()
        cur = state[(page1[:, None] * 4 + torch.arange(3, device=x.device)).clamp(0, rows - 1)].float()
        kv = torch.cat([ov[..., :D], cur[..., D:2 * D], x[:, None, D:2 * D]], 1)
        s = torch.cat([ov[..., 2 * D:3 * D], cur[..., 3 * D:], x[:, None, 3 * D:]], 1)
        s[:, :4] = torch.where((seq <= 4)[:, None, None], float("-inf"), s[:, :4])
    else:
        ring = state[(page1[:, None] * 128 + torch.arange(127, device=x.device)).clamp(0, rows - 1)].float()
        kv = torch.cat([ring[..., :D], x[:, None, :D]], 1)
        s = torch.cat([ring[..., D:], x[:, None, D:]], 1)
    out = _pool(kv, s, ape)
    out = torch.where((seq % ratio == 0)[:, None], out, torch.zeros_like(out))
    valid = (write_loc >= 0) & (write_loc < rows - ratio)
    state.index_copy_(0, torch.where(valid, write_loc, rows - 1).long(), torch.where(
        valid[:, None], x.to(state.dtype), state[rows - 1]))
    return out


def compress_prefill(state, x, ape, plan, plan_w, head_dim: int, ratio: int):
    """Prefill: gather the window rows of every CompressPlan row from the ring or the input."""
    D = head_dim
    window = 8 if ratio == 4 else 128
    words = plan.view(torch.int32)
    seq, word1, page0, page1 = words[:, 0], words[:, 1], words[:, 2], words[:, 3]
    src, buffer_len = word1 & 0xFFFF, (word1 >> 16) & 0xFFFF
    k = torch.arange(window, device=x.device)
    in_rows = (src[:, None] - (window - 1) + k).clamp(0, x.shape[0] - 1)
    page = torch.where(k < 4, page0[:, None], page1[:, None]) if ratio == 4 else page1[:, None]
    ring_rows = (page * ratio + k % ratio).clamp(0, state.shape[0] - 1)
    rows = torch.where((k < buffer_len[:, None])[..., None], state[ring_rows].float(), x[in_rows].float())
    if ratio == 4:
        kv = torch.cat([rows[:, :4, :D], rows[:, 4:, D:2 * D]], 1)
        s = torch.cat([rows[:, :4, 2 * D:3 * D], rows[:, 4:, 3 * D:]], 1)
        s[:, :4] = torch.where((seq < 8)[:, None, None], float("-inf"), s[:, :4])
    else:
        kv, s = rows[..., :D], rows[..., D:]
    out = _pool(kv, s, ape)
    out = torch.where((seq != -1)[:, None], out, torch.zeros_like(out))
    w = plan_w.view(torch.int32)
    n = state.shape[0]
    valid = (w[:, 0] != -1) & (w[:, 1] >= 0) & (w[:, 1] < n - ratio)
    state.index_copy_(0, torch.where(valid, w[:, 1], n - 1).long(),
                      torch.where(valid[:, None], x[w[:, 0].clamp(0, x.shape[0] - 1)].to(state.dtype), state[n - 1]))
    return out
