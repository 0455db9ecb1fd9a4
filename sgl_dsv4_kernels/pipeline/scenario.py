"""A scripted serving session for the pipeline tests, the selftest and the benchmarks: requests of different
lengths arrive, prefill (some in chunks, mixed with one-token extends of running requests), decode in a
padded CUDA-graph bucket, verify speculative drafts with accepted and rejected tokens, and finish, so that
later requests reuse their pages. ``Scenario.steps`` does the host bookkeeping around each step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Tuple

import torch

from .kinds import LayerKind
from .layer import LayerRows
from .pool import PoolGeometry, RequestPool, StepBatch


@dataclass(frozen=True)
class Action:
    """A scheduler decision. prefill: new requests with their prompt chunk; extend: more tokens of running
    (or just-admitted) requests; decode / verify: every running request; finish: requests leave."""

    mode: str
    tokens: Dict[str, int] = field(default_factory=dict)  # request name -> tokens (prefill / extend)
    names: Tuple[str, ...] = ()  # finish

    @staticmethod
    def repeat(mode: str, times: int) -> List["Action"]:
        return [Action(mode) for _ in range(times)]


def default_schedule() -> List[Action]:
    """52 steps. The lengths put c128 and c4 boundaries inside decode and verify steps (b crosses 256, c 384,
    f 256 and 384), d arrives as a chunked prefill mixed with one-token extends, and three requests finish
    while others run."""
    A = Action
    return [
        A("prefill", {"a": 37, "b": 250, "c": 380}),
        *A.repeat("decode", 5),
        A("extend", {"d": 96, "a": 1, "b": 1, "c": 1}),  # chunked prefill mixed with running requests
        A("extend", {"d": 104}),
        *A.repeat("decode", 4),
        *A.repeat("verify", 3),
        *A.repeat("decode", 2),
        A("finish", names=("a",)),
        A("prefill", {"e": 129}),
        *A.repeat("decode", 3),
        *A.repeat("verify", 2),
        A("extend", {"b": 70, "e": 3}),
        *A.repeat("decode", 4),
        A("finish", names=("c",)),
        A("prefill", {"f": 255}),
        *A.repeat("decode", 4),
        *A.repeat("verify", 4),
        A("finish", names=("d",)),
        *A.repeat("decode", 6),
        A("extend", {"f": 130}),
        *A.repeat("decode", 3),
        *A.repeat("verify", 2),
        *A.repeat("decode", 3),
    ]


# The session's sizes: at most 4 requests run at once, so a 6-row decode bucket always has padded rows.
MAX_REQUESTS = 6
MAX_TOKENS = 640
DECODE_BATCH = 6
VERIFY_WIDTH = 4  # D_v, root included (sglang's speculative_num_draft_tokens)


def default_geometry() -> PoolGeometry:
    return PoolGeometry.for_requests(MAX_REQUESTS, MAX_TOKENS, swa_page_size=64)


class Scenario:
    """Turns a schedule into ``StepBatch`` es over ``pool``. Iterating ``steps()`` yields each batch after
    reserving its slots and refreshing the device tables; when the consumer asks for the next one, the batch
    is committed (accepted drafts only) and finished requests are freed."""

    def __init__(self, pool: RequestPool, schedule: List[Action], *, decode_batch: int = DECODE_BATCH,
                 verify_width: int = VERIFY_WIDTH, seed: int = 0):
        self.pool, self.schedule = pool, schedule
        self.decode_batch, self.verify_width, self.seed = decode_batch, verify_width, seed
        self.rid_of: Dict[str, int] = {}

    def steps(self) -> Iterator[StepBatch]:
        pool = self.pool
        for index, action in enumerate(self.schedule):
            if action.mode == "finish":
                for name in action.names:
                    pool.finish(self.rid_of.pop(name))
                continue
            batch = self._batch(index, action)
            for rid, prefix, extend in zip(batch.rids, batch.prefix_lens, batch.extend_lens):
                pool.reserve(rid, prefix + extend)
            pool.sync_tables()
            yield batch
            pool.commit(batch)

    def rows(self, batch_index: int, kind: LayerKind, batch: StepBatch) -> LayerRows:
        """The step's activations for a layer of ``kind``: the same for every consumer of the scenario."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + batch_index * 31 + list(LayerKind).index(kind))
        return LayerRows.random(kind, batch.num_tokens, g)

    def _batch(self, index: int, action: Action) -> StepBatch:
        pool = self.pool
        if action.mode in ("prefill", "extend"):
            for name in action.tokens:
                if name not in self.rid_of:
                    self.rid_of[name] = pool.admit()
            rids = [self.rid_of[name] for name in action.tokens]
            return StepBatch(action.mode, rids, [pool.lengths[r] for r in rids], list(action.tokens.values()))
        rids = [self.rid_of[name] for name in sorted(self.rid_of)]
        prefixes = [pool.lengths[r] for r in rids]
        if action.mode == "decode":
            return StepBatch("decode", rids, prefixes, [1] * len(rids), padded_rows=self.decode_batch - len(rids))
        # Accepted tokens rotate through 1 (every draft rejected) .. D_v (every draft accepted).
        d = self.verify_width
        accept = [(index + b) % d + 1 for b in range(len(rids))]
        return StepBatch("verify", rids, prefixes, [d] * len(rids), accept_lens=accept)
