"""The KV side of one attention layer driven through the ops: per step the metadata, the sliding-window K
write, the layer's compressor and compressed-cache store, the C4 indexer cache and the paged-MQA schedule.

``KVLayer.decode_step`` is the CUDA-graph / torch.compile unit: it reads only fixed input buffers that the
caller ``copy_``s into (``load_decode``), writes only preallocated buffers (the ``_out`` forms of the
metadata ops and planners) and the caches, and never reads a value on the host. Prefill, chunked extend and
speculative verify (``extend``) run eagerly and may plan on the host.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Optional, Tuple

import torch

from .. import compress as C
from .. import metadata as M
from ..kv_layout import IndexerFormat
from ..rope import precompute_rope_table
from ..writers import compress_norm_rope_store, fused_k_norm_rope_flashmla
from .kinds import FULL_PAGE_SIZE, INDEXER_DIM, INDEXER_PROJECTION_WIDTH, SWA_WINDOW, LayerKind, state_ring
from .pool import PoolGeometry, StepBatch, StepInputs

HEAD_DIM = 512
EPS = 1e-6
TOPK = 512  # index top-k of the V4.1 low-ratio metadata (metadata.md §1.1)
MQA_BLOCK_KV = 64  # the index pool's block (metadata.md §6.1)
# YaRN RoPE of a compressed layer: compress_rope_theta, factor, original_seq_len, beta_fast, beta_slow
# (cache-writers.md §1.3, typical V4 values). The SWA write, compressed store and indexer store share it.
YARN = dict(original_seq_len=65536, base=160000.0, factor=16.0, beta_fast=32.0, beta_slow=1.0)


def _to(obj, device):
    """The dataclass of tensors ``obj`` with every tensor field moved to ``device`` (None fields kept)."""
    return replace(obj, **{f.name: getattr(obj, f.name).to(device) for f in fields(obj)
                           if getattr(obj, f.name) is not None})


@dataclass
class LayerWeights:
    rope_table: torch.Tensor  # fp32 [max_pos, 64]
    k_norm: torch.Tensor  # bf16 [512]: RMSNorm weight of the sliding-window K
    compress_norm: torch.Tensor  # bf16 [512]: RMSNorm weight of the compressed latent
    ape: Optional[torch.Tensor] = None  # c4 [8, 512] / c128 [128, 512], kernel order (compress.ape_for_kernel)
    index_norm: Optional[torch.Tensor] = None  # C4 indexer: bf16 [128]
    index_ape: Optional[torch.Tensor] = None  # C4 indexer: [8, 128]

    @staticmethod
    def random(kind: LayerKind, max_pos: int, generator: torch.Generator) -> "LayerWeights":
        def norm_weight(n):
            return (1.0 + 0.25 * torch.randn(n, generator=generator)).to(torch.bfloat16)

        r = kind.spec.ratio
        ape = torch.randn(8 if r == 4 else 128, HEAD_DIM, generator=generator) if r in (4, 128) else None
        has_index = kind.spec.has_indexer
        return LayerWeights(
            rope_table=precompute_rope_table(64, max_pos, **YARN),
            k_norm=norm_weight(HEAD_DIM), compress_norm=norm_weight(HEAD_DIM), ape=ape,
            index_norm=norm_weight(INDEXER_DIM) if has_index else None,
            index_ape=torch.randn(8, INDEXER_DIM, generator=generator) if has_index else None)

    def to(self, device) -> "LayerWeights":
        return _to(self, device)


@dataclass
class LayerRows:
    """A step's activations for one layer, one row per query token (what the projections would produce)."""

    kv: torch.Tensor  # bf16 [N, 512]: raw K latent, input of the sliding-window writer
    projection: torch.Tensor  # compressor input [N, W]: fp32 (c4, c128, c2) or bf16 (c1) (compressors.md §1.2)
    index_projection: Optional[torch.Tensor] = None  # C4 indexer compressor input, fp32 [N, 512]

    @staticmethod
    def random(kind: LayerKind, n: int, generator: torch.Generator) -> "LayerRows":
        spec = kind.spec
        scale = torch.exp2(torch.randint(-3, 4, (n, 1), generator=generator).float())
        kv = (torch.randn(n, HEAD_DIM, generator=generator) * scale).to(torch.bfloat16)
        projection = torch.randn(n, spec.projection_width, generator=generator) * 2
        if spec.ratio == 1:
            projection = (projection * scale).to(torch.bfloat16)
        index = torch.randn(n, INDEXER_PROJECTION_WIDTH, generator=generator) * 2 if spec.has_indexer else None
        return LayerRows(kv, projection, index)

    def to(self, device) -> "LayerRows":
        return _to(self, device)


