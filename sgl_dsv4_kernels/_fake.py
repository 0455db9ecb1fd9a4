"""Fake (meta) implementations of every tensor op in torch.ops.dsv4.

Each fake runs the metadata half of its host launcher's validation with ``torch._check`` (dtypes,
devices, ranks, sizes, strides, integer arguments; never data pointers or values) and returns
outputs of the right shape, so the ops trace under ``torch.compile`` and ``opcheck``.
"""
from __future__ import annotations

import math
import struct

import torch

from .kv_layout import IndexerFormat, KVLayout

_INDEX_DTYPES = (torch.int32, torch.int64)
_ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
_MAIN_DIM = 512
_INDEXER_DIM = 128
_ROPE_DIM = 64


def _register(name):
    def wrap(fn):
        if hasattr(torch.ops.dsv4, name.split(".")[0]):
            torch.library.register_fake(f"dsv4::{name}")(fn)
        return fn

    return wrap


def _msg(op, text):
    return lambda: f"dsv4.{op}: {text}"


def check_same_device(op, name, t, ref):
    torch._check(t.device == ref.device, _msg(op, f"{name} must be on {ref.device}, got {t.device}"))


def check_index_vector(op, name, t, ref):
    check_same_device(op, name, t, ref)
    torch._check(t.dtype in _INDEX_DTYPES, _msg(op, f"{name} must be int32 or int64, got {t.dtype}"))
    torch._check(t.dim() == 1, _msg(op, f"{name} must be 1-D, got {t.dim()}-D"))
    torch._check(t.numel() <= 1 or t.stride(0) == 1, _msg(op, f"{name} must be contiguous"))


def check_activation(op, name, t, width, ref):
    check_same_device(op, name, t, ref)
    torch._check(t.dtype in _ACTIVATION_DTYPES, _msg(op, f"{name} must be bfloat16 or float32, got {t.dtype}"))
    torch._check(t.dim() == 2, _msg(op, f"{name} must be 2-D, got {t.dim()}-D"))
    torch._check(t.size(1) == width, _msg(op, f"{name} must have {width} columns"))
    torch._check(t.stride(1) == 1, _msg(op, f"{name} must have stride(1) == 1"))


def check_page_size(op, page_size):
    torch._check(
        1 <= page_size <= 1024 and (page_size & (page_size - 1)) == 0,
        _msg(op, f"page_size must be a power of two in [1, 1024], got {page_size}"),
    )


def check_cache(op, name, cache, fmt, page_size, align):
    """Metadata part of the cache tensor rule (kv-layouts-and-quant.md §2); alignment of the
    data pointer is checked by the real op only."""
    check_page_size(op, page_size)
    torch._check(cache.dtype == torch.uint8, _msg(op, f"{name} must be uint8, got {cache.dtype}"))
    torch._check(cache.dim() == 2, _msg(op, f"{name} must be 2-D, got {cache.dim()}-D"))
    torch._check(cache.stride(1) == 1, _msg(op, f"{name} must have stride(1) == 1"))
    need = fmt.page_bytes(page_size)
    torch._check(cache.size(1) >= need, _msg(op, f"{name} rows must hold at least {need} bytes"))
    if cache.size(0) >= 2:
        torch._check(cache.stride(0) >= cache.size(1), _msg(op, f"{name} stride(0) is smaller than its width"))
        torch._check(cache.stride(0) % align == 0, _msg(op, f"{name} stride(0) must be a multiple of {align}"))


def check_layout(op, layout):
    torch._check(layout in (0, 1, 2), _msg(op, f"layout must be a KVLayout id (0, 1, 2), got {layout}"))
    return KVLayout(layout)


