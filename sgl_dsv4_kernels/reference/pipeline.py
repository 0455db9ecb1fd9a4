"""Pure-torch model of one attention layer's KV side, composed from the reference functions of this package
(the oracle of ``sgl_dsv4_kernels.pipeline``): per step the metadata, the sliding-window K write, the layer's
compressor and compressed-cache store, the C4 indexer cache and the paged-MQA schedule. CPU tensors; it
computes nothing through the extension.

Where the driver takes a shortcut, the model follows the specs' definitions instead: c2 verify and extend
are successive decode calls (compressors.md §5.3, §5.5), and every plan is the literal per-token reference planner.

The model keeps state rings as the driver does, so a mistake they share (a ring too small for the verify width,
a write set that misses a row the next step reads) gives both the same wrong entries. Each step therefore also
computes the compressor outputs from every request's committed rows, with no ring at all (compressors.md §4.5
history): ``ReferenceStep.truth``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..metadata import CompressionMetadata, LowRatioMetadata, PageTablePositions  # named tuples only
from ..pipeline.kinds import FULL_PAGE_SIZE, INDEXER_DIM, SWA_WINDOW, LayerKind
from ..pipeline.pool import StepBatch, StepInputs
from .compress import compress_entries_fp64, compress_forward
from .low_ratio import (_latent, _store_latents, c1_decode_norm_rope_store, c2_decode_or_verify_norm_rope_store,
                        pair_pool)
from .metadata import (build_low_ratio_metadata, build_page_table_positions_small, get_paged_mqa_logits_metadata,
                       init_compression_metadata)
from .plans import plan_compress_decode, plan_compress_prefill
from .quant import kv_page_bytes
from .writers import compress_norm_rope_store, fused_k_norm_rope_flashmla

__all__ = ["ReferenceLayer", "ReferenceStep"]

HEAD_DIM = 512
EPS = 1e-6
TOPK = 512
MQA_BLOCK_KV = 64


@dataclass
class ReferenceStep:
    """What one step produced, field for field as the driver's ``StepResult`` / ``StepMetadata``."""

    page: PageTablePositions
    swa_loc: torch.Tensor
    compression: Optional[CompressionMetadata]
    low_ratio: Optional[LowRatioMetadata]
    plan: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]]  # (plan, plan_w)
    mqa_schedule: Optional[torch.Tensor]
    compressed: torch.Tensor
    indexer_compressed: Optional[torch.Tensor]
    # The compressor outputs of the step's live rows (the first sum(extend_lens)) from the requests' committed
    # rows, without state rings: c4 / c128 fp64 truth in the driver's row order (zero where nothing is
    # emitted), c1 / c2 latents.
    truth: Optional[torch.Tensor] = None
    indexer_truth: Optional[torch.Tensor] = None


