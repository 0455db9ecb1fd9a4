"""Typed wrappers of the compressor ops and their Python utilities (compressors.md): state ring sizes
and, per ratio family, the ops that pool raw KV projections into compressed cache entries.
"""
from __future__ import annotations

from typing import Union

import torch

from .kv_layout import KVLayout
from .rope import as_rope_table

LayoutLike = Union[KVLayout, int, str]

__all__ = [
    "state_ring_size",
    "c1_decode_norm_rope_store",
    "c2_decode_or_verify_norm_rope_store",
]

# ------------------------------------------------------------------------------------------------
# State rings (section 2.1)

_WINDOW = {2: 2, 4: 8, 128: 128}  # tokens pooled per entry, which is also the ring without speculation


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def state_ring_size(ratio: int, verify_width: int) -> int:
    """State rows per owner for a compressor of ``ratio`` (2, 4 or 128) serving ``verify_width`` tokens
    verified per request per step (sglang's ``speculative_num_draft_tokens``, root included; 0 or 1 means no
    speculation). Without speculation: the window (2, 8, 128). With it: the smallest power of two
    >= verify_width + 2 for ratio 2, and >= max(2 * window, verify_width + window - 2) for ratios 4 and 128.
    Ratio 1 keeps no state.
    """
    if ratio not in _WINDOW:
        raise ValueError(f"state_ring_size: ratio must be 2, 4 or 128 (ratio 1 keeps no state), got {ratio}")
    if verify_width < 0:
        raise ValueError(f"state_ring_size: verify_width must be >= 0, got {verify_width}")
    window = _WINDOW[ratio]
    if verify_width <= 1:
        return window
    if ratio == 2:
        return _next_power_of_two(verify_width + 2)
    return _next_power_of_two(max(2 * window, verify_width + window - 2))


# ------------------------------------------------------------------------------------------------
# Ratio-1 and ratio-2 decode compressors (section 5): RMSNorm (+ pair pooling for c2), RoPE, quantized
# store into the compressed main cache; each returns the fresh bf16 pre-RoPE latent [N, 512].


def c1_decode_norm_rope_store(
    kv_input: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    page_size: int,
    layout: LayoutLike = KVLayout.V4,
) -> torch.Tensor:
    """Ratio-1 compressor step: ``latent = bf16(RMSNorm(kv_input) * norm_weight)`` (fp32 statistics), stored
    into ``k_cache`` at slot ``out_loc[i]`` after RoPE at ``positions[i]``; returns the latent.

    ``kv_input`` bf16 ``[N, 512]`` (any row stride); ``norm_weight`` ``[512]``; ``freqs_cis`` the fp32
    ``[max_pos, 64]`` table or complex64 ``[max_pos, 32]``; ``positions`` and ``out_loc`` int32/int64 ``[N]``.
    ``out_loc <= 0`` marks a padded row (slot 0 is the reserved dummy): its latent is returned but nothing is
    stored; slots past the cache and positions outside the table are not stored either.
    """
    return torch.ops.dsv4.c1_decode_norm_rope_store(
        kv_input, norm_weight, positions, out_loc, float(eps), as_rope_table(freqs_cis), k_cache,
        page_size, int(KVLayout.parse(layout)),
    )


def c2_decode_or_verify_norm_rope_store(
    kv_input: torch.Tensor,
    kv_state: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    req_pool_indices: torch.Tensor,
    raw_out_loc: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    page_size: int,
    ring_size: int,
    draft_len: int = 0,
    layout: LayoutLike = KVLayout.V4,
) -> torch.Tensor:
    """Ratio-2 compressor step (decode, or verify with ``draft_len > 0``); returns the bf16 latent ``[N, 512]``.

    ``kv_input`` fp32 ``[N, 1024]`` = (kv, score) projection rows; ``kv_state`` fp32 ``[owners * ring_size
    (+ pad rows), 1024]`` the pair-state ring, updated in place. An even position parks its row at
    ``req * ring_size + p % ring_size`` and returns a zero latent row. An odd position pools with its partner
    (closed-form 2-way softmax), returns ``bf16(RMSNorm(bf16(pooled)))`` and stores it at slot
    ``raw_out_loc >> 1`` rotated at ``p - 1``. ``raw_out_loc`` is the raw full-KV slot; ``<= 0`` marks a padded
    row (no state or cache write; odd padded rows still return a latent); rows with ``p < 0`` touch nothing and
    return zeros. Verify: request-major blocks of ``draft_len`` consecutive positions, ``N % draft_len == 0``
    and ``ring_size > draft_len`` (see ``state_ring_size(2, draft_len)``).
    """
    return torch.ops.dsv4.c2_decode_or_verify_norm_rope_store(
        kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc, float(eps),
        as_rope_table(freqs_cis), k_cache, page_size, int(ring_size), int(draft_len),
        int(KVLayout.parse(layout)),
    )
