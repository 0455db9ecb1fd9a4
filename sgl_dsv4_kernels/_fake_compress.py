"""Fake (meta) implementations of the c4/c128 planners and of compress_forward.

Each runs the metadata half of the host checks in csrc/compress/*_ops.cpp with ``torch._check``
(never values) and returns outputs of the right shape; host-path prefill plans get unbacked sizes.
"""
from __future__ import annotations

import torch

from ._fake import _msg, _register, check_index_vector, check_same_device

_MAX_PLAN_TOKENS = 1 << 16
_MAX_PLAN_BATCH = 0xFFFF - 1


def _window(ratio):
    return 8 if ratio == 4 else 128


def _check_config(op, ratio, swa_page_size, ring, use_req_ring, req_to_token, full_to_swa, anchor):
    torch._check(ratio in (4, 128), _msg(op, f"compress_ratio must be 4 or 128, got {ratio}"))
    window = _window(ratio)
    torch._check(ring >= window and ring % ratio == 0 and ring <= 0x7FFFFFFF,
                 _msg(op, f"ring_size must be a multiple of {ratio} and >= the window of {window} rows, got {ring}"))
    paged = ratio == 4 and not use_req_ring
    if paged:
        torch._check(swa_page_size > 0 and swa_page_size % ring == 0 and swa_page_size <= 0x7FFFFFFF,
                     _msg(op, f"swa_page_size must be a positive multiple of ring_size={ring} and at most "
                              "2^31 - 1 in paged mode"))
        torch._check(req_to_token is not None, _msg(op, "req_to_token is required in paged mode"))
        torch._check(full_to_swa is not None, _msg(op, "full_to_swa is required in paged mode"))
    if req_to_token is not None:
        check_same_device(op, "req_to_token", req_to_token, anchor)
        torch._check(req_to_token.dtype in (torch.int32, torch.int64), _msg(op, "req_to_token must be int32 or int64"))
        torch._check(req_to_token.dim() == 2, _msg(op, "req_to_token must be 2-D"))
        torch._check(req_to_token.size(1) <= 1 or req_to_token.stride(1) == 1,
                     _msg(op, "req_to_token must have stride(1) == 1"))
    if paged:
        check_index_vector(op, "full_to_swa", full_to_swa, anchor)


def _check_batch_vector(op, name, t, batch, anchor):
    check_index_vector(op, name, t, anchor)
    torch._check(t.size(0) == batch, _msg(op, f"{name} must have one entry per request"))


def _check_plan_buffer(op, name, t, rows, width, anchor):
    check_same_device(op, name, t, anchor)
    torch._check(t.dtype == torch.uint8, _msg(op, f"{name} must be uint8, got {t.dtype}"))
    torch._check(t.dim() == 2 and t.size(0) == rows and t.size(1) == width,
                 _msg(op, f"{name} must be [{rows}, {width}]"))
    torch._check(t.is_contiguous(), _msg(op, f"{name} must be contiguous"))


def _check_decode(op, req_pool_indices, seq_lens, req_to_token, full_to_swa, ratio, swa_page_size, ring,
                  use_req_ring):
    _check_config(op, ratio, swa_page_size, ring, use_req_ring, req_to_token, full_to_swa, req_pool_indices)
    check_index_vector(op, "req_pool_indices", req_pool_indices, req_pool_indices)
    _check_batch_vector(op, "seq_lens", seq_lens, req_pool_indices.size(0), req_pool_indices)


@_register("plan_compress_decode")
def _plan_compress_decode(req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio, swa_page_size,
                          ring_size, use_req_ring=False):
    _check_decode("plan_compress_decode", req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio,
                  swa_page_size, ring_size, use_req_ring)
    return req_pool_indices.new_empty((req_pool_indices.size(0), 16), dtype=torch.uint8)


@_register("plan_compress_decode_out")
def _plan_compress_decode_out(req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio, swa_page_size,
                              ring_size, use_req_ring, plan_d):
    op = "plan_compress_decode_out"
    _check_decode(op, req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio, swa_page_size,
                  ring_size, use_req_ring)
    _check_plan_buffer(op, "plan_d", plan_d, req_pool_indices.size(0), 16, req_pool_indices)
    return None


def _check_prefill(op, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens, ratio,
                   swa_page_size, ring, use_req_ring, allow_host_input):
    torch._check(num_q_tokens >= 0, _msg(op, f"num_q_tokens must be >= 0, got {num_q_tokens}"))
    torch._check(num_q_tokens <= _MAX_PLAN_TOKENS,
                 _msg(op, f"num_q_tokens={num_q_tokens} exceeds {_MAX_PLAN_TOKENS} (ragged ids are uint16)"))
    _check_config(op, ratio, swa_page_size, ring, use_req_ring, req_to_token, full_to_swa, req_pool_indices)
    check_index_vector(op, "req_pool_indices", req_pool_indices, req_pool_indices)
    batch = req_pool_indices.size(0)
    torch._check(batch <= _MAX_PLAN_BATCH,
                 _msg(op, f"batch_size={batch} must be below {_MAX_PLAN_BATCH + 1} "
                          "(batch ids are packed into 16 bits)"))
    host_input = allow_host_input and req_pool_indices.device.type == "cuda" and seq_lens.device.type == "cpu"
    lens_anchor = seq_lens if host_input else req_pool_indices
    _check_batch_vector(op, "seq_lens", seq_lens, batch, lens_anchor)
    _check_batch_vector(op, "extend_lens", extend_lens, batch, lens_anchor)
    return host_input


