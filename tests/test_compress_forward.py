"""Tests of compress_forward, c4 and c128 (compressors.md §4, §8.1, §8.3): fp64 truth, exact state rows and
the pad page over prefill / decode / extend / verify sequences, the plan -> compress -> store -> dequant
pipeline, validation, opcheck, compile without state clones, CUDA-graph replay and PDL on/off."""
from __future__ import annotations

import os
import re
import textwrap

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import reference as ref

from compress_cases import DEVICES, HAS_CUDA, Engine, capacity, gen, width_of
from samples import overlapping_rows, run_with_pdl_off_and_on


# (ratio, head_dim, paged, sps): c4 in paged mode (sps 256 and 64) and request rings, D 512 and 128;
# c128 in request rings.
C4_MODES = [(512, True, 256), (512, True, 64), (512, False, 0), (128, True, 256), (128, False, 0)]
C4_IDS = ["D512-paged256", "D512-paged64", "D512-reqring", "D128-paged256", "D128-reqring"]


def c4_engines(device, **kw):
    for (D, paged, sps), name in zip(C4_MODES, C4_IDS):
        for ring in (8, 16):
            yield f"{name}-ring{ring}", lambda D=D, paged=paged, sps=sps, ring=ring: Engine(
                4, D, ring, paged=paged, sps=sps or 256, device=device, **kw)


def c128_engines(device, **kw):
    for ring in (128, 256):
        yield f"ring{ring}", lambda ring=ring: Engine(128, 512, ring, paged=False, device=device, **kw)


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------
# §8.1 scenarios against the fp64 truth


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_from_scratch(device, ratio):
    lengths = (4, 5, 8, 32, 256, 1024) if ratio == 4 else (128, 129, 256, 512, 1000)
    engines = c4_engines(device) if ratio == 4 else c128_engines(device)
    for name, make in engines:
        for L in lengths:
            e = make()
            e.extend([1], [L])


