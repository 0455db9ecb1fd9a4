"""Runs layers of the given kinds through a scenario: the driven layer (its decode step eager, replayed from
a CUDA graph, or compiled), optionally beside the pure-torch reference model and beside an eager twin, and
reports per step its time and the named checks of ``check.py``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch

from ..kv_layout import IndexerFormat
from ..reference.pipeline import ReferenceLayer
from .check import Check, compare_twins, compare_with_reference
from .kinds import LayerKind
from .layer import KVLayer, LayerWeights, StepResult
from .pool import RequestPool, StepBatch
from .scenario import DECODE_BATCH, VERIFY_WIDTH, Scenario, default_geometry, default_schedule

DECODE_MODES = ("eager", "graph", "compiled")


@dataclass
class StepReport:
    index: int
    batch: StepBatch
    kind: LayerKind
    seconds: float  # the driven layer's step, synchronized
    checks: List[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


class _Driven:
    """One layer kind in the session: the layer under test, its reference and its eager twin."""

    def __init__(self, kind, pool, device, decode_mode, with_reference, num_sms, seed, indexer_format):
        geometry = pool.geometry
        weights = LayerWeights.random(kind, geometry.max_tokens, torch.Generator().manual_seed(seed + 7))
        tables = (pool.device_req_to_token, pool.device_full_to_swa)
        kw = dict(decode_batch=DECODE_BATCH, verify_width=VERIFY_WIDTH, num_sms=num_sms, device=device,
                  indexer_format=indexer_format)
        self.kind, self.decode_mode = kind, decode_mode
        self.layer = KVLayer(kind, geometry, weights, tables, **kw)
        self.twin = KVLayer(kind, geometry, weights, tables, **kw) if decode_mode != "eager" else None
        self.reference = ReferenceLayer(kind, self.layer.caches.clone("cpu"), weights, ring=self.layer.ring,
                                        swa_page_size=geometry.swa_page_size, num_sms=self.layer.num_sms,
                                        indexer_fp4=self.layer.indexer_format.is_fp4) if with_reference else None
        self._graph = None
        self._compiled: Optional[Callable] = None

    def decode(self) -> StepResult:
        if self.decode_mode == "graph":
            if self._graph is None:
                self._graph = self.layer.capture_decode_graph()
            return self._graph.replay()
        if self.decode_mode == "compiled":
            if self._compiled is None:
                self._compiled = torch.compile(self.layer.decode_step, fullgraph=True)
            return StepResult(self.layer.decode_meta, *self._compiled())
        return self.layer.decode()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_session(kinds: Iterable[LayerKind], device="cpu", *, decode_mode: str = "eager", with_reference: bool = True,
                seed: int = 0, num_sms: int = 132, on_step: Optional[Callable[[StepReport], None]] = None,
                schedule=None, indexer_format: Optional[IndexerFormat] = None) -> List[StepReport]:
    """Drives every kind through ``schedule`` (default: the 52-step session) and returns one report per
    (step, kind). ``decode_mode`` != "eager" also runs an eager twin and compares it bit for bit."""
    if decode_mode not in DECODE_MODES:
        raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
    device = torch.device(device)
    pool = RequestPool(default_geometry(), device=device, seed=seed)
    scenario = Scenario(pool, default_schedule() if schedule is None else schedule, seed=seed)
    driven: Dict[LayerKind, _Driven] = {
        k: _Driven(k, pool, device, decode_mode, with_reference, num_sms, seed, indexer_format) for k in kinds}
    reports = []
    for index, batch in enumerate(scenario.steps()):
        inputs = pool.step_inputs(batch)
        for kind, d in driven.items():
            rows = scenario.rows(index, kind, batch)
            _synchronize(device)
            start = time.perf_counter()
            if batch.is_decode:
                d.layer.load_decode(inputs.to(device), rows.to(device))
                result = d.decode()
            else:
                result = d.layer.extend(batch, inputs, rows)
            _synchronize(device)
            report = StepReport(index, batch, kind, time.perf_counter() - start)
            if d.twin is not None:
                if batch.is_decode:
                    d.twin.load_decode(inputs.to(device), rows.to(device))
                    twin_result = d.twin.decode()
                else:
                    twin_result = d.twin.extend(batch, inputs, rows)
                report.checks += compare_twins(d.layer, result, d.twin, twin_result)
            if d.reference is not None:
                stored = (result.compressed.cpu(),
                          None if result.indexer_compressed is None else result.indexer_compressed.cpu())
                expected = d.reference.step(batch, inputs, rows, pool.req_to_token, pool.full_to_swa, stored)
                lengths = {**pool.lengths, **{rid: prefix + accepted for rid, prefix, accepted
                                              in zip(batch.rids, batch.prefix_lens, batch.committed)}}
                report.checks += compare_with_reference(d.layer, result, d.reference, expected, pool, lengths)
            reports.append(report)
            if on_step is not None:
                on_step(report)
    return reports
