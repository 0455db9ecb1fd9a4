"""Reference numerics of the cache writers (cache-writers.md sections 1 and 5): RMSNorm in the fixed reduction
order, the GPT-J RoPE tail, the 128-point Walsh-Hadamard transform, and the reference `fused_store_cache`.
Every product and sum is its own fp32 torch op (no FMA); the only float64 step is the RMSNorm square root.
"""
from __future__ import annotations

import torch

from .quant import _f32_const, _indexer_id, _layout_id, store_indexer_cache, store_k_cache

__all__ = ["rms_norm_fp32", "rope_tail", "hadamard128", "fused_store_cache"]

_ROPE_DIMS = 64
_WHT_SCALE_BITS = 0x3DB504F3  # fp32 nearest to 1/sqrt(128)


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Section 1.2 order: halving inside 32 groups of D/32 squares, then halving across the 32 partials."""
    d = x.shape[-1]
    q = (x * x).reshape(*x.shape[:-1], 32, d // 32)
    while q.shape[-1] > 1:
        h = q.shape[-1] // 2
        q = q[..., :h] + q[..., h:]
    s = q[..., 0]
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def rms_norm_fp32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """y = (x * r) * w with r = 1 / sqrt(ss / D + eps); fp32 out.

    The root is taken in float64 and rounded once to fp32 (fp32 torch.sqrt on CPU is not correctly rounded),
    then torch.reciprocal in fp32, as the kernels' IEEE sqrt followed by an IEEE division.
    """
    d = x.shape[-1]
    if d % 32 or (d // 32) & (d // 32 - 1):
        raise ValueError(f"rms_norm_fp32: D must be 32 times a power of two, got {d}")
    x = x.to(torch.float32)
    w = w.to(torch.float32)
    ss = _sum_of_squares(x)
    ms = ss / torch.full_like(ss, float(d))  # a power of two: exact either way
    v = ms + torch.full_like(ms, eps)  # eps rounded once to fp32
    r = torch.reciprocal(torch.sqrt(v.to(torch.float64)).to(torch.float32))
    return (x * r.unsqueeze(-1)) * w


def rope_tail(v: torch.Tensor, freqs_rows: torch.Tensor) -> torch.Tensor:
    """Rotates the last 64 dims of v (GPT-J adjacent pairs, forward): re' = re*c - im*s, im' = re*s + im*c.

    freqs_rows fp32 [..., 64] = (c0, s0, c1, s1, ...). Returns a new fp32 tensor shaped like v; the first
    D - 64 dims are copied unchanged. Callers do any rounding.
    """
    out = v.to(torch.float32).clone()
    tail = out[..., -_ROPE_DIMS:]
    re, im = tail[..., 0::2], tail[..., 1::2]
    f = freqs_rows.to(torch.float32)
    c, s = f[..., 0::2], f[..., 1::2]
    new_re = re * c - im * s  # each product and the difference separately rounded
    new_im = re * s + im * c
    out[..., -_ROPE_DIMS:] = torch.stack([new_re, new_im], dim=-1).flatten(-2)
    return out


def hadamard128(v: torch.Tensor) -> torch.Tensor:
    """Orthonormal Sylvester WHT of the last dim (128): butterflies h = 1, 2, ..., 64 in that order,
    (v_i, v_{i+h}) <- (v_i + v_{i+h}, v_i - v_{i+h}), then one multiply by fp32 0x3DB504F3."""
    if v.shape[-1] != 128:
        raise ValueError(f"hadamard128: expected last dim 128, got {v.shape[-1]}")
    x = v.to(torch.float32)
    lead = x.shape[:-1]
    h = 1
    while h < 128:
        pairs = x.reshape(*lead, 128 // (2 * h), 2, h)  # [..., block, (i, i+h), j]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*lead, 128)
        h *= 2
    return x * _f32_const(_WHT_SCALE_BITS, x)


def _rope_rows(freqs_cis: torch.Tensor) -> torch.Tensor:
    if freqs_cis.is_complex():
        return torch.view_as_real(freqs_cis).flatten(1)  # reshape(N, -1) fails for N = 0
    return freqs_cis


def fused_store_cache(
    input: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    page_size: int,
    type: str = "flashmla",
    layout=0,
    use_fp4: bool = False,
    freqs_cis: torch.Tensor | None = None,
) -> None:
    """Reference of dsv4::fused_store_cache (cache-writers section 2), in place; invalid slots write nothing.

    flashmla: input [N, 512] into main layout `layout`; with freqs_cis (V41 / V41_FP4 only) the tail is
    rotated, rounded to the input dtype T and widened back before all 512 values are quantized.
    indexer: input [N, 128] into the indexer fp8 (use_fp4=False) or fp4 format; layout must be 0.
    """
    op = "reference.fused_store_cache"
    if type == "flashmla":
        lid = _layout_id(layout)
        if use_fp4:
            raise RuntimeError(f"{op}: use_fp4=True requires type='indexer'")
        x = input.to(torch.float32)
        if freqs_cis is not None:
            if lid == 0:
                raise RuntimeError(f"{op}: freqs_cis is not supported with layout V4")
            rotated = rope_tail(x, _rope_rows(freqs_cis).to(x.device))
            x = rotated.to(input.dtype).to(torch.float32)  # T(rot(x)); the untouched dims round-trip exactly
        store_k_cache(cache, x, indices, page_size, lid)
    elif type == "indexer":
        if _layout_id(layout) != 0:
            raise RuntimeError(f"{op}: layout must be 0 for type='indexer', got {layout!r}")
        if freqs_cis is not None:
            raise RuntimeError(f"{op}: freqs_cis must be None for type='indexer'")
        store_indexer_cache(cache, input, indices, page_size, _indexer_id(1 if use_fp4 else 0))
    else:
        raise RuntimeError(f"{op}: type must be 'flashmla' or 'indexer', got {type!r}")
