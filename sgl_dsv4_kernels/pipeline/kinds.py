"""The four kinds of attention layer of DeepSeek-V4 / V4.1 and, per kind, which caches, compressor and
metadata its KV side owns. Pure data (no ops), shared by the driver and the reference model.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from ..kv_layout import KVLayout

FULL_PAGE_SIZE = 256  # tokens per full-KV page; DSV4 hard-wires it (metadata.md §1.1)
SWA_WINDOW = 128  # sliding-window length (metadata.md §1.1)
ROPE_DIMS = 64


class LayerKind(enum.Enum):
    """One attention layer's compression ratio and model generation."""

    V4_C4 = "v4_c4"  # V4 ratio-4 layer: overlapping-window compressor + C4 indexer
    V4_C128 = "v4_c128"  # V4 ratio-128 layer: no indexer, attends to every compressed entry
    V41_C1 = "v41_c1"  # V4.1 ratio-1 layer: per-token latent
    V41_C2 = "v41_c2"  # V4.1 ratio-2 layer: pair-pooled latent

    @property
    def spec(self) -> "KindSpec":
        return KIND_SPECS[self]


@dataclass(frozen=True)
class KindSpec:
    ratio: int
    # Sliding-window main cache written by fused_k_norm_rope_flashmla (cache-writers.md §3: "the production
    # SWA cache is V4 or V41").
    swa_layout: KVLayout
    # Ratio-r compressed cache: V4 layers store V4 rows (compress_norm_rope_store, cache-writers.md §4); V4.1
    # layers pair a V41 main cache with V41_FP4 compressed caches (kv-layouts-and-quant.md §1, valid pair
    # (V41, V41_FP4)), written by the c1 / c2 writers (compressors.md §5).
    compressed_layout: KVLayout
    # The C4 indexer keeps its own ratio-4 compressor (D = 128) and cache (cache-writers.md §4, indexer
    # variant). Ratio-1/2 layers' indexer keys come from a wk projection outside this library.
    has_indexer: bool
    # The DeepGEMM paged-MQA schedule is built for the layers with an indexer pass: C4 on c4_seq_lens_raw,
    # C1 / C2 on cX_seq_lens (metadata.md §6.1). c128 layers attend to every compressed entry.
    has_mqa_schedule: bool

    @property
    def compressed_page_size(self) -> int:
        """Slots per page of the compressed pool: a full page of 256 tokens owns 256 / r (metadata.md §1.1)."""
        return FULL_PAGE_SIZE // self.ratio

    @property
    def has_state_ring(self) -> bool:
        """c4 / c128 / c2 keep raw rows between steps (compressors.md §2.1); c1 keeps none."""
        return self.ratio != 1

    @property
    def projection_width(self) -> int:
        """Width of one token's compressor input row (compressors.md §1.2): c4 4D, c128 2D, c2 1024, c1 512."""
        return {4: 4 * 512, 128: 2 * 512, 2: 1024, 1: 512}[self.ratio]


KIND_SPECS = {
    LayerKind.V4_C4: KindSpec(4, KVLayout.V4, KVLayout.V4, has_indexer=True, has_mqa_schedule=True),
    LayerKind.V4_C128: KindSpec(128, KVLayout.V4, KVLayout.V4, has_indexer=False, has_mqa_schedule=False),
    LayerKind.V41_C1: KindSpec(1, KVLayout.V41, KVLayout.V41_FP4, has_indexer=False, has_mqa_schedule=True),
    LayerKind.V41_C2: KindSpec(2, KVLayout.V41, KVLayout.V41_FP4, has_indexer=False, has_mqa_schedule=True),
}

INDEXER_DIM = 128
INDEXER_PROJECTION_WIDTH = 4 * INDEXER_DIM  # the C4 indexer compressor's (kv_ov, kv, s_ov, s) row


def state_ring(kind: LayerKind, verify_width: int) -> Optional[int]:
    """Ring rows per owner for a layer serving ``verify_width`` verify tokens (compressors.md §2.1)."""
    from ..compress import state_ring_size

    spec = kind.spec
    return state_ring_size(spec.ratio, verify_width) if spec.has_state_ring else None
