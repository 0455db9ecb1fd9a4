"""Reference c4/c128 planners written from compressors.md §2.2 and §3: a literal per-token loop in
Python integers, then the byte packing of §3.1. Also ``unpack_plan``, which decodes plan bytes into
int64 columns for tests. Slow by design; never imports the extension.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

__all__ = [
    "INVALID_WORD",
    "unpack_plan",
    "pack_decode_plan",
    "pack_compress_plan",
    "pack_write_plan",
    "state_slot",
    "state_page",
    "plan_compress_decode",
    "plan_compress_prefill",
]

INVALID_WORD = 0xFFFFFFFF
INT32_MAX = 2**31 - 1


def _i32(v: int) -> int:
    """The int32 whose bits are the low 32 bits of v."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def _pack_words(words: Sequence[Sequence[int]], width_words: int, device) -> torch.Tensor:
    t = torch.tensor([[_i32(w) for w in row] for row in words], dtype=torch.int32).reshape(-1, width_words)
    return t.view(torch.uint8).reshape(-1, 4 * width_words).to(device)


def pack_decode_plan(rows: Sequence[Tuple[int, int, int, int]], device="cpu") -> torch.Tensor:
    """DecodePlan bytes from (seq_len, write_loc, read_page_0, read_page_1) tuples."""
    return _pack_words(rows, 4, device)


def pack_compress_plan(rows: Sequence[Tuple[int, int, int, int, int]], device="cpu") -> torch.Tensor:
    """CompressPlan bytes from (seq_len, ragged_id, buffer_len, read_page_0, read_page_1) tuples."""
    return _pack_words([(s, (r & 0xFFFF) | ((b & 0xFFFF) << 16), p0, p1) for s, r, b, p0, p1 in rows], 4, device)


def pack_write_plan(rows: Sequence[Tuple[int, int]], device="cpu") -> torch.Tensor:
    """WritePlan bytes from (word0, write_loc) tuples."""
    return _pack_words(rows, 2, device)


def unpack_plan(t: torch.Tensor, kind: str) -> Dict[str, torch.Tensor]:
    """Decodes plan bytes into int64 columns. kind: "decode", "compress" or "write".

    Unsigned fields (seq_len, ragged_id, buffer_len, word0) are zero-extended, signed ones
    sign-extended; ``valid`` is word 0 != 0xFFFFFFFF.
    """
    width = {"decode": 16, "compress": 16, "write": 8}[kind]
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"unpack_plan: expected uint8 [N, {width}] for {kind}, got {t.dtype} {list(t.shape)}")
    words = t.cpu().contiguous().view(torch.int32).to(torch.int64)
    unsigned = words & 0xFFFFFFFF
    valid = unsigned[:, 0] != INVALID_WORD
    if kind == "decode":
        return dict(seq_len=unsigned[:, 0], write_loc=words[:, 1], read_page_0=words[:, 2],
                    read_page_1=words[:, 3], valid=valid)
    if kind == "compress":
        return dict(seq_len=unsigned[:, 0], ragged_id=unsigned[:, 1] & 0xFFFF, buffer_len=unsigned[:, 1] >> 16,
                    read_page_0=words[:, 2], read_page_1=words[:, 3], valid=valid)
    return dict(word0=unsigned[:, 0], ragged_id=unsigned[:, 0], write_loc=words[:, 1], valid=valid)


class _Tables:
    """Host copies of the lookup tables and the addressing mode (§2.2)."""

    def __init__(self, ratio, ring, swa_page_size, use_req_ring, req_to_token, full_to_swa):
        self.ratio = ratio
        self.ring = ring
        self.sps = swa_page_size
        self.paged = ratio == 4 and not use_req_ring
        self.r2t = req_to_token.cpu().tolist() if req_to_token is not None else None
        self.r2t_rows = req_to_token.shape[0] if req_to_token is not None else 0
        self.r2t_cols = req_to_token.shape[1] if req_to_token is not None else 0
        self.f2s = full_to_swa.cpu().tolist() if (full_to_swa is not None and self.paged) else None

    def slot(self, rid: int, p: int) -> int:
        return state_slot(rid, p, self)


