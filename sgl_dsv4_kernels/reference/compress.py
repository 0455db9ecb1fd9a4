"""Reference c4/c128 compressor written from compressors.md §1.3, §1.4 and §4: ``compress_forward``
in pure torch (fp32 softmax with max subtraction, every compression before any state write), and the
fp64 ground truth of §4.5 computed from a request's full history of rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from .plans import unpack_plan

__all__ = ["compress_forward", "compress_entries_fp64", "compress_window", "state_row_width"]


def compress_window(ratio: int) -> int:
    return 8 if ratio == 4 else 128


def state_row_width(ratio: int, head_dim: int) -> int:
    return (4 if ratio == 4 else 2) * head_dim


def _slot_columns(ratio: int, head_dim: int):
    """(value column, score column) of each window slot: c4 rows are (kv_ov, kv, s_ov, s), c128 (kv, s)."""
    D = head_dim
    if ratio == 4:
        return [(0, 2 * D)] * 4 + [(D, 3 * D)] * 4
    return [(0, D)] * 128


def compress_forward(state: torch.Tensor, kv_score_input: torch.Tensor, ape: torch.Tensor, plan: torch.Tensor,
                     plan_w: Optional[torch.Tensor], head_dim: int, compress_ratio: int,
                     is_decode: bool) -> torch.Tensor:
    """Returns ``[plan rows, head_dim]`` in the input dtype and updates ``state`` in place."""
    r, D = compress_ratio, head_dim
    window = compress_window(r)
    W = state_row_width(r, D)
    rows = state.view(-1, W)
    pages = rows.shape[0] // r
    N = kv_score_input.shape[0]
    x = kv_score_input.float()
    ring = rows.float()  # read before any write of this call
    apef = ape.float()
    cols = _slot_columns(r, D)
    fields = unpack_plan(plan, "decode" if is_decode else "compress")
    out = torch.zeros(plan.shape[0], D, dtype=torch.float32, device=kv_score_input.device)
    neg_inf = float("-inf")
    for k in range(plan.shape[0]):
        if not bool(fields["valid"][k]):
            continue
        seq_len = int(fields["seq_len"][k])
        if seq_len == 0 or (is_decode and seq_len % r != 0):
            continue
        p = seq_len - 1
        src = k if is_decode else int(fields["ragged_id"][k])
        buffer_len = window - 1 if is_decode else int(fields["buffer_len"][k])
        pages_of = (int(fields["read_page_0"][k]), int(fields["read_page_1"][k]))
        values, scores = [], []
        for slot in range(window):
            overlap = r == 4 and slot < 4
            vc, sc = cols[slot]
            row = None
            if overlap and p < window - 1:
                row = None  # masked first chunk
            elif slot < buffer_len:
                page = pages_of[0] if overlap else pages_of[1]
                if 0 <= page < pages:
                    row = ring[page * r + slot % r]
            else:
                i = src - (window - 1) + slot
                if 0 <= i < N:
                    row = x[i]
            if row is None:
                values.append(torch.zeros(D, device=x.device))
                scores.append(torch.full((D,), neg_inf, device=x.device))
            else:
                values.append(row[vc:vc + D])
                scores.append(row[sc:sc + D] + apef[slot])
        v, s = torch.stack(values), torch.stack(scores)
        m = s.max(dim=0).values
        finite = m != neg_inf
        e = torch.exp(s - torch.where(finite, m, torch.zeros_like(m)))
        pooled = (v * e).sum(dim=0) / e.sum(dim=0)
        out[k] = torch.where(finite, pooled, torch.zeros_like(pooled))
    # State writes, after every compression of the call.
    if is_decode:
        targets = [(b, int(fields["write_loc"][b])) for b in range(plan.shape[0]) if bool(fields["valid"][b])]
    else:
        w = unpack_plan(plan_w, "write")
        targets = [(int(w["ragged_id"][i]), int(w["write_loc"][i])) for i in range(plan_w.shape[0])
                   if bool(w["valid"][i])]
    for src, dst in targets:
        if 0 <= src < N and 0 <= dst < rows.shape[0] - r:
            rows[dst] = kv_score_input[src].to(rows.dtype)
    return out.to(kv_score_input.dtype)


def compress_entries_fp64(history: torch.Tensor, ape: torch.Tensor, compress_ratio: int, head_dim: int) -> torch.Tensor:
    """fp64 truth (§4.5): every entry g < L // r of a request whose rows at positions 0..L-1 are
    ``history [L, W]``; returns ``[L // r, head_dim]`` float64. c4 masks the overlap of g = 0."""
    r, D = compress_ratio, head_dim
    h = history.double()
    a = ape.double()
    n = h.shape[0] // r
    if n == 0:
        return torch.zeros(0, D, dtype=torch.float64, device=history.device)
    if r == 128:
        chunks = h[: n * 128].view(n, 128, 2 * D)
        kv, s = chunks[..., :D], chunks[..., D:] + a
    else:
        chunks = h[: n * 4].view(n, 4, 4 * D)
        cur_kv, cur_s = chunks[..., D:2 * D], chunks[..., 3 * D:] + a[4:]
        prev = torch.cat([torch.zeros_like(chunks[:1]), chunks[:-1]], dim=0)
        ov_kv, ov_s = prev[..., :D], prev[..., 2 * D:3 * D] + a[:4]
        ov_s = ov_s.clone()
        ov_s[0] = float("-inf")
        kv = torch.cat([ov_kv, cur_kv], dim=1)
        s = torch.cat([ov_s, cur_s], dim=1)
    return (torch.softmax(s, dim=1) * kv).sum(dim=1)
