"""Step-by-step comparisons of a driven layer: against the pure-torch reference model (exact where the specs
say so, their tolerances elsewhere) and against a twin layer run another way (CUDA graph, torch.compile),
bit for bit. Each comparison returns named ``Check`` results, so tests assert them and the selftest
prints them.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional

import torch

from ..cache import dequantize_k_cache_paged
from ..reference import dequantize_k_cache_paged as reference_dequantize
from ..reference.pipeline import ReferenceLayer, ReferenceStep
from .layer import KVLayer, LayerCaches, StepResult
from .pool import RequestPool

# compressors.md §4.5 (c4 / c128 outputs against fp32/fp64 math) and §8.3 (c1 / c2 latents).
POOLED_TOL = dict(atol=2e-5, rtol=2e-5)
LATENT_TOL = dict(atol=2.0**-14, rtol=2.0**-7)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.detach().cpu(), b.detach().cpu()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _close(a: torch.Tensor, b: torch.Tensor, tol: dict) -> str:
    """'' when close, else the worst error."""
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    if a.shape != b.shape:
        return f"shape {list(a.shape)} != {list(b.shape)}"
    err = (a - b).abs() - tol["rtol"] * b.abs()
    worst = float(err.max()) if err.numel() else 0.0
    return "" if worst <= tol["atol"] else f"max excess error {worst:.3g}"


def _first_difference(items) -> str:
    bad = [name for name, ok in items if not ok]
    return "" if not bad else "differ: " + ", ".join(bad)


def _metadata_items(result: StepResult, expected) -> list:
    """(name, equal) for every metadata tensor; ``expected`` is a ReferenceStep or another StepResult's
    metadata."""
    got = result.metadata
    items = [(f"page.{k}", _same(v, getattr(expected.page, k))) for k, v in got.page._asdict().items()]
    items.append(("swa_loc", _same(got.swa_loc, expected.swa_loc)))
    for group in ("compression", "low_ratio"):
        mine, theirs = getattr(got, group), getattr(expected, group)
        if mine is not None:
            items += [(f"{group}.{k}", _same(v, getattr(theirs, k))) for k, v in mine._asdict().items()]
    if got.plan is not None:
        plan, plan_w = expected.plan if isinstance(expected, ReferenceStep) else (expected.plan.plan,
                                                                                    expected.plan.plan_w)
        items += [("plan", _same(got.plan.plan, plan)), ("plan_w", _same(got.plan.plan_w, plan_w))]
    items.append(("mqa_schedule", _same(got.mqa_schedule, expected.mqa_schedule)))
    return items


def live_slots(layer: KVLayer, pool: RequestPool, lengths: Dict[int, int]):
    """Slots holding the committed tokens of requests of ``lengths`` (rid -> tokens): (sliding-window slots,
    compressed-cache slots); the token closing a group of r writes compressed slot raw_slot // r
    (metadata.md §1.1)."""
    r = layer.spec.ratio
    swa, compressed = [], []
    for rid, length in lengths.items():
        if length == 0:
            continue
        swa.append(pool.swa_slots(rid, range(length)))
        closing = torch.arange(r - 1, max(length, r - 1), r)  # c2: odd positions; c1: every position
        compressed.append(pool.full_slots(rid, closing) // r)
    empty = torch.zeros(0, dtype=torch.int64)
    return (torch.cat(swa) if swa else empty), (torch.cat(compressed) if compressed else empty)


def _dequantized_equal(cache, ref_cache, slots, page_size, layout) -> Check:
    got = dequantize_k_cache_paged(cache, slots.to(cache.device), page_size, layout=layout).cpu().view(-1, 512)
    want = reference_dequantize(ref_cache, slots, page_size, layout=int(layout)).view(-1, 512)
    differing = int((got.view(torch.int16) != want.view(torch.int16)).any(dim=1).sum())
    blank = int((got.float().abs().amax(dim=1) == 0).sum()) if slots.numel() else 0  # a live row never written
    detail = f"{slots.numel()} rows" + (f", {differing} differ" if differing else "") + \
        (f", {blank} all zero" if blank else "")
    return Check("", differing == 0 and blank == 0, detail)


def compare_with_reference(layer: KVLayer, result: StepResult, ref: ReferenceLayer, expected: ReferenceStep,
                           pool: RequestPool, lengths: Dict[int, int]) -> List[Check]:
    """Everything a step produced against the reference model's step; ``lengths``: committed tokens of the
    live requests once this step's accepted tokens count."""
    spec = layer.spec
    d = _first_difference(_metadata_items(result, expected))
    checks = [Check("metadata", not d, d)]
    # Compressor outputs, within the specs' tolerances.
    if spec.ratio in (4, 128):
        err = _close(result.compressed, expected.compressed, POOLED_TOL)
        if spec.has_indexer:
            err += " " + _close(result.indexer_compressed, expected.indexer_compressed, POOLED_TOL)
    else:
        err = _close(result.compressed, expected.compressed, LATENT_TOL)
    err = err.strip()
    checks.append(Check("compressor output", not err, err))
    # The same outputs against the ring-free truth from the requests' committed rows: the reference model keeps
    # rings as the driver does, so only this catches a mistake they share (stale or missing ring rows).
    live = expected.truth.shape[0]
    tol = POOLED_TOL if spec.ratio in (4, 128) else LATENT_TOL
    err = _close(result.compressed[:live], expected.truth, tol)
    if spec.has_indexer:
        err += " " + _close(result.indexer_compressed[:live], expected.indexer_truth, tol)
    err = err.strip()
    checks.append(Check("compressor output vs history", not err, err))
    # Cache and state bytes, exactly; page 0 / owner 0 belong to padded rows (unspecified contents).
    checks.append(_caches_equal(layer.caches, ref.caches, layer.ring))
    if spec.ratio in (4, 128):
        pools = [p for p in (layer.caches.state, layer.caches.index_state) if p is not None]
        checks.append(Check("state pad page", all(_pad_page_intact(p, spec.ratio) for p in pools)))
    # The live rows read back through the dequantizer.
    swa_slots, compressed_slots = live_slots(layer, pool, lengths)
    c = _dequantized_equal(layer.caches.swa, ref.caches.swa, swa_slots, layer.geometry.swa_page_size,
                           spec.swa_layout)
    checks.append(Check("dequantized SWA rows", c.ok, c.detail))
    c = _dequantized_equal(layer.caches.compressed, ref.caches.compressed, compressed_slots,
                           spec.compressed_page_size, spec.compressed_layout)
    checks.append(Check("dequantized compressed rows", c.ok, c.detail))
    return checks


