"""Pure-torch reference implementations written from the specs (the independent oracle).

Nothing here imports or calls the compiled extension. Speed is irrelevant; every function runs on
CPU and CUDA tensors with bit-identical results.
"""
from .metadata import (
    build_low_ratio_metadata,
    build_page_table_positions_small,
    fill_all_compressed_indices,
    get_paged_mqa_logits_metadata,
    get_paged_mqa_logits_metadata_loop,
    init_compression_metadata,
)

__all__ = [
    "build_page_table_positions_small",
    "build_low_ratio_metadata",
    "fill_all_compressed_indices",
    "init_compression_metadata",
    "get_paged_mqa_logits_metadata",
    "get_paged_mqa_logits_metadata_loop",
]
