"""Reference norm + RoPE cache writers (cache-writers.md sections 3 and 4): `fused_k_norm_rope_flashmla`
and `compress_norm_rope_store`, composed from the reference RMSNorm, RoPE tail, Walsh-Hadamard transform and
slot stores, with the rounding points of section 1.6. In place; skipped rows write nothing.
"""
from __future__ import annotations

from typing import Tuple

import torch

from .norm_rope import hadamard128, rms_norm_fp32, rope_tail
from .quant import _indexer_id, _layout_id, store_indexer_cache, store_k_cache

__all__ = ["fused_k_norm_rope_flashmla", "compress_norm_rope_store"]

_V4 = 0
_ROPE_START_MAIN = 448  # dims 448..511 of the main latent are the RoPE dims
_PLAN_SENTINEL = 0xFFFFFFFF


def _rope_table(freqs: torch.Tensor) -> torch.Tensor:
    """fp32 [max_pos, 64] from the fp32 table or complex64 freqs_cis [max_pos, 32]."""
    if freqs.is_complex():
        return torch.view_as_real(freqs).reshape(freqs.shape[0], -1)
    return freqs.to(torch.float32)


def _table_rows(table: torch.Tensor, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(in_range, rows): whether each position indexes the table, and its row (row 0 where it does not)."""
    pos = positions.to(torch.int64)
    in_range = (pos >= 0) & (pos < table.shape[0])
    return in_range, table[torch.where(in_range, pos, torch.zeros_like(pos))]


def _bf16(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.bfloat16).to(torch.float32)


def _main_rows(y: torch.Tensor, rows: torch.Tensor, layout: int, round_v4_nope: bool) -> torch.Tensor:
    """The fp32 values that reach the main quantizer (section 1.6).

    V4: nope dims of y (bf16-rounded first on the compress path), tail rotated from the fp32 y (the store
    rounds it to bf16). V41 / V41_FP4: u = bf16(y), its tail rotated and rounded to bf16 again.
    """
    if layout == _V4:
        out = rope_tail(y, rows)
        if round_v4_nope:
            out[:, :_ROPE_START_MAIN] = _bf16(y[:, :_ROPE_START_MAIN])
        return out
    return _bf16(rope_tail(_bf16(y), rows))


def fused_k_norm_rope_flashmla(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    *,
    page_size: int,
    layout=_V4,
) -> None:
    """Reference of dsv4::fused_k_norm_rope_flashmla: row b -> slot out_loc[b], rotated at positions[b].

    Rows whose slot is out of range or whose position is outside [0, max_pos) write nothing.
    """
    lid = _layout_id(layout)
    in_range, rows = _table_rows(_rope_table(freqs).to(kv.device), positions)
    slots = torch.where(in_range, out_loc.to(torch.int64), torch.full_like(in_range, -1, dtype=torch.int64))
    y = rms_norm_fp32(kv, weight, eps)
    store_k_cache(kvcache, _main_rows(y, rows, lid, round_v4_nope=False), slots, page_size, lid)


def _plan_fields(plan: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(seq_len, ragged_id) as int64 from a uint8 [N, 16] plan (little-endian u32 at byte 0, u16 at byte 4)."""
    b = plan.to(torch.int64)
    seq_len = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    ragged_id = b[:, 4] | (b[:, 5] << 8)
    return seq_len, ragged_id


def _compress_targets(plan, out_loc, compress_ratio, is_decode, table):
    """(slots, table rows) of each plan entry; slot -1 for entries that write nothing (section 4)."""
    seq_len, ragged_id = _plan_fields(plan)
    out_loc = out_loc.to(torch.int64)
    if is_decode:
        take = seq_len % compress_ratio == 0
        index = torch.arange(plan.shape[0], device=plan.device)
    else:
        take = (seq_len != _PLAN_SENTINEL) & (ragged_id < out_loc.shape[0])
        index = ragged_id
    gathered = out_loc[torch.where(take, index, torch.zeros_like(index))] if out_loc.numel() else \
        torch.full_like(index, -1)
    in_range, rows = _table_rows(table, seq_len - compress_ratio)
    slots = torch.where(take & in_range, gathered, torch.full_like(gathered, -1))
    return slots, rows


def compress_norm_rope_store(
    kv: torch.Tensor,
    plan,
    *,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freq_cis: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    layout=_V4,
    use_fp4: bool = False,
    compress_ratio: int | None = None,
    is_decode: bool | None = None,
) -> None:
    """Reference of dsv4::compress_norm_rope_store.

    kv [N, 512]: main cache in `layout`; kv [N, 128]: C4 indexer cache (fp8, or fp4 with use_fp4), with
    y -> rotate dims 64..127 in fp32 -> hadamard128 -> indexer quantizer. `plan` is a raw uint8 [N, 16] plan
    (then compress_ratio and is_decode are required) or an object with .plan, .compress_ratio, .is_decode.
    """
    op = "reference.compress_norm_rope_store"
    if not isinstance(plan, torch.Tensor):
        compress_ratio, is_decode, plan = plan.compress_ratio, plan.is_decode, plan.plan
    if compress_ratio is None or is_decode is None:
        raise TypeError(f"{op}: a raw plan tensor needs compress_ratio and is_decode")
    table = _rope_table(freq_cis).to(kv.device)
    slots, rows = _compress_targets(plan.to(kv.device), out_loc.to(kv.device), int(compress_ratio),
                                    bool(is_decode), table)
    y = rms_norm_fp32(kv, norm_weight, norm_eps)
    if kv.shape[-1] == 128:
        if _layout_id(layout) != _V4:
            raise RuntimeError(f"{op}: layout must be 0 for the indexer variant, got {layout!r}")
        store_indexer_cache(kvcache, hadamard128(rope_tail(y, rows)), slots, page_size, _indexer_id(int(use_fp4)))
        return
    if use_fp4:
        raise RuntimeError(f"{op}: use_fp4=True requires the indexer variant (kv [N, 128])")
    lid = _layout_id(layout)
    store_k_cache(kvcache, _main_rows(y, rows, lid, round_v4_nope=True), slots, page_size, lid)
