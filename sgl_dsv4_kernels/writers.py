"""Typed wrappers of the norm + RoPE cache writers: the sliding-window K writer
(``fused_k_norm_rope_flashmla``) and the compressed-row writer (``compress_norm_rope_store``).
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .kv_layout import KVLayout, layout_argument
from .rope import as_rope_table

LayoutLike = Union[KVLayout, int, str]

__all__ = ["fused_k_norm_rope_flashmla", "compress_norm_rope_store"]


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
    layout: LayoutLike = KVLayout.V4,
) -> None:
    """RMSNorm + RoPE + quantized store of raw K latents into the sliding-window main cache, in place.

    ``kv [B, 512]`` (bf16/fp32, any row stride), ``weight [512]`` (bf16/fp32), ``freqs`` the fp32
    ``[max_pos, 64]`` table or complex64 ``[max_pos, 32]`` freqs_cis, ``positions [B]`` and
    ``out_loc [B]`` (int32/int64). Row b goes to slot ``out_loc[b]`` rotated at ``positions[b]``;
    rows whose slot or position is out of range (e.g. ``out_loc == -1``) write nothing.
    """
    op = "fused_k_norm_rope_flashmla"
    torch.ops.dsv4.fused_k_norm_rope_flashmla(
        kv, weight, float(eps), as_rope_table(freqs, op, "freqs"), positions, out_loc, kvcache,
        page_size=page_size, layout=layout_argument(op, layout),
    )


def compress_norm_rope_store(
    kv: torch.Tensor,
    plan: Any,
    *,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freq_cis: torch.Tensor,
    out_loc: torch.Tensor,
    kvcache: torch.Tensor,
    page_size: int,
    layout: LayoutLike = KVLayout.V4,
    use_fp4: bool = False,
    compress_ratio: Optional[int] = None,
    is_decode: Optional[bool] = None,
) -> None:
    """RMSNorm + RoPE (+ Walsh-Hadamard for the indexer) + quantized store of compressor output rows.

    ``kv [N, 512]`` writes the compressed main cache in ``layout``; ``kv [N, 128]`` writes the C4
    indexer cache (fp8, or fp4 with ``use_fp4=True``; ``layout`` must stay V4). ``plan`` is a
    ``CompressPlan`` (its ``plan``, ``compress_ratio`` and ``is_decode`` are used) or the raw uint8
    ``[N, 16]`` plan tensor together with explicit ``compress_ratio`` and ``is_decode``.
    Explicit values must agree with the plan object's. ``freq_cis`` is the fp32 ``[max_pos, 64]``
    table or complex64 ``[max_pos, 32]``. Decode row b is written to ``out_loc[b]`` when its
    ``seq_len`` closes a block; prefill entry k to ``out_loc[ragged_id]``; RoPE position
    ``seq_len - compress_ratio``.
    """
    op = "compress_norm_rope_store"
    if isinstance(plan, torch.Tensor):
        if compress_ratio is None or is_decode is None:
            raise TypeError(
                "compress_norm_rope_store: a raw plan tensor needs explicit compress_ratio and is_decode"
            )
        plan_tensor = plan
    elif all(hasattr(plan, field) for field in ("plan", "compress_ratio", "is_decode")):
        plan_tensor = plan.plan
        for name, given, own in (("compress_ratio", compress_ratio, plan.compress_ratio),
                                 ("is_decode", is_decode, plan.is_decode)):
            if given is not None and given != own:
                raise ValueError(f"compress_norm_rope_store: {name}={given} contradicts the plan's {own}")
        compress_ratio, is_decode = plan.compress_ratio, plan.is_decode
    else:
        raise TypeError(f"{op}: plan must be a CompressPlan or a uint8 [N, 16] tensor, got {type(plan).__name__}")
    torch.ops.dsv4.compress_norm_rope_store(
        kv, plan_tensor, norm_weight, float(norm_eps), as_rope_table(freq_cis, op, "freq_cis"), out_loc, kvcache,
        page_size=page_size, compress_ratio=int(compress_ratio), is_decode=bool(is_decode),
        layout=layout_argument(op, layout), use_fp4=bool(use_fp4),
    )
