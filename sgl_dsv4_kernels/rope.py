"""RoPE tables of the DeepSeek-V4 cache writers (cache-writers.md §1.3): the YaRN ``freqs_cis``
(complex64 ``[seqlen, dim/2]``) and the fp32 ``[max_pos, 64]`` table of interleaved (cos, sin)
pairs that the ops take. Pure torch on CPU; build once, then move the table to the device.
"""
from __future__ import annotations

import math

import torch

__all__ = ["precompute_freqs_cis", "rope_table_from_freqs_cis", "precompute_rope_table"]


def _yarn_correction_dim(rotations: float, dim: int, base: float, original_seq_len: int) -> float:
    """Pair index whose wavelength fits ``rotations`` times into ``original_seq_len`` (float64)."""
    return dim * math.log(original_seq_len / (2 * math.pi * rotations)) / (2 * math.log(base))


def precompute_freqs_cis(
    dim: int,
    seqlen: int,
    original_seq_len: int = 0,
    base: float = 10000.0,
    factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """complex64 ``[seqlen, dim // 2]`` with ``freqs_cis[p, i] = exp(1j * p * f_i)``.

    ``original_seq_len > 0`` applies YaRN: pairs up to the fast correction index keep their
    frequency, pairs from the slow one on are divided by ``factor``, pairs in between blend linearly.
    No mscale is folded in. Every intermediate is fp32, in the order of the spec.
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"precompute_freqs_cis: dim must be a positive even number, got {dim}")
    if seqlen < 0:
        raise ValueError(f"precompute_freqs_cis: seqlen must be >= 0, got {seqlen}")
    half = dim // 2
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    freqs = torch.reciprocal(torch.pow(torch.tensor(base, dtype=torch.float32), exponents))
    if original_seq_len > 0:
        lo = max(math.floor(_yarn_correction_dim(beta_fast, dim, base, original_seq_len)), 0)
        hi = min(math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_seq_len)), dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(half, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = (freqs / factor) * (1 - smooth) + freqs * smooth
    positions = torch.arange(seqlen, dtype=torch.float32)
    angles = torch.outer(positions, freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rope_table_from_freqs_cis(freqs_cis: torch.Tensor) -> torch.Tensor:
    """complex64 ``[max_pos, 32]`` -> fp32 ``[max_pos, 64]`` with (Re, Im) interleaved per pair.

    A zero-copy view when ``freqs_cis`` is contiguous, else a contiguous copy.
    """
    if freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 2:
        raise ValueError(
            f"rope_table_from_freqs_cis: expected complex64 [max_pos, pairs], got {freqs_cis.dtype} "
            f"{list(freqs_cis.shape)}"
        )
    return torch.view_as_real(freqs_cis.contiguous()).reshape(freqs_cis.shape[0], -1)


def precompute_rope_table(
    dim: int,
    seqlen: int,
    original_seq_len: int = 0,
    base: float = 10000.0,
    factor: float = 1.0,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """fp32 ``[seqlen, dim]`` table: ``rope_table_from_freqs_cis(precompute_freqs_cis(...))``."""
    return rope_table_from_freqs_cis(
        precompute_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow)
    )


def as_rope_table(freqs: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """An op wrapper's RoPE argument ``name``: the fp32 table, or complex64 ``freqs_cis`` (converted); other
    real dtypes pass through to the op, which rejects them with a message naming the argument. A complex
    table that is not complex64 ``[max_pos, pairs]`` raises ValueError naming ``op`` and ``name``."""
    if not isinstance(freqs, torch.Tensor) or not freqs.is_complex():
        return freqs
    try:
        return rope_table_from_freqs_cis(freqs)
    except ValueError as e:
        raise ValueError(f"{op}: {name}: {e}") from None