@_register("fused_store_cache")
def _fused_store_cache(input, cache, indices, *, page_size, type="flashmla", layout=0, use_fp4=False,
                       freqs_cis=None):
    op = "fused_store_cache"
    torch._check(type in ("flashmla", "indexer"), _msg(op, f'type must be "flashmla" or "indexer", got "{type}"'))
    kv_layout = check_layout(op, layout)
    indexer = type == "indexer"
    if indexer:
        torch._check(layout == 0, _msg(op, f'layout must be 0 (V4) when type="indexer", got {layout}'))
        torch._check(freqs_cis is None, _msg(op, 'freqs_cis must be None when type="indexer"'))
        fmt, align, width = (IndexerFormat.FP4 if use_fp4 else IndexerFormat.FP8), 4, _INDEXER_DIM
    else:
        torch._check(not use_fp4, _msg(op, 'use_fp4=True requires type="indexer"'))
        fmt, align, width = kv_layout, 16, _MAIN_DIM
    check_cache(op, "cache", cache, fmt, page_size, align)
    check_activation(op, "input", input, width, cache)
    check_index_vector(op, "indices", indices, cache)
    torch._check(indices.size(0) == input.size(0), _msg(op, "indices must have one entry per input row"))
    if freqs_cis is not None:
        torch._check(kv_layout != KVLayout.V4, _msg(op, "freqs_cis requires layout V41 or V41_FP4"))
        check_same_device(op, "freqs_cis", freqs_cis, cache)
        torch._check(freqs_cis.dtype == torch.float32, _msg(op, "freqs_cis must be float32"))
        torch._check(freqs_cis.dim() == 2, _msg(op, "freqs_cis must be 2-D"))
        torch._check(
            freqs_cis.size(0) == input.size(0) and freqs_cis.size(1) == _ROPE_DIM,
            _msg(op, f"freqs_cis must be [N, {_ROPE_DIM}]"),
        )
        torch._check(freqs_cis.is_contiguous(), _msg(op, "freqs_cis must be contiguous"))
    return None


def _check_dequant(op, cache, slots, page_size, layout):
    kv_layout = check_layout(op, layout)
    check_cache(op, "cache", cache, kv_layout, page_size, 16)
    check_index_vector(op, "slots", slots, cache)


@_register("dequantize_k_cache_paged")
def _dequantize_k_cache_paged(cache, slots, page_size, layout=0):
    _check_dequant("dequantize_k_cache_paged", cache, slots, page_size, layout)
    return cache.new_empty((slots.size(0), 1, _MAIN_DIM), dtype=torch.bfloat16)


@_register("dequantize_k_cache_paged.out")
def _dequantize_k_cache_paged_out(cache, slots, page_size, layout=0, *, out):
    op = "dequantize_k_cache_paged"
    _check_dequant(op, cache, slots, page_size, layout)
    n = slots.size(0)
    check_same_device(op, "out", out, cache)
    torch._check(out.dtype == torch.bfloat16, _msg(op, f"out must be bfloat16, got {out.dtype}"))
    torch._check(out.dim() == 3, _msg(op, f"out must be 3-D, got {out.dim()}-D"))
    torch._check(
        out.size(0) == n and out.size(1) == 1 and out.size(2) == _MAIN_DIM,
        _msg(op, f"out must be [N, 1, {_MAIN_DIM}]"),
    )
    torch._check(out.stride(2) == 1, _msg(op, "out must have stride(2) == 1"))
    torch._check(n <= 1 or out.stride(0) >= _MAIN_DIM, _msg(op, f"out stride(0) must be >= {_MAIN_DIM}"))
    return None


def _check_fake_quant(op, x, block_size):
    torch._check(
        x.dtype in (torch.bfloat16, torch.float16, torch.float32),
        _msg(op, f"x must be bfloat16, float16 or float32, got {x.dtype}"),
    )
    torch._check(x.dim() >= 1, _msg(op, "x must have rank >= 1, got a 0-d tensor"))
    torch._check(x.size(-1) <= 1 or x.stride(-1) == 1, _msg(op, "x must have stride(-1) == 1"))
    torch._check(x.size(-1) % block_size == 0, _msg(op, f"x.size(-1) must be a multiple of {block_size}"))
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_register("fake_quant_compressed_kv")
def _fake_quant_compressed_kv(x):
    return _check_fake_quant("fake_quant_compressed_kv", x, KVLayout.V41_FP4.tile_size)


@_register("fake_quant_fp4")
def _fake_quant_fp4(x, *, block_size=32):
    op = "fake_quant_fp4"
    torch._check(block_size in (16, 32, 64, 128), _msg(op, f"block_size must be 16, 32, 64 or 128, got {block_size}"))
    return _check_fake_quant(op, x, block_size)


