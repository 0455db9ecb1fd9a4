"""Typed wrappers of the KV I/O ops: store rows into a paged cache, read them back, fake-quantize."""
from __future__ import annotations

from typing import Optional, Union

import torch

from .kv_layout import KVLayout, layout_argument

LayoutLike = Union[KVLayout, int, str]


def _rope_rows(freqs_cis: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-row rotations as fp32 [N, 64]: complex64 [N, 32] is converted (N = 0 included); any other complex
    tensor is rejected here, a real one by the op."""
    if freqs_cis is None or not freqs_cis.is_complex():
        return freqs_cis
    if freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 2:
        raise ValueError(f"fused_store_cache: freqs_cis must be complex64 [N, 32] or float32 [N, 64], got "
                         f"{freqs_cis.dtype} {list(freqs_cis.shape)}")
    return torch.view_as_real(freqs_cis).flatten(1)


def fused_store_cache(
    input: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    page_size: int,
    type: str = "flashmla",
    layout: LayoutLike = KVLayout.V4,
    use_fp4: bool = False,
    freqs_cis: Optional[torch.Tensor] = None,
) -> None:
    """Quantizes finished rows into a paged cache in place.

    ``type="flashmla"``: ``input [N, 512]`` into the main layout ``layout`` (V4 / V41 / V41_FP4);
    with ``freqs_cis`` (V41 / V41_FP4 only) the last 64 dims are rotated first.
    ``type="indexer"``: ``input [N, 128]`` into the indexer fp8 (``use_fp4=False``) or fp4 cache.
    Row i goes to slot ``indices[i]``; rows with an invalid slot write nothing.
    """
    torch.ops.dsv4.fused_store_cache(
        input,
        cache,
        indices,
        page_size=page_size,
        type=type,
        layout=layout_argument("fused_store_cache", layout),
        use_fp4=use_fp4,
        freqs_cis=_rope_rows(freqs_cis),
    )


def dequantize_k_cache_paged(
    cache: torch.Tensor,
    slots: torch.Tensor,
    page_size: int,
    *,
    layout: LayoutLike = KVLayout.V4,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Decodes the rows at ``slots`` into bf16 ``[N, 1, 512]`` (invalid slots give zero rows).

    With ``out`` (bf16 ``[N, 1, 512]``, any row stride >= 512) the rows are written there and
    ``out`` is returned.
    """
    layout_id = layout_argument("dequantize_k_cache_paged", layout)
    if out is None:
        return torch.ops.dsv4.dequantize_k_cache_paged(cache, slots, page_size, layout_id)
    torch.ops.dsv4.dequantize_k_cache_paged.out(cache, slots, page_size, layout_id, out=out)
    return out


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """V41_FP4 quantize-dequantize round trip per block of 16 along the last dim (new tensor)."""
    return torch.ops.dsv4.fake_quant_compressed_kv(x)


def fake_quant_fp4(x: torch.Tensor, *, block_size: int = 32) -> torch.Tensor:
    """e2m1 quantize-dequantize with a power-of-two scale per block of ``block_size`` (new tensor)."""
    return torch.ops.dsv4.fake_quant_fp4(x, block_size=block_size)
