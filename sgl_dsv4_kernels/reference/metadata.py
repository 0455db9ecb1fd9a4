"""Pure-torch oracles of the metadata ops, written from spec/metadata.md (never from the kernels).

Spelling of the integer rules (§1.2): floor = ``//`` and ``%`` on integer tensors, truncation =
``torch.div(x, d, rounding_mode="trunc")`` / ``torch.fmod``, round-down = ``torch.bitwise_and(pos, -r)``,
int32 narrowing = ``.to(torch.int32)`` (two's-complement wrap). Every function runs on CPU and CUDA.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

SPLIT_TOKENS = 256  # §6: the unit of work of the paged-MQA schedule


def _i32(t: torch.Tensor) -> torch.Tensor:
    """Lengths, positions, slots and page ids are narrowed to int32 on load (§1.3)."""
    return t.to(torch.int32).contiguous()


def _i64(t: torch.Tensor) -> torch.Tensor:
    """Locs and request ids are widened to int64 on load (§1.3)."""
    return t.to(torch.int64).contiguous()


def _paged_slots(table: torch.Tensor, k: torch.Tensor, spp: int) -> torch.Tensor:
    """``int32(table[row, k // spp]) * spp + k % spp`` in int32 wrap arithmetic, for a [rows, n]
    grid of compressed positions ``k`` (clamped into the table: callers mask invalid columns)."""
    cols = torch.clamp(k // spp, max=table.size(1) - 1)
    ids = _i32(torch.gather(table, 1, cols)).to(torch.int64)
    return (ids * spp + k % spp).to(torch.int32)


def build_page_table_positions_small(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    page_size: int,
    swa_window: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """§2: (seq_lens, positions, page_table, swa_lengths), all int32."""
    device = seq_lens.device
    L = _i32(seq_lens).clone()
    rows = L.numel()
    pages = (max_seq_len + page_size - 1) // page_size
    positions = (L.to(torch.int64) - 1).to(torch.int32)
    swa = torch.clamp(L, max=min(swa_window, 2**31 - 1))
    page_table = torch.zeros((rows, pages), dtype=torch.int32, device=device)
    num_requests = req_to_token.size(0)
    if rows > 0 and pages > 0 and num_requests > 0:
        q = _i64(req_pool_indices)
        known = (q >= 0) & (q < num_requests)
        first_slots = torch.arange(pages, device=device, dtype=torch.int64) * page_size
        slots = _i32(req_to_token[torch.clamp(q, 0, num_requests - 1)[:, None], first_slots[None, :]])
        ids = torch.div(slots, page_size, rounding_mode="trunc")
        page_table = torch.where(known[:, None], ids, torch.zeros_like(ids))
    return L, positions, page_table, swa


def build_low_ratio_metadata(seq_lens: torch.Tensor, out_loc: torch.Tensor, topk: int):
    """§3: the torch-floor formulation, for ratio 1 then ratio 2:
    ``(out_loc, seq_lens, sparse_lens, page_indices)`` twice."""
    L = _i32(seq_lens)
    loc = _i64(out_loc)
    rows = L.numel()
    padded = (topk + 63) // 64 * 64
    outputs = []
    for r in (1, 2):
        out_loc_r = torch.where(L % r == 0, loc // r, torch.full_like(loc, -1))
        clamp1 = torch.clamp(L // r, min=1)
        sparse = torch.clamp(clamp1, max=topk)
        page_indices = torch.full((rows, padded), -1, dtype=torch.int32, device=L.device)
        outputs += [out_loc_r, clamp1, sparse, page_indices]
    return tuple(outputs)


def fill_all_compressed_indices(
    page_table: torch.Tensor,
    compressed_seq_lens: torch.Tensor,
    page_indices: torch.Tensor,
    compress_ratio: int,
    page_size: int,
    raw_indices: Optional[torch.Tensor] = None,
):
    """§4: writes ``page_indices`` (and ``raw_indices`` when given) in place and returns both."""
    rows, width = page_indices.shape
    spp = page_size // compress_ratio
    num_pages = page_table.size(1)
    device = page_indices.device
    length = _i32(compressed_seq_lens).to(torch.int64)[:, None]
    p = torch.arange(width, device=device, dtype=torch.int64)[None, :].expand(rows, width)
    valid = (p < length) & (p // spp < num_pages)
    minus_one = torch.full((rows, width), -1, dtype=torch.int32, device=device)
    if num_pages > 0 and rows > 0:
        slots = torch.where(valid, _paged_slots(page_table, p, spp), minus_one)
    else:
        slots = minus_one
    raw = torch.where(valid, p.to(torch.int32), minus_one)
    page_indices.copy_(slots)
    if raw_indices is not None:
        raw_indices.copy_(raw)
    return page_indices, raw_indices


def init_compression_metadata(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    page_size: int = 0,
    compute_page_indices: bool = True,
):
    """§5: ``(c4_out_loc, c4_positions, c4_seq_lens_raw, c4_seq_lens_clamp1, c128_out_loc,
    c128_positions, c128_seq_lens_raw, c128_seq_lens_clamp1, c128_page_indices)``; the page
    indices are ``[bs, 0]`` when not computed (like the op)."""
    s = _i32(seq_lens)
    pos = _i32(positions)
    loc = _i64(raw_out_loc)
    bs, num_locs = s.numel(), loc.numel()
    outputs = []
    for r in (4, 128):
        closes_group = torch.fmod(s[:num_locs], r) == 0
        out_loc = torch.where(closes_group, torch.div(loc, r, rounding_mode="trunc"), torch.zeros_like(loc))
        raw = torch.div(s, r, rounding_mode="trunc")
        outputs += [out_loc, torch.bitwise_and(pos, -r), raw, torch.clamp(raw, min=1)]
    cps = cap = width = 0
    if compute_page_indices:
        cps = page_size // 128
        cap = cps * page_table.size(1)
        width = (cap + 63) // 64 * 64
    c128_raw = outputs[6]
    j = torch.arange(width, device=s.device, dtype=torch.int64)[None, :].expand(bs, width)
    valid = (j < c128_raw.to(torch.int64)[:, None]) & (j < cap)
    minus_one = torch.full((bs, width), -1, dtype=torch.int32, device=s.device)
    if width > 0 and bs > 0 and page_table.size(1) > 0:
        page_indices = torch.where(valid, _paged_slots(page_table, j, cps), minus_one)
    else:
        page_indices = minus_one
    return tuple(outputs) + (page_indices,)


def _split_counts(context_lens: torch.Tensor) -> torch.Tensor:
    """n_b = ceil(max(int32(L_b), 0) / 256) as int64 (§6.2 step 1)."""
    L = torch.clamp(_i32(context_lens.flatten()).to(torch.int64), min=0)
    return (L + SPLIT_TOKENS - 1) // SPLIT_TOKENS


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """§6.4, vectorised: int32 ``[num_sms + 1, 2]`` rows ``(request, split)``; ``block_kv`` does
    not change the output."""
    assert block_kv in (64, 128) and 1 <= num_sms <= 1024
    device = context_lens.device
    n = _split_counts(context_lens)
    B = n.numel()
    if B == 0:
        return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=device)
    P = torch.cumsum(n, 0)
    S = P[-1]
    q = torch.div(S, num_sms, rounding_mode="floor")
    pivot = num_sms - (S - q * num_sms)
    i = torch.arange(num_sms + 1, device=device, dtype=torch.int64)
    start = i * q + torch.clamp(i - pivot, min=0)
    b = torch.searchsorted(P, start, right=True)
    base = torch.where(b > 0, P[torch.clamp(b - 1, min=0)], torch.zeros_like(b))
    sentinel = b == B
    request = torch.where(sentinel, torch.full_like(b, B), b)
    split = torch.where(sentinel, torch.zeros_like(b), start - base)
    return torch.stack([request, split], dim=1).to(torch.int32)


def get_paged_mqa_logits_metadata_loop(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """§6.4, the second oracle: one forward cursor over the requests, running sum in Python ints."""
    assert block_kv in (64, 128) and 1 <= num_sms <= 1024
    n = _split_counts(context_lens).tolist()
    B = len(n)
    S = sum(n)
    q, rem = divmod(S, num_sms)
    pivot = num_sms - rem
    rows = []
    b, before = 0, 0  # before = P_{b-1}
    for i in range(num_sms + 1):
        start = i * q + max(i - pivot, 0)
        while b < B and before + n[b] <= start:
            before += n[b]
            b += 1
        rows.append((b, start - before) if b < B else (B, 0))
    return torch.tensor(rows, dtype=torch.int32, device=context_lens.device)