@pytest.mark.parametrize("device", DEVICES)
def test_c128_prefill_many_windows(device):
    """A c128 prefill of 70 windows (one warp per window on CUDA, where short plans share a window among
    warps), then an extend that reads the ring: outputs against the fp64 truth, state rows exact."""
    e = Engine(128, 512, 256, paged=False, num_requests=2, max_tokens=9216, device=device, seed=("c128-many",))
    e.extend([1, 2], [128 * 70 + 5, 128 * 2])
    e.extend([2, 1], [128 * 66 + 3, 130])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_then_decode_across_boundaries(device, ratio):
    if ratio == 4:
        prefixes, steps, engines = (4, 256), 9, c4_engines(device)
    else:
        prefixes, steps, engines = (0, 128, 256), 130, c128_engines(device)
    for name, make in engines:
        e = make()
        rids = list(range(1, len(prefixes) + 1))
        live = [(r, p) for r, p in zip(rids, prefixes) if p > 0]
        if live:
            e.extend([r for r, _ in live], [p for _, p in live])
        for _ in range(steps):
            e.decode(rids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_prefill_then_extend_every_buffer_len(device, ratio):
    """Every (prefix, extend) pair is a request of one batch, so every buffer_len value is checked."""
    if ratio == 4:
        prefixes, extends, engines = (256, 257, 258, 259, 512, 768), (1, 3, 4, 32), c4_engines
    else:
        prefixes, extends, engines = (120, 128, 129, 191, 255, 256), (8, 128, 256), c128_engines
    pairs = [(p, x) for p in prefixes for x in extends]
    for name, make in engines(device, num_requests=len(pairs), max_tokens=1024):
        e = make()
        rids = list(range(1, len(pairs) + 1))
        e.extend(rids, [p for p, _ in pairs])
        out = e.extend(rids, [x for _, x in pairs])
        lens = ref.unpack_plan(dsv4.plan_compress_prefill(
            torch.tensor(rids), torch.tensor([p + x for p, x in pairs]), torch.tensor([x for _, x in pairs]),
            e.req_to_token, e.full_to_swa, num_q_tokens=sum(x for _, x in pairs), **e.plan_kwargs()).plan,
            "compress")["buffer_len"]
        want = set(range(8)) if ratio == 4 else {0, 1, 63, 120, 127}
        assert want <= set(lens.tolist()), name
        assert out.shape[1] == e.D


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_multibatch_plan_order(device, ratio):
    lengths = (8, 256, 260, 1023) if ratio == 4 else (128, 300, 512)
    engines = c4_engines(device) if ratio == 4 else c128_engines(device)
    for name, make in engines:
        e = make()
        rids = [3, 1, 4, 2][: len(lengths)]
        e.extend(rids, list(lengths))
        e.extend(rids, [5, 0, 13, 1][: len(lengths)])  # mixed extends, one request idle


def test_c128_all_residues_cpu():
    """prefix 128 + k for every k in [0, 128), extend 128: buffer_len k appears once per residue."""
    e = Engine(128, 512, 256, paged=False, num_requests=128, max_tokens=512, seed=("residues",))
    rids = list(range(1, 129))
    e.extend(rids, [128 + k for k in range(128)], check_reference_plan=False)
    e.extend(rids, [128] * 128, check_reference_plan=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sps", [256, 64])
@pytest.mark.parametrize("ring", [8, 16])
def test_page_tail_rows_and_resume_at_swa_page_edge(device, sps, ring):
    e = Engine(4, 512, ring, paged=True, sps=sps, num_requests=3, max_tokens=1536, device=device)
    e.extend([1], [1024])
    state = e.state.cpu()
    rows = e.history[1]
    for p in range(1024):
        if p % sps >= sps - 4:
            assert torch.equal(state[e.slot(1, p)], rows[p]), f"page-tail row of position {p}"
    # Request 2 resumes from request 1's cached prefix at an SWA page edge and reads its tail band.
    edge = 3 * sps if 3 * sps < 1024 else 2 * sps
    e.share_prefix(2, 1, edge)
    e.extend([2], [37])
    e.share_prefix(3, 1, sps)
    e.extend([3], [3])  # first window's overlap only from the band rows
    for _ in range(5):
        e.decode([2, 3])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,draft", [(4, 1), (4, 2), (4, 5), (4, 10), (128, 1), (128, 5), (128, 64), (128, 130)])
def test_speculative_trajectory(device, ratio, draft):
    """Verify calls of D_v tokens, a random accept in [1, D_v] each, rows >= the new prefix redrawn."""
    ring = 16 if ratio == 4 else 256
    assert draft <= capacity(ratio, ring)
    paged = ratio == 4
    e = Engine(ratio, 512, ring, paged=paged, sps=256, num_requests=2, max_tokens=4096, device=device,
               seed=("spec", ratio, draft))
    g = gen("accept", ratio, draft)
    start = (37, 250) if ratio == 4 else (250, 383)
    e.extend([1, 2], list(start))
    steps = 12 if ratio == 4 else (40 if draft == 1 else 10)
    for _ in range(steps):
        accept = [int(torch.randint(1, draft + 1, (1,), generator=g)) for _ in range(2)]
        e.extend([1, 2], [draft, draft], accept=accept)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_bf16_state(device, ratio):
    """bf16 state with bf16-representable inputs meets the fp32 tolerance; arbitrary inputs stay < 0.1."""
    ring = 16 if ratio == 4 else 256
    e = Engine(ratio, 512, ring, paged=ratio == 4, state_dtype=torch.bfloat16, device=device, seed=("bf16", ratio))
    e.extend([1, 2], [300, 133])
    e.extend([1, 2], [40, 5])
    for _ in range(10 if ratio == 4 else 130):
        e.decode([1, 2])
    # Arbitrary fp32 rows: the ring keeps their bf16 roundings, so the truth (from the fp32 rows) is
    # met within 0.1.
    loose = Engine(ratio, 512, ring, paged=ratio == 4, state_dtype=torch.bfloat16, device=device,
                   seed=("bf16-loose", ratio))
    x = torch.randn(300, loose.W, generator=gen("loose")) * 2
    loose.extend([1], [300], rows=[x])
    for _ in range(10 if ratio == 4 else 130):
        loose.decode([1], rows=torch.randn(1, loose.W, generator=gen("loose", len(loose.history[1]))), out_tol=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_bf16_input(device, ratio):
    """bf16 projection rows: a bf16 output within one bf16 ulp of the rounded truth."""
    ring = 16 if ratio == 4 else 128
    e = Engine(ratio, 512, ring, paged=False, input_dtype=torch.bfloat16, device=device, seed=("bf16-in", ratio))
    e.extend([1], [300])
    for _ in range(10 if ratio == 4 else 130):
        e.decode([1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_padded_decode_rows_leave_live_state_unchanged(device, ratio):
    """A 200-step decode batch whose padded rows carry rid 0 and seq_len 1 (§8.3)."""
    ring = 8 if ratio == 4 else 128
    e = Engine(ratio, 512 if ratio == 128 else 128, ring, paged=ratio == 4, num_requests=3, max_tokens=1024,
               device=device, seed=("padded", ratio))
    e.extend([1, 2, 3], [5, 130, 255])
    rids = [1, 0, 2, 0, 3, 0]
    for step in range(200):
        seq = [len(e.history[r]) + 1 if r else 1 for r in rids]
        e.decode(rids, seq_lens=seq, padded_ok=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_padded_verify_rows_leave_live_state_unchanged(device, ratio):
    ring = 16 if ratio == 4 else 256
    draft = 5
    e = Engine(ratio, 512, ring, paged=ratio == 4, num_requests=2, max_tokens=2048, device=device,
               seed=("padded-verify", ratio))
    e.extend([1, 2], [61, 300])
    g = gen("padded-verify-accept", ratio)
    # Padded rows: rid 0, seq_len 1, E in {0, 1} (and D_v on the GPU path, which reads no values).
    pad_extend = draft if device == "cuda" else 1
    for step in range(8):
        rids = [1, 0, 2, 0, 0]
        prefixes = [len(e.history[1]), 1 - pad_extend, len(e.history[2]), 1, 0]
        extends = [draft, pad_extend, draft, 0, 1]
        accept = [int(torch.randint(1, draft + 1, (1,), generator=g)), 0, int(torch.randint(1, draft + 1, (1,),
                                                                                                generator=g)), 0, 0]
        e.extend(rids, extends, prefixes=prefixes, accept=accept, padded_ok=True,
                 num_q_tokens=sum(extends) + 3, check_reference_plan=True)


# ---------------------------------------------------------------------------------------------------------
# The reference compressor and hand-built plans


@pytest.mark.parametrize("ratio", [4, 128])
def test_reference_compressor_matches_truth_and_op(ratio):
    D, ring = (128, 16) if ratio == 4 else (512, 256)
    W = width_of(ratio, D)
    g = gen("ref", ratio)
    e = Engine(ratio, D, ring, paged=False, num_requests=2, seed=("ref", ratio))
    e.extend([1, 2], [133, 260])
    state_ref = e.state.clone()
    x = torch.randn(70, W, generator=g)
    rids, L, E = torch.tensor([1, 2]), torch.tensor([133 + 30, 260 + 40]), torch.tensor([30, 40])
    plan = dsv4.plan_compress_prefill(rids, L, E, num_q_tokens=70, **e.plan_kwargs())
    out_ref = ref.compress_forward(state_ref, x, e.ape, plan.plan, plan.plan_w, D, ratio, False)
    out = dsv4.compress_forward(e.state, x, e.ape, plan, head_dim=D)
    assert torch.equal(e.state, state_ref)
    torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=2e-5)
    hist = [torch.cat([e.history[1], x[:30]]), torch.cat([e.history[2], x[30:]])]
    f = ref.unpack_plan(plan.plan, "compress")
    for k in range(plan.plan.shape[0]):
        b = 0 if int(f["ragged_id"][k]) < 30 else 1
        truth = ref.compress_entries_fp64(hist[b], e.ape, ratio, D)[int(f["seq_len"][k]) // ratio - 1]
        torch.testing.assert_close(out_ref[k].double(), truth, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_hand_built_plan_rows_skip_and_stay_in_bounds(device):
    """Invalid rows give zeros, out-of-range pages and input rows read the pad value, writes outside
    [0, rows - r) and ragged ids >= N are skipped; plan rows with ragged id 65535 are served. Rows 2 and 4
    have no ring slot: row 2 takes the kernel's all-input path, row 4 (input rows before 0) the general one."""
    D, r = 128, 4
    W = width_of(r, D)
    g = gen("hand")
    state = dsv4.alloc_compress_state(r, D, 4, 8, device=device)
    state[: -r] = torch.randn(state.shape[0] - r, W, generator=g).to(device)
    before = state.clone()
    x = torch.randn(10, W, generator=g).to(device)
    ape = torch.randn(8, D, generator=g).to(device)
    plan = ref.pack_compress_plan([
        (0xFFFFFFFF, 0, 0, -1, -1),        # sentinel
        (12, 9, 3, 1000, -5),              # pages out of range: ring slots read the pad value
        (8, 7, 0, -1, -1),                 # all slots from the input
        (4, 65535, 0, -1, -1),             # ragged id out of range: pad everywhere (memory-safe)
        (16, 5, 0, -1, -1),                # no ring slot, but slots 0, 1 would be input rows -2, -1: pad
    ], device)
    plan_w = ref.pack_write_plan([(0xFFFFFFFF, 3), (2, state.shape[0] - r), (3, -1), (12, 5), (1, 6),
                                  (0xFFFF, 7)], device)
    out = dsv4.compress_forward(state, x, ape, plan, plan_w, head_dim=D, compress_ratio=r, is_decode=False)
    assert torch.all(out[0] == 0)
    expected = before.clone()
    expected[6] = x[1]
    assert torch.equal(state, expected), "only the in-range write with an in-range ragged id lands"
    # row 1: slots 0..2 pad (overlap slots 0..2 < buffer_len from page 1000), slot 3 input 9-4=5,
    # current slots 4..7: slots < 3 none, so inputs 6..9.
    hist = torch.zeros(8, W, dtype=torch.float64)
    hist[:4, 2 * D:] = float("-inf")
    hist[3] = x[5].double().cpu()
    hist[4:] = x[6:10].double().cpu()
    kv = torch.cat([hist[:4, :D], hist[4:, D:2 * D]])
    s = torch.cat([hist[:4, 2 * D:3 * D], hist[4:, 3 * D:]]) + ape.double().cpu()
    truth = (torch.softmax(s, 0) * torch.nan_to_num(kv)).sum(0)
    torch.testing.assert_close(out[1].double().cpu(), truth, atol=2e-5, rtol=2e-5)
    truth2 = ref.compress_entries_fp64(x[:8].cpu(), ape.cpu(), r, D)[1]
    torch.testing.assert_close(out[2].double().cpu(), truth2, atol=2e-5, rtol=2e-5)
    assert torch.all(torch.isfinite(out[3]))
    # row 4: slots 2..7 are input rows 0..5 (overlap halves for slots < 4, current halves after).
    hist = torch.zeros(8, W, dtype=torch.float64)
    hist[:2, 2 * D:] = float("-inf")
    hist[2:] = x[:6].double().cpu()
    kv = torch.cat([hist[:4, :D], hist[4:, D:2 * D]])
    s = torch.cat([hist[:4, 2 * D:3 * D], hist[4:, 3 * D:]]) + ape.double().cpu()
    truth4 = (torch.softmax(s, 0) * kv).sum(0)
    torch.testing.assert_close(out[4].double().cpu(), truth4, atol=2e-5, rtol=2e-5)


def _c128_window_truth(state, x, ape, seq_len, ragged_id, buffer_len, page):
    """fp64 pooled row of one hand-built c128 CompressPlan row, by compressors.md §4.2's slot rules written
    out directly: slot k < buffer_len is ring row page·128 + k (pad if the page is out of range), else input
    row ragged_id − 127 + k (pad if out of range)."""
    D = ape.shape[1]
    pages = state.shape[0] // 128
    kv = torch.zeros(128, D, dtype=torch.float64)
    s = torch.full((128, D), float("-inf"), dtype=torch.float64)
    for k in range(128):
        if k < buffer_len:
            row = state[page * 128 + k] if 0 <= page < pages else None
        else:
            i = ragged_id - 127 + k
            row = x[i] if 0 <= i < x.shape[0] else None
        if row is not None:
            kv[k] = row[:D].double()
            s[k] = row[D:].double() + ape[k].double()
    if bool(torch.isinf(s).all()):
        return torch.zeros(D, dtype=torch.float64)
    return (torch.softmax(s, 0) * kv).sum(0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding_rows", [0, 100], ids=["7-rows", "107-rows"])
def test_c128_hand_built_prefill_rows_read_only_their_slots(device, padding_rows):
    """c128 prefill windows split into a ring range and an input range: ring slots of an out-of-range page
    and input rows before 0 or past the input are pad, every other slot is read once. Rows whose ranges end
    inside a group of slots (buffer_len 50, 100, 1), windows cut at either end of the input, and a fully pad
    window (zeros), against the fp64 slot rules. A short plan shares each window among a block's warps, a
    long one (invalid rows appended) gives each window one warp."""
    D, r = 512, 128
    g = gen("hand-c128")
    state = dsv4.alloc_compress_state(r, D, 3, 128, device=device)
    state[:-r] = torch.randn(state.shape[0] - r, 2 * D, generator=g).to(device)
    before = state.clone()
    x = torch.randn(200, 2 * D, generator=g).to(device)
    ape = torch.randn(128, D, generator=g).to(device)
    rows = [
        (0xFFFFFFFF, 0, 0, -1, -1),    # sentinel: zeros
        (256, 127, 50, -1, 1),         # ring slots 0..49 of page 1, input rows 50..127
        (384, 190, 100, -1, 1000),     # page out of range: slots 0..99 pad, input rows 163..190
        (128, 60, 0, -1, -1),          # input rows before 0: slots 0..66 pad, rows 0..60
        (512, 230, 1, -1, 2),          # one ring slot; input rows past 199 are pad
        (640, 65535, 0, -1, -1),       # every slot pad: zeros, finite
        (768, 199, 0, -1, -1),         # the whole window from the input, its last row the input's last
    ]
    plan = ref.pack_compress_plan(rows + [(0xFFFFFFFF, 0, 0, -1, -1)] * padding_rows, device)
    out = dsv4.compress_forward(state, x, ape, plan, ref.pack_write_plan([(0xFFFFFFFF, 0)], device), head_dim=D,
                                compress_ratio=r, is_decode=False)
    assert torch.equal(state, before), "the only write row is invalid"
    assert torch.all(out[0] == 0) and torch.all(out[5] == 0) and torch.all(out[len(rows):] == 0)
    s_cpu, x_cpu, ape_cpu = before.cpu(), x.cpu(), ape.cpu()
    for k, (seq_len, rid, blen, _, page) in enumerate(rows[1:], start=1):
        truth = _c128_window_truth(s_cpu, x_cpu, ape_cpu, seq_len, rid, blen, page)
        torch.testing.assert_close(out[k].double().cpu(), truth, atol=2e-5, rtol=2e-5, msg=f"plan row {k}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_nan_scores_pool_to_nan_as_in_the_reference(device, ratio):
    """NaN inputs are not valid, yet their outputs follow the reference's softmax on every path (prefill, then
    decode from the ring): a channel is NaN exactly when a live slot of its window has a NaN score. That covers
    a window whose live slots are all NaN and c4's first window, whose overlap half is padding (both once gave
    0: a max that skips NaN took them for all-padding windows)."""
    D, ring, blocks = 512, (16 if ratio == 4 else 256), 4
    e = Engine(ratio, D, ring, paged=False, num_requests=1, device=device, seed=("nan", ratio))
    L = blocks * ratio
    x = e.rows(L + ratio)  # the prefill's rows, then the decode rows of one more block
    scores = [2 * D, 3 * D] if ratio == 4 else [D]  # the score columns (c4: the overlap's, then the current's)
    nan = float("nan")
    x[0:ratio, [c + 0 for c in scores]] = nan  # channel 0, block 0 (c4: window 0 is pad + NaN)
    x[ratio:3 * ratio, [c + 1 for c in scores]] = nan  # channel 1, blocks 1 and 2 (c4: window 2 all NaN)
    x[2 * ratio + 1, scores[-1] + 2] = nan  # channel 2: one NaN slot of window 2
    x[L - ratio:, [c + 3 for c in scores]] = nan  # channel 3: the decoded window all NaN
    x[L + 1, scores[-1] + 4] = nan  # channel 4: one NaN slot of the decoded window
    state_ref = e.state.cpu().clone()
    ape = e.ape.to(device)
    r2t, f2s = e.tables()
    one = torch.tensor([1])
    plan = dsv4.plan_compress_prefill(one.to(device), torch.tensor([L], device=device),
                                      torch.tensor([L], device=device), num_q_tokens=L, **e.plan_kwargs())
    calls = [(plan, x[:L], False)]
    for p in range(L, L + ratio):
        calls.append((dsv4.plan_compress_decode(one.to(device), torch.tensor([p + 1], device=device), r2t, f2s,
                                                **e.plan_kwargs()), x[p:p + 1], True))
    nan_channels = set()
    for plan, rows, is_decode in calls:
        out = dsv4.compress_forward(e.state, rows.to(device), ape, plan, head_dim=D)
        plan_w = None if is_decode else plan.plan_w.cpu()
        out_ref = ref.compress_forward(state_ref, rows, e.ape, plan.plan.cpu(), plan_w, D, ratio, is_decode)
        torch.testing.assert_close(out.cpu(), out_ref, atol=2e-5, rtol=2e-5, equal_nan=True)
        assert torch.equal(_bits(e.state), _bits(state_ref))
        nan_channels |= set(out_ref.isnan().nonzero()[:, 1].tolist())
    assert nan_channels == {0, 1, 2, 3, 4}


@pytest.mark.parametrize("device", DEVICES)
def test_empty_plans_and_dim0_slice_state(device):
    e = Engine(4, 128, 8, paged=False, device=device)
    empty = dsv4.plan_compress_prefill(*(torch.tensor([v], device=device) for v in (1, 3, 0)), num_q_tokens=0,
                                       **e.plan_kwargs())
    out = dsv4.compress_forward(e.state, torch.zeros(0, e.W, device=device), e.ape.to(device), empty, head_dim=128)
    assert out.shape == (0, 128)
    pool = torch.zeros(100, e.W, device=device)
    state = pool[10:10 + e.state.shape[0]]
    state.copy_(e.state)
    x = torch.randn(3, e.W, device=device)
    plan = dsv4.plan_compress_decode(torch.tensor([1, 2, 3], device=device), torch.tensor([4, 5, 8], device=device),
                                     **e.plan_kwargs())
    out = dsv4.compress_forward(state, x, e.ape.to(device), plan, head_dim=128)
    assert torch.equal(pool[10 + 1 * 8 + 3], x[0]) and torch.all(pool[:10] == 0)
    assert out.shape == (3, 128) and torch.all(out[1] == 0)


# ---------------------------------------------------------------------------------------------------------
# Pipeline: plan -> compress_forward -> compress_norm_rope_store -> dequantize_k_cache_paged


def _reference_writer():
    from sgl_dsv4_kernels.reference import writers as ref_writers

    return ref_writers.compress_norm_rope_store


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(dsv4.KVLayout), ids=lambda l: l.str_name)
@pytest.mark.parametrize("ratio", [4, 128])
def test_sequence_plan_compress_store_dequant(device, ratio, layout):
    """Several steps (prefill, decode across a boundary, extend) through the whole chain, against the
    reference planner, compressor, writer and dequantizer, for each main cache layout."""
    ref_store = _reference_writer()
    D, ring, page = 512, (16 if ratio == 4 else 256), 64
    e = Engine(ratio, D, ring, paged=ratio == 4, num_requests=2, max_tokens=2048, device=device, seed=("seq", ratio))
    table = dsv4.precompute_rope_table(64, 4096, 65536, 160000.0, 16.0, 32.0, 1.0)
    weight = torch.randn(D, generator=gen("seq-w")).bfloat16()
    num_slots = 64 * page
    cache_ref = torch.zeros(num_slots // page, layout.page_bytes(page), dtype=torch.uint8)
    cache = cache_ref.clone().to(device)
    state_ref = e.state.cpu().clone()
    slot_of = {}  # (rid, entry g) -> compressed-pool slot

    def out_loc_for(rids, seq_lens, extends):
        locs = []
        for r, L, E in zip(rids, seq_lens, extends):
            for p in range(L - E, L):
                if (p + 1) % ratio == 0:
                    slot_of[(r, p // ratio)] = 1 + len(slot_of) % (num_slots - 1)
                    locs.append(slot_of[(r, p // ratio)])
                else:
                    locs.append(0)
        return torch.tensor(locs, dtype=torch.int64)

    steps = [("prefill", [300, 131])] + [("decode", None)] * (9 if ratio == 4 else 130) + [("extend", [7, 40])]
    rids = [1, 2]
    for kind, extends in steps:
        if kind == "decode":
            extends = [1, 1]
        prefixes = [len(e.history[r]) for r in rids]
        seq_lens = [p + x for p, x in zip(prefixes, extends)]
        x = e.rows(sum(extends))
        r_t, L_t, E_t = torch.tensor(rids), torch.tensor(seq_lens), torch.tensor(extends)
        if kind == "decode":
            plan = dsv4.plan_compress_decode(r_t.to(device), L_t.to(device), *e.tables(), **e.plan_kwargs())
            plan_ref = ref.plan_compress_decode(r_t, L_t, e.req_to_token, e.full_to_swa, ratio, e.sps, ring,
                                                not e.paged)
            plan_w_ref = None
            out_loc = torch.tensor([slot_of.setdefault((r, (L - 1) // ratio), 1 + len(slot_of) % (num_slots - 1))
                                    if L % ratio == 0 else 0 for r, L in zip(rids, seq_lens)])
        else:
            plan = dsv4.plan_compress_prefill(r_t.to(device), L_t.to(device), E_t.to(device), *e.tables(),
                                              num_q_tokens=sum(extends), **e.plan_kwargs())
            plan_ref, plan_w_ref = ref.plan_compress_prefill(r_t, L_t, E_t, e.req_to_token, e.full_to_swa,
                                                             sum(extends), ratio, e.sps, ring, not e.paged,
                                                             device == "cuda")
            out_loc = out_loc_for(rids, seq_lens, extends)
        assert torch.equal(plan.plan.cpu(), plan_ref)
        out = dsv4.compress_forward(e.state, x.to(device), e.ape.to(device), plan, head_dim=D)
        out_ref = ref.compress_forward(state_ref, x, e.ape, plan_ref, plan_w_ref, D, ratio, kind == "decode")
        assert torch.equal(e.state.cpu(), state_ref)
        torch.testing.assert_close(out.cpu(), out_ref, atol=2e-5, rtol=2e-5)
        dsv4.compress_norm_rope_store(out, plan, norm_weight=weight.to(device), norm_eps=1e-6,
                                      freq_cis=table.to(device), out_loc=out_loc.to(device), kvcache=cache,
                                      page_size=page, layout=layout)
        # The writer's contract on the op's own rows is byte-exact.
        ref_store(out.cpu(), plan_ref, norm_weight=weight, norm_eps=1e-6, freq_cis=table, out_loc=out_loc,
                  kvcache=cache_ref, page_size=page, layout=int(layout), compress_ratio=ratio,
                  is_decode=kind == "decode")
        assert torch.equal(cache.cpu(), cache_ref), f"{kind}: cache bytes differ from the reference writer"
        for r, x_rows in zip(rids, torch.split(x, extends)):
            e.history[r] = torch.cat([e.history[r], x_rows])
    slots = torch.tensor(sorted(set(slot_of.values())))
    deq = dsv4.dequantize_k_cache_paged(cache, slots.to(device), page, layout=layout).cpu()
    deq_ref = ref.dequantize_k_cache(cache_ref, page, int(layout)).reshape(-1, 512)[slots]
    assert torch.equal(deq.view(-1, 512).view(torch.int16), deq_ref.view(torch.int16))
    assert torch.all(torch.isfinite(deq.float()))


# ---------------------------------------------------------------------------------------------------------
# Validation


def _args(device="cpu", ratio=4, D=128, state_dtype=torch.float32, is_decode=True):
    W = width_of(ratio, D)
    state = dsv4.alloc_compress_state(ratio, D, 2, 8 if ratio == 4 else 128, state_dtype, device)
    x = torch.zeros(3, W, device=device)
    ape = torch.zeros(8 if ratio == 4 else 128, D, device=device)
    plan = torch.zeros(3, 16, dtype=torch.uint8, device=device)
    plan_w = None if is_decode else torch.zeros(5, 8, dtype=torch.uint8, device=device)
    return dict(state=state, kv_score_input=x, ape=ape, plan=plan, plan_w=plan_w, head_dim=D, compress_ratio=ratio,
                is_decode=is_decode)


def _call(a):
    return torch.ops.dsv4.compress_forward(a["state"], a["kv_score_input"], a["ape"], a["plan"], a["plan_w"],
                                           a["head_dim"], a["compress_ratio"], a["is_decode"])


BAD = [
    ("ratio", lambda a: a.update(compress_ratio=2), "compress_ratio"),
    ("head_dim_c128", lambda a: a.update(compress_ratio=128, ape=torch.zeros(128, 128)), "head_dim"),
    ("state_dtype", lambda a: a.update(state=a["state"].half()), "state"),
    ("state_width", lambda a: a.update(state=a["state"][:, :256]), "state"),
    ("state_rows", lambda a: a.update(state=a["state"][:-1]), "state"),
    ("state_noncontig", lambda a: a.update(state=torch.zeros(20, 1024)[:, ::2]), "state"),
    ("input_width", lambda a: a.update(kv_score_input=torch.zeros(3, 256)), "kv_score_input"),
    ("input_stride", lambda a: a.update(kv_score_input=torch.zeros(3, 1024)[:, ::2]), "kv_score_input"),
    ("input_dtype", lambda a: a.update(kv_score_input=torch.zeros(3, 512, dtype=torch.float16)), "kv_score_input"),
    ("ape_shape", lambda a: a.update(ape=torch.zeros(4, 128)), "ape"),
    ("ape_dtype", lambda a: a.update(ape=torch.zeros(8, 128, dtype=torch.bfloat16)), "ape"),
    ("plan_width", lambda a: a.update(plan=torch.zeros(3, 8, dtype=torch.uint8)), "plan"),
    ("plan_dtype", lambda a: a.update(plan=torch.zeros(3, 4, dtype=torch.int32)), "plan"),
    ("decode_rows", lambda a: a.update(plan=torch.zeros(4, 16, dtype=torch.uint8)), "kv_score_input"),
    ("decode_plan_w", lambda a: a.update(plan_w=torch.zeros(1, 8, dtype=torch.uint8)), "plan_w"),
    ("prefill_no_plan_w", lambda a: a.update(is_decode=False), "plan_w"),
    ("plan_w_width", lambda a: a.update(is_decode=False, plan_w=torch.zeros(2, 16, dtype=torch.uint8)), "plan_w"),
]


@pytest.mark.parametrize("name,mutate,arg", BAD, ids=[b[0] for b in BAD])
def test_validation_names_op_and_argument(name, mutate, arg):
    a = _args()
    mutate(a)
    with pytest.raises(RuntimeError, match=rf"compress_forward: .*{arg}"):
        _call(a)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode, pytest.raises(RuntimeError, match=rf"compress_forward: .*{arg}"):
        fa = {k: (torch.empty_strided(v.shape, v.stride(), dtype=v.dtype) if isinstance(v, torch.Tensor) else v)
              for k, v in a.items()}
        _call(fa)


def test_unaligned_plan_rejected():
    a = _args()
    buf = torch.zeros(3 * 16 + 8, dtype=torch.uint8)
    a["plan"] = buf[8:].view(3, 16)
    with pytest.raises(RuntimeError, match="compress_forward: plan data pointer must be 16-byte aligned"):
        _call(a)


def test_wrapper_rules():
    a = _args()
    plan = dsv4.CompressPlan(a["plan"], None, 4, True)
    out = dsv4.compress_forward(a["state"], a["kv_score_input"], a["ape"], plan, head_dim=128)
    assert out.shape == (3, 128)
    with pytest.raises(ValueError, match="contradicts"):
        dsv4.compress_forward(a["state"], a["kv_score_input"], a["ape"], plan, head_dim=128, compress_ratio=128)
    with pytest.raises(TypeError, match="explicit"):
        dsv4.compress_forward(a["state"], a["kv_score_input"], a["ape"], a["plan"], head_dim=128)
    with pytest.raises(Exception):
        plan.plan = None  # frozen


def test_wrapper_passes_integers_unconverted():
    """head_dim = 128.5 and compress_ratio = 4.5 reach the op's schema, which names the op and the argument (an
    int() in the wrapper would truncate them and run)."""
    a = _args()
    for name, value in (("head_dim", 128.5), ("compress_ratio", 4.5)):
        kwargs = dict(head_dim=a["head_dim"], compress_ratio=a["compress_ratio"], is_decode=True)
        kwargs[name] = value
        with pytest.raises(RuntimeError, match=rf"compress_forward\(\) .* argument '{name}'"):
            dsv4.compress_forward(a["state"], a["kv_score_input"], a["ape"], a["plan"], **kwargs)


def test_state_utilities():
    s = dsv4.alloc_compress_state(4, 128, 3, 16, torch.bfloat16)
    assert s.shape == (3 * 16 + 4, 512) and s.dtype == torch.bfloat16
    assert torch.all(s[-4:, :256] == 0) and torch.all(s[-4:, 256:] == float("-inf")) and torch.all(s[:-4] == 0)
    s = dsv4.alloc_compress_state(128, 512, 2, 256)
    assert s.shape == (2 * 256 + 128, 1024)
    assert torch.all(s[-128:, 512:] == float("-inf")) and torch.all(s[-128:, :512] == 0)
    ckpt = torch.randn(4, 256)
    a = dsv4.ape_for_kernel(ckpt)
    assert a.shape == (8, 128) and torch.equal(a[:4], ckpt[:, :128]) and torch.equal(a[4:], ckpt[:, 128:])
    assert dsv4.ape_for_kernel(torch.randn(128, 512).bfloat16()).dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------
# opcheck, torch.compile


def _opcheck_case(device, ratio, is_decode):
    D, ring = (128, 8) if ratio == 4 else (512, 128)
    e = Engine(ratio, D, ring, paged=False, num_requests=3, device=device, seed=("opcheck", ratio, is_decode))
    e.extend([1, 2], [9, 130])
    rids = torch.tensor([1, 2, 3], device=device)
    if is_decode:
        plan = dsv4.plan_compress_decode(rids, torch.tensor([12, 131, 1], device=device), **e.plan_kwargs())
        x = e.rows(3).to(device)
    else:
        plan = dsv4.plan_compress_prefill(rids, torch.tensor([12, 140, 4], device=device),
                                          torch.tensor([3, 10, 4], device=device), num_q_tokens=17,
                                          use_cuda_graph=True, **e.plan_kwargs())
        x = e.rows(17).to(device)
    return e, x, plan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
def test_opcheck(device, ratio, is_decode):
    e, x, plan = _opcheck_case(device, ratio, is_decode)
    torch.library.opcheck(torch.ops.dsv4.compress_forward.default,
                          (e.state, x, e.ape.to(device), plan.plan, plan.plan_w, e.D, ratio, is_decode))


def _assert_no_state_copy(code: str):
    found = re.findall(r"\bclone\(|\bcopy_\(|empty_strided\w*\(", code)
    assert not found, f"compiled code copies the state ({found}):\n{code}"


RATIO_AND_PLAN = pytest.mark.parametrize("ratio,is_decode", [(4, True), (4, False), (128, True), (128, False)],
                                         ids=["c4-decode", "c4-prefill", "c128-decode", "c128-prefill"])


def _emitting_step(device, ratio, is_decode, seed):
    """(engine, input rows, plan) of one decode or prefill step over three requests in which every step emits:
    request 1 closes a chunk (decode), request 2's extend closes one reading the ring."""
    D, ring = (128, 8) if ratio == 4 else (512, 128)
    e = Engine(ratio, D, ring, paged=False, num_requests=3, device=device, seed=seed)
    e.extend([1, 2], [9, 130] if ratio == 4 else [127, 250])
    rids = torch.tensor([1, 2, 3], device=device)
    if is_decode:
        L = [12, 131, 1] if ratio == 4 else [128, 251, 1]
        plan = dsv4.plan_compress_decode(rids, torch.tensor(L, device=device), **e.plan_kwargs())
        x = e.rows(3).to(device)
    else:
        L, E = ([12, 140, 4], [3, 10, 4]) if ratio == 4 else ([131, 256, 4], [4, 6, 4])
        plan = dsv4.plan_compress_prefill(rids, torch.tensor(L, device=device), torch.tensor(E, device=device),
                                          num_q_tokens=sum(E), use_cuda_graph=True, **e.plan_kwargs())
        x = e.rows(sum(E)).to(device)
    return e, x, plan


@pytest.mark.parametrize("device", DEVICES)
@RATIO_AND_PLAN
@pytest.mark.parametrize("as_slice", [False, True], ids=["base", "slice"])
def test_compile_without_state_clone(device, ratio, is_decode, as_slice):
    """fullgraph compile of compress_forward, decode and prefill (plan_w; two launches on CUDA), with the
    state passed as the base tensor and as a dim-0 slice of a larger pool: no copy of the state (§7)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    e, x, plan = _emitting_step(device, ratio, is_decode, ("compile", ratio, is_decode))
    ape = e.ape.to(device)
    rows = e.state.shape[0]
    pool = torch.zeros(rows + 2 * ratio, e.W, device=device)
    pool[ratio:ratio + rows] = e.state

    def step(x, plan_c, plan_w, pool):
        state = pool[ratio:ratio + rows] if as_slice else pool
        return dsv4.compress_forward(state, x, ape, plan_c, plan_w, head_dim=e.D, compress_ratio=ratio,
                                     is_decode=is_decode)

    if not as_slice:
        pool = e.state.clone()
    expected_pool = pool.clone()
    expected = step(x, plan.plan, plan.plan_w, expected_pool)
    assert not torch.equal(expected_pool, pool), "the step writes the state"
    if not is_decode:
        assert int(ref.unpack_plan(plan.plan, "compress")["buffer_len"].max()) > 0, "the step reads the ring"
    compiled = torch.compile(step, fullgraph=True)
    got, codes = run_and_get_code(compiled, x, plan.plan, plan.plan_w, pool)
    _assert_no_state_copy("\n".join(codes))
    assert torch.equal(pool, expected_pool)
    assert torch.equal(got, expected)
    assert got.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@RATIO_AND_PLAN
@pytest.mark.parametrize("stride", [0, 1, "W-4"], ids=lambda s: f"stride{s}")
def test_overlapping_input_rows_equal_contiguous_copy(device, ratio, is_decode, stride):
    """kv_score_input may have any row stride, repeated and overlapping rows included (compress_forward only reads
    it, §4: "last dim contiguous"): the output and the state equal those of the same rows copied contiguously (and
    the reference's), the input is untouched, and the fake accepts the strides (fake mode, fullgraph compile)."""
    e, x, plan = _emitting_step(device, ratio, is_decode, ("overlap", ratio, is_decode))
    x = overlapping_rows(x, e.W - 4 if stride == "W-4" else stride)
    x_before, copy = x.clone(), x.contiguous()
    ape = e.ape.to(device)

    def step(rows, state):
        return dsv4.compress_forward(state, rows, ape, plan, head_dim=e.D)

    state_ref = e.state.cpu().clone()
    out_ref = ref.compress_forward(state_ref, copy.cpu(), e.ape, plan.plan.cpu(),
                                   None if is_decode else plan.plan_w.cpu(), e.D, ratio, is_decode)
    state_copy = e.state.clone()
    out_copy = step(copy, state_copy)
    out = step(x, e.state)
    assert torch.equal(out, out_copy) and torch.equal(e.state, state_copy)
    assert torch.equal(x, x_before), "kv_score_input was written"
    assert out.abs().sum() > 0, "the step emits"
    assert torch.equal(e.state.cpu(), state_ref)
    torch.testing.assert_close(out.cpu(), out_ref, atol=2e-5, rtol=2e-5)

    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake_plan = dsv4.CompressPlan(mode.from_tensor(plan.plan),
                                      None if is_decode else mode.from_tensor(plan.plan_w), ratio, is_decode)
        fake = dsv4.compress_forward(mode.from_tensor(state_copy), mode.from_tensor(x), mode.from_tensor(ape),
                                     fake_plan, head_dim=e.D)
    assert fake.shape == out.shape and fake.dtype == out.dtype
    torch._dynamo.reset()
    state_compiled = state_copy.clone()
    assert torch.equal(torch.compile(step, fullgraph=True)(x, state_compiled), step(x, state_copy))
    assert torch.equal(state_compiled, state_copy)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_plan_and_compress_chain(device):
    """Planner + compressor in one fullgraph; the GPU-input / graph-padded plan shapes are static."""
    torch._dynamo.reset()
    e = Engine(128, 512, 256, paged=False, num_requests=2, device=device, seed=("compile-chain",))
    e.extend([1, 2], [127, 250])
    ape = e.ape.to(device)

    def step(rids, L, E, x, state):
        plan_c, plan_w = torch.ops.dsv4.plan_compress_prefill(rids, L, E, None, None, 8, 128, 0, 256, True, True)
        return torch.ops.dsv4.compress_forward(state, x, ape, plan_c, plan_w, 512, 128, False)

    rids, L, E = (torch.tensor(v, device=device) for v in ([1, 2], [131, 256], [4, 4]))
    x = e.rows(8).to(device)
    expected_state = e.state.clone()
    expected = step(rids, L, E, x, expected_state)
    got = torch.compile(step, fullgraph=True)(rids, L, E, x, e.state)
    assert torch.equal(e.state, expected_state) and torch.equal(got, expected)


# ---------------------------------------------------------------------------------------------------------
# CUDA graphs, PDL


def replay_without_sync_or_allocation(graph) -> None:
    """Replays graph under sync-debug "error" and checks that the replay allocated nothing."""
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio", [4, 128])
def test_cuda_graph_replay_decode_and_gpu_prefill(ratio):
    """Capture decode planning + compress_forward and GPU-path prefill planning + compress_forward once,
    refill the static inputs (dummy rows of rid 0 and seq_len 1 with E in {0, 1, D_v}, §8.3), replay, compare
    the graph's own outputs with eager and its plans with the reference planner's bytes."""
    D, ring = (512, 16) if ratio == 4 else (512, 256)
    draft = 5  # D_v of the padded verify row; the rings serve it
    e = Engine(ratio, D, ring, paged=ratio == 4, num_requests=4, max_tokens=2048, device="cuda",
               seed=("graph", ratio))
    e.extend([1, 2, 3, 4], [50, 127, 255, 300])
    r2t, f2s = e.tables()
    kw = e.plan_kwargs()
    B, nq = 7, 24
    rids = torch.zeros(B, dtype=torch.int64, device="cuda")
    seq = torch.ones(B, dtype=torch.int64, device="cuda")
    seq_p = torch.ones(B, dtype=torch.int64, device="cuda")
    ext = torch.zeros(B, dtype=torch.int64, device="cuda")
    xd = torch.zeros(B, e.W, device="cuda")
    xp = torch.zeros(nq, e.W, device="cuda")
    ape = e.ape.cuda()
    plan_c = torch.empty(nq, 16, dtype=torch.uint8, device="cuda")
    plan_w = torch.empty(nq, 8, dtype=torch.uint8, device="cuda")
    plan_d = torch.empty(B, 16, dtype=torch.uint8, device="cuda")
    outs = {}

    def calls(state):
        dsv4.plan_compress_decode(rids, seq, r2t, f2s, out=plan_d, **kw)
        outs["d"] = dsv4.compress_forward(state, xd, ape, plan_d, head_dim=D, compress_ratio=ratio, is_decode=True)
        p = dsv4.plan_compress_prefill(rids, seq_p, ext, r2t, f2s, num_q_tokens=nq, out=(plan_c, plan_w), **kw)
        outs["p"] = dsv4.compress_forward(state, xp, ape, p, head_dim=D)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls(e.state.clone())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls(e.state)
    replayed = dict(outs)  # the graph's output tensors (the eager calls below rebind outs)
    g = gen("graph-refill", ratio)
    for trial in range(5):
        lens = [len(e.history[r]) for r in (1, 2, 3, 4)]
        rid_list = [1, 0, 2, 3, 0, 4, 0]
        E = [3, 0, 5, 1, 1, 4, draft]
        L = [lens[0] + 1 + trial, 1, lens[1] + 1 + trial, lens[2] + 1 + trial, 1, lens[3] + 1 + trial, 1]
        L_p = [1 if r == 0 else L[b] + E[b] for b, r in enumerate(rid_list)]  # padded rows: seq_len 1
        rids.copy_(torch.tensor(rid_list))
        seq.copy_(torch.tensor(L))
        seq_p.copy_(torch.tensor(L_p))
        ext.copy_(torch.tensor(E))
        xd.copy_(torch.randn(B, e.W, generator=g))
        xp.copy_(torch.randn(nq, e.W, generator=g))
        state_eager = e.state.clone()
        calls(state_eager)
        eager = {k: v.clone() for k, v in outs.items()}
        eager_plans = (plan_d.clone(), plan_c.clone(), plan_w.clone())
        replay_without_sync_or_allocation(graph)
        assert torch.equal(replayed["d"], eager["d"]) and torch.equal(replayed["p"], eager["p"])
        assert torch.equal(e.state[ring:], state_eager[ring:]), "state outside owner 0"
        rid_t, L_t, Lp_t, E_t = (torch.tensor(v) for v in (rid_list, L, L_p, E))
        want_d = ref.plan_compress_decode(rid_t, L_t, e.req_to_token, e.full_to_swa, ratio, e.sps, ring, not e.paged)
        want_c, want_w = ref.plan_compress_prefill(rid_t, Lp_t, E_t, e.req_to_token, e.full_to_swa, nq, ratio, e.sps,
                                                   ring, not e.paged, True)
        for got, want, eager_plan in zip((plan_d, plan_c, plan_w), (want_d, want_c, want_w), eager_plans):
            assert torch.equal(got.cpu(), want) and torch.equal(eager_plan.cpu(), want)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio", [4, 128])
def test_cuda_graph_replay_two_launch_planner(ratio):
    """B = 1100 > 1024 runs the GPU-input planner as two launches (scan, then emit) over scratch that the op
    allocates itself (plan_compress_prefill and its _out form alike), so the allocation happens inside the
    capture. A verify batch with padded rows of rid 0, seq_len 1 and E in {0, 1, D_v} (§8.3) and a decode
    step, captured once, refilled and replayed 5x: plans equal the reference planner's bytes, outputs and state
    equal eager and the reference compressor."""
    D, ring, sps, live = (128, 16, 64, 300) if ratio == 4 else (512, 256, 0, 200)
    draft, B = 5, 1100
    nq = B * draft + 4
    e = Engine(ratio, D, ring, paged=ratio == 4, sps=sps or 256, num_requests=live, max_tokens=512, device="cuda",
               seed=("graph-two-launch", ratio))
    g = gen("graph-two-launch", ratio)
    e.state[:-ratio] = torch.randn(e.state.shape[0] - ratio, e.W, generator=g).cuda()  # ring reads matter
    r2t, f2s = e.tables()
    kw = e.plan_kwargs()
    ape = e.ape.cuda()
    rids, seq_p, ext, seq_d = (torch.zeros(B, dtype=torch.int64, device="cuda") for _ in range(4))
    x = torch.zeros(nq, e.W, device="cuda")
    xd = torch.zeros(B, e.W, device="cuda")
    plan_c = torch.empty(nq, 16, dtype=torch.uint8, device="cuda")
    plan_w = torch.empty(nq, 8, dtype=torch.uint8, device="cuda")
    plan_d = torch.empty(B, 16, dtype=torch.uint8, device="cuda")
    state_a, state_b = e.state, e.state.clone()
    outs = {}

    def calls(a, b):
        p = dsv4.plan_compress_prefill(rids, seq_p, ext, r2t, f2s, num_q_tokens=nq, **kw)  # scratch inside the op
        outs["plan"], outs["plan_w"] = p.plan, p.plan_w
        outs["a"] = dsv4.compress_forward(a, x, ape, p, head_dim=D)
        q = dsv4.plan_compress_prefill(rids, seq_p, ext, r2t, f2s, num_q_tokens=nq, out=(plan_c, plan_w), **kw)
        outs["b"] = dsv4.compress_forward(b, x, ape, q, head_dim=D)
        d = dsv4.plan_compress_decode(rids, seq_d, r2t, f2s, out=plan_d, **kw)
        outs["d"] = dsv4.compress_forward(b, xd, ape, d, head_dim=D)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls(state_a.clone(), state_b.clone())
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls(state_a, state_b)
    replayed = dict(outs)
    emitted = 0
    for trial in range(5):
        rid_t = torch.zeros(B, dtype=torch.int64)
        rid_t[torch.randperm(B, generator=g)[:live]] = torch.arange(1, live + 1)
        pad = rid_t == 0
        E_t = torch.randint(1, draft + 1, (B,), generator=g)
        E_t[pad] = torch.tensor([0, 1, draft])[torch.randint(0, 3, (int(pad.sum()),), generator=g)]
        if ratio == 4:
            prefix = torch.randint(200, 400, (B,), generator=g)
        else:  # ends a 128-chunk inside most verify windows
            prefix = 128 * torch.randint(1, 3, (B,), generator=g) - torch.randint(0, draft, (B,), generator=g)
        Lp_t = torch.where(pad, 1, prefix + E_t)
        Ld_t = torch.where(pad, 1, Lp_t + 1)
        for static, value in ((rids, rid_t), (seq_p, Lp_t), (ext, E_t), (seq_d, Ld_t)):
            static.copy_(value)
        x.copy_(torch.randn(nq, e.W, generator=g))
        xd.copy_(torch.randn(B, e.W, generator=g))
        ref_a, ref_b = state_a.cpu(), state_b.cpu()
        eager_a, eager_b = state_a.clone(), state_b.clone()
        calls(eager_a, eager_b)
        eager = {k: v.clone() for k, v in outs.items()}
        replay_without_sync_or_allocation(graph)
        for k in eager:
            assert torch.equal(replayed[k], eager[k]), k
        assert torch.equal(state_a[ring:], eager_a[ring:]) and torch.equal(state_b[ring:], eager_b[ring:])
        # the reference planner and compressor (owner 0, which padded rows share, excluded)
        want_c, want_w = ref.plan_compress_prefill(rid_t, Lp_t, E_t, e.req_to_token, e.full_to_swa, nq, ratio,
                                                   e.sps, ring, not e.paged, True)
        want_d = ref.plan_compress_decode(rid_t, Ld_t, e.req_to_token, e.full_to_swa, ratio, e.sps, ring,
                                          not e.paged)
        for got, want in ((replayed["plan"], want_c), (replayed["plan_w"], want_w), (plan_c, want_c),
                          (plan_w, want_w), (plan_d, want_d)):
            assert torch.equal(got.cpu(), want)
        out_a = ref.compress_forward(ref_a, x.cpu(), e.ape, want_c, want_w, D, ratio, False)
        out_b = ref.compress_forward(ref_b, x.cpu(), e.ape, want_c, want_w, D, ratio, False)
        out_d = ref.compress_forward(ref_b, xd.cpu(), e.ape, want_d, None, D, ratio, True)
        for got, want in ((replayed["a"], out_a), (replayed["b"], out_b), (replayed["d"], out_d)):
            torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
        assert torch.equal(state_a[ring:].cpu(), ref_a[ring:]) and torch.equal(state_b[ring:].cpu(), ref_b[ring:])
        emitted += int(ref.unpack_plan(want_c, "compress")["valid"].sum())
    assert emitted >= 5 * live // 4, "the replays compress, not only write"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ratio,D,ring,prefix,E", [(4, 512, 16, [37, 300], [50, 9]), (4, 128, 16, [37, 300], [50, 9]),
                                                   (128, 512, 256, [137, 300], [246, 90])],
                         ids=["c4-D512", "c4-D128", "c128"])
@pytest.mark.parametrize("input_dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)], ids=["f32", "bf16-f32", "bf16"])
def test_input_strides_give_identical_bytes(ratio, D, ring, prefix, E, input_dtype, state_dtype):
    """The kernels use vector loads for aligned input rows and scalar loads otherwise: an extend that reads
    ring rows and input rows, then a decode step in which request 1 closes a chunk, give the same outputs and
    state from row strides W, W + 4 (vector loads), W + 2 and W + 1 (scalar loads), each a view into a wider
    buffer."""
    e = Engine(ratio, D, ring, paged=False, num_requests=2, max_tokens=2048, state_dtype=state_dtype,
               input_dtype=input_dtype, device="cuda", seed=("strides", ratio, D))
    e.extend([1, 2], prefix)
    r2t, f2s = e.tables()
    L = [len(e.history[1]) + E[0], len(e.history[2]) + E[1]]
    plan = dsv4.plan_compress_prefill(torch.tensor([1, 2], device="cuda"), torch.tensor(L, device="cuda"),
                                      torch.tensor(E, device="cuda"), r2t, f2s, num_q_tokens=sum(E),
                                      **e.plan_kwargs())
    assert int(ref.unpack_plan(plan.plan, "compress")["buffer_len"].max()) > 0, "the extend must read the ring"
    decode_plan = dsv4.plan_compress_decode(torch.tensor([1, 2], device="cuda"),
                                            torch.tensor([L[0] + 1, L[1] + 1], device="cuda"), r2t, f2s,
                                            **e.plan_kwargs())
    assert (L[0] + 1) % ratio == 0 and (L[1] + 1) % ratio != 0
    x = e.rows(sum(E)).to("cuda", input_dtype)
    x_decode = e.rows(2).to("cuda", input_dtype)

    def strided(t, pad):
        view = torch.full((t.shape[0], e.W + pad), float("nan"), device="cuda", dtype=input_dtype)[:, :e.W]
        return view.copy_(t)

    results = []
    for pad in (0, 4, 2, 1):
        state = e.state.clone()
        out = dsv4.compress_forward(state, strided(x, pad), e.ape.cuda(), plan, head_dim=D)
        out_decode = dsv4.compress_forward(state, strided(x_decode, pad), e.ape.cuda(), decode_plan, head_dim=D)
        results.append((pad, out, out_decode, state))
    _, out0, decode0, state0 = results[0]
    assert out0.abs().sum() > 0 and decode0[0].abs().sum() > 0
    for pad, out, out_decode, state in results[1:]:
        assert torch.equal(out, out0), f"prefill outputs differ at row stride W + {pad}"
        assert torch.equal(out_decode, decode0), f"decode outputs differ at row stride W + {pad}"
        assert torch.equal(state, state0), f"state differs at row stride W + {pad}"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("D,batch", [(512, 300), (128, 1100)])
def test_c4_large_decode_batch_matches_small_batches(D, batch):
    """c4 decode runs one channel per thread up to 256 x 512 (rows x head_dim) and two above it: a batch past
    that bound gives the same outputs and state bytes as its halves, which take the one-channel kernel
    (itself checked against the fp64 truth by the tests above). Random ring contents, positions from the
    first chunk on, about a quarter of the rows emitting."""
    g = gen("large-decode", D)
    ring = 16
    state = dsv4.alloc_compress_state(4, D, batch + 1, ring, device="cuda")
    state[:-4] = torch.randn(state.shape[0] - 4, state.shape[1], generator=g).cuda()
    rids = (torch.randperm(batch, generator=g) + 1).cuda()
    seq = torch.randint(1, 4000, (batch,), generator=g)
    seq[:16] = torch.arange(1, 17)  # the first chunks: pad overlap slots up to position 6
    seq = seq.cuda()
    x = torch.randn(batch, 4 * D, generator=g).cuda()
    ape = torch.randn(8, D, generator=g).cuda()
    kw = dict(compress_ratio=4, ring_size=ring, use_req_ring=True)
    whole = state.clone()
    out = dsv4.compress_forward(whole, x, ape, dsv4.plan_compress_decode(rids, seq, **kw), head_dim=D)
    halves = state.clone()
    parts = []
    for part in (slice(0, batch // 2), slice(batch // 2, batch)):
        plan = dsv4.plan_compress_decode(rids[part], seq[part], **kw)
        parts.append(dsv4.compress_forward(halves, x[part], ape, plan, head_dim=D))
    assert batch * D > 256 * 512 >= batch // 2 * D
    assert int((seq % 4 == 0).sum()) > batch // 8 and int((seq < 8).sum()) > 0
    assert torch.equal(out, torch.cat(parts))
    assert torch.equal(whole, halves)
    assert not torch.equal(whole, state), "the ring writes happened"


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_host_path_raises_under_capture():
    rids = torch.tensor([1], device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError, match="capture"):
            with torch.cuda.graph(graph):
                dsv4.plan_compress_prefill(rids, torch.tensor([5]), torch.tensor([5]), num_q_tokens=5,
                                           compress_ratio=128, ring_size=128, use_req_ring=True)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_state_writes_right_after_the_host_path_planner():
    """A prefill that closes no compressed row has an empty CompressPlan, so compress_forward's only launch is
    the state writes, and with PDL it may start while the host-input planner's stage-1 kernel is still turning
    its WritePlan rows from stage 0 into slots (§4.6: read the plan only after griddepcontrol.wait; the write
    kernel once loaded plan_w before its wait, a race that this test did not catch in six runs on an H200).
    Each step extends every request by 1-3 tokens inside a block of 4 (paged c4: stage 1 looks up two tables
    per row), with the launches queued back to back; the state must match the CPU op's after every step."""
    e = Engine(4, 512, 8, paged=True, num_requests=64, max_tokens=512, device="cuda", seed=("host-path-writes",))
    g = gen("host-path-writes-steps")
    r2t, f2s = e.tables()
    state_cpu, ape = e.state.cpu(), e.ape
    rids = torch.arange(1, 65)
    for step in range(24):
        prefix = 4 * torch.randint(0, 120, (64,), generator=g)
        extend = torch.randint(1, 4, (64,), generator=g)
        x = e.rows(int(extend.sum()))
        x_dev = x.cuda()  # before the plan: no copy between the planner's launches and the state writes
        torch.cuda._sleep(200_000)  # queues the next launches, so that they start back to back as in serving
        kw = dict(num_q_tokens=int(extend.sum()), **e.plan_kwargs())
        plan = dsv4.plan_compress_prefill(rids.cuda(), prefix + extend, extend, r2t, f2s, **kw)
        assert plan.plan.shape[0] == 0 and plan.plan_w.shape[0] == int(extend.sum())
        dsv4.compress_forward(e.state, x_dev, ape.cuda(), plan, head_dim=512)
        plan_cpu = dsv4.plan_compress_prefill(rids, prefix + extend, extend, e.req_to_token, e.full_to_swa, **kw)
        dsv4.compress_forward(state_cpu, x, ape, plan_cpu, head_dim=512)
        assert torch.equal(e.state.cpu(), state_cpu), f"step {step}"


_PDL_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, sys.argv[2])
    from compress_cases import Engine, gen
    import sgl_dsv4_kernels as dsv4
    device = sys.argv[3]
    out = {}
    for ratio, ring, paged in ((4, 8, True), (4, 16, False), (128, 128, False), (128, 256, False)):
        e = Engine(ratio, 512, ring, paged=paged, num_requests=3, max_tokens=1024, device=device,
                   seed=("pdl", ratio, ring))
        r2t, f2s = e.tables()
        kw = e.plan_kwargs()
        g = torch.Generator().manual_seed(ratio + ring)
        outs = []
        # c4 extend at prefix 5, E 7 (ring 8): writes of positions 8..11 alias the ring rows of 0..3,
        # which the emission at p = 7 reads (compress before write).
        calls = [([1, 2, 3], [5, 130, 1], [5, 130, 1]), ([1, 2, 3], [12, 200, 9], [7, 70, 8])]
        calls += [([1, 2, 3, 0], [12 + k + 1, 200 + k + 1, 9 + k + 1, 1], None) for k in range(140)]
        for rids, L, E in calls:
            rids_t = torch.tensor(rids, device=device)
            L_t = torch.tensor(L, device=device)
            if E is None:
                plan = dsv4.plan_compress_decode(rids_t, L_t, r2t, f2s, **kw)
                x = torch.randn(len(rids), e.W, generator=g).to(device)
            else:
                E_t = torch.tensor(E, device=device)
                plan = dsv4.plan_compress_prefill(rids_t, L_t, E_t, r2t, f2s, num_q_tokens=sum(E), **kw)
                x = torch.randn(sum(E), e.W, generator=g).to(device)
            outs.append((plan.plan.cpu(), None if plan.plan_w is None else plan.plan_w.cpu(),
                         dsv4.compress_forward(e.state, x, e.ape.to(device), plan, head_dim=512).cpu()))
        out[(ratio, ring)] = (outs, e.state[ring:].cpu())

    # Every planner kernel back to back with compress_forward, as in serving: the GPU-input planner (one
    # launch for B <= 1024, scan then emit above), the host-input path's stage-1 kernel, both _out planners
    # rewriting one reused buffer (which the previous step's compress_forward reads), and the decode planner.
    # Every input is staged first and the launches queue behind a sleep, so nothing separates them.
    KINDS = ("gpu", "host", "prefill_out", "decode", "decode_out")
    CHAINS = [  # name, engine, batch rows, live requests, initial lengths, largest extend
        ("c4-paged-B1100", lambda: Engine(4, 128, 8, paged=True, sps=64, num_requests=1000, max_tokens=128,
                                          device=device, seed=("pdl-chain", 1)), 1100, 1000, (20, 60), 4),
        ("c128-B1100", lambda: Engine(128, 512, 128, paged=False, num_requests=100, max_tokens=1024,
                                      device=device, seed=("pdl-chain", 2)), 1100, 100, (100, 250), 9),
        ("c4-ring16-B7", lambda: Engine(4, 512, 16, paged=False, num_requests=5, max_tokens=1024, device=device,
                                        seed=("pdl-chain", 3)), 7, 5, (3, 40), 9),
        ("c128-ring256-B5", lambda: Engine(128, 512, 256, paged=False, num_requests=4, max_tokens=1024,
                                           device=device, seed=("pdl-chain", 4)), 5, 4, (128, 250), 9),
    ]
    for name, make, B, live, (lo, hi), max_e in CHAINS:
        e = make()
        g = gen("pdl-chain", name)
        r2t, f2s = e.tables()
        kw = e.plan_kwargs()
        ape = e.ape.to(device)
        # live requests 1..live spread over the B rows; the other rows are padded (rid 0, seq_len 1)
        rids = torch.zeros(B, dtype=torch.int64)
        rids[torch.randperm(B, generator=g)[:live]] = torch.arange(1, live + 1)
        pad = rids == 0
        lens = torch.zeros(B, dtype=torch.int64)
        first = torch.where(pad, 1, torch.randint(lo, hi, (B,), generator=g))
        steps = [("gpu", first, first.clone())]  # the prefill from scratch
        for kind in KINDS * 3:
            if kind.startswith("decode"):
                E = torch.ones(B, dtype=torch.int64)
            else:
                E = torch.randint(1, max_e + 1, (B,), generator=g)
                # E = 5 > L only where the GPU-input path runs: host planners reject E > L. The draws do not
                # depend on the device, so the requests' positions (and which rows emit) do not either.
                pad_e = torch.tensor([0, 1, 5 if kind != "host" and device == "cuda" else 1])
                E[pad] = pad_e[torch.randint(0, 3, (int(pad.sum()),), generator=g)]
            steps.append((kind, None, E))
        staged, nq_out = [], 3 + max(int(E.sum()) for kind, _, E in steps if kind == "prefill_out")
        for i, (kind, L0, E) in enumerate(steps):
            L = L0 if L0 is not None else torch.where(pad, 1, lens + E)
            lens = torch.where(pad, 0, L)
            nq = B if kind.startswith("decode") else nq_out if kind == "prefill_out" else int(E.sum()) + 3
            x = (torch.randn(nq, e.W, generator=gen("pdl-chain-rows", name, i)) * 2).to(device)
            staged.append((kind, L.to(device), E.to(device), L, E, nq, x))
        rids_d = rids.to(device)
        plan_c = torch.full((nq_out, 16), 0x5A, dtype=torch.uint8, device=device)
        plan_w = torch.full((nq_out, 8), 0x5A, dtype=torch.uint8, device=device)
        plan_d = torch.full((B, 16), 0x5A, dtype=torch.uint8, device=device)
        if device == "cuda":
            torch.cuda._sleep(100_000_000)
        results = []
        for kind, L_d, E_d, L, E, nq, x in staged:
            if kind == "gpu":
                plan = dsv4.plan_compress_prefill(rids_d, L_d, E_d, r2t, f2s, num_q_tokens=nq, **kw)
            elif kind == "host":
                plan = dsv4.plan_compress_prefill(rids_d, L, E, r2t, f2s, num_q_tokens=int(E.sum()), **kw)
                x = x[: int(E.sum())]
            elif kind == "prefill_out":
                plan = dsv4.plan_compress_prefill(rids_d, L_d, E_d, r2t, f2s, num_q_tokens=nq, out=(plan_c, plan_w),
                                                  **kw)
            elif kind == "decode":
                plan = dsv4.plan_compress_decode(rids_d, L_d, r2t, f2s, **kw)
            else:
                plan = dsv4.plan_compress_decode(rids_d, L_d, r2t, f2s, out=plan_d, **kw)
            y = dsv4.compress_forward(e.state, x, ape, plan, head_dim=e.D)
            reused = kind.endswith("_out")  # the buffer is rewritten by the next step of its kind
            results.append((None if reused else plan.plan, None if reused else plan.plan_w, y))
        outs = [tuple(None if t is None else t.cpu() for t in r) for r in results]
        outs.append((plan_c.cpu(), plan_w.cpu(), plan_d.cpu()))
        emitted = sum(int((r[2] != 0).any(dim=1).sum()) for r in outs[:-1])
        assert emitted >= 5, (name, emitted)  # the chains compress, not only write
        out[("chain", name)] = (outs, e.state[e.ring:].cpu())
    torch.save(out, sys.argv[1])
""")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_pdl_on_and_off_give_identical_bytes(tmp_path):
    """§4.6 / §8.3: the same calls in a process with SGL_DSV4_PDL=0 and one with =1 give identical plans (every
    planner kernel: decode, the one-launch and scan -> emit GPU-input planners, host-input stage 1, the _out
    forms), outputs and state outside owner 0."""
    off, on = run_with_pdl_off_and_on(_PDL_SCRIPT, tmp_path, os.path.dirname(os.path.abspath(__file__)), "cuda")
    assert off.keys() == on.keys() and ("chain", "c4-paged-B1100") in off
    for key in off:
        (outs_off, state_off), (outs_on, state_on) = off[key], on[key]
        assert torch.equal(state_off, state_on), key
        assert len(outs_off) == len(outs_on), key
        for a, b in zip(outs_off, outs_on):
            for u, v in zip(a, b):
                assert (u is None and v is None) or torch.equal(u, v), key


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch,closing,in_dtype,state_dtype", [
    (100, "all", torch.float32, torch.float32),       # 2 pool blocks of 50 windows each
    (1500, "third", torch.float32, torch.float32),    # two 1024-row slices of the closing-row scan
    (1500, "third", torch.bfloat16, torch.float32),   # the mixed-dtype kernel
    (300, "few", torch.float32, torch.bfloat16),
])
def test_c128_decode_many_closing_rows_matches_reference(batch, closing, in_dtype, state_dtype):
    """c128 decode pools closing rows in separate pool blocks, each taking the closing rows of rank
    pool mod P in row order: outputs and state match the reference compressor whatever the number of closing
    rows, their spread over the batch's 1024-row slices, and invalid (padded) rows among them."""
    g = gen("c128-closing", batch, closing)
    D, ring = 512, 256
    state = dsv4.alloc_compress_state(128, D, batch + 1, ring, state_dtype, device="cuda")
    state[:-128] = torch.randn(state.shape[0] - 128, state.shape[1], generator=g).to(state_dtype).cuda()
    rids = (torch.randperm(batch, generator=g) + 1).cuda()
    seq = torch.randint(129, 8000, (batch,), generator=g)
    seq[seq % 128 == 0] += 1
    closes = {"all": torch.ones(batch, dtype=torch.bool), "few": torch.arange(batch) % 97 == 5,
              "third": torch.rand(batch, generator=g) < 1 / 3}[closing]
    seq[closes] = 128 * torch.randint(1, 60, (int(closes.sum()),), generator=g)
    padded = torch.arange(batch) % 41 == 7
    seq[padded] = 0  # padded rows: invalid plan entries
    plan = dsv4.plan_compress_decode(rids, seq.cuda(), compress_ratio=128, ring_size=ring, use_req_ring=True)
    x = torch.randn(batch, 2 * D, generator=g).to(in_dtype).cuda()
    ape = torch.randn(128, D, generator=g).cuda()
    expected_state = state.clone()
    expected = ref.compress_forward(expected_state, x, ape, plan.plan, None, D, 128, True)
    out = dsv4.compress_forward(state, x, ape, plan, head_dim=D)
    emitting = closes & ~padded
    assert torch.equal(emitting, (seq % 128 == 0) & (seq > 0)) and int(emitting.sum()) >= 3
    if batch > 1024:  # closing rows in both slices of the scan
        assert emitting[:1024].any() and emitting[1024:].any()
    assert out[emitting.cuda()].abs().sum() > 0 and torch.all(out[~emitting.cuda()] == 0)
    assert torch.equal(state, expected_state)
    tol = dict(atol=2e-5, rtol=2e-5) if in_dtype == torch.float32 else dict(atol=1e-5, rtol=2 ** -7)  # 2 bf16 ulps
    torch.testing.assert_close(out.float(), expected.float(), **tol)
