"""End-to-end tests of one attention layer's KV side (sgl_dsv4_kernels.pipeline, issue 7): a 52-step serving
session (prefill, chunked extend mixed with running requests, decode in a padded CUDA-graph bucket,
speculative verify with accepted and rejected drafts, requests that finish and free their pages) for every
layer kind, checked after every step against the pure-torch reference model; the decode step replayed from
one CUDA graph, and compiled with torch.compile(fullgraph=True), against an eager twin.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels.pipeline import (KVLayer, LayerKind, LayerWeights, RequestPool, StepBatch, default_schedule,
                                       run_session)
from sgl_dsv4_kernels.pipeline import layer as layer_module
from sgl_dsv4_kernels.pipeline.scenario import DECODE_BATCH, VERIFY_WIDTH, default_geometry

torch.set_flush_denormal(False)

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]
KINDS = list(LayerKind)


def failures(reports):
    return [f"step {r.index} ({r.batch.mode}) {r.kind.value}: {c.name}: {c.detail}"
            for r in reports for c in r.checks if not c.ok]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small tensors: the thread pool costs more than it gains here
    yield
    torch.set_num_threads(threads)


def test_session_covers_the_issue():
    """The scripted session is what the tests claim: 50+ steps of every mode, padded decode rows, verify
    steps that accept every draft and steps that reject all of them, requests that finish mid-session."""
    schedule = default_schedule()
    steps = [a for a in schedule if a.mode != "finish"]
    assert len(steps) >= 50
    assert {a.mode for a in steps} == {"prefill", "extend", "decode", "verify"}
    assert sum(a.mode == "finish" for a in schedule) >= 3
    reports = run_session([LayerKind.V41_C1], with_reference=False)
    batches = [r.batch for r in reports]
    assert all(b.padded_rows > 0 for b in batches if b.is_decode)
    accepts = [a for b in batches if b.mode == "verify" for a in b.accept_lens]
    assert 1 in accepts and VERIFY_WIDTH in accepts and max(len(b.rids) for b in batches if b.is_decode) < DECODE_BATCH
    assert any(b.mode == "extend" and len(set(b.extend_lens)) > 1 for b in batches), "chunk mixed with 1-token rows"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_every_step_matches_the_reference_model(device, kind):
    """After every step: metadata and plans equal the reference oracles; compressor outputs within the specs'
    tolerances; SWA, compressed and indexer caches and the state rings equal byte for byte (writers fed the
    kernels' own compressor rows); live rows read back through dequantize_k_cache_paged equal the
    reference dequantizer bit for bit and none is blank."""
    reports = run_session([kind], device)
    assert len(reports) >= 50
    assert not failures(reports), "\n".join(failures(reports)[:20])
    names = {c.name for c in reports[0].checks}
    assert {"metadata", "compressor output", "cache and state bytes", "dequantized SWA rows",
            "dequantized compressed rows"} <= names


@pytest.mark.parametrize("device", DEVICES)
def test_c4_layer_with_the_fp4_indexer_cache(device):
    reports = run_session([LayerKind.V4_C4], device, schedule=default_schedule()[:16],
                          indexer_format=dsv4.IndexerFormat.FP4)
    assert not failures(reports), "\n".join(failures(reports)[:20])


def test_reference_model_detects_a_shifted_rope_position(monkeypatch):
    """The comparison is not vacuous: a driver that rotates the sliding-window K one position late fails."""
    original = layer_module.fused_k_norm_rope_flashmla

    def late(kv, weight, eps, freqs, positions, *args, **kwargs):
        return original(kv, weight, eps, freqs, positions + 1, *args, **kwargs)

    monkeypatch.setattr(layer_module, "fused_k_norm_rope_flashmla", late)
    reports = run_session([LayerKind.V4_C128], schedule=default_schedule()[:3])
    bad = {c.name for r in reports for c in r.checks if not c.ok}
    assert {"cache and state bytes", "dequantized SWA rows"} <= bad


def test_decode_step_compiled_fullgraph_equals_eager():
    """torch.compile(fullgraph=True) of each kind's decode step (no graph break, so no host read), equal bit
    for bit to an eager twin at every step; one compilation per layer (none as the inputs change); the
    generated code copies no cache or buffer."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    reports, codes = run_and_get_code(run_session, KINDS, "cpu", decode_mode="compiled", with_reference=False)
    assert not failures(reports), "\n".join(failures(reports)[:20])
    assert len(codes) == len(KINDS), "a decode step was compiled more than once"
    copies = re.findall(r"\bclone\(|\bcopy_\(", "\n".join(codes))
    assert not copies, f"compiled decode steps copy tensors: {copies}"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_decode_step_compiled_fullgraph_equals_eager_cuda():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    reports, codes = run_and_get_code(run_session, KINDS, "cuda", decode_mode="compiled", with_reference=False)
    assert not failures(reports), "\n".join(failures(reports)[:20])
    assert len(codes) == len(KINDS), "a decode step was compiled more than once"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_decode_graph_captured_once_replayed_every_step(kind, monkeypatch):
    """The decode step is captured once and replayed for every later decode step with new inputs, tables and
    padded rows: each replay equals an eager twin bit for bit and the reference model, allocates nothing
    and never syncs; eager decode steps never sync either."""
    captures = []
    original_init = layer_module.DecodeGraph.__init__
    original_replay = layer_module.DecodeGraph.replay
    original_step = KVLayer.decode_step

    def counting_init(self, layer):
        captures.append(layer)
        original_init(self, layer)

    def checked_replay(self):
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = original_replay(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == allocated, "a replay allocated"
        return result

    def sync_free_step(self):
        if torch.cuda.is_current_stream_capturing():
            return original_step(self)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original_step(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(layer_module.DecodeGraph, "__init__", counting_init)
    monkeypatch.setattr(layer_module.DecodeGraph, "replay", checked_replay)
    monkeypatch.setattr(KVLayer, "decode_step", sync_free_step)
    reports = run_session([kind], "cuda", decode_mode="graph")
    assert not failures(reports), "\n".join(failures(reports)[:20])
    assert len(captures) == 1
    assert sum(r.batch.is_decode for r in reports) >= 30


def _small_layer(kind, device="cpu", **kw):
    g = default_geometry()
    pool = RequestPool(g, device=device)
    weights = LayerWeights.random(kind, g.max_tokens, torch.Generator().manual_seed(1))
    return KVLayer(kind, g, weights, (pool.device_req_to_token, pool.device_full_to_swa), device=device, **kw), pool


@pytest.mark.parametrize("device", DEVICES)
def test_decode_buffers_keep_their_address(device):
    """Graph replay relies on it: every decode step writes its metadata into the same tensors."""
    layer, _ = _small_layer(LayerKind.V4_C4, device, decode_batch=4)
    meta = layer.decode_meta
    buffers = (meta.swa_loc, meta.plan.plan, meta.page.page_table, meta.compression.c4_out_loc, meta.mqa_schedule)
    pointers = [t.data_ptr() for t in buffers]
    for _ in range(2):
        result = layer.decode()
        assert result.metadata is meta
    assert pointers == [t.data_ptr() for t in buffers]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_two_decode_batches_over_one_layer_equal_one_batch_of_both(device, kind):
    """`another_decode_batch` shares the caches and nothing else: two half batches decoded one after the
    other write the same caches and return the same compressor outputs as one layer decoding all rows."""
    g = default_geometry()
    pool = RequestPool(g, device=device)
    rids = [pool.admit() for _ in range(6)]
    gen = torch.Generator().manual_seed(3)
    for rid in rids:
        length = int(torch.randint(300, g.max_tokens, (1,), generator=gen))
        pool.reserve(rid, length)
        pool.lengths[rid] = length - 1
    pool.sync_tables()
    weights = LayerWeights.random(kind, g.max_tokens, torch.Generator().manual_seed(1))
    tables = (pool.device_req_to_token, pool.device_full_to_swa)
    whole = KVLayer(kind, g, weights, tables, decode_batch=6, device=device)
    first = KVLayer(kind, g, weights, tables, decode_batch=3, device=device)
    second = first.another_decode_batch()
    assert second.caches is first.caches and second.decode_inputs is not first.decode_inputs
    rows = layer_module.LayerRows.random(kind, 6, gen)

    def load(layer, part):
        step = StepBatch("decode", [rids[i] for i in part], [pool.lengths[rids[i]] for i in part], [1] * len(part))
        picked = layer_module.LayerRows(*(None if t is None else t[part] for t in (rows.kv, rows.projection,
                                                                                 rows.index_projection)))
        layer.load_decode(pool.step_inputs(step).to(device), picked.to(device))

    load(whole, list(range(6)))
    load(first, [0, 1, 2])
    load(second, [3, 4, 5])
    expected = whole.decode_step()
    halves = [first.decode_step(), second.decode_step()]
    for i, t in enumerate(expected):
        if t is not None:
            assert torch.equal(torch.cat([h[i] for h in halves]), t)
    for field in dataclasses.fields(layer_module.LayerCaches):
        mine, theirs = getattr(first.caches, field.name), getattr(whole.caches, field.name)
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), field.name
    assert first.caches.swa.any(), "the steps wrote nothing"


def test_rings_follow_the_verify_width_and_decode_batches_are_checked():
    for kind, ratio in ((LayerKind.V4_C4, 4), (LayerKind.V4_C128, 128), (LayerKind.V41_C2, 2)):
        layer, pool = _small_layer(kind, decode_batch=2, verify_width=10)
        assert layer.ring == dsv4.state_ring_size(ratio, 10)
    with pytest.raises(ValueError, match="decode batch"):
        layer.load_decode(pool.step_inputs(StepBatch("decode", [], [], [], padded_rows=3)), layer.decode_rows)
