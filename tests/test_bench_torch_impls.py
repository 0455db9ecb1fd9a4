"""The benchmarks' idiomatic torch baselines (benchmarks/torch_impls_compress.py) against the library ops on
CPU: the planner baselines must produce byte-identical plans on the benchmark's kind of inputs (distinct
rids, positive lengths; bench_compress.py `_planners`), plus variants that reach every branch; the
compressor baselines must match compress_forward within fp32 tolerance. CPU only, no benchmark runs.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import sgl_dsv4_kernels as dsv4

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # benchmarks/ is a package beside sgl_dsv4_kernels, not installed
    sys.path.insert(0, REPO)

from benchmarks import torch_impls_compress as torch_impls  # noqa: E402

T = 4096  # req_to_token columns, as in the benchmark
F = 1 << 20  # full_to_swa entries


def _kwargs(ratio, ring, sps, req_ring):
    if ratio == 4 and not req_ring:
        return dict(compress_ratio=4, ring_size=ring, swa_page_size=sps)
    return dict(compress_ratio=ratio, ring_size=ring, use_req_ring=True)


def _inputs(ratio, ring, bs, seed, *, sps=256, req_ring=None, lens="bench", hostile=False):
    """(rids, old seq lens, req_to_token, full_to_swa, planner kwargs) as bench_compress `_planners` builds
    them: rids a permutation of 1..bs, lengths in [256, T), random tables. lens="short": lengths in [0, 40),
    covering L < 8 and (decode) L <= 0; "edge": lengths in [T - 12, T + 2), so positions reach past
    req_to_token's T columns and those paged lookups fail. `hostile`: some table entries out of range or
    negative (not just -1: swa = -1 happens to give slot -1), so lookups fail at every stage."""
    gen = torch.Generator().manual_seed(1000 * seed + 7 * bs + ratio)
    req_ring = ratio == 128 if req_ring is None else req_ring
    rids = torch.randperm(bs, generator=gen) + 1
    low, high = {"bench": (256, T), "short": (0, 40), "edge": (T - 12, T + 2)}[lens]
    seq = torch.randint(low, high, (bs,), generator=gen)
    r2t = torch.randint(0, F, (bs + 1, T), generator=gen, dtype=torch.int32)
    f2s = torch.randint(0, F, (F,), generator=gen, dtype=torch.int32)
    if hostile:
        r2t[torch.rand(r2t.shape, generator=gen) < 0.2] = -3
        r2t[torch.rand(r2t.shape, generator=gen) < 0.2] = F + 5
        neg = torch.rand(f2s.shape, generator=gen) < 0.2
        f2s[neg] = -torch.randint(1, 1000, (int(neg.sum()),), generator=gen, dtype=torch.int32)
    if req_ring:  # request rings: the benchmark passes no tables (req_to_token would only bound rid)
        r2t = f2s = None
    return rids, seq, r2t, f2s, _kwargs(ratio, ring, sps, req_ring)


def _check_decode(fn, rids, seq, r2t, f2s, kw):
    ours = dsv4.plan_compress_decode(rids, seq, r2t, f2s, **kw).plan
    theirs = fn(rids, seq, r2t, f2s, **kw)
    assert theirs.dtype == torch.uint8 and theirs.shape == ours.shape
    assert torch.equal(theirs, ours), "DecodePlan bytes differ"


def _check_verify(fn, rids, seq, r2t, f2s, kw, draft):
    """The benchmark's verify call: every request extends by `draft`, seq_lens = old + draft, graph rows."""
    bs = rids.shape[0]
    ext = torch.full((bs,), draft)
    ours = dsv4.plan_compress_prefill(rids, seq + ext, ext, r2t, f2s, num_q_tokens=bs * draft, use_cuda_graph=True,
                                      **kw)
    plan_c, plan_w = fn(rids, seq + ext, r2t, f2s, draft=draft, **kw)
    assert plan_c.dtype == plan_w.dtype == torch.uint8
    assert plan_c.shape == (bs * draft, 16) and plan_w.shape == (bs * draft, 8)
    assert torch.equal(plan_c, ours.plan), "CompressPlan bytes differ"
    assert torch.equal(plan_w, ours.plan_w), "WritePlan bytes differ"