class ReferenceLayer:
    """``caches`` and ``weights`` are CPU copies shaped as the driver's (its ``LayerCaches`` /
    ``LayerWeights``); ``ring`` the state ring rows per owner."""

    def __init__(self, kind: LayerKind, caches, weights, *, ring: Optional[int], swa_page_size: int, num_sms: int,
                 indexer_fp4: bool = False):
        self.kind, self.spec = kind, kind.spec
        self.caches, self.weights = caches, weights
        self.ring, self.sps, self.num_sms, self.indexer_fp4 = ring, swa_page_size, num_sms, indexer_fp4
        ps = self.spec.compressed_page_size
        # c1 / c2 latents are computed here against a cache with no pages (every slot invalid), then stored
        # from the rows the caller chooses (see `step`).
        self._no_pages = torch.zeros(0, kv_page_bytes(int(self.spec.compressed_layout), ps), dtype=torch.uint8)
        # rid -> committed projection rows (and C4 indexer rows) of its positions 0, 1, ...
        self.history: Dict[int, Tuple[torch.Tensor, Optional[torch.Tensor]]] = {}

    def step(self, batch: StepBatch, x: StepInputs, rows, req_to_token: torch.Tensor, full_to_swa: torch.Tensor,
             stored: Optional[Tuple[torch.Tensor, Optional[torch.Tensor]]] = None) -> ReferenceStep:
        """Runs one step in place on the caches. ``stored``: the compressor output rows to quantize into the
        compressed and indexer caches, by default this model's own. The writers are byte-exact on given rows
        (cache-writers.md §7.2, compressors.md §8.3) while the compressors are exact only within §4.5's
        tolerance, so tests pass the kernels' outputs here and compare the outputs themselves separately."""
        spec, w, caches = self.spec, self.weights, self.caches
        page = PageTablePositions(*build_page_table_positions_small(
            req_to_token, x.token_rids, x.token_seq_lens, req_to_token.shape[1], FULL_PAGE_SIZE, SWA_WINDOW))
        positions = page.positions_casual
        swa_loc = full_to_swa[x.token_locs]  # SWA-pool slot of each token (compressors.md §2.2)
        fused_k_norm_rope_flashmla(rows.kv, w.k_norm, EPS, w.rope_table, positions, swa_loc, caches.swa,
                                   page_size=self.sps, layout=int(spec.swa_layout))
        result = ReferenceStep(page, swa_loc, None, None, None, None, None, None)
        if spec.ratio in (4, 128):
            self._compressed_layer(batch, x, rows, result, stored, req_to_token, full_to_swa)
            lengths = result.compression.c4_seq_lens_raw
        else:
            result.low_ratio = LowRatioMetadata(*build_low_ratio_metadata(x.token_seq_lens, x.token_locs, TOPK))
            self._low_ratio_layer(batch, x, rows, result, stored)
            lengths = result.low_ratio.c1_seq_lens if spec.ratio == 1 else result.low_ratio.c2_seq_lens
        if spec.has_mqa_schedule:
            result.mqa_schedule = get_paged_mqa_logits_metadata(lengths, MQA_BLOCK_KV, self.num_sms)
        self._truth(batch, rows, result)
        return result

    # ---- the ring-free truth (compressors.md §1, §4.5) ----

    def _truth(self, batch: StepBatch, rows, result: ReferenceStep) -> None:
        """Sets ``result.truth`` / ``indexer_truth`` from each request's committed rows and this step's rows,
        then commits the step's accepted rows to the history."""
        spec, w, r = self.spec, self.weights, self.spec.ratio
        n = sum(batch.extend_lens)
        truth = torch.zeros(n, HEAD_DIM, dtype=torch.float64 if r in (4, 128) else torch.float32)
        index_truth = torch.zeros(n, INDEXER_DIM, dtype=torch.float64) if spec.has_indexer else None
        emitted, off, windows = 0, 0, {}
        none_yet = (rows.projection[:0], None if index_truth is None else rows.index_projection[:0])
        for b, (rid, prefix, extend) in enumerate(zip(batch.rids, batch.prefix_lens, batch.extend_lens)):
            past, past_index = self.history.get(rid, none_yet) if prefix > 0 else none_yet  # a slot reused at 0
            if past.shape[0] < prefix:
                raise ValueError(f"ReferenceLayer: request {rid} starts at {prefix}, but the model saw only "
                                 f"{past.shape[0]} of its tokens")
            x = torch.cat([past[:prefix], rows.projection[off:off + extend]])
            xi = None if past_index is None else torch.cat([past_index[:prefix],
                                                            rows.index_projection[off:off + extend]])
            windows[rid] = (x, xi, prefix)
            for p in range(prefix, prefix + extend):
                row = off + p - prefix
                if r in (4, 128):
                    if (p + 1) % r:
                        continue
                    at = b if batch.is_decode else emitted  # decode row b; prefill plan rows in emission order
                    emitted += 1
                    truth[at] = self._entry(x, w.ape, p // r, HEAD_DIM)
                    if xi is not None:
                        index_truth[at] = self._entry(xi, w.index_ape, p // r, INDEXER_DIM)
                elif r == 1:
                    truth[row] = _latent(x[p:p + 1], w.compress_norm, EPS).float()[0]
                elif p % 2 == 1:
                    even, odd = x[p - 1:p + 1].float()
                    pooled = pair_pool(even[:HEAD_DIM], even[HEAD_DIM:], odd[:HEAD_DIM], odd[HEAD_DIM:])
                    truth[row] = _latent(pooled.to(torch.bfloat16)[None], w.compress_norm, EPS).float()[0]
            off += extend
        result.truth, result.indexer_truth = truth, index_truth
        for rid, accepted in zip(batch.rids, batch.committed):
            x, xi, prefix = windows[rid]
            self.history[rid] = (x[:prefix + accepted], None if xi is None else xi[:prefix + accepted])

    def _entry(self, x: torch.Tensor, ape: torch.Tensor, g: int, head_dim: int) -> torch.Tensor:
        """Entry g of the rows ``x`` of positions 0, 1, ... (c4 reads chunks g - 1 and g, c128 chunk g)."""
        r = self.spec.ratio
        start = max(g - 1, 0) * r if r == 4 else g * r
        return compress_entries_fp64(x[start:(g + 1) * r], ape, r, head_dim)[-1]

    # ---- c4 / c128 (compressors.md §3, §4; cache-writers.md §4) ----

    def _compressed_layer(self, batch, x, rows, result, stored, r2t, f2s) -> None:
        spec, w, caches = self.spec, self.weights, self.caches
        r, paged = spec.ratio, spec.ratio == 4
        page = result.page
        cm = init_compression_metadata(x.token_seq_lens, page.positions_casual, x.token_locs, page.page_table,
                                       FULL_PAGE_SIZE, compute_page_indices=r == 128)
        result.compression = CompressionMetadata(*cm)  # c4: page indices of width 0, as the driver's buffer
        sps = self.sps if paged else 0
        if batch.is_decode:
            plan = plan_compress_decode(x.req_rids, x.req_seq_lens, r2t, f2s if paged else None, r, sps, self.ring,
                                        not paged)
            plan_w = None
        else:
            plan, plan_w = plan_compress_prefill(x.req_rids, x.req_seq_lens, x.req_extend_lens, r2t,
                                                 f2s if paged else None, x.num_tokens, r, sps, self.ring, not paged,
                                                 use_cuda_graph=True)
        result.plan = (plan, plan_w)
        out_loc = result.compression.c4_out_loc if r == 4 else result.compression.c128_out_loc
        common = dict(norm_eps=EPS, freq_cis=w.rope_table, out_loc=out_loc, page_size=spec.compressed_page_size,
                      compress_ratio=r, is_decode=batch.is_decode)
        result.compressed = compress_forward(caches.state, rows.projection, w.ape, plan, plan_w, HEAD_DIM, r,
                                             batch.is_decode)
        compress_norm_rope_store(stored[0] if stored else result.compressed, plan, norm_weight=w.compress_norm,
                                 kvcache=caches.compressed, layout=int(spec.compressed_layout), **common)
        if spec.has_indexer:
            result.indexer_compressed = compress_forward(caches.index_state, rows.index_projection, w.index_ape,
                                                         plan, plan_w, INDEXER_DIM, r, batch.is_decode)
            compress_norm_rope_store(stored[1] if stored else result.indexer_compressed, plan,
                                     norm_weight=w.index_norm, kvcache=caches.indexer, use_fp4=self.indexer_fp4,
                                     **common)

    # ---- c1 / c2 (compressors.md §5) ----

    def _low_ratio_layer(self, batch, x, rows, result, stored) -> None:
        spec, w, caches = self.spec, self.weights, self.caches
        positions = result.page.positions_casual.to(torch.int64)
        raw = result.low_ratio.c1_out_loc  # the raw slot for both ratios (metadata.md §3)
        layout, ps = int(spec.compressed_layout), spec.compressed_page_size
        if spec.ratio == 1:
            result.compressed = c1_decode_norm_rope_store(rows.projection, w.compress_norm, positions, raw, EPS,
                                                          w.rope_table, self._no_pages, ps, layout)
            slots, rope_positions = torch.where(raw > 0, raw, -1), positions
        else:
            latent = torch.zeros(x.num_tokens, HEAD_DIM, dtype=torch.bfloat16)
            for rows_of_call in self._c2_decode_calls(batch, x.num_tokens):
                i = torch.tensor(rows_of_call, dtype=torch.int64)
                latent[i] = c2_decode_or_verify_norm_rope_store(
                    rows.projection[i], caches.state, w.compress_norm, positions[i], x.token_rids[i], raw[i], EPS,
                    w.rope_table, self._no_pages, ps, self.ring, 0, layout)
            result.compressed = latent
            odd = (positions >= 0) & (positions % 2 == 1)
            slots, rope_positions = torch.where(odd & (raw > 0), raw >> 1, -1), positions - 1
        _store_latents(caches.compressed, stored[0] if stored else result.compressed, slots, rope_positions,
                       w.rope_table, ps, layout)

    @staticmethod
    def _c2_decode_calls(batch: StepBatch, num_tokens: int) -> List[List[int]]:
        """Token rows of each successive decode call: one row per request and position, in position order."""
        if batch.is_decode:
            return [list(range(num_tokens))]
        starts = [0]
        for e in batch.extend_lens:
            starts.append(starts[-1] + e)
        return [[s + j for s, e in zip(starts, batch.extend_lens) if j < e] for j in range(max(batch.extend_lens))]
