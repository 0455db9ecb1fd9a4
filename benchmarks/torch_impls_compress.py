"""Idiomatic torch versions of the c4/c128 compressor: what an engine developer would write without
this library (decode the plan words, gather every window row, softmax, weighted sum, index_copy_ the
state rows), and of its planners (table gathers, masks, a cumsum to compact the events, int32 words
viewed as plan bytes). The benchmarks compile them once with torch.compile(dynamic=True). Speed
comparisons only; the exact semantics are in reference/ (the planners produce the library's bytes on
the benchmark's inputs, which tests/test_bench_torch_impls.py checks).
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


# ---- planners (compressors.md §2.2, §3) ----

INT32_MAX = 2**31 - 1


def _slot(rid, p, ring: int, req_to_token, full_to_swa, swa_page_size: int, paged: bool):
    """State row of position p of request rid (§2.2) in int64, -1 where the lookup fails. rid and p
    broadcast; out-of-range indices are clamped for the gathers and masked afterwards."""
    rid, p = rid.long(), p.long()
    ok = (rid >= 0) & (p >= 0)
    if paged:  # one ring per SWA page: (swa // swa_page_size) * ring + swa % ring
        R, T = req_to_token.shape
        ok = ok & (rid < R) & (p < T)
        loc = req_to_token[rid.clamp(0, R - 1), p.clamp(0, T - 1)].long()
        F = full_to_swa.shape[0]
        ok = ok & (loc >= 0) & (loc < F)
        swa = full_to_swa[loc.clamp(0, F - 1)].long()
        ok = ok & (swa >= 0)
        slot = swa // swa_page_size * ring + swa % ring
    else:  # request ring; req_to_token, when given, only bounds rid
        if req_to_token is not None:
            ok = ok & (rid < req_to_token.shape[0])
        slot = rid * ring + p % ring
    return torch.where(ok & (slot <= INT32_MAX), slot, -1)


def _page(slot, ratio: int):
    """page(slot) = slot // r, and -1 for a failed lookup (never a truncated negative slot)."""
    return torch.where(slot >= 0, slot // ratio, -1)


def plan_decode(req_pool_indices, seq_lens, req_to_token=None, full_to_swa=None, *, compress_ratio: int,
                ring_size: int, swa_page_size: int = 0, use_req_ring: bool = False):
    """DecodePlan ``[B, 16]`` (§3.4): {L, slot(p), page(slot(p - 4)) for c4 at L >= 8, page(slot(p))}
    with p = L - 1; rows with L <= 0 are the all -1 sentinel."""
    r = compress_ratio
    paged = r == 4 and not use_req_ring
    L = seq_lens.long()
    p = L - 1
    rid = req_pool_indices
    write_loc = _slot(rid, p, ring_size, req_to_token, full_to_swa, swa_page_size, paged)
    if r == 4:  # the overlap chunk's page, once there is a full previous chunk
        ov = _page(_slot(rid, p - 4, ring_size, req_to_token, full_to_swa, swa_page_size, paged), r)
        page0 = torch.where(L >= 8, ov, -1)
    else:
        page0 = torch.full_like(write_loc, -1)
    words = torch.stack([L, write_loc, page0, _page(write_loc, r)], 1)
    words = torch.where((L > 0)[:, None], words, -1)
    return words.int().view(torch.uint8)  # [B, 4] int32 -> [B, 16] bytes (little-endian)


def _compact(rows, keep, sentinel):
    """The kept rows first, in order, then sentinel rows up to the same count (the capturable planner's
    fixed-shape output): the running count of kept rows gives each its destination; dropped rows all go
    to a spare last row that is cut off."""
    n = rows.shape[0]
    dest = torch.where(keep, torch.cumsum(keep, 0) - 1, n)
    out = torch.stack([rows.new_full((n + 1,), w) for w in sentinel], 1)  # built on device: no host copy
    out[dest] = rows
    return out[:n]


def plan_prefill_verify(req_pool_indices, seq_lens, req_to_token=None, full_to_swa=None, *, draft: int,
                        compress_ratio: int, ring_size: int, swa_page_size: int = 0, use_req_ring: bool = False):
    """Verify plans (§3.3) when every request extends by the same ``draft`` tokens: ``seq_lens`` are
    the lengths after the call (prefix + draft), num_q_tokens = B * draft. Returns CompressPlan
    ``[B * draft, 16]`` and WritePlan ``[B * draft, 8]``, entries first and sentinels after, as the
    capturable GPU planner (inputs on one device) writes them."""
    r, ring = compress_ratio, ring_size
    window = 8 if r == 4 else 128
    mtp_pad = ring - window + 2 if ring > window else 0
    paged = r == 4 and not use_req_ring  # paged c4 also writes the last 4 tokens of every SWA page
    L = seq_lens.long()[:, None]  # [B, 1]
    B = L.shape[0]
    j = torch.arange(draft, device=L.device)
    p = L - draft + j  # [B, draft]: the draft positions; flattened, batch-major with ascending p
    q = torch.arange(B * draft, device=L.device).view(B, draft)  # ragged ids: the fixed-width offsets
    live = p >= 0
    emit = live & ((p + 1) % r == 0)  # a chunk closes
    first_w = torch.minimum(L // r * r - (4 if r == 4 else 0), L - mtp_pad)
    write = live & (p >= first_w)
    if paged:
        write = write | (live & (p % swa_page_size >= swa_page_size - 4))
    rid = req_pool_indices[:, None]
    slot = _slot(rid, p, ring, req_to_token, full_to_swa, swa_page_size, paged)
    # window slots before the prefix come from the ring; with none, neither page is read (-1)
    buffer_len = window - torch.clamp(j + 1, max=window)
    has_buf = buffer_len > 0
    page1 = torch.where(has_buf, _page(slot, r), -1)
    if r == 4:
        ov = _page(_slot(rid, p - 4, ring, req_to_token, full_to_swa, swa_page_size, paged), r)
        page0 = torch.where(has_buf & (p >= 7), ov, -1)  # §3.2's rule (p - 4 < 0 fails the lookup anyway)
    else:
        page0 = torch.full_like(page1, -1)
    word1 = q + (buffer_len << 16)  # u16 ragged_id | u16 buffer_len << 16
    c_rows = torch.stack([p + 1, word1, page0, page1], -1).view(B * draft, 4).int()
    w_rows = torch.stack([q, slot], -1).view(B * draft, 2).int()
    plan_c = _compact(c_rows, emit.flatten(), (-1, 0, -1, -1))
    plan_w = _compact(w_rows, write.flatten(), (-1, -1))
    return plan_c.view(torch.uint8), plan_w.view(torch.uint8)