BENCH_CASES = [(4, 16), (128, 256)]  # (ratio, ring): c4 paged, c128 request rings, as in `_planners`


@pytest.mark.parametrize("ratio,ring", BENCH_CASES)
@pytest.mark.parametrize("bs", [1, 8, 64, 300])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planners_benchmark_inputs(ratio, ring, bs, seed):
    rids, seq, r2t, f2s, kw = _inputs(ratio, ring, bs, seed)
    _check_decode(torch_impls.plan_decode, rids, seq, r2t, f2s, kw)
    _check_verify(torch_impls.plan_prefill_verify, rids, seq, r2t, f2s, kw, draft=4)


@pytest.mark.parametrize("ratio,ring,sps,req_ring", [
    (4, 16, 256, False), (4, 16, 16, False), (4, 8, 16, False),  # paged; ring 8: no mtp_pad, the band decides
    (4, 16, 0, True), (4, 8, 0, True), (128, 256, 0, True), (128, 128, 0, True)])
@pytest.mark.parametrize("draft", [1, 2, 4, 8, 13, 140])  # 13, 140: past c4 ring 16's / c128 ring 256's mtp_pad
@pytest.mark.parametrize("lens", ["bench", "short", "edge"])
def test_planners_variants(ratio, ring, sps, req_ring, draft, lens):
    rids, seq, r2t, f2s, kw = _inputs(ratio, ring, 37, draft, sps=sps, req_ring=req_ring, lens=lens)
    _check_decode(torch_impls.plan_decode, rids, seq, r2t, f2s, kw)
    _check_verify(torch_impls.plan_prefill_verify, rids, seq, r2t, f2s, kw, draft)


@pytest.mark.parametrize("lens", ["bench", "short", "edge"])
def test_planners_failed_lookups(lens):
    """Paged c4 with table entries out of range: -1 write_loc and pages, entries kept (§3.2)."""
    rids, seq, r2t, f2s, kw = _inputs(4, 16, 200, 5, sps=16, lens=lens, hostile=True)
    _check_decode(torch_impls.plan_decode, rids, seq, r2t, f2s, kw)
    _check_verify(torch_impls.plan_prefill_verify, rids, seq, r2t, f2s, kw, draft=4)


def test_planners_request_ring_with_table_and_int32():
    """Request rings given req_to_token (it bounds rid: the last rid is past its rows), int32 lengths and rids."""
    rids, seq, r2t, _, kw = _inputs(4, 16, 50, 3, req_ring=False)
    kw = _kwargs(128, 256, 0, True)
    r2t = r2t[:40]  # rids 40..50 fail the bound
    rids, seq = rids.int(), seq.int()
    _check_decode(torch_impls.plan_decode, rids, seq, r2t, None, kw)
    _check_verify(torch_impls.plan_prefill_verify, rids, seq, r2t, None, kw, draft=4)


def test_verify_out_variant_matches():
    """The benchmark calls plan_compress_prefill with out=(plan_c, plan_w): the same bytes, stale rows rewritten."""
    rids, seq, r2t, f2s, kw = _inputs(4, 16, 64, 9)
    bs, draft = 64, 4
    ext = torch.full((bs,), draft)
    out = (torch.full((bs * draft, 16), 0xAB, dtype=torch.uint8), torch.full((bs * draft, 8), 0xAB, dtype=torch.uint8))
    dsv4.plan_compress_prefill(rids, seq + ext, ext, r2t, f2s, num_q_tokens=bs * draft, out=out, **kw)
    plan_c, plan_w = torch_impls.plan_prefill_verify(rids, seq + ext, r2t, f2s, draft=draft, **kw)
    assert torch.equal(plan_c, out[0]) and torch.equal(plan_w, out[1])


@pytest.mark.parametrize("ratio,ring", BENCH_CASES)
def test_planners_compiled_dynamic(ratio, ring):
    """Through torch.compile(dynamic=True, fullgraph=True), as the benchmark compiles them (fullgraph: no
    graph break, so no host sync); two batch sizes on one compiled graph. 10-25 s of CPU compilation each
    when the inductor cache is cold."""
    plan_decode = torch.compile(torch_impls.plan_decode, dynamic=True, fullgraph=True)
    plan_verify = torch.compile(torch_impls.plan_prefill_verify, dynamic=True, fullgraph=True)
    for bs in (3, 300):
        rids, seq, r2t, f2s, kw = _inputs(ratio, ring, bs, 11, lens="edge" if bs == 3 else "bench")
        _check_decode(plan_decode, rids, seq, r2t, f2s, kw)
        _check_verify(plan_verify, rids, seq, r2t, f2s, kw, draft=4)


