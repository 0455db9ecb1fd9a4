"""Typed wrappers of the compressor ops and their Python utilities (compressors.md): state ring sizes
and, per ratio family, the ops that pool raw KV projections into compressed cache entries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .kv_layout import KVLayout, layout_argument
from .rope import as_rope_table

LayoutLike = Union[KVLayout, int, str]

__all__ = [
    "state_ring_size",
    "c1_decode_norm_rope_store",
    "c2_decode_or_verify_norm_rope_store",
    "c2_prefill_norm_rope_store",
    "CompressPlan",
    "plan_compress_decode",
    "plan_compress_prefill",
    "compress_forward",
    "compress_window",
    "ring_capacity",
    "check_ring_serves_draft_tokens",
    "state_row_width",
    "alloc_compress_state",
    "reset_compress_state",
    "ape_for_kernel",
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
# Ratio-1 and ratio-2 compressors (section 5): RMSNorm (+ pair pooling for c2), RoPE, quantized store into
# the compressed main cache; each returns the fresh bf16 pre-RoPE latent [N, 512].


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

    ``kv_input`` bf16 ``[N, 512]`` (any row stride; ``N <= 2**31 - 1``, one block per row); ``norm_weight``
    ``[512]``; ``freqs_cis`` the fp32 ``[max_pos, 64]`` table or complex64 ``[max_pos, 32]``; ``positions`` and
    ``out_loc`` int32/int64 ``[N]``.
    ``out_loc <= 0`` marks a padded row (slot 0 is the reserved dummy): its latent is returned but nothing is
    stored; slots past the cache and positions outside the table are not stored either.
    """
    op = "c1_decode_norm_rope_store"
    return torch.ops.dsv4.c1_decode_norm_rope_store(
        kv_input, norm_weight, positions, out_loc, float(eps), as_rope_table(freqs_cis, op, "freqs_cis"), k_cache,
        page_size, layout_argument(op, layout),
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

    ``kv_input`` fp32 ``[N, 1024]`` = (kv, score) projection rows (``N <= 2**31 - 1``); ``kv_state`` fp32
    ``[owners * ring_size (+ pad rows), 1024]`` the pair-state ring, updated in place. An even position parks its row at
    ``req * ring_size + p % ring_size`` and returns a zero latent row. An odd position pools with its partner
    (closed-form 2-way softmax), returns ``bf16(RMSNorm(bf16(pooled)))`` and stores it at slot
    ``raw_out_loc >> 1`` rotated at ``p - 1``. ``raw_out_loc`` is the raw full-KV slot; ``<= 0`` marks a padded
    row (no state or cache write; odd padded rows still return a latent); rows with ``p < 0`` touch nothing and
    return zeros. Verify: request-major blocks of ``draft_len`` consecutive positions, ``N % draft_len == 0``
    and ``ring_size > draft_len`` (see ``state_ring_size(2, draft_len)``).
    """
    op = "c2_decode_or_verify_norm_rope_store"
    return torch.ops.dsv4.c2_decode_or_verify_norm_rope_store(
        kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc, float(eps),
        as_rope_table(freqs_cis, op, "freqs_cis"), k_cache, page_size, ring_size, draft_len,
        layout_argument(op, layout),
    )


def c2_prefill_norm_rope_store(
    kv_input: torch.Tensor,
    kv_state: torch.Tensor,
    norm_weight: torch.Tensor,
    positions: torch.Tensor,
    req_pool_indices: torch.Tensor,
    raw_out_loc: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    k_cache: torch.Tensor,
    extend_starts: torch.Tensor,
    extend_lens: torch.Tensor,
    *,
    page_size: int,
    ring_size: int,
    layout: LayoutLike = KVLayout.V4,
) -> torch.Tensor:
    """Ratio-2 compressor over a chunked prefill (compressors.md §5.5); returns the bf16 latent ``[N, 512]``.

    Request r owns input rows ``[extend_starts[r], extend_starts[r] + extend_lens[r])``, at consecutive positions.
    Latents, cache bytes and the final ring rows equal those of running ``c2_decode_or_verify_norm_rope_store``
    (decode) row by row in position order: a request's first row pools with the ring, later odd rows with the row
    before, and each ring row ends up holding the newest even position of the chunk that maps to it (or its old
    content). Arguments and skip rules as in the decode op. Padding (``raw_out_loc <= 0`` or ``p < 0``) is meant
    for whole rows past the requests or whole requests: the partners follow the positions (an odd row pools with
    the input row before it whenever that row is its request's previous position, as in verify), and only a
    request's last ``lcm(2, ring_size)`` rows park their rows in the ring. Two launches on CUDA: the rows, then
    the ring writes, so that every ring read comes first. At most ``2**31 - 1`` requests (one block each in the
    ring-write launch); more are rejected before anything is written.
    """
    op = "c2_prefill_norm_rope_store"
    return torch.ops.dsv4.c2_prefill_norm_rope_store(
        kv_input, kv_state, norm_weight, positions, req_pool_indices, raw_out_loc, float(eps),
        as_rope_table(freqs_cis, op, "freqs_cis"), k_cache, extend_starts, extend_lens, page_size, ring_size,
        layout_argument(op, layout),
    )


# ---------------------------------------------------------------------------------------------------------
# c4 / c128


@dataclass(frozen=True)
class CompressPlan:
    """One call's compression plan (compressors.md §3.1, §7).

    ``plan`` holds the DecodePlan ``[B, 16]`` (``is_decode``) or CompressPlan ``[Nc, 16]`` bytes and
    ``plan_w`` the WritePlan ``[Nw, 8]`` bytes (None for decode). ``compress_forward`` and
    ``compress_norm_rope_store`` accept the object in place of the raw tensors.
    """

    plan: torch.Tensor
    plan_w: Optional[torch.Tensor]
    compress_ratio: int
    is_decode: bool


def compress_window(ratio: int) -> int:
    """Tokens pooled per entry: 8 for c4 (overlapping), 128 for c128, 2 for c2, 1 for c1."""
    if ratio == 1:
        return 1
    if ratio not in _WINDOW:
        raise ValueError(f"compress_window: ratio must be 1, 2, 4 or 128, got {ratio}")
    return _WINDOW[ratio]


# Argument checks of the c4/c128 utilities (§2.1-2.3, §3.7), each naming the calling function.


def _check_ratio(fn: str, ratio: int, name: str = "ratio") -> None:
    if ratio not in (4, 128):
        raise ValueError(f"{fn}: {name} must be 4 or 128, got {ratio}")


def _check_ring(fn: str, ratio: int, ring: int) -> None:
    window = _WINDOW[ratio]
    if ring % ratio != 0 or ring < window:
        raise ValueError(f"{fn}: ring must be a multiple of {ratio} and >= the window {window} for ratio {ratio}, "
                         f"got {ring}")


def _check_head_dim(fn: str, ratio: int, head_dim: int) -> None:
    allowed = (128, 512) if ratio == 4 else (512,)
    if head_dim not in allowed:
        raise ValueError(f"{fn}: head_dim must be {' or '.join(map(str, allowed))} for ratio {ratio}, got {head_dim}")


def ring_capacity(ratio: int, ring: int) -> int:
    """Draft tokens a c4/c128 ring serves (§2.1): ``ring - window + 2`` (mtp_pad) if ``ring > window``, else 1."""
    _check_ratio("ring_capacity", ratio)
    _check_ring("ring_capacity", ratio, ring)
    window = compress_window(ratio)
    return ring - window + 2 if ring > window else 1


def check_ring_serves_draft_tokens(ratio: int, ring: int, draft_tokens: int) -> None:
    """Startup guard of every c4/c128 layer: raises ValueError when a ring cannot serve ``draft_tokens``
    verify tokens per step (a wider verify would leave ring rows stale, §3.5), or when the ring itself is not
    a valid c4/c128 ring (a multiple of the ratio, at least the window)."""
    fn = "check_ring_serves_draft_tokens"
    _check_ratio(fn, ratio)
    _check_ring(fn, ratio, ring)
    if draft_tokens < 0:
        raise ValueError(f"{fn}: draft_tokens must be >= 0, got {draft_tokens}")
    capacity = ring_capacity(ratio, ring)
    if draft_tokens > capacity:
        raise ValueError(
            f"ratio-{ratio} state ring of {ring} rows serves at most {capacity} draft tokens; grow the ring"
        )


def state_row_width(ratio: int, head_dim: int) -> int:
    """Width W of a projection / state row: 4D for c4 (kv_ov, kv, s_ov, s), 2D for c128 (kv, s)."""
    _check_ratio("state_row_width", ratio)
    _check_head_dim("state_row_width", ratio, head_dim)
    return 4 * head_dim if ratio == 4 else 2 * head_dim


def _score_columns(ratio: int, head_dim: int) -> slice:
    return slice(2 * head_dim, 4 * head_dim) if ratio == 4 else slice(head_dim, 2 * head_dim)


def reset_compress_state(state: torch.Tensor, ratio: int, head_dim: int) -> torch.Tensor:
    """Clears a pool in place (zeros) and restores its pad page (kv 0, score -inf) (§2.3)."""
    fn = "reset_compress_state"
    _check_ratio(fn, ratio)
    _check_head_dim(fn, ratio, head_dim)
    width = state_row_width(ratio, head_dim)
    if state.dim() < 2 or state.shape[-1] != width or state.numel() // width < ratio:
        raise ValueError(f"{fn}: state must be [rows, {width}] (or [pages, {ratio}, {width}]) with at least "
                         f"{ratio} rows for ratio {ratio}, head_dim {head_dim}, got {list(state.shape)}")
    rows = state.view(-1, state.shape[-1])
    rows.zero_()
    rows[-ratio:, _score_columns(ratio, head_dim)] = float("-inf")
    return state


def alloc_compress_state(
    ratio: int,
    head_dim: int,
    owners: int,
    ring: int,
    dtype: torch.dtype = torch.float32,
    device: Union[torch.device, str] = "cpu",
) -> torch.Tensor:
    """A c4/c128 state pool ``[owners * ring + ratio, W]`` (§2.3): zeros, with the trailing page of
    ``ratio`` rows holding the pad value (kv 0, score -inf). Owner 0 is the dummy owner of padded rows, so
    ``owners`` counts it and must be >= 1. ``head_dim`` is 512, or 128 for the c4 indexer compressor."""
    fn = "alloc_compress_state"
    _check_ratio(fn, ratio)
    _check_head_dim(fn, ratio, head_dim)
    if owners < 1:
        raise ValueError(f"{fn}: owners must be >= 1 (owner 0 is the dummy owner of padded rows), got {owners}")
    _check_ring(fn, ratio, ring)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{fn}: dtype must be float32 or bfloat16, got {dtype}")
    state = torch.empty(owners * ring + ratio, state_row_width(ratio, head_dim), dtype=dtype, device=device)
    return reset_compress_state(state, ratio, head_dim)


def ape_for_kernel(ape: torch.Tensor, compress_ratio: Optional[int] = None) -> torch.Tensor:
    """The positional bias as the kernels take it, fp32 contiguous (§1.4).

    c4 checkpoints hold ``ape [4, 2D]`` (D = 512, or 128 for the indexer): rows 0-3 of the result are its
    first D columns (overlap bias), rows 4-7 its last D columns. A c128 ``ape [128, 512]`` is only converted.
    Without ``compress_ratio`` the ratio follows the row count (4 or 128). Call once at load.
    """
    fn = "ape_for_kernel"
    if ape.dim() != 2:
        raise ValueError(f"{fn}: ape must be 2-D ([4, 2D] for c4, [128, 512] for c128), got {list(ape.shape)}")
    if compress_ratio is None:
        if ape.shape[0] not in (4, 128):
            raise ValueError(f"{fn}: cannot infer compress_ratio from ape of shape {list(ape.shape)} "
                             "(a c4 ape is [4, 2D], a c128 ape [128, 512]); pass compress_ratio")
        ratio = 4 if ape.shape[0] == 4 else 128
    else:
        _check_ratio(fn, compress_ratio, "compress_ratio")
        ratio = compress_ratio
    if ratio == 4:
        if ape.shape[0] != 4 or ape.shape[1] not in (256, 1024):
            raise ValueError(f"{fn}: a c4 ape must be [4, 2D] with D = 512 or 128, got {list(ape.shape)}")
        d = ape.shape[1] // 2
        return torch.cat([ape[:, :d], ape[:, d:]], dim=0).float().contiguous()
    if ape.shape[0] != 128 or ape.shape[1] != 512:
        raise ValueError(f"{fn}: a c128 ape must be [128, 512], got {list(ape.shape)}")
    return ape.float().contiguous()


def plan_compress_decode(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    req_to_token: Optional[torch.Tensor] = None,
    full_to_swa: Optional[torch.Tensor] = None,
    *,
    compress_ratio: int,
    ring_size: int,
    swa_page_size: int = 0,
    use_req_ring: bool = False,
    out: Optional[torch.Tensor] = None,
) -> CompressPlan:
    """Decode plan: one ``[16]`` row per request (§3.4), on the inputs' device.

    c4 in paged mode (default) needs ``req_to_token``, ``full_to_swa`` and ``swa_page_size``; c128
    and c4 with ``use_req_ring=True`` address request rings ``rid * ring + p % ring``. With ``out``
    (uint8 ``[B, 16]``) the plan is written there (``plan_compress_decode_out``).
    """
    args = (req_pool_indices, seq_lens, req_to_token, full_to_swa, compress_ratio, swa_page_size,
            ring_size, bool(use_req_ring))
    if out is None:
        plan = torch.ops.dsv4.plan_compress_decode(*args)
    else:
        torch.ops.dsv4.plan_compress_decode_out(*args, out)
        plan = out
    return CompressPlan(plan, None, int(compress_ratio), True)


def plan_compress_prefill(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    req_to_token: Optional[torch.Tensor] = None,
    full_to_swa: Optional[torch.Tensor] = None,
    *,
    num_q_tokens: int,
    compress_ratio: int,
    ring_size: int,
    swa_page_size: int = 0,
    use_req_ring: bool = False,
    use_cuda_graph: bool = False,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> CompressPlan:
    """Prefill / extend / verify plans (§3.3): CompressPlan ``[Nc, 16]`` and WritePlan ``[Nw, 8]``.

    The path follows the devices (§3.6): everything on CPU runs the host planner; ``seq_lens`` and
    ``extend_lens`` on CPU with the rest on CUDA plans on the host and finishes on the GPU (not
    capturable); everything on CUDA runs the capturable GPU planner with ``[num_q_tokens, ...]``
    outputs. ``use_cuda_graph`` pads host-path outputs to num_q_tokens rows with sentinels. With
    ``out=(plan_c, plan_w)`` (``[num_q_tokens, 16]`` / ``[num_q_tokens, 8]``, one device) the
    plans are written there (``plan_compress_prefill_out``).
    """
    args = (req_pool_indices, seq_lens, extend_lens, req_to_token, full_to_swa, num_q_tokens,
            compress_ratio, swa_page_size, ring_size, bool(use_req_ring))
    if out is None:
        plan_c, plan_w = torch.ops.dsv4.plan_compress_prefill(*args, bool(use_cuda_graph))
    else:
        plan_c, plan_w = out
        torch.ops.dsv4.plan_compress_prefill_out(*args, plan_c, plan_w)
    return CompressPlan(plan_c, plan_w, int(compress_ratio), False)


def compress_forward(
    state: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan: Union[CompressPlan, torch.Tensor],
    plan_w: Optional[torch.Tensor] = None,
    *,
    head_dim: int,
    compress_ratio: Optional[int] = None,
    is_decode: Optional[bool] = None,
) -> torch.Tensor:
    """c4 / c128 compression (§4): returns ``[plan rows, head_dim]`` in the input dtype (row k for
    plan row k; zero where no entry is emitted) and updates the state ring in place.

    ``state`` is the pool of ``alloc_compress_state`` (or a dim-0 slice of it), ``kv_score_input``
    the raw projection rows ``[N, W]`` (last dim contiguous, any row stride: repeated or overlapping rows are
    only read), ``ape`` the kernel bias of ``ape_for_kernel``. ``plan`` is a
    ``CompressPlan`` or the raw plan tensor with explicit ``compress_ratio`` and ``is_decode``
    (and ``plan_w`` for prefill). A window of pad slots only gives 0; a NaN score in a live slot gives NaN in its
    channel (as the reference's softmax), never 0. Nothing may alias ``state`` (the op rejects it).
    """
    if isinstance(plan, CompressPlan):
        for name, given, own in (("compress_ratio", compress_ratio, plan.compress_ratio),
                                 ("is_decode", is_decode, plan.is_decode)):
            if given is not None and given != own:
                raise ValueError(f"compress_forward: {name}={given} contradicts the plan's {own}")
        if plan_w is not None:
            raise ValueError("compress_forward: pass plan_w inside the CompressPlan, not beside it")
        plan_tensor, plan_w = plan.plan, plan.plan_w
        compress_ratio, is_decode = plan.compress_ratio, plan.is_decode
    else:
        if compress_ratio is None or is_decode is None:
            raise TypeError("compress_forward: a raw plan tensor needs explicit compress_ratio and is_decode")
        plan_tensor = plan
    return torch.ops.dsv4.compress_forward(state, kv_score_input, ape, plan_tensor, plan_w, head_dim,
                                           compress_ratio, bool(is_decode))
