"""DeepSeek-V4 / V4.1 attention-side kernels as ``torch.ops.dsv4`` custom ops.

Importing the package loads the compiled module (which registers the ops) and the Python fakes.
"""
import torch  # noqa: F401  (the extension needs libtorch loaded first)

from . import _C  # noqa: F401  registers torch.ops.dsv4.*
from . import _fake  # noqa: F401  registers the fake (meta) implementations
from . import _fake_compress  # noqa: F401  fakes of the c4/c128 planners and compressor
from . import _autograd  # noqa: F401  declares every op non-differentiable
from .cache import (
    dequantize_k_cache_paged,
    fake_quant_compressed_kv,
    fake_quant_fp4,
    fused_store_cache,
)
from .compress import (
    CompressPlan,
    alloc_compress_state,
    ape_for_kernel,
    c1_decode_norm_rope_store,
    c2_decode_or_verify_norm_rope_store,
    c2_prefill_norm_rope_store,
    check_ring_serves_draft_tokens,
    compress_forward,
    plan_compress_decode,
    plan_compress_prefill,
    state_ring_size,
)
from .kv_layout import IndexerFormat, KVLayout, is_valid_kv_layout_pair
from .metadata import (
    CompressionMetadata,
    LowRatioMetadata,
    PageTablePositions,
    build_low_ratio_metadata,
    build_low_ratio_metadata_out,
    build_page_table_positions_small,
    build_page_table_positions_small_out,
    fill_all_compressed_indices,
    get_paged_mqa_logits_metadata,
    get_paged_mqa_logits_metadata_out,
    init_compression_metadata,
    init_compression_metadata_out,
)
from .rope import precompute_freqs_cis, precompute_rope_table, rope_table_from_freqs_cis
from .writers import compress_norm_rope_store, fused_k_norm_rope_flashmla

__all__ = [
    "KVLayout",
    "IndexerFormat",
    "is_valid_kv_layout_pair",
    "fused_store_cache",
    "dequantize_k_cache_paged",
    "fake_quant_compressed_kv",
    "fake_quant_fp4",
    "PageTablePositions",
    "LowRatioMetadata",
    "CompressionMetadata",
    "build_page_table_positions_small",
    "build_page_table_positions_small_out",
    "build_low_ratio_metadata",
    "build_low_ratio_metadata_out",
    "fill_all_compressed_indices",
    "init_compression_metadata",
    "init_compression_metadata_out",
    "get_paged_mqa_logits_metadata",
    "get_paged_mqa_logits_metadata_out",
    "fused_k_norm_rope_flashmla",
    "compress_norm_rope_store",
    "precompute_freqs_cis",
    "rope_table_from_freqs_cis",
    "precompute_rope_table",
    "state_ring_size",
    "c1_decode_norm_rope_store",
    "c2_decode_or_verify_norm_rope_store",
    "c2_prefill_norm_rope_store",
    "CompressPlan",
    "plan_compress_decode",
    "plan_compress_prefill",
    "compress_forward",
    "check_ring_serves_draft_tokens",
    "alloc_compress_state",
    "ape_for_kernel",
]