@dataclass
class LayerCaches:
    """Everything a layer keeps between steps. Page 0 of every cache and owner 0 of every state ring
    belong to the dummy request of padded rows."""

    swa: torch.Tensor  # sliding-window main cache, [num_swa_pages, page_bytes(swa_page_size)]
    compressed: torch.Tensor  # ratio-r cache, [num_full_pages, page_bytes(256 / r)]
    indexer: Optional[torch.Tensor] = None  # C4 indexer cache, [num_full_pages, 64 * bytes_per_token]
    state: Optional[torch.Tensor] = None  # c4 / c128 state pool (with its pad page), or the c2 pair ring
    index_state: Optional[torch.Tensor] = None  # the C4 indexer compressor's state pool

    @staticmethod
    def allocate(kind: LayerKind, geometry: PoolGeometry, ring: Optional[int], indexer_format: IndexerFormat,
                 device) -> "LayerCaches":
        spec = kind.spec
        g = geometry

        def cache(layout_or_format, pages, page_size):
            return torch.zeros(pages, layout_or_format.page_bytes(page_size), dtype=torch.uint8, device=device)

        caches = LayerCaches(swa=cache(spec.swa_layout, g.num_swa_pages, g.swa_page_size),
                             compressed=cache(spec.compressed_layout, g.num_full_pages, spec.compressed_page_size))
        if spec.ratio == 4:  # paged rings: one per SWA page (compressors.md §2.2)
            caches.state = C.alloc_compress_state(4, HEAD_DIM, g.num_swa_pages, ring, device=device)
            caches.index_state = C.alloc_compress_state(4, INDEXER_DIM, g.num_swa_pages, ring, device=device)
            caches.indexer = cache(indexer_format, g.num_full_pages, spec.compressed_page_size)
        elif spec.ratio == 128:  # request rings
            caches.state = C.alloc_compress_state(128, HEAD_DIM, g.num_request_slots, ring, device=device)
        elif spec.ratio == 2:  # pair-state ring, one per request slot (compressors.md §5.2)
            caches.state = torch.zeros(g.num_request_slots * ring, 1024, device=device)
        return caches

    def clone(self, device=None) -> "LayerCaches":
        """An independent copy (on ``device`` when given)."""
        def copy(t):
            return None if t is None else t.to(device if device is not None else t.device, copy=True)

        return replace(self, **{f.name: copy(getattr(self, f.name)) for f in fields(self)})