def state_slot(rid: int, p: int, tables: "_Tables") -> int:
    """State row of position p of request rid, or -1 (§2.2)."""
    if rid < 0 or p < 0:
        return -1
    if tables.paged:
        if rid >= tables.r2t_rows or p >= tables.r2t_cols:
            return -1
        loc = tables.r2t[rid][p]
        if loc < 0 or loc >= len(tables.f2s):
            return -1
        swa = tables.f2s[loc]
        if swa < 0:
            return -1
        slot = (swa // tables.sps) * tables.ring + swa % tables.ring
    else:
        if tables.r2t is not None and rid >= tables.r2t_rows:
            return -1
        slot = rid * tables.ring + p % tables.ring
    return -1 if slot > INT32_MAX else slot


def state_page(slot: int, ratio: int) -> int:
    """page(slot): -1 for a failed lookup, else slot // ratio (§2.2)."""
    return -1 if slot < 0 else slot // ratio


def _window(ratio: int) -> int:
    return 8 if ratio == 4 else 128


def _mtp_pad(ratio: int, ring: int) -> int:
    return ring - _window(ratio) + 2 if ring > _window(ratio) else 0


def plan_compress_decode(req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio: int,
                         swa_page_size: int, ring_size: int, use_req_ring: bool = False) -> torch.Tensor:
    """DecodePlan ``[B, 16]`` (§3.4) on req_pool_indices' device."""
    r = compress_ratio
    tables = _Tables(r, ring_size, swa_page_size, use_req_ring, req_to_token, full_to_swa)
    rows = []
    for rid, L in zip(req_pool_indices.cpu().tolist(), seq_lens.cpu().tolist()):
        if L <= 0:
            rows.append((INVALID_WORD, -1, -1, -1))
            continue
        p = L - 1
        write_loc = tables.slot(rid, p)
        read_page_0 = state_page(tables.slot(rid, p - 4), r) if (r == 4 and L >= 8) else -1
        rows.append((L, write_loc, read_page_0, state_page(write_loc, r)))
    return pack_decode_plan(rows, req_pool_indices.device) if rows else torch.empty(
        0, 16, dtype=torch.uint8, device=req_pool_indices.device)


def plan_compress_prefill(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens: int,
                          compress_ratio: int, swa_page_size: int, ring_size: int, use_req_ring: bool = False,
                          use_cuda_graph: bool = False, final: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """CompressPlan ``[Nc, 16]`` and WritePlan ``[Nw, 8]`` (§3.3), stage 1 applied unless ``final=False``.

    With ``use_cuda_graph`` both plans have num_q_tokens rows, the tail holding sentinels.
    """
    r = compress_ratio
    window = _window(r)
    mtp_pad = _mtp_pad(r, ring_size)
    band = r == 4 and not use_req_ring
    sps = swa_page_size
    tables = _Tables(r, ring_size, swa_page_size, use_req_ring, req_to_token, full_to_swa)
    rids = req_pool_indices.cpu().tolist()
    compress: List[Tuple[int, int, int, int, int]] = []
    writes: List[Tuple[int, int]] = []
    off = 0
    for b, (L, E) in enumerate(zip(seq_lens.cpu().tolist(), extend_lens.cpu().tolist())):
        E = max(E, 0)
        prefix = L - E
        last_c = (L // r) * r
        first_w = min(last_c - (4 if r == 4 else 0), L - mtp_pad)
        for j in range(E):
            p = prefix + j
            q = off + j
            if p < 0 or q >= num_q_tokens:
                continue
            if (p + 1) % r == 0:
                buffer_len = window - min(j + 1, window)
                # stage 0: read_page_0 = -1, read_page_1 = batch index
                compress.append((p + 1, q, buffer_len, -1, b))
            if p >= first_w or (band and p % sps >= sps - 4):
                writes.append((((b << 16) | q), p + 1))
        off += E
    if final:
        for i, (seq_len, q, buffer_len, _, b) in enumerate(compress):
            if buffer_len > 0:
                p = seq_len - 1
                page_1 = state_page(tables.slot(rids[b], p), r)
                page_0 = state_page(tables.slot(rids[b], p - 4), r) if (r == 4 and p >= 7) else -1
            else:
                page_0 = page_1 = -1
            compress[i] = (seq_len, q, buffer_len, page_0, page_1)
        for i, (word0, word1) in enumerate(writes):
            b, q = word0 >> 16, word0 & 0xFFFF
            writes[i] = (q, tables.slot(rids[b], word1 - 1))
    if use_cuda_graph:
        compress += [(INVALID_WORD, 0, 0, -1, -1)] * (num_q_tokens - len(compress))
        writes += [(INVALID_WORD, -1)] * (num_q_tokens - len(writes))
    device = req_pool_indices.device
    plan_c = pack_compress_plan(compress, device) if compress else torch.empty(0, 16, dtype=torch.uint8, device=device)
    plan_w = pack_write_plan(writes, device) if writes else torch.empty(0, 8, dtype=torch.uint8, device=device)
    return plan_c, plan_w