# ---- metadata ----
# Shapes of spec/metadata.md §2-§7; sizes come from shapes and int arguments only.

_MAX_ROWS = 2**31 - 1
_MAX_TOPK = 2**30
_MAX_NUM_SMS = 1024
_C128_PAGE_SIZE_RANGE = (128, 2**16)


def _is_pow2(v):
    return v >= 1 and (v & (v - 1)) == 0


def _check_int_vector(op, name, t, ref):
    """1-D int32/int64 of any stride on ref's device."""
    check_same_device(op, name, t, ref)
    torch._check(t.dtype in _INDEX_DTYPES, _msg(op, f"{name} must be int32 or int64, got {t.dtype}"))
    torch._check(t.dim() == 1, _msg(op, f"{name} must be 1-D, got {t.dim()}-D"))
    torch._check(t.size(0) <= _MAX_ROWS, _msg(op, f"{name} has too many entries"))


def _check_int_table(op, name, t, ref):
    """2-D int32/int64 with any row stride and stride(1) == 1."""
    check_same_device(op, name, t, ref)
    torch._check(t.dtype in _INDEX_DTYPES, _msg(op, f"{name} must be int32 or int64, got {t.dtype}"))
    torch._check(t.dim() == 2, _msg(op, f"{name} must be 2-D, got {t.dim()}-D"))
    torch._check(t.size(1) <= 1 or t.stride(1) == 1, _msg(op, f"{name} must have stride(1) == 1"))


def _check_out(op, name, t, ref, dtype, shape):
    """A caller-owned output buffer: fixed dtype, exact shape, contiguous."""
    check_same_device(op, name, t, ref)
    torch._check(t.dtype == dtype, _msg(op, f"{name} must be {dtype}, got {t.dtype}"))
    torch._check(t.dim() == len(shape), _msg(op, f"{name} must be {len(shape)}-D, got {t.dim()}-D"))
    for dim, size in enumerate(shape):
        torch._check(t.size(dim) == size, _msg(op, f"{name} must have size {size} in dim {dim}"))
    torch._check(t.is_contiguous(), _msg(op, f"{name} must be contiguous"))


def _check_page_table_args(op, req_to_token, req_pool_indices, seq_lens, page_size, swa_window):
    _check_int_table(op, "req_to_token", req_to_token, req_to_token)
    _check_int_vector(op, "seq_lens", seq_lens, req_to_token)
    _check_int_vector(op, "req_pool_indices", req_pool_indices, req_to_token)
    torch._check(
        req_pool_indices.size(0) == seq_lens.size(0),
        _msg(op, "req_pool_indices must have one entry per seq_lens row"),
    )
    check_page_size(op, page_size)
    torch._check(swa_window >= 1, _msg(op, f"swa_window must be >= 1, got {swa_window}"))
    return seq_lens.size(0)


@_register("build_page_table_positions_small")
def _build_page_table_positions_small(req_to_token, req_pool_indices, seq_lens, max_seq_len, page_size, swa_window):
    op = "build_page_table_positions_small"
    rows = _check_page_table_args(op, req_to_token, req_pool_indices, seq_lens, page_size, swa_window)
    torch._check(
        0 <= max_seq_len <= req_to_token.size(1),
        _msg(op, f"max_seq_len must be in [0, req_to_token.size(1)], got {max_seq_len}"),
    )
    pages = (max_seq_len + page_size - 1) // page_size
    new = lambda *shape: req_to_token.new_empty(shape, dtype=torch.int32)  # noqa: E731
    return new(rows), new(rows), new(rows, pages), new(rows)