@_register("plan_compress_prefill")
def _plan_compress_prefill(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens,
                           compress_ratio, swa_page_size, ring_size, use_req_ring=False, use_cuda_graph=False):
    _check_prefill("plan_compress_prefill", req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa,
                   num_q_tokens, compress_ratio, swa_page_size, ring_size, use_req_ring, True)
    if use_cuda_graph or seq_lens.device.type == "cuda":
        rows_c = rows_w = num_q_tokens
    else:  # sized from host lengths: data-dependent
        ctx = torch.library.get_ctx()
        rows_c, rows_w = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (req_pool_indices.new_empty((rows_c, 16), dtype=torch.uint8),
            req_pool_indices.new_empty((rows_w, 8), dtype=torch.uint8))


@_register("plan_compress_prefill_out")
def _plan_compress_prefill_out(req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens,
                               compress_ratio, swa_page_size, ring_size, use_req_ring, plan_c, plan_w):
    op = "plan_compress_prefill_out"
    _check_prefill(op, req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens,
                   compress_ratio, swa_page_size, ring_size, use_req_ring, False)
    _check_plan_buffer(op, "plan_c", plan_c, num_q_tokens, 16, req_pool_indices)
    _check_plan_buffer(op, "plan_w", plan_w, num_q_tokens, 8, req_pool_indices)
    return None


def _check_plan_rows(op, name, t, width, anchor):
    check_same_device(op, name, t, anchor)
    torch._check(t.dtype == torch.uint8, _msg(op, f"{name} must be uint8, got {t.dtype}"))
    torch._check(t.dim() == 2 and t.size(1) == width, _msg(op, f"{name} must be [rows, {width}]"))
    torch._check(t.is_contiguous(), _msg(op, f"{name} must be contiguous"))


@_register("compress_forward")
def _compress_forward(state, kv_score_input, ape, plan, plan_w, head_dim, compress_ratio, is_decode):
    op = "compress_forward"
    ratio = compress_ratio
    torch._check(ratio in (4, 128), _msg(op, f"compress_ratio must be 4 or 128, got {ratio}"))
    torch._check(head_dim == 512 or (ratio == 4 and head_dim == 128),
                 _msg(op, f"head_dim must be 512 (or 128 for compress_ratio=4), got {head_dim}"))
    width = (4 if ratio == 4 else 2) * head_dim
    window = _window(ratio)
    torch._check(state.dtype in (torch.float32, torch.bfloat16), _msg(op, "state must be float32 or bfloat16"))
    torch._check(state.dim() == 2 or (state.dim() == 3 and state.size(1) == ratio),
                 _msg(op, f"state must be [rows, {width}] or [pages, {ratio}, {width}]"))
    torch._check(state.size(-1) == width, _msg(op, f"state rows must have {width} columns"))
    torch._check(state.is_contiguous(), _msg(op, "state must be contiguous"))
    rows = state.size(0) if state.dim() == 2 else state.size(0) * ratio
    torch._check(rows >= ratio and rows % ratio == 0, _msg(op, f"state must have a positive multiple of {ratio} rows"))
    check_same_device(op, "kv_score_input", kv_score_input, state)
    torch._check(kv_score_input.dtype in (torch.float32, torch.bfloat16),
                 _msg(op, "kv_score_input must be float32 or bfloat16"))
    torch._check(kv_score_input.dim() == 2, _msg(op, "kv_score_input must be 2-D"))
    torch._check(kv_score_input.size(1) == width, _msg(op, f"kv_score_input must have {width} columns"))
    torch._check(kv_score_input.stride(1) == 1, _msg(op, "kv_score_input must have stride(1) == 1"))
    check_same_device(op, "ape", ape, state)
    torch._check(ape.dtype == torch.float32, _msg(op, f"ape must be float32, got {ape.dtype}"))
    torch._check(ape.dim() == 2 and ape.size(0) == window and ape.size(1) == head_dim,
                 _msg(op, f"ape must be [{window}, {head_dim}]"))
    torch._check(ape.is_contiguous(), _msg(op, "ape must be contiguous"))
    _check_plan_rows(op, "plan", plan, 16, state)
    if is_decode:
        torch._check(plan_w is None, _msg(op, "plan_w must be None when is_decode=True"))
        torch._check(kv_score_input.size(0) == plan.size(0),
                     _msg(op, "kv_score_input must have one row per decode plan row"))
    else:
        torch._check(plan_w is not None, _msg(op, "plan_w is required when is_decode=False"))
        _check_plan_rows(op, "plan_w", plan_w, 8, state)
    return kv_score_input.new_empty((plan.size(0), head_dim))
