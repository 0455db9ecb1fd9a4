"""Typed wrappers of the metadata ops (spec/metadata.md): page tables and positions, low-ratio and
compression metadata, the all-compressed index fill, and the paged-MQA schedule.

Every function launches on the current CUDA stream and never syncs with the host; output shapes
depend only on input shapes and int arguments, so all of them can be captured in CUDA graphs. The
``*_out`` forms write caller-owned buffers (same field layout as the pure form's result) that keep
their address across graph replays.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# DSV4 constants (spec §1.1); they are arguments of the ops, not hard-wired in the kernels.
FULL_PAGE_SIZE = 256
SWA_WINDOW = 128


class PageTablePositions(NamedTuple):
    """Result of :func:`build_page_table_positions_small` (field names as upstream, "casual" included)."""

    seq_lens_casual: torch.Tensor  # int32 [rows]
    positions_casual: torch.Tensor  # int32 [rows]: L - 1
    page_table: torch.Tensor  # int32 [rows, pages]
    swa_topk_lengths: torch.Tensor  # int32 [rows]: min(L, swa_window)


class LowRatioMetadata(NamedTuple):
    """Result of :func:`build_low_ratio_metadata` (ratios 1 and 2)."""

    c1_out_loc: torch.Tensor  # int64 [rows]
    c1_seq_lens: torch.Tensor  # int32 [rows]
    c1_sparse_lens: torch.Tensor  # int32 [rows]
    c1_page_indices: torch.Tensor  # int32 [rows, ceil(topk / 64) * 64], all -1
    c2_out_loc: torch.Tensor
    c2_seq_lens: torch.Tensor
    c2_sparse_lens: torch.Tensor
    c2_page_indices: torch.Tensor


class CompressionMetadata(NamedTuple):
    """Result of :func:`init_compression_metadata` (ratios 4 and 128)."""

    c4_out_loc: torch.Tensor  # int64 [W]
    c4_positions: torch.Tensor  # int32 [bs]
    c4_seq_lens_raw: torch.Tensor  # int32 [bs]
    c4_seq_lens_clamp1: torch.Tensor  # int32 [bs]
    c128_out_loc: torch.Tensor
    c128_positions: torch.Tensor
    c128_seq_lens_raw: torch.Tensor
    c128_seq_lens_clamp1: torch.Tensor
    c128_page_indices: Optional[torch.Tensor]  # int32 [bs, width], None when not computed


def build_page_table_positions_small(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_seq_len: Optional[int] = None,
    page_size: int = FULL_PAGE_SIZE,
    swa_window: int = SWA_WINDOW,
) -> PageTablePositions:
    """Per query row: its KV length, position ``L - 1``, SWA length ``min(L, swa_window)`` and the
    page table ``trunc(req_to_token[req, p * page_size] / page_size)`` for ``p < ceil(max_seq_len /
    page_size)`` (0 for an out-of-range request id). ``max_seq_len`` defaults to the capacity
    ``req_to_token.size(1)``, which keeps the page-table width fixed under CUDA-graph capture."""
    if max_seq_len is None:
        max_seq_len = req_to_token.size(1)
    return PageTablePositions(
        *torch.ops.dsv4.build_page_table_positions_small(
            req_to_token, req_pool_indices, seq_lens, max_seq_len, page_size, swa_window
        )
    )


def build_page_table_positions_small_out(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: PageTablePositions,
    page_size: int = FULL_PAGE_SIZE,
    swa_window: int = SWA_WINDOW,
) -> PageTablePositions:
    """:func:`build_page_table_positions_small` into ``out`` (the page count is ``out.page_table.size(1)``)."""
    torch.ops.dsv4.build_page_table_positions_small_out(
        req_to_token, req_pool_indices, seq_lens, page_size, swa_window, *out
    )
    return out


def build_low_ratio_metadata(seq_lens: torch.Tensor, out_loc: torch.Tensor, topk: int) -> LowRatioMetadata:
    """V4.1 decode metadata of the ratio-1 and ratio-2 pools (floor semantics): write slots
    (``c2_out_loc`` is -1 for odd L), lengths clamped to >= 1, sparse lengths ``min(len, topk)`` and
    -1-filled page-index rows of ``ceil(topk / 64) * 64`` columns."""
    return LowRatioMetadata(*torch.ops.dsv4.build_low_ratio_metadata(seq_lens, out_loc, topk))


def build_low_ratio_metadata_out(
    seq_lens: torch.Tensor, out_loc: torch.Tensor, *, topk: int, out: LowRatioMetadata
) -> LowRatioMetadata:
    """:func:`build_low_ratio_metadata` into ``out``."""
    torch.ops.dsv4.build_low_ratio_metadata_out(seq_lens, out_loc, topk, *out)
    return out


def fill_all_compressed_indices(
    page_table: torch.Tensor,
    compressed_seq_lens: torch.Tensor,
    page_indices: torch.Tensor,
    *,
    compress_ratio: int,
    page_size: int = FULL_PAGE_SIZE,
    raw_indices: Optional[torch.Tensor] = None,
) -> None:
    """In place: column p of row r of ``page_indices`` becomes the pool slot of compressed position p
    (``page_table[r, p / spp] * spp + p % spp``, spp = page_size / compress_ratio) when
    ``p < compressed_seq_lens[r]`` and the page exists, else -1; ``raw_indices`` (optional) gets p or -1."""
    torch.ops.dsv4.fill_all_compressed_indices(
        page_table, compressed_seq_lens, page_indices, compress_ratio, page_size, raw_indices
    )


def init_compression_metadata(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    *,
    page_size: int = FULL_PAGE_SIZE,
    compute_page_indices: bool = True,
) -> CompressionMetadata:
    """V4 metadata of the ratio-4 and ratio-128 pools (truncation semantics): write slots (0 for a
    row that closes no group), rounded-down positions, raw and clamp-1 lengths, and the c128 page
    indices (``None`` when ``compute_page_indices`` is false)."""
    result = torch.ops.dsv4.init_compression_metadata(
        seq_lens, positions, raw_out_loc, page_table, page_size, compute_page_indices
    )
    if not compute_page_indices:
        result = result[:8] + (None,)
    return CompressionMetadata(*result)


def init_compression_metadata_out(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: Optional[torch.Tensor] = None,
    *,
    out: CompressionMetadata,
    page_size: int = FULL_PAGE_SIZE,
) -> CompressionMetadata:
    """:func:`init_compression_metadata` into ``out``; ``out.c128_page_indices`` None (or with 0
    columns) skips the page indices."""
    page_indices = out.c128_page_indices
    if page_indices is None:
        page_indices = seq_lens.new_empty((seq_lens.size(0), 0), dtype=torch.int32)
    torch.ops.dsv4.init_compression_metadata_out(
        seq_lens, positions, raw_out_loc, page_table, page_size, *out[:8], page_indices
    )
    return out


def _default_num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        raise ValueError("get_paged_mqa_logits_metadata: num_sms is required for non-CUDA tensors")
    return torch.cuda.get_device_properties(device).multi_processor_count


def get_paged_mqa_logits_metadata(
    context_lens: torch.Tensor, block_kv: int = 64, num_sms: Optional[int] = None
) -> torch.Tensor:
    """DeepGEMM paged-MQA schedule: int32 ``[num_sms + 1, 2]`` rows ``(request, split)`` giving each
    SM's first 256-token split (the last ``S % num_sms`` SMs take one extra split; the last row is
    ``(B, 0)``). ``context_lens`` is ``[B]`` or ``[B, 1]``; ``block_kv`` (64 or 128) is validated
    only. ``num_sms`` defaults to the SM count of the tensor's CUDA device."""
    if num_sms is None:
        num_sms = _default_num_sms(context_lens.device)
    return torch.ops.dsv4.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)


def get_paged_mqa_logits_metadata_out(
    context_lens: torch.Tensor, *, out: torch.Tensor, block_kv: int = 64
) -> torch.Tensor:
    """:func:`get_paged_mqa_logits_metadata` into ``out`` (int32 ``[num_sms + 1, 2]``)."""
    torch.ops.dsv4.get_paged_mqa_logits_metadata_out(context_lens, block_kv, out)
    return out