def _pad_page_intact(state: torch.Tensor, ratio: int) -> bool:
    """The trailing page of a c4/c128 pool still holds kv 0, score -inf (no kernel writes it, compressors.md §2.3)."""
    pad = state[-ratio:].cpu()
    score_start = pad.shape[1] // 2  # c4 rows are (kv_ov, kv, s_ov, s), c128 rows (kv, s)
    return bool(torch.all(pad[:, :score_start] == 0)) and bool(torch.all(pad[:, score_start:] == float("-inf")))


def _caches_equal(mine: LayerCaches, theirs: LayerCaches, ring: Optional[int],
                  name: str = "cache and state bytes") -> Check:
    items = []
    for f in fields(LayerCaches):
        a, b = getattr(mine, f.name), getattr(theirs, f.name)
        if a is None:
            continue
        skip = ring if f.name in ("state", "index_state") else 1  # owner 0 / page 0
        items.append((f.name, _same(a[skip:], b[skip:])))
    d = _first_difference(items)
    return Check(name, not d, d)


def compare_twins(layer: KVLayer, result: StepResult, twin: KVLayer, twin_result: StepResult) -> List[Check]:
    """Two layers fed the same steps, one of them run another way: everything bit for bit."""
    items = _metadata_items(result, twin_result.metadata)
    items += [("compressed", _same(result.compressed, twin_result.compressed)),
              ("indexer_compressed", _same(result.indexer_compressed, twin_result.indexer_compressed))]
    d = _first_difference(items)
    # Named apart from the reference checks, so that a step's tally counts each check once.
    return [Check("twin: metadata and outputs", not d, d),
            _caches_equal(layer.caches, twin.caches, layer.ring, "twin: cache and state bytes")]
