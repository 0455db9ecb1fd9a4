"""DeepSeek-V4 / V4.1 attention-side kernels as ``torch.ops.dsv4`` custom ops.

Importing the package loads the compiled module (which registers the ops) and the Python fakes.
"""
import torch  # noqa: F401  (the extension needs libtorch loaded first)

from . import _C  # noqa: F401  registers torch.ops.dsv4.*
from . import _fake  # noqa: F401  registers the fake (meta) implementations
from .cache import (
    dequantize_k_cache_paged,
    fake_quant_compressed_kv,
    fake_quant_fp4,
    fused_store_cache,
)
from .kv_layout import IndexerFormat, KVLayout, is_valid_kv_layout_pair
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
    "fused_k_norm_rope_flashmla",
    "compress_norm_rope_store",
    "precompute_freqs_cis",
    "rope_table_from_freqs_cis",
    "precompute_rope_table",
]
