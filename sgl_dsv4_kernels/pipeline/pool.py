"""Host-side bookkeeping of an inference engine, shared by every layer of a model: request slots, full-KV
and sliding-window page allocation, the two lookup tables the kernels read (``req_to_token``,
``full_to_swa``), and the per-step tensors that describe a batch (``StepInputs``).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace
from typing import Dict, List, Optional

import torch

from .kinds import FULL_PAGE_SIZE


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes of the pools. Page 0 of each pool and request 0 are the reserved dummies that padded
    CUDA-graph rows point at (metadata.md §1.4, compressors.md §3.4); live requests never get them."""

    max_requests: int  # live request slots; rid 0 comes on top
    max_tokens: int  # per request: req_to_token width and RoPE table length
    num_full_pages: int  # 256-token pages of the full pool (page 0 = dummy)
    num_swa_pages: int  # pages of the sliding-window pool (page 0 = dummy)
    swa_page_size: int = 64  # divides 256 (prefix-match granularity, compressors.md §2.2)

    @property
    def num_request_slots(self) -> int:
        return self.max_requests + 1

    @property
    def num_full_slots(self) -> int:
        return self.num_full_pages * FULL_PAGE_SIZE

    @staticmethod
    def for_requests(max_requests: int, max_tokens: int, swa_page_size: int = 64, spare_pages: int = 2):
        """Enough pages for ``max_requests`` requests of ``max_tokens`` tokens, plus spares and the dummies."""
        full = max_requests * -(-max_tokens // FULL_PAGE_SIZE) + 1 + spare_pages
        swa = max_requests * -(-max_tokens // swa_page_size) + 1 + spare_pages
        return PoolGeometry(max_requests, max_tokens, full, swa, swa_page_size)


@dataclass
class StepInputs:
    """One step's batch as tensors. Request-level fields feed the c4/c128 planners; token-level fields
    (one row per query token, in request-major order) feed everything else. A decode step has one
    token per request; its padded rows use rid 0, seq_len 1, slot 0 (metadata.md §1.4)."""

    req_rids: torch.Tensor  # int64 [B]
    req_seq_lens: torch.Tensor  # int64 [B]: length after the step (prefix + extend)
    req_extend_lens: torch.Tensor  # int64 [B]
    token_rids: torch.Tensor  # int64 [N]
    token_seq_lens: torch.Tensor  # int64 [N]: position + 1 (causal length of the token)
    token_locs: torch.Tensor  # int64 [N]: full-pool slot req_to_token[rid, position]

    @property
    def num_tokens(self) -> int:
        return self.token_rids.shape[0]

    def to(self, device) -> "StepInputs":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


@dataclass
class StepBatch:
    """A step as the scheduler decides it: which requests, from which prefix, by how many tokens."""

    mode: str  # "prefill", "extend", "decode" or "verify"
    rids: List[int]
    prefix_lens: List[int]
    extend_lens: List[int]
    padded_rows: int = 0  # decode only: dummy rows after the live ones (CUDA-graph bucket)
    accept_lens: Optional[List[int]] = None  # verify only: tokens committed afterwards (>= 1 each)

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @property
    def draft_len(self) -> int:
        """Verify width D_v (every request verifies the same number of tokens), else 0."""
        return self.extend_lens[0] if self.mode == "verify" else 0

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens) + self.padded_rows

    @property
    def committed(self) -> List[int]:
        """Tokens each request commits: all of them, except rejected drafts of a verify."""
        return self.accept_lens if self.accept_lens is not None else self.extend_lens


class RequestPool:
    """Allocates request slots and pages, keeps the host tables and their device copies in step.

    Pages come from shuffled free lists, so a request's pages are scattered and freed pages are reused
    by later requests (their stale bytes stay in the caches until overwritten). SWA pages are
    page-aligned with positions (``swa % swa_page_size == p % swa_page_size``, compressors.md §2.2) and,
    for simplicity, cover a request's whole length: nothing is evicted when it leaves the window.
    """

    def __init__(self, geometry: PoolGeometry, device="cpu", seed: int = 0):
        self.geometry = g = geometry
        rng = random.Random(seed)
        self._free_rids = list(range(1, g.num_request_slots))
        self._free_full = list(range(1, g.num_full_pages))
        self._free_swa = list(range(1, g.num_swa_pages))
        rng.shuffle(self._free_full)
        rng.shuffle(self._free_swa)
        self._full_pages: Dict[int, List[int]] = {}
        self._swa_pages: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}  # committed tokens of each live request
        # Host tables; rid 0, full loc 0 and SWA page 0 stay 0 (the dummies).
        self.req_to_token = torch.zeros(g.num_request_slots, g.max_tokens, dtype=torch.int32)
        self.full_to_swa = torch.zeros(g.num_full_slots, dtype=torch.int64)
        # Device copies at fixed addresses (captured decode graphs read them); refreshed by sync_tables().
        self.device = torch.device(device)
        self.device_req_to_token = self.req_to_token.to(self.device)
        self.device_full_to_swa = self.full_to_swa.to(self.device)

    # ---- requests ----

    def admit(self) -> int:
        rid = self._free_rids.pop(0)
        self._full_pages[rid], self._swa_pages[rid] = [], []
        self.lengths[rid] = 0
        return rid

    def finish(self, rid: int) -> None:
        """Returns the request's pages to the free lists; its cache bytes are left as they are."""
        self._free_full += self._full_pages.pop(rid)
        self._free_swa += self._swa_pages.pop(rid)
        del self.lengths[rid]
        self.req_to_token[rid] = 0
        self._free_rids.append(rid)

    @property
    def live(self) -> List[int]:
        return sorted(self.lengths)

    def reserve(self, rid: int, length: int) -> None:
        """Gives positions [0, length) of ``rid`` full and SWA slots (allocating pages on demand)."""
        g = self.geometry
        if length > g.max_tokens:
            raise ValueError(f"request {rid}: {length} tokens exceed max_tokens={g.max_tokens}")
        full, swa = self._full_pages[rid], self._swa_pages[rid]
        start = len(full) * FULL_PAGE_SIZE
        while len(full) * FULL_PAGE_SIZE < length:
            full.append(self._free_full.pop())
        while len(swa) * g.swa_page_size < length:
            swa.append(self._free_swa.pop())
        end = len(full) * FULL_PAGE_SIZE
        if end > start:
            p = torch.arange(start, min(end, g.max_tokens))
            loc = torch.tensor(full)[p // FULL_PAGE_SIZE] * FULL_PAGE_SIZE + p % FULL_PAGE_SIZE
            self.req_to_token[rid, p] = loc.to(torch.int32)
        p = torch.arange(0, length)
        loc = self.req_to_token[rid, :length].to(torch.int64)
        self.full_to_swa[loc] = torch.tensor(swa)[p // g.swa_page_size] * g.swa_page_size + p % g.swa_page_size

    def sync_tables(self) -> None:
        """Copies the host tables into their device tensors in place (outside the decode step)."""
        self.device_req_to_token.copy_(self.req_to_token)
        self.device_full_to_swa.copy_(self.full_to_swa)

    def commit(self, batch: StepBatch) -> None:
        for rid, prefix, accepted in zip(batch.rids, batch.prefix_lens, batch.committed):
            self.lengths[rid] = prefix + accepted

    # ---- slots of committed tokens (what tests read back) ----

    def full_slots(self, rid: int, positions) -> torch.Tensor:
        return self.req_to_token[rid, torch.as_tensor(positions, dtype=torch.int64)].to(torch.int64)

    def swa_slots(self, rid: int, positions) -> torch.Tensor:
        return self.full_to_swa[self.full_slots(rid, positions)]

    # ---- a batch as tensors ----

    def step_inputs(self, batch: StepBatch) -> StepInputs:
        """Host tensors of ``batch`` (reserve() its tokens first)."""
        token_rids, token_pos = [], []
        for rid, prefix, extend in zip(batch.rids, batch.prefix_lens, batch.extend_lens):
            token_rids += [rid] * extend
            token_pos += range(prefix, prefix + extend)
        rids = torch.tensor(token_rids, dtype=torch.int64)
        pos = torch.tensor(token_pos, dtype=torch.int64)
        locs = self.req_to_token[rids, pos].to(torch.int64) if len(token_rids) else torch.zeros(0, dtype=torch.int64)
        pad = batch.padded_rows
        zeros = torch.zeros(pad, dtype=torch.int64)
        req_rids = torch.tensor(batch.rids, dtype=torch.int64)
        seq_lens = torch.tensor([p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)], dtype=torch.int64)
        return StepInputs(
            req_rids=torch.cat([req_rids, zeros]),
            req_seq_lens=torch.cat([seq_lens, torch.ones(pad, dtype=torch.int64)]),
            req_extend_lens=torch.cat([torch.tensor(batch.extend_lens, dtype=torch.int64),
                                       torch.ones(pad, dtype=torch.int64)]),
            token_rids=torch.cat([rids, zeros]),
            token_seq_lens=torch.cat([pos + 1, torch.ones(pad, dtype=torch.int64)]),
            token_locs=torch.cat([locs, zeros]),
        )