@_register("build_page_table_positions_small_out")
def _build_page_table_positions_small_out(
    req_to_token, req_pool_indices, seq_lens, page_size, swa_window, seq_lens_out, positions, page_table, swa_lengths
):
    op = "build_page_table_positions_small_out"
    rows = _check_page_table_args(op, req_to_token, req_pool_indices, seq_lens, page_size, swa_window)
    torch._check(page_table.dim() == 2, _msg(op, f"page_table must be 2-D, got {page_table.dim()}-D"))
    pages = page_table.size(1)
    torch._check(
        pages == 0 or (pages - 1) * page_size < req_to_token.size(1),
        _msg(op, "page_table has more columns than req_to_token holds pages"),
    )
    for name, t, shape in (
        ("seq_lens_out", seq_lens_out, (rows,)),
        ("positions", positions, (rows,)),
        ("page_table", page_table, (rows, pages)),
        ("swa_lengths", swa_lengths, (rows,)),
    ):
        _check_out(op, name, t, req_to_token, torch.int32, shape)
    return None


def _check_low_ratio_args(op, seq_lens, out_loc, topk):
    _check_int_vector(op, "seq_lens", seq_lens, seq_lens)
    _check_int_vector(op, "out_loc", out_loc, seq_lens)
    torch._check(out_loc.size(0) == seq_lens.size(0), _msg(op, "out_loc must have one entry per seq_lens row"))
    torch._check(1 <= topk <= _MAX_TOPK, _msg(op, f"topk must be in [1, {_MAX_TOPK}], got {topk}"))
    return seq_lens.size(0), (topk + 63) // 64 * 64


_LOW_RATIO_FIELDS = (
    ("out_loc", torch.int64, False),
    ("seq_lens", torch.int32, False),
    ("sparse_lens", torch.int32, False),
    ("page_indices", torch.int32, True),
)


@_register("build_low_ratio_metadata")
def _build_low_ratio_metadata(seq_lens, out_loc, topk):
    rows, padded = _check_low_ratio_args("build_low_ratio_metadata", seq_lens, out_loc, topk)
    outputs = []
    for _ in (1, 2):
        for _, dtype, is_row in _LOW_RATIO_FIELDS:
            outputs.append(seq_lens.new_empty((rows, padded) if is_row else (rows,), dtype=dtype))
    return tuple(outputs)


@_register("build_low_ratio_metadata_out")
def _build_low_ratio_metadata_out(seq_lens, out_loc, topk, c1_out_loc, c1_seq_lens, c1_sparse_lens, c1_page_indices,
                                  c2_out_loc, c2_seq_lens, c2_sparse_lens, c2_page_indices):
    op = "build_low_ratio_metadata_out"
    buffers = (c1_out_loc, c1_seq_lens, c1_sparse_lens, c1_page_indices,
               c2_out_loc, c2_seq_lens, c2_sparse_lens, c2_page_indices)
    rows, padded = _check_low_ratio_args(op, seq_lens, out_loc, topk)
    for k, ratio in enumerate((1, 2)):
        for j, (field, dtype, is_row) in enumerate(_LOW_RATIO_FIELDS):
            shape = (rows, padded) if is_row else (rows,)
            _check_out(op, f"c{ratio}_{field}", buffers[4 * k + j], seq_lens, dtype, shape)
    return None


@_register("fill_all_compressed_indices")
def _fill_all_compressed_indices(page_table, compressed_seq_lens, page_indices, compress_ratio, page_size,
                                 raw_indices=None):
    op = "fill_all_compressed_indices"
    _check_int_table(op, "page_table", page_table, page_table)
    _check_int_vector(op, "compressed_seq_lens", compressed_seq_lens, page_table)
    rows = compressed_seq_lens.size(0)
    torch._check(page_table.size(0) == rows, _msg(op, "page_table must have one row per compressed_seq_lens entry"))
    torch._check(_is_pow2(compress_ratio), _msg(op, f"compress_ratio must be a power of two, got {compress_ratio}"))
    check_page_size(op, page_size)
    torch._check(page_size % compress_ratio == 0, _msg(op, "page_size must be a multiple of compress_ratio"))
    torch._check(page_indices.dim() == 2, _msg(op, f"page_indices must be 2-D, got {page_indices.dim()}-D"))
    shape = (rows, page_indices.size(1))
    _check_out(op, "page_indices", page_indices, page_table, torch.int32, shape)
    if raw_indices is not None:
        _check_out(op, "raw_indices", raw_indices, page_table, torch.int32, shape)
    return None


