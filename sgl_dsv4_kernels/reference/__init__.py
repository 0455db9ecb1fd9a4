"""Pure-torch reference implementations written from the specs (the independent oracle).

Nothing here imports or calls the compiled extension. Speed is irrelevant; every function runs on
CPU and CUDA tensors with bit-identical results.
"""

from .quant import *  # noqa: F401,F403  formats, quantizers, pages, slots, indexer, fake quant
from .norm_rope import *  # noqa: F401,F403  RMSNorm, RoPE tail, WHT-128, reference fused_store_cache
from .metadata import (  # noqa: F401  page tables, low-ratio / compression metadata, paged-MQA schedule
    build_low_ratio_metadata,
    build_page_table_positions_small,
    fill_all_compressed_indices,
    get_paged_mqa_logits_metadata,
    get_paged_mqa_logits_metadata_loop,
    init_compression_metadata,
)
from .writers import *  # noqa: F401,F403  reference fused_k_norm_rope_flashmla, compress_norm_rope_store
from .low_ratio import *  # noqa: F401,F403  reference c1 / c2 compressors
from .plans import *  # noqa: F401,F403  c4/c128 planners, unpack_plan
from .compress import *  # noqa: F401,F403  c4/c128 compress_forward, fp64 ground truth