# ---- compressor baselines against compress_forward ----

def _state(ratio, head_dim, owners, ring, gen):
    """A pool with random rows below its pad page (both sides read the same rows, whatever they hold)."""
    state = dsv4.alloc_compress_state(ratio, head_dim, owners, ring)
    state[:-ratio] = torch.randn(state[:-ratio].shape, generator=gen)
    return state


def _compare(ours, theirs, state_ours, state_theirs):
    torch.testing.assert_close(theirs, ours, rtol=2e-5, atol=2e-5)
    assert torch.equal(state_theirs, state_ours), "state rows differ"


@pytest.mark.parametrize("ratio,head_dim,ring", [(4, 128, 16), (128, 512, 256)])
def test_compress_decode_baseline(ratio, head_dim, ring):
    """Request rings as bench_compress `_decode_set`; lengths chosen so that about half the rows emit."""
    gen = torch.Generator().manual_seed(ratio)
    bs, W = 16, (4 if ratio == 4 else 2) * head_dim
    state = _state(ratio, head_dim, bs + 1, ring, gen)
    rids = torch.randperm(bs, generator=gen) + 1
    seq = torch.randint(1, 4 * ring, (bs,), generator=gen)
    seq[::2] = seq[::2] // ratio * ratio + ratio  # emitting rows (seq % ratio == 0), including L = 4 for c4
    if ratio == 4:
        seq[0] = 4
    ape = torch.randn(8 if ratio == 4 else 128, head_dim, generator=gen)
    x = torch.randn(bs, W, generator=gen)
    plan = dsv4.plan_compress_decode(rids, seq, compress_ratio=ratio, ring_size=ring, use_req_ring=True)
    s_ours, s_theirs = state.clone(), state.clone()
    ours = dsv4.compress_forward(s_ours, x, ape, plan, head_dim=head_dim)
    theirs = torch_impls.compress_decode(s_theirs, x, ape, plan.plan, head_dim, ratio)
    assert bool((ours != 0).any(dim=1)[::2].all())  # the emitting rows really emitted
    _compare(ours, theirs, s_ours, s_theirs)


@pytest.mark.parametrize("ratio,head_dim,ring", [(4, 128, 16), (128, 512, 256)])
def test_compress_prefill_baseline(ratio, head_dim, ring):
    """A chunked prefill of three requests (one from scratch, two resuming mid-chunk, so entries read the
    ring), compact host plans as in bench_compress `_prefill_plans`."""
    gen = torch.Generator().manual_seed(100 + ratio)
    W = (4 if ratio == 4 else 2) * head_dim
    state = _state(ratio, head_dim, 4, ring, gen)
    prefixes = [0, 37, 3 * ratio + 1] if ratio == 4 else [0, 200, 300]
    extends = [50, 20, 9] if ratio == 4 else [260, 150, 90]
    rids = torch.tensor([2, 3, 1])
    seq = torch.tensor([p + e for p, e in zip(prefixes, extends)])
    ext = torch.tensor(extends)
    nq = sum(extends)
    ape = torch.randn(8 if ratio == 4 else 128, head_dim, generator=gen)
    x = torch.randn(nq, W, generator=gen)
    plan = dsv4.plan_compress_prefill(rids, seq, ext, num_q_tokens=nq, compress_ratio=ratio, ring_size=ring,
                                      use_req_ring=True)
    s_ours, s_theirs = state.clone(), state.clone()
    ours = dsv4.compress_forward(s_ours, x, ape, plan, head_dim=head_dim)
    theirs = torch_impls.compress_prefill(s_theirs, x, ape, plan.plan, plan.plan_w, head_dim, ratio)
    assert ours.shape[0] > 3 and bool((ours != 0).any(dim=1).all())
    _compare(ours, theirs, s_ours, s_theirs)