def _check_compression_args(op, seq_lens, positions, raw_out_loc):
    _check_int_vector(op, "seq_lens", seq_lens, seq_lens)
    _check_int_vector(op, "positions", positions, seq_lens)
    _check_int_vector(op, "raw_out_loc", raw_out_loc, seq_lens)
    bs = seq_lens.size(0)
    torch._check(positions.size(0) == bs, _msg(op, "positions must have one entry per seq_lens row"))
    torch._check(raw_out_loc.size(0) <= bs, _msg(op, "raw_out_loc has more entries than seq_lens rows"))
    return bs, raw_out_loc.size(0)


def _c128_width(op, page_table, page_size, seq_lens):
    torch._check(page_table is not None, _msg(op, "page_table is required to compute the c128 page indices"))
    _check_int_table(op, "page_table", page_table, seq_lens)
    torch._check(page_table.size(0) == seq_lens.size(0), _msg(op, "page_table must have one row per seq_lens row"))
    lo, hi = _C128_PAGE_SIZE_RANGE
    torch._check(
        _is_pow2(page_size) and lo <= page_size <= hi,
        _msg(op, f"page_size must be a power of two in [{lo}, {hi}] to compute the c128 page indices, got {page_size}"),
    )
    cps_bits = (page_size // 128).bit_length() - 1
    most_pages = (2**63 - 1 - 63) >> cps_bits  # the page-index width must fit int64
    torch._check(page_table.size(1) <= most_pages,
                 _msg(op, f"page_table has too many columns; at most {most_pages} are supported at page_size "
                          f"{page_size}"))
    cap = page_size // 128 * page_table.size(1)
    return (cap + 63) // 64 * 64


@_register("init_compression_metadata")
def _init_compression_metadata(seq_lens, positions, raw_out_loc, page_table=None, page_size=0,
                               compute_page_indices=True):
    op = "init_compression_metadata"
    bs, num_locs = _check_compression_args(op, seq_lens, positions, raw_out_loc)
    width = _c128_width(op, page_table, page_size, seq_lens) if compute_page_indices else 0
    outputs = []
    for _ in (4, 128):
        outputs.append(seq_lens.new_empty((num_locs,), dtype=torch.int64))
        outputs += [seq_lens.new_empty((bs,), dtype=torch.int32) for _ in range(3)]
    outputs.append(seq_lens.new_empty((bs, width), dtype=torch.int32))
    return tuple(outputs)


_COMPRESSION_FIELDS = ("out_loc", "positions", "seq_lens_raw", "seq_lens_clamp1")


@_register("init_compression_metadata_out")
def _init_compression_metadata_out(seq_lens, positions, raw_out_loc, page_table, page_size, c4_out_loc, c4_positions,
                                   c4_seq_lens_raw, c4_seq_lens_clamp1, c128_out_loc, c128_positions,
                                   c128_seq_lens_raw, c128_seq_lens_clamp1, c128_page_indices):
    op = "init_compression_metadata_out"
    buffers = (c4_out_loc, c4_positions, c4_seq_lens_raw, c4_seq_lens_clamp1,
               c128_out_loc, c128_positions, c128_seq_lens_raw, c128_seq_lens_clamp1, c128_page_indices)
    bs, num_locs = _check_compression_args(op, seq_lens, positions, raw_out_loc)
    page_indices = buffers[8]
    torch._check(page_indices.dim() == 2, _msg(op, f"c128_page_indices must be 2-D, got {page_indices.dim()}-D"))
    width = page_indices.size(1)
    if width != 0:
        expected = _c128_width(op, page_table, page_size, seq_lens)
        torch._check(width == expected, _msg(op, f"c128_page_indices must have 0 or {expected} columns"))
    for k, ratio in enumerate((4, 128)):
        for j, field in enumerate(_COMPRESSION_FIELDS):
            dtype, shape = (torch.int64, (num_locs,)) if j == 0 else (torch.int32, (bs,))
            _check_out(op, f"c{ratio}_{field}", buffers[4 * k + j], seq_lens, dtype, shape)
    _check_out(op, "c128_page_indices", page_indices, seq_lens, torch.int32, (bs, width))
    return None


def _check_schedule_args(op, context_lens, block_kv):
    torch._check(
        context_lens.dtype in _INDEX_DTYPES, _msg(op, f"context_lens must be int32 or int64, got {context_lens.dtype}")
    )
    torch._check(
        context_lens.dim() == 1 or (context_lens.dim() == 2 and context_lens.size(1) == 1),
        _msg(op, "context_lens must be [B] or [B, 1] (next_n == 1)"),
    )
    torch._check(context_lens.size(0) <= _MAX_ROWS, _msg(op, "context_lens has too many requests"))
    torch._check(block_kv in (64, 128), _msg(op, f"block_kv must be 64 or 128, got {block_kv}"))


@_register("get_paged_mqa_logits_metadata")
def _get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
    op = "get_paged_mqa_logits_metadata"
    _check_schedule_args(op, context_lens, block_kv)
    torch._check(1 <= num_sms <= _MAX_NUM_SMS, _msg(op, f"num_sms must be in [1, {_MAX_NUM_SMS}], got {num_sms}"))
    return context_lens.new_empty((num_sms + 1, 2), dtype=torch.int32)


@_register("get_paged_mqa_logits_metadata_out")
def _get_paged_mqa_logits_metadata_out(context_lens, block_kv, out):
    op = "get_paged_mqa_logits_metadata_out"
    _check_schedule_args(op, context_lens, block_kv)
    torch._check(out.dim() == 2, _msg(op, f"out must be 2-D, got {out.dim()}-D"))
    num_sms = out.size(0) - 1
    torch._check(1 <= num_sms <= _MAX_NUM_SMS, _msg(op, f"out.size(0) - 1 (num_sms) must be in [1, {_MAX_NUM_SMS}]"))
    _check_out(op, "out", out, context_lens, torch.int32, (out.size(0), 2))
# ---- norm + RoPE writers ----


def check_norm_weight(op, name, t, width, ref):
    check_same_device(op, name, t, ref)
    torch._check(t.dtype in _ACTIVATION_DTYPES, _msg(op, f"{name} must be bfloat16 or float32, got {t.dtype}"))
    torch._check(t.dim() == 1, _msg(op, f"{name} must be 1-D, got {t.dim()}-D"))
    torch._check(t.size(0) == width, _msg(op, f"{name} must have {width} elements"))
    torch._check(t.stride(0) == 1, _msg(op, f"{name} must be contiguous"))


def _finite_in_fp32(x):
    """x is finite and stays finite when rounded to fp32 (older Pythons raise where it would overflow)."""
    try:
        return math.isfinite(x) and math.isfinite(struct.unpack("f", struct.pack("f", x))[0])
    except OverflowError:
        return False


def check_eps(op, name, eps):
    torch._check(_finite_in_fp32(eps) and eps >= 0, _msg(op, f"{name} must be finite and >= 0, got {eps}"))


def check_rope_table(op, name, t, ref):
    check_same_device(op, name, t, ref)
    torch._check(t.dtype == torch.float32, _msg(op, f"{name} must be float32, got {t.dtype}"))
    torch._check(t.dim() == 2, _msg(op, f"{name} must be 2-D, got {t.dim()}-D"))
    torch._check(t.size(0) >= 1 and t.size(1) == _ROPE_DIM, _msg(op, f"{name} must be [max_pos >= 1, {_ROPE_DIM}]"))
    torch._check(t.is_contiguous(), _msg(op, f"{name} must be contiguous"))


@_register("fused_k_norm_rope_flashmla")
def _fused_k_norm_rope_flashmla(kv, weight, eps, freqs, positions, out_loc, kvcache, *, page_size, layout=0):
    op = "fused_k_norm_rope_flashmla"
    kv_layout = check_layout(op, layout)
    check_cache(op, "kvcache", kvcache, kv_layout, page_size, 16)
    check_activation(op, "kv", kv, _MAIN_DIM, kvcache)
    check_norm_weight(op, "weight", weight, _MAIN_DIM, kvcache)
    check_eps(op, "eps", eps)
    check_rope_table(op, "freqs", freqs, kvcache)
    check_index_vector(op, "positions", positions, kvcache)
    check_index_vector(op, "out_loc", out_loc, kvcache)
    torch._check(positions.size(0) == kv.size(0), _msg(op, "positions must have one entry per kv row"))
    torch._check(out_loc.size(0) == kv.size(0), _msg(op, "out_loc must have one entry per kv row"))
    return None


@_register("compress_norm_rope_store")
def _compress_norm_rope_store(kv, plan, norm_weight, norm_eps, freqs, out_loc, kvcache, *, page_size,
                              compress_ratio, is_decode, layout=0, use_fp4=False):
    op = "compress_norm_rope_store"
    kv_layout = check_layout(op, layout)
    torch._check(kv.dim() == 2, _msg(op, f"kv must be 2-D, got {kv.dim()}-D"))
    dim = kv.size(1)
    torch._check(dim in (_MAIN_DIM, _INDEXER_DIM),
                 _msg(op, f"kv must have {_MAIN_DIM} (main) or {_INDEXER_DIM} (indexer) columns"))
    if dim == _INDEXER_DIM:
        torch._check(layout == 0, _msg(op, f"layout must be 0 (V4) for the indexer variant, got {layout}"))
        fmt, align = (IndexerFormat.FP4 if use_fp4 else IndexerFormat.FP8), 4
    else:
        torch._check(not use_fp4, _msg(op, "use_fp4=True requires the indexer variant"))
        fmt, align = kv_layout, 16
    check_cache(op, "kvcache", kvcache, fmt, page_size, align)
    check_activation(op, "kv", kv, dim, kvcache)
    check_same_device(op, "plan", plan, kvcache)
    torch._check(plan.dtype == torch.uint8, _msg(op, f"plan must be uint8, got {plan.dtype}"))
    torch._check(plan.dim() == 2, _msg(op, f"plan must be 2-D, got {plan.dim()}-D"))
    torch._check(plan.size(0) == kv.size(0) and plan.size(1) == 16,
                 _msg(op, "plan must be [N, 16] (one entry per kv row)"))
    torch._check(plan.is_contiguous(), _msg(op, "plan must be contiguous"))
    check_norm_weight(op, "norm_weight", norm_weight, dim, kvcache)
    check_eps(op, "norm_eps", norm_eps)
    check_rope_table(op, "freqs", freqs, kvcache)
    check_index_vector(op, "out_loc", out_loc, kvcache)
    torch._check(compress_ratio >= 1, _msg(op, f"compress_ratio must be >= 1, got {compress_ratio}"))
    if is_decode:
        torch._check(out_loc.size(0) == kv.size(0),
                     _msg(op, "out_loc must have one entry per plan row when is_decode=True"))
    return None


# ---- ratio-1 / ratio-2 decode compressors ----

_PAIR_ROW_WIDTH = 2 * _MAIN_DIM  # c2 projection and state rows: kv then score
_MAX_C2_PREFILL_REQUESTS = 2**31 - 1  # one block each along grid x of the ring-park launch (low_ratio_launch.h)
_MAX_LOW_RATIO_ROWS = 2**31 - 1  # one block per kv row along grid x of the rows launches (low_ratio_launch.h)


def _check_low_ratio_common(op, k_cache, page_size, layout, norm_weight, eps, freqs_cis):
    kv_layout = check_layout(op, layout)
    check_cache(op, "k_cache", k_cache, kv_layout, page_size, 16)
    check_norm_weight(op, "norm_weight", norm_weight, _MAIN_DIM, k_cache)
    check_eps(op, "eps", eps)
    check_rope_table(op, "freqs_cis", freqs_cis, k_cache)


def _check_row_count(op, kv_input):
    torch._check(kv_input.size(0) <= _MAX_LOW_RATIO_ROWS,
                 _msg(op, f"kv_input has {kv_input.size(0)} rows; at most {_MAX_LOW_RATIO_ROWS} are supported"))


def _check_per_row(op, name, t, kv_input):
    torch._check(t.size(0) == kv_input.size(0), _msg(op, f"{name} must have one entry per kv_input row"))


@_register("c1_decode_norm_rope_store")
def _c1_decode_norm_rope_store(kv_input, norm_weight, positions, out_loc, eps, freqs_cis, k_cache, page_size,
                               layout=0):
    op = "c1_decode_norm_rope_store"
    _check_low_ratio_common(op, k_cache, page_size, layout, norm_weight, eps, freqs_cis)
    torch._check(kv_input.dtype == torch.bfloat16, _msg(op, f"kv_input must be bfloat16, got {kv_input.dtype}"))
    check_activation(op, "kv_input", kv_input, _MAIN_DIM, k_cache)
    _check_row_count(op, kv_input)
    check_index_vector(op, "positions", positions, k_cache)
    check_index_vector(op, "out_loc", out_loc, k_cache)
    _check_per_row(op, "positions", positions, kv_input)
    _check_per_row(op, "out_loc", out_loc, kv_input)
    return kv_input.new_empty((kv_input.size(0), _MAIN_DIM), dtype=torch.bfloat16)


def _check_c2_rows(op, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, k_cache, ring_size):
    torch._check(kv_input.dtype == torch.float32, _msg(op, f"kv_input must be float32, got {kv_input.dtype}"))
    check_activation(op, "kv_input", kv_input, _PAIR_ROW_WIDTH, k_cache)
    _check_row_count(op, kv_input)
    torch._check(kv_state.dtype == torch.float32, _msg(op, f"kv_state must be float32, got {kv_state.dtype}"))
    check_activation(op, "kv_state", kv_state, _PAIR_ROW_WIDTH, k_cache)
    torch._check(kv_state.size(0) <= 1 or kv_state.stride(0) >= _PAIR_ROW_WIDTH,
                 _msg(op, "kv_state row stride overlaps rows (the ring is written)"))
    for name, t in (("positions", positions), ("req_pool_indices", req_pool_indices), ("raw_out_loc", raw_out_loc)):
        check_index_vector(op, name, t, k_cache)
        _check_per_row(op, name, t, kv_input)
    torch._check(ring_size >= 1, _msg(op, f"ring_size must be >= 1, got {ring_size}"))
    torch._check(kv_state.size(0) >= ring_size, _msg(op, f"kv_state must hold at least ring_size={ring_size} rows"))


@_register("c2_decode_or_verify_norm_rope_store")
def _c2_decode_or_verify_norm_rope_store(kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc,
                                         eps, freqs_cis, k_cache, page_size, ring_size, draft_len=0, layout=0):
    op = "c2_decode_or_verify_norm_rope_store"
    _check_low_ratio_common(op, k_cache, page_size, layout, norm_weight, eps, freqs_cis)
    torch._check(draft_len >= 0, _msg(op, f"draft_len must be >= 0, got {draft_len}"))
    _check_c2_rows(op, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, k_cache, ring_size)
    if draft_len > 0:
        torch._check(ring_size > draft_len, _msg(
            op, f"ring_size must be wider than the draft length (ring_size={ring_size}, draft_len={draft_len})"))
        torch._check(kv_input.size(0) % draft_len == 0,
                     _msg(op, f"kv_input rows must be a multiple of draft_len={draft_len} in verify mode"))
    return kv_input.new_empty((kv_input.size(0), _MAIN_DIM), dtype=torch.bfloat16)


@_register("c2_prefill_norm_rope_store")
def _c2_prefill_norm_rope_store(kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc, eps,
                                freqs_cis, k_cache, extend_starts, extend_lens, page_size, ring_size, layout=0):
    op = "c2_prefill_norm_rope_store"
    _check_low_ratio_common(op, k_cache, page_size, layout, norm_weight, eps, freqs_cis)
    _check_c2_rows(op, kv_input, kv_state, positions, req_pool_indices, raw_out_loc, k_cache, ring_size)
    check_index_vector(op, "extend_starts", extend_starts, k_cache)
    check_index_vector(op, "extend_lens", extend_lens, k_cache)
    torch._check(extend_lens.size(0) == extend_starts.size(0),
                 _msg(op, "extend_lens must have one entry per request (as many as extend_starts)"))
    torch._check(extend_starts.size(0) <= _MAX_C2_PREFILL_REQUESTS,
                 _msg(op, f"extend_starts has {extend_starts.size(0)} requests; at most {_MAX_C2_PREFILL_REQUESTS} "
                          "are supported"))
    return kv_input.new_empty((kv_input.size(0), _MAIN_DIM), dtype=torch.bfloat16)