@dataclass
class StepMetadata:
    """Buffers of the step's metadata: written by the ``_out`` forms, read by attention (not in this library)."""

    page: M.PageTablePositions  # per token: seq_lens, positions (= L - 1), page_table, swa lengths
    swa_loc: torch.Tensor  # int64 [N]: SWA-pool slot of each token's K
    compression: Optional[M.CompressionMetadata] = None  # c4 / c128 (metadata.md §5)
    low_ratio: Optional[M.LowRatioMetadata] = None  # c1 / c2 (metadata.md §3)
    plan: Optional[C.CompressPlan] = None  # c4 / c128 DecodePlan, or CompressPlan + WritePlan
    mqa_schedule: Optional[torch.Tensor] = None  # int32 [num_sms + 1, 2] (metadata.md §6)

    @staticmethod
    def allocate(kind: LayerKind, n: int, *, num_requests: int, is_decode: bool, max_tokens: int,
                 num_sms: int, device) -> "StepMetadata":
        spec = kind.spec

        def i32(*shape):
            return torch.empty(shape, dtype=torch.int32, device=device)

        def i64(*shape):
            return torch.empty(shape, dtype=torch.int64, device=device)

        pages = -(-max_tokens // FULL_PAGE_SIZE)
        meta = StepMetadata(page=M.PageTablePositions(i32(n), i32(n), i32(n, pages), i32(n)), swa_loc=i64(n))
        if spec.ratio in (4, 128):
            # c128 layers attend to every compressed entry through page indices of width
            # ceil(2 * pages / 64) * 64 (cps = 256 / 128; metadata.md §5); c4 layers need none (width 0,
            # preallocated too so that the wrapper allocates nothing).
            width = -(-2 * pages // 64) * 64 if spec.ratio == 128 else 0
            meta.compression = M.CompressionMetadata(i64(n), i32(n), i32(n), i32(n), i64(n), i32(n), i32(n), i32(n),
                                                     i32(n, width))
            u8 = dict(dtype=torch.uint8, device=device)
            if is_decode:
                meta.plan = C.CompressPlan(torch.empty(num_requests, 16, **u8), None, spec.ratio, True)
            else:
                meta.plan = C.CompressPlan(torch.empty(n, 16, **u8), torch.empty(n, 8, **u8), spec.ratio, False)
        else:
            padded = -(-TOPK // 64) * 64
            meta.low_ratio = M.LowRatioMetadata(i64(n), i32(n), i32(n), i32(n, padded),
                                                i64(n), i32(n), i32(n), i32(n, padded))
        if spec.has_mqa_schedule:
            meta.mqa_schedule = i32(num_sms + 1, 2)
        return meta


class StepResult(NamedTuple):
    metadata: StepMetadata
    # c4 / c128: compress_forward output [plan rows, 512] (zero rows where nothing is emitted);
    # c1 / c2: the bf16 pre-RoPE latent [N, 512] (zero for even c2 positions).
    compressed: torch.Tensor
    indexer_compressed: Optional[torch.Tensor]  # C4 indexer compress_forward output [plan rows, 128]


class KVLayer:
    """One layer's caches and the ops that fill them, for a batch of requests of one ``RequestPool``.

    ``tables`` are the pool's device ``(req_to_token, full_to_swa)``: the decode step reads them in place,
    so the caller refreshes them with ``copy_`` (``RequestPool.sync_tables``), never by rebinding.
    """

    def __init__(self, kind: LayerKind, geometry: PoolGeometry, weights: LayerWeights,
                 tables: Tuple[torch.Tensor, torch.Tensor], *, decode_batch: int, verify_width: int = 0,
                 num_sms: Optional[int] = None, indexer_format: Optional[IndexerFormat] = None, device="cpu"):
        self.kind, self.spec, self.geometry = kind, kind.spec, geometry
        self.device = torch.device(device)
        self.weights = weights.to(self.device)
        self.req_to_token, self.full_to_swa = tables
        self.ring = state_ring(kind, verify_width)
        if self.spec.ratio in (4, 128):  # the startup guard of every c4/c128 layer (compressors.md §2.1)
            C.check_ring_serves_draft_tokens(self.spec.ratio, self.ring, max(verify_width, 1))
        # The fp8 indexer cache of DeepSeek-V3.2 (132 B/token) unless fp4 (68 B) is asked for.
        self.indexer_format = indexer_format if indexer_format is not None else IndexerFormat.FP8
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
                if self.device.type == "cuda" else 132
        self.num_sms = num_sms
        self.caches = LayerCaches.allocate(kind, geometry, self.ring, self.indexer_format, self.device)
        self.decode_batch = decode_batch
        self._allocate_decode_buffers()

    def _allocate_decode_buffers(self) -> None:
        """Fixed decode buffers: inputs the caller copy_s into, metadata the step writes."""
        self.decode_inputs = StepInputs(*(torch.zeros(self.decode_batch, dtype=torch.int64, device=self.device)
                                          for _ in fields(StepInputs)))
        self.decode_rows = LayerRows.random(self.kind, self.decode_batch,
                                            torch.Generator().manual_seed(0)).to(self.device)
        self.decode_meta = self._allocate_metadata(self.decode_batch, self.decode_batch, is_decode=True)

    def another_decode_batch(self) -> "KVLayer":
        """The same layer (caches, tables, weights) with decode buffers of its own: a second batch of other
        requests decoding into the same caches, as two overlapped micro-batches of one step do."""
        other = copy.copy(self)
        other._allocate_decode_buffers()
        return other

    def _allocate_metadata(self, n: int, num_requests: int, is_decode: bool) -> StepMetadata:
        return StepMetadata.allocate(self.kind, n, num_requests=num_requests, is_decode=is_decode,
                                     max_tokens=self.geometry.max_tokens, num_sms=self.num_sms, device=self.device)

    # ---- the two entry points ----

    def load_decode(self, inputs: StepInputs, rows: LayerRows) -> None:
        """Copies a decode batch (live rows, then padded rows) into the fixed decode buffers."""
        if inputs.num_tokens != self.decode_batch:
            raise ValueError(f"decode batch has {inputs.num_tokens} rows, the layer's buffers {self.decode_batch}")
        for f in fields(StepInputs):
            getattr(self.decode_inputs, f.name).copy_(getattr(inputs, f.name), non_blocking=True)
        for f in fields(LayerRows):
            if getattr(rows, f.name) is not None:
                getattr(self.decode_rows, f.name).copy_(getattr(rows, f.name), non_blocking=True)

    def decode_step(self) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One decode token per row from the fixed buffers; capturable, compilable, no host sync.
        Returns the compressor outputs; the metadata is in ``decode_meta``."""
        x, rows, meta = self.decode_inputs, self.decode_rows, self.decode_meta
        self._build_metadata(x, meta, is_decode=True)
        self._write_sliding_window(rows, meta)
        return self._compress(x, rows, meta, is_decode=True, draft_len=0)

    def decode(self) -> StepResult:
        return StepResult(self.decode_meta, *self.decode_step())

    def extend(self, batch: StepBatch, inputs: StepInputs, rows: LayerRows) -> StepResult:
        """Prefill, chunked extend or speculative verify (``batch.mode == "verify"``: every request verifies
        ``batch.draft_len`` tokens; the host commits the accepted ones afterwards)."""
        x, rows = inputs.to(self.device), rows.to(self.device)
        meta = self._allocate_metadata(x.num_tokens, len(batch.rids), is_decode=False)
        self._build_metadata(x, meta, is_decode=False)
        self._write_sliding_window(rows, meta)
        compressed, indexer = self._compress(x, rows, meta, is_decode=False, draft_len=batch.draft_len, batch=batch)
        return StepResult(meta, compressed, indexer)

    def capture_decode_graph(self) -> "DecodeGraph":
        return DecodeGraph(self)

    # ---- the pieces of a step ----

    def _build_metadata(self, x: StepInputs, meta: StepMetadata, is_decode: bool) -> None:
        M.build_page_table_positions_small_out(self.req_to_token, x.token_rids, x.token_seq_lens, out=meta.page,
                                               page_size=FULL_PAGE_SIZE, swa_window=SWA_WINDOW)
        torch.index_select(self.full_to_swa, 0, x.token_locs, out=meta.swa_loc)
        spec = self.spec
        if spec.ratio in (4, 128):
            page_table = meta.page.page_table if spec.ratio == 128 else None
            M.init_compression_metadata_out(x.token_seq_lens, meta.page.positions_casual, x.token_locs, page_table,
                                            out=meta.compression, page_size=FULL_PAGE_SIZE)
            self._plan(x, meta, is_decode)
            lengths = meta.compression.c4_seq_lens_raw  # the C4 indexer's unclamped context lengths
        else:
            M.build_low_ratio_metadata_out(x.token_seq_lens, x.token_locs, topk=TOPK, out=meta.low_ratio)
            lengths = meta.low_ratio.c1_seq_lens if spec.ratio == 1 else meta.low_ratio.c2_seq_lens
        if spec.has_mqa_schedule:
            M.get_paged_mqa_logits_metadata_out(lengths, out=meta.mqa_schedule, block_kv=MQA_BLOCK_KV)

    def _plan(self, x: StepInputs, meta: StepMetadata, is_decode: bool) -> None:
        """c4 rings are paged by SWA page, c128 rings by request (compressors.md §2.2)."""
        paged = self.spec.ratio == 4
        kw = dict(compress_ratio=self.spec.ratio, ring_size=self.ring, use_req_ring=not paged,
                  swa_page_size=self.geometry.swa_page_size if paged else 0)
        f2s = self.full_to_swa if paged else None
        if is_decode:
            C.plan_compress_decode(x.req_rids, x.req_seq_lens, self.req_to_token, f2s, out=meta.plan.plan, **kw)
        else:  # every tensor on one device: the capturable GPU path on CUDA, padded like it on the CPU
            C.plan_compress_prefill(x.req_rids, x.req_seq_lens, x.req_extend_lens, self.req_to_token, f2s,
                                    num_q_tokens=x.num_tokens, out=(meta.plan.plan, meta.plan.plan_w), **kw)

    def _write_sliding_window(self, rows: LayerRows, meta: StepMetadata) -> None:
        w = self.weights
        fused_k_norm_rope_flashmla(rows.kv, w.k_norm, EPS, w.rope_table, meta.page.positions_casual, meta.swa_loc,
                                   self.caches.swa, page_size=self.geometry.swa_page_size, layout=self.spec.swa_layout)

    def _compress(self, x: StepInputs, rows: LayerRows, meta: StepMetadata, *, is_decode: bool, draft_len: int,
                  batch: Optional[StepBatch] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        spec, w, caches = self.spec, self.weights, self.caches
        positions = meta.page.positions_casual
        store = dict(norm_eps=EPS, freq_cis=w.rope_table, page_size=spec.compressed_page_size)
        if spec.ratio in (4, 128):
            out_loc = meta.compression.c4_out_loc if spec.ratio == 4 else meta.compression.c128_out_loc
            out = C.compress_forward(caches.state, rows.projection, w.ape, meta.plan, head_dim=HEAD_DIM)
            compress_norm_rope_store(out, meta.plan, norm_weight=w.compress_norm, out_loc=out_loc,
                                     kvcache=caches.compressed, layout=spec.compressed_layout, **store)
            if not spec.has_indexer:
                return out, None
            index_out = C.compress_forward(caches.index_state, rows.index_projection, w.index_ape, meta.plan,
                                           head_dim=INDEXER_DIM)
            compress_norm_rope_store(index_out, meta.plan, norm_weight=w.index_norm, out_loc=out_loc,
                                     kvcache=caches.indexer, use_fp4=self.indexer_format.is_fp4, **store)
            return out, index_out
        raw_out_loc = meta.low_ratio.c1_out_loc  # the raw slot; c2 shifts it itself (metadata.md §3)
        if spec.ratio == 1:  # rows are independent: prefill is the decode op over every token
            return C.c1_decode_norm_rope_store(rows.projection, w.compress_norm, positions, raw_out_loc, EPS,
                                               w.rope_table, caches.compressed, page_size=spec.compressed_page_size,
                                               layout=spec.compressed_layout), None
        if is_decode or draft_len > 0:
            return self._c2(rows.projection, positions, x.token_rids, raw_out_loc, draft_len), None
        return self._c2_extend(batch, x, rows, meta), None

    def _c2(self, projection, positions, rids, raw_out_loc, draft_len) -> torch.Tensor:
        w = self.weights
        return C.c2_decode_or_verify_norm_rope_store(
            projection, self.caches.state, w.compress_norm, positions, rids, raw_out_loc, EPS, w.rope_table,
            self.caches.compressed, page_size=self.spec.compressed_page_size, ring_size=self.ring,
            draft_len=draft_len, layout=self.spec.compressed_layout)

    def _c2_extend(self, batch: StepBatch, x: StepInputs, rows: LayerRows, meta: StepMetadata) -> torch.Tensor:
        """An extend step's c2 rows in one call (compressors.md §5.5): each request's rows are contiguous, at
        consecutive positions."""
        w = self.weights
        lens = torch.tensor(batch.extend_lens, dtype=torch.int32)
        starts = torch.cumsum(lens, 0, dtype=torch.int32) - lens
        return C.c2_prefill_norm_rope_store(
            rows.projection, self.caches.state, w.compress_norm, meta.page.positions_casual, x.token_rids,
            meta.low_ratio.c1_out_loc, EPS, w.rope_table, self.caches.compressed, starts.to(self.device),
            lens.to(self.device), page_size=self.spec.compressed_page_size, ring_size=self.ring,
            layout=self.spec.compressed_layout)


class DecodeGraph:
    """``KVLayer.decode_step`` captured once in a CUDA graph; ``replay`` reruns it on whatever the decode
    buffers and tables hold now (capture_begin's warm-up runs on a side stream, as torch recommends)."""

    def __init__(self, layer: KVLayer):
        self.layer = layer
        saved = layer.caches.clone()  # warm-up and capture must leave the caches as they were
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer.decode_step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = layer.decode_step()
        for f in fields(LayerCaches):
            if getattr(saved, f.name) is not None:
                getattr(layer.caches, f.name).copy_(getattr(saved, f.name))

    def replay(self) -> StepResult:
        self.graph.replay()
        return StepResult(self.layer.decode_meta, *self.outputs)
