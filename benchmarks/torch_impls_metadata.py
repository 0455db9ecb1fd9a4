"""Idiomatic torch implementations of the metadata ops: what an engine developer would write without
this library (gathers, arange masks, cumsum + searchsorted). The benchmarks compile them once with
torch.compile(dynamic=True) and compare speed; exactness on hostile values is reference/'s job.
"""
from __future__ import annotations

import torch


def page_table_positions(req_to_token, req_pool_indices, seq_lens, max_seq_len: int, page_size: int, swa_window: int):
    pages = (max_seq_len + page_size - 1) // page_size
    cols = torch.arange(pages, device=seq_lens.device) * page_size
    page_table = (req_to_token[req_pool_indices[:, None], cols[None, :]] // page_size).int()
    lens = seq_lens.int()
    return lens, lens - 1, page_table, torch.clamp(lens, max=swa_window)


def low_ratio_metadata(seq_lens, out_loc, topk: int):
    padded = (topk + 63) // 64 * 64
    out = []
    for r in (1, 2):
        clamp1 = torch.clamp(seq_lens // r, min=1).int()
        out += [
            torch.where(seq_lens % r == 0, out_loc // r, -1),
            clamp1,
            torch.clamp(clamp1, max=topk),
            torch.full((seq_lens.shape[0], padded), -1, dtype=torch.int32, device=seq_lens.device),
        ]
    return out


def fill_all_compressed_indices(page_table, lens, width: int, compress_ratio: int, page_size: int):
    spp = page_size // compress_ratio
    p = torch.arange(width, device=lens.device)
    page = torch.clamp(p // spp, max=page_table.shape[1] - 1)
    valid = (p[None, :] < lens[:, None]) & (p[None, :] // spp < page_table.shape[1])
    slots = page_table[:, page] * spp + p % spp
    return torch.where(valid, slots, -1).int(), torch.where(valid, p, -1).int()


def compression_metadata(seq_lens, positions, raw_out_loc, page_table, page_size: int):
    out = []
    for r in (4, 128):
        raw = torch.div(seq_lens, r, rounding_mode="trunc").int()
        closes = seq_lens[: raw_out_loc.shape[0]] % r == 0
        out += [torch.where(closes, raw_out_loc // r, 0), positions & -r, raw, torch.clamp(raw, min=1)]
    cps = page_size // 128
    cap = cps * page_table.shape[1]
    width = (cap + 63) // 64 * 64
    j = torch.arange(width, device=seq_lens.device)
    valid = (j[None, :] < out[6][:, None]) & (j[None, :] < cap)
    slots = page_table[:, torch.clamp(j // cps, max=page_table.shape[1] - 1)] * cps + j % cps
    out.append(torch.where(valid, slots, -1).int())
    return out


def paged_mqa_schedule(context_lens, num_sms: int):
    splits = (torch.clamp(context_lens.long(), min=0) + 255) // 256
    prefix = torch.cumsum(splits, 0)
    total = prefix[-1]
    q = total // num_sms
    pivot = num_sms - (total - q * num_sms)
    i = torch.arange(num_sms + 1, device=context_lens.device)
    start = i * q + torch.clamp(i - pivot, min=0)
    b = torch.searchsorted(prefix, start, right=True)
    base = torch.where(b > 0, prefix[torch.clamp(b - 1, min=0)], 0)
    batch = context_lens.shape[0]
    sentinel = b == batch
    return torch.stack([torch.where(sentinel, batch, b), torch.where(sentinel, 0, start - base)], 1).int()
