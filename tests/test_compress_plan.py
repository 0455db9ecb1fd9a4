"""Tests of the c4/c128 planners (compressors.md §2-3, §8.2): hand pins, the reference planner, equal bytes
on every path, ring residency under speculation, write sets, uint16 / batch bounds, sentinels, invalid
lookups, validation, opcheck, compile and the ring utilities."""
from __future__ import annotations

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import compress as C
from sgl_dsv4_kernels import reference as ref

from compress_cases import CUDA_MARKS, DEVICES, Engine, capacity, gen

INVALID = 0xFFFFFFFF


def cuda_only(fn):
    for mark in CUDA_MARKS:
        fn = mark(fn)
    return fn


def rows_of(plan_tensor, kind):
    f = ref.unpack_plan(plan_tensor, kind)
    return f


# ---------------------------------------------------------------------------------------------------------
# Ring utilities (§2.1)


def test_state_ring_size_and_capacity():
    assert [dsv4.state_ring_size(4, d) for d in (0, 1, 2, 5, 10, 11, 26, 27)] == [8, 8, 16, 16, 16, 32, 32, 64]
    assert [dsv4.state_ring_size(128, d) for d in (0, 1, 2, 130, 131)] == [128, 128, 256, 256, 512]
    assert [dsv4.state_ring_size(2, d) for d in (0, 1, 2, 5, 9)] == [2, 2, 4, 8, 16]
    for ratio, d in [(4, 2), (4, 10), (4, 11), (128, 2), (128, 130), (128, 200)]:
        ring = dsv4.state_ring_size(ratio, d)
        dsv4.check_ring_serves_draft_tokens(ratio, ring, d)  # a ring sized for D_v serves it
    assert capacity(4, 8) == 1 and capacity(4, 16) == 10 and capacity(128, 128) == 1 and capacity(128, 256) == 130


def test_check_ring_serves_draft_tokens_message():
    dsv4.check_ring_serves_draft_tokens(4, 16, 6)
    dsv4.check_ring_serves_draft_tokens(4, 16, 10)
    with pytest.raises(ValueError,
                       match=r"^ratio-4 state ring of 16 rows serves at most 10 draft tokens; grow the ring$"):
        dsv4.check_ring_serves_draft_tokens(4, 16, 11)
    dsv4.check_ring_serves_draft_tokens(128, 128, 1)
    with pytest.raises(ValueError,
                       match=r"^ratio-128 state ring of 128 rows serves at most 1 draft tokens; grow the ring$"):
        dsv4.check_ring_serves_draft_tokens(128, 128, 2)


def test_state_utilities_accept_every_valid_argument():
    """The valid domains of §2.1-2.3 and §1.4: ratios 4 and 128, head_dim 512 (and 128 for c4), rings that are
    multiples of the ratio and at least the window, owners >= 1 (the dummy owner alone included)."""
    for ratio, D, rings in [(4, 512, (8, 12, 16, 24)), (4, 128, (8, 16)), (128, 512, (128, 256, 384))]:
        W = (4 if ratio == 4 else 2) * D
        assert C.state_row_width(ratio, D) == W
        for ring in rings:
            assert C.ring_capacity(ratio, ring) == capacity(ratio, ring)
            C.check_ring_serves_draft_tokens(ratio, ring, 0)
            C.check_ring_serves_draft_tokens(ratio, ring, capacity(ratio, ring))
            for owners in (1, 3):
                s = dsv4.alloc_compress_state(ratio, D, owners, ring)
                assert s.shape == (owners * ring + ratio, W)
                assert torch.all(s[:-ratio] == 0) and torch.all(s[-ratio:, W // 2:] == float("-inf"))
                assert C.reset_compress_state(s.view(-1, ratio, W), ratio, D).shape == (owners * ring // ratio + 1,
                                                                                      ratio, W)
    assert C.ring_capacity(4, 12) == 6 and C.compress_window(1) == 1 and C.compress_window(2) == 2
    ckpt = torch.randn(4, 1024, generator=gen("ape-valid"))
    assert torch.equal(dsv4.ape_for_kernel(ckpt, compress_ratio=4), torch.cat([ckpt[:, :512], ckpt[:, 512:]]))
    c128 = torch.randn(128, 512, generator=gen("ape-valid")).bfloat16()
    assert torch.equal(dsv4.ape_for_kernel(c128, compress_ratio=128), c128.float())


# (name, call, message): each error names the function and the argument (ARCHITECTURE §1).
UTILITY_BAD = [
    ("serves_ring_below_window", lambda: C.check_ring_serves_draft_tokens(4, 4, 1),
     r"^check_ring_serves_draft_tokens: ring must be .* got 4$"),
    ("serves_ring_not_multiple", lambda: C.check_ring_serves_draft_tokens(4, 18, 1),
     r"^check_ring_serves_draft_tokens: ring .* got 18$"),
    ("serves_c128_ring_below_window", lambda: C.check_ring_serves_draft_tokens(128, 64, 1),
     r"^check_ring_serves_draft_tokens: ring .* got 64$"),
    ("serves_ratio", lambda: C.check_ring_serves_draft_tokens(2, 4, 1),
     r"^check_ring_serves_draft_tokens: ratio must be 4 or 128, got 2$"),
    ("serves_negative_drafts", lambda: C.check_ring_serves_draft_tokens(4, 16, -1),
     r"^check_ring_serves_draft_tokens: draft_tokens must be >= 0, got -1$"),
    ("capacity_ring", lambda: C.ring_capacity(128, 200), r"^ring_capacity: ring .* got 200$"),
    ("capacity_ratio", lambda: C.ring_capacity(2, 4), r"^ring_capacity: ratio must be 4 or 128, got 2$"),
    ("window_ratio", lambda: C.compress_window(3), r"^compress_window: ratio must be 1, 2, 4 or 128, got 3$"),
    ("width_ratio", lambda: C.state_row_width(2, 512), r"^state_row_width: ratio must be 4 or 128, got 2$"),
    ("width_head_dim", lambda: C.state_row_width(4, 256), r"^state_row_width: head_dim must be 128 or 512"),
    ("alloc_ratio", lambda: dsv4.alloc_compress_state(2, 512, 2, 2),
     r"^alloc_compress_state: ratio must be 4 or 128, got 2$"),
    ("alloc_head_dim_256", lambda: dsv4.alloc_compress_state(4, 256, 2, 8),
     r"^alloc_compress_state: head_dim must be 128 or 512 for ratio 4, got 256$"),
    ("alloc_c128_head_dim_128", lambda: dsv4.alloc_compress_state(128, 128, 2, 128),
     r"^alloc_compress_state: head_dim must be 512 for ratio 128, got 128$"),
    ("alloc_no_dummy_owner", lambda: dsv4.alloc_compress_state(4, 512, 0, 8),
     r"^alloc_compress_state: owners must be >= 1 \(owner 0 is the dummy owner of padded rows\), got 0$"),
    ("alloc_ring_below_window", lambda: dsv4.alloc_compress_state(4, 512, 2, 4),
     r"^alloc_compress_state: ring .* got 4$"),
    ("alloc_ring_not_multiple", lambda: dsv4.alloc_compress_state(128, 512, 2, 200),
     r"^alloc_compress_state: ring .* got 200$"),
    ("alloc_dtype", lambda: dsv4.alloc_compress_state(4, 512, 2, 8, torch.float16),
     r"^alloc_compress_state: dtype must be float32 or bfloat16"),
    ("reset_width", lambda: C.reset_compress_state(torch.zeros(12, 512), 4, 512),
     r"^reset_compress_state: state must be \[rows, 2048\]"),
    ("reset_head_dim", lambda: C.reset_compress_state(torch.zeros(12, 1024), 4, 256),
     r"^reset_compress_state: head_dim must be 128 or 512"),
    ("ape_ratio_2", lambda: dsv4.ape_for_kernel(torch.zeros(4, 1024), compress_ratio=2),
     r"^ape_for_kernel: compress_ratio must be 4 or 128, got 2$"),
    ("ape_c128_D", lambda: dsv4.ape_for_kernel(torch.zeros(128, 128)),
     r"^ape_for_kernel: a c128 ape must be \[128, 512\], got \[128, 128\]$"),
    ("ape_c128_explicit_D", lambda: dsv4.ape_for_kernel(torch.zeros(128, 1024), compress_ratio=128),
     r"^ape_for_kernel: a c128 ape must be \[128, 512\], got \[128, 1024\]$"),
    ("ape_c128_as_c4", lambda: dsv4.ape_for_kernel(torch.zeros(128, 512), compress_ratio=4),
     r"^ape_for_kernel: a c4 ape must be \[4, 2D\] with D = 512 or 128, got \[128, 512\]$"),
    ("ape_c4_D", lambda: dsv4.ape_for_kernel(torch.zeros(4, 512)),
     r"^ape_for_kernel: a c4 ape must be \[4, 2D\] with D = 512 or 128, got \[4, 512\]$"),
    ("ape_kernel_layout", lambda: dsv4.ape_for_kernel(torch.zeros(8, 512)),
     r"^ape_for_kernel: cannot infer compress_ratio from ape of shape \[8, 512\]"),
    ("ape_1d", lambda: dsv4.ape_for_kernel(torch.zeros(4)), r"^ape_for_kernel: ape must be 2-D"),
]


@pytest.mark.parametrize("name,call,message", UTILITY_BAD, ids=[b[0] for b in UTILITY_BAD])
def test_state_utilities_reject_bad_arguments(name, call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---------------------------------------------------------------------------------------------------------
# Hand-checked plans


# Request ring, rid 2: c4 ring 8 -> slot 16 + p % 8; c128 ring 128 -> slot 256 + p % 128.
DECODE_PINS = {
    4: {1: (1, 16, -1, 4), 4: (4, 19, -1, 4), 5: (5, 20, -1, 5), 8: (8, 23, 4, 5), 9: (9, 16, 5, 4),
        128: (128, 23, 4, 5), 129: (129, 16, 5, 4)},
    128: {1: (1, 256, -1, 2), 4: (4, 259, -1, 2), 5: (5, 260, -1, 2), 8: (8, 263, -1, 2), 9: (9, 264, -1, 2),
          128: (128, 383, -1, 2), 129: (129, 256, -1, 2)},
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_plan_hand_checked(device, ratio):
    ring = 8 if ratio == 4 else 128
    lens = [1, 4, 5, 8, 9, 128, 129, 0, -3]
    want = ref.pack_decode_plan([DECODE_PINS[ratio][L] for L in lens[:7]] + [(INVALID, -1, -1, -1)] * 2)
    rids = torch.full((len(lens),), 2, dtype=torch.int32)
    L = torch.tensor(lens, dtype=torch.int64)
    got = dsv4.plan_compress_decode(rids.to(device), L.to(device), compress_ratio=ratio, ring_size=ring,
                                    use_req_ring=True)
    assert got.is_decode and got.plan_w is None and got.compress_ratio == ratio
    assert torch.equal(got.plan.cpu(), want)
    assert torch.equal(ref.plan_compress_decode(rids, L, None, None, ratio, 0, ring, True), want)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_plan_hand_checked(device):
    """c4, request ring 8, rid 1, a 10-token prefill: entries at p = 3 (buffer_len 4: its masked overlap
    slots lie before the prefix) and p = 7; writes from first_w = min(8 - 4, 10) = 4 on."""
    want_c = ref.pack_compress_plan([(4, 3, 4, -1, 2), (8, 7, 0, -1, -1)])
    want_w = ref.pack_write_plan([(4, 12), (5, 13), (6, 14), (7, 15), (8, 8), (9, 9)])
    args = [torch.tensor([1]), torch.tensor([10]), torch.tensor([10])]
    got = dsv4.plan_compress_prefill(*(a.to(device) for a in args), num_q_tokens=10, compress_ratio=4, ring_size=8,
                                     use_req_ring=True, use_cuda_graph=True)
    f = ref.unpack_plan(got.plan, "compress")
    assert torch.equal(got.plan[:2].cpu(), want_c) and not f["valid"][2:].any()
    assert torch.all(got.plan[2:].cpu().view(torch.int32) == torch.tensor([-1, 0, -1, -1], dtype=torch.int32))
    assert torch.equal(got.plan_w[:6].cpu(), want_w)
    assert torch.all(got.plan_w[6:].cpu().view(torch.int32) == -1)
    rc, rw = ref.plan_compress_prefill(*args, None, None, 10, 4, 0, 8, True, False)
    assert torch.equal(rc, want_c) and torch.equal(rw, want_w)
    # stage 0 of the reference: packed (batch, ragged) words and p + 1
    s0c, s0w = ref.plan_compress_prefill(*args, None, None, 10, 4, 0, 8, True, False, final=False)
    assert ref.unpack_plan(s0c, "compress")["read_page_1"].tolist() == [0, 0]
    assert ref.unpack_plan(s0w, "write")["write_loc"].tolist() == [5, 6, 7, 8, 9, 10]


# ---------------------------------------------------------------------------------------------------------
# Random batches: every path gives the reference bytes


def random_case(B, ratio, ring, paged, seed, sps=256, max_len=3000, max_extend=24, invalid_lookups=True,
                num_q_slack=7):
    g = gen("random-plan", B, ratio, ring, paged, seed)
    R, T, F = max(B + 3, 8), max_len + 64, 50000
    L = torch.randint(1, max_len, (B,), generator=g)
    E = torch.minimum(torch.randint(0, max_extend, (B,), generator=g), L)
    E[torch.rand(B, generator=g) < 0.1] = 0
    rids = torch.randint(1, R, (B,), generator=g)
    r2t = torch.randint(0, F, (R, T), generator=g, dtype=torch.int64)
    f2s = torch.randint(0, 1 << 20, (F,), generator=g, dtype=torch.int64)
    if invalid_lookups:
        r2t.view(-1)[torch.randint(0, r2t.numel(), (r2t.numel() // 50,), generator=g)] = -1
        f2s[torch.randint(0, F, (F // 50,), generator=g)] = -7
        rids[torch.rand(B, generator=g) < 0.05] = R + 3  # out of the table
        # SWA locations above 2^31 - 1 (int64 tables): some still give a valid slot
        big = torch.randint(0, F, (F // 50,), generator=g)
        f2s[big] = torch.randint(1 << 31, 1 << 36, (big.numel(),), generator=g)
    nq = int(E.sum()) + num_q_slack
    kw = dict(compress_ratio=ratio, swa_page_size=sps if paged else 0, ring_size=ring, use_req_ring=not paged)
    return dict(rids=rids, L=L.int(), E=E, r2t=r2t.int(), f2s=f2s, nq=nq, kw=kw)


def ref_plans(c, use_cuda_graph):
    kw = c["kw"]
    return ref.plan_compress_prefill(c["rids"], c["L"], c["E"], c["r2t"], c["f2s"], c["nq"], kw["compress_ratio"],
                                     kw["swa_page_size"], kw["ring_size"], kw["use_req_ring"], use_cuda_graph)


# (ratio, ring, paged, swa_page_size); the last two have rings and pages that are not powers of two.
CONFIGS = [(4, 8, True, 256), (4, 16, True, 256), (4, 16, False, 0), (128, 128, False, 0), (128, 256, False, 0),
           (4, 24, True, 120), (128, 384, False, 0)]
CONFIG_IDS = ["c4-ring8-paged", "c4-ring16-paged", "c4-ring16-reqring", "c128-ring128", "c128-ring256",
              "c4-ring24-paged-sps120", "c128-ring384"]


# GPU-input path: B = 0 plans sentinels only, B <= 32 runs one warp, 100 several (with more rows than a
# request's owner lanes write), 700 one block of 22 scanning warps, 1025 and 3000 the two-launch path.
BATCHES = [0, 1, 7, 100, 700, 1025, 3000]


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("ratio,ring,paged,sps", CONFIGS, ids=CONFIG_IDS)
def test_cpu_planners_match_reference(B, ratio, ring, paged, sps):
    c = random_case(B, ratio, ring, paged, "cpu", sps=sps, max_extend=24 if B < 1000 else 6)
    for use_cuda_graph in (False, True):
        rc, rw = ref_plans(c, use_cuda_graph)
        got = dsv4.plan_compress_prefill(c["rids"], c["L"], c["E"], c["r2t"], c["f2s"], num_q_tokens=c["nq"],
                                         use_cuda_graph=use_cuda_graph, **c["kw"])
        assert torch.equal(got.plan, rc) and torch.equal(got.plan_w, rw)
    # _out on CPU: the padded plans, every row rewritten
    pc = torch.full((c["nq"], 16), 0x5A, dtype=torch.uint8)
    pw = torch.full((c["nq"], 8), 0x5A, dtype=torch.uint8)
    dsv4.plan_compress_prefill(c["rids"], c["L"], c["E"], c["r2t"], c["f2s"], num_q_tokens=c["nq"], out=(pc, pw),
                               **c["kw"])
    assert torch.equal(pc, rc) and torch.equal(pw, rw)
    d = dsv4.plan_compress_decode(c["rids"], c["L"], c["r2t"], c["f2s"], **c["kw"]).plan
    assert torch.equal(d, ref.plan_compress_decode(c["rids"], c["L"], c["r2t"], c["f2s"], ratio,
                                                   c["kw"]["swa_page_size"], ring, not paged))
    if B > 1025:  # the host planner has no batch-size-dependent path; spare the reference's time
        return
    # The other dtype of every index tensor, an int32 full_to_swa included (its wrapped values are the
    # reference's input too)
    s = swap_index_dtypes(c)
    assert s["f2s"].dtype == torch.int32 and s["r2t"].dtype == torch.int64
    rc, rw = ref_plans(s, True)
    got = dsv4.plan_compress_prefill(s["rids"], s["L"], s["E"], s["r2t"], s["f2s"], num_q_tokens=s["nq"],
                                     use_cuda_graph=True, **s["kw"])
    assert torch.equal(got.plan, rc) and torch.equal(got.plan_w, rw)
    d = dsv4.plan_compress_decode(s["rids"], s["L"], s["r2t"], s["f2s"], **s["kw"]).plan
    assert torch.equal(d, ref.plan_compress_decode(s["rids"], s["L"], s["r2t"], s["f2s"], ratio,
                                                   s["kw"]["swa_page_size"], ring, not paged))


INDEX_KEYS = ("rids", "L", "E", "r2t", "f2s")


def swap_index_dtypes(c, dtypes=None):
    """The case with each index tensor in the given dtype (default: the other one of int32 / int64)."""
    if dtypes is None:
        dtypes = [torch.int64 if c[k].dtype == torch.int32 else torch.int32 for k in INDEX_KEYS]
    return dict(c, **{k: c[k].to(dt) for k, dt in zip(INDEX_KEYS, dtypes)})


@cuda_only
@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("ratio,ring,paged,sps", CONFIGS, ids=CONFIG_IDS)
def test_every_path_gives_the_same_bytes(B, ratio, ring, paged, sps):
    """CPU op, host-input path, GPU-input path and both _out variants; the decode planner on CPU and CUDA."""
    c = random_case(B, ratio, ring, paged, "gpu", sps=sps, max_extend=24 if B < 1000 else 6)
    rc, rw = ref_plans(c, True)
    n_c = int(ref.unpack_plan(rc, "compress")["valid"].sum())
    n_w = int(ref.unpack_plan(rw, "write")["valid"].sum())
    cu = {k: c[k].cuda() for k in ("rids", "L", "E", "r2t", "f2s")}
    common = dict(num_q_tokens=c["nq"], **c["kw"])
    # (c) GPU-input path: always num_q_tokens rows
    for flag in (False, True):
        p = dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], use_cuda_graph=flag,
                                       **common)
        assert torch.equal(p.plan.cpu(), rc) and torch.equal(p.plan_w.cpu(), rw)
    # (b) host-input path: compact, or padded with use_cuda_graph
    p = dsv4.plan_compress_prefill(cu["rids"], c["L"], c["E"], cu["r2t"], cu["f2s"], **common)
    assert p.plan.is_cuda and torch.equal(p.plan.cpu(), rc[:n_c]) and torch.equal(p.plan_w.cpu(), rw[:n_w])
    p = dsv4.plan_compress_prefill(cu["rids"], c["L"], c["E"], cu["r2t"], cu["f2s"], use_cuda_graph=True, **common)
    assert torch.equal(p.plan.cpu(), rc) and torch.equal(p.plan_w.cpu(), rw)
    # _out on CUDA over garbage buffers: every row rewritten
    pc = torch.full((c["nq"], 16), 0x5A, dtype=torch.uint8, device="cuda")
    pw = torch.full((c["nq"], 8), 0x5A, dtype=torch.uint8, device="cuda")
    dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], out=(pc, pw), **common)
    assert torch.equal(pc.cpu(), rc) and torch.equal(pw.cpu(), rw)
    # decode: CPU == CUDA == _out
    d_cpu = dsv4.plan_compress_decode(c["rids"], c["L"], c["r2t"], c["f2s"], **c["kw"]).plan
    d_gpu = dsv4.plan_compress_decode(cu["rids"], cu["L"], cu["r2t"], cu["f2s"], **c["kw"]).plan
    d_out = torch.full((B, 16), 0x5A, dtype=torch.uint8, device="cuda")
    dsv4.plan_compress_decode(cu["rids"], cu["L"], cu["r2t"], cu["f2s"], out=d_out, **c["kw"])
    assert torch.equal(d_cpu, d_gpu.cpu()) and torch.equal(d_cpu, d_out.cpu())


@cuda_only
@pytest.mark.parametrize("B", [1025, 3000])
@pytest.mark.parametrize("ratio,ring,paged,sps", CONFIGS, ids=CONFIG_IDS)
def test_two_launch_planner_index_dtypes(B, ratio, ring, paged, sps):
    """The scan -> emit GPU planner (B > 1024), the host-input path's stage 1 and the decode planner with every
    index tensor in int32 and in int64: all int32, all int64, and the complement of random_case's mix (which
    test_every_path_gives_the_same_bytes runs), against the reference on the same tensors."""
    c = random_case(B, ratio, ring, paged, "dtypes", sps=sps, max_extend=6)
    I32, I64 = torch.int32, torch.int64
    for dtypes in ([I32] * 5, [I64] * 5, None):
        s = swap_index_dtypes(c, dtypes)
        rc, rw = ref_plans(s, True)
        n_c = int(ref.unpack_plan(rc, "compress")["valid"].sum())
        n_w = int(ref.unpack_plan(rw, "write")["valid"].sum())
        cu = {k: s[k].cuda() for k in INDEX_KEYS}
        common = dict(num_q_tokens=s["nq"], **s["kw"])
        p = dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], **common)
        assert torch.equal(p.plan.cpu(), rc) and torch.equal(p.plan_w.cpu(), rw), [s[k].dtype for k in INDEX_KEYS]
        pc = torch.full((s["nq"], 16), 0x5A, dtype=torch.uint8, device="cuda")
        pw = torch.full((s["nq"], 8), 0x5A, dtype=torch.uint8, device="cuda")
        dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], out=(pc, pw), **common)
        assert torch.equal(pc.cpu(), rc) and torch.equal(pw.cpu(), rw), [s[k].dtype for k in INDEX_KEYS]
        p = dsv4.plan_compress_prefill(cu["rids"], s["L"], s["E"], cu["r2t"], cu["f2s"], **common)  # host input
        assert torch.equal(p.plan.cpu(), rc[:n_c]) and torch.equal(p.plan_w.cpu(), rw[:n_w])
        d = dsv4.plan_compress_decode(cu["rids"], cu["L"], cu["r2t"], cu["f2s"], **s["kw"]).plan
        assert torch.equal(d.cpu(), ref.plan_compress_decode(s["rids"], s["L"], s["r2t"], s["f2s"], ratio,
                                                             s["kw"]["swa_page_size"], ring, not paged))


@cuda_only
@pytest.mark.parametrize("ratio,ring,paged,sps", CONFIGS, ids=CONFIG_IDS)
def test_gpu_path_out_of_envelope_inputs_stay_in_bounds(ratio, ring, paged, sps):
    """The GPU path reads no values: negative E counts as 0, tokens at p < 0 or with ragged id >=
    num_q_tokens emit nothing (an underfilled replay cannot overrun), as the §3.3 loop says; E beyond int32
    and L = 0 plan nothing."""
    c = random_case(300, ratio, ring, paged, "envelope", sps=sps, num_q_slack=0)
    g = gen("envelope")
    c["E"][torch.rand(300, generator=g) < 0.1] = -5
    over = torch.rand(300, generator=g) < 0.1
    c["E"][over] = c["L"][over].long() + 3  # p < 0 for the first tokens
    c["nq"] = max(1, int(c["E"].clamp_min(0).sum()) // 2)  # underfilled
    c["L"][torch.rand(300, generator=g) < 0.05] = 0  # no rows, whatever E
    # E beyond int32 in the tail, which the GPU path clamps: like any E >= L + num_q_tokens, it plans no row
    # and uses up the ragged tokens, so the reference (which walks every token) gets L + num_q_tokens instead.
    huge = torch.zeros(300, dtype=torch.bool)
    huge[290:] = torch.rand(10, generator=g) < 0.5
    rc, rw = ref_plans(dict(c, E=torch.where(huge, c["L"].long() + c["nq"], c["E"])), True)
    c["E"][huge] = 1 << 40
    cu = {k: c[k].cuda() for k in ("rids", "L", "E", "r2t", "f2s")}
    p = dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], num_q_tokens=c["nq"], **c["kw"])
    assert torch.equal(p.plan.cpu(), rc) and torch.equal(p.plan_w.cpu(), rw)


@cuda_only
@pytest.mark.parametrize("B", [1, 7, 32, 33, 100, 300, 1024])
@pytest.mark.parametrize("ratio,ring,paged,sps", CONFIGS, ids=CONFIG_IDS)
def test_gpu_path_verify_batches(B, ratio, ring, paged, sps):
    """Verify/extend batches of decode size (every E <= 8), whose rows the GPU path's owner lanes write
    (one row each), the rest of each plan being sentinels: one scanning warp (B <= 32) or several, one
    slice of owned requests or several, padded rows (rid 0, prefix 0), invalid lookups, both table dtypes,
    spare rows, and an underfilled num_q_tokens that cuts a request's rows short (the second scan)."""
    c = random_case(B, ratio, ring, paged, "verify", sps=sps, max_extend=9)
    pad = torch.rand(B, generator=gen("verify-pad", B, ratio, ring)) < 0.2
    c["rids"][pad] = 0
    c["L"][pad] = c["E"][pad].int()
    for r2t_dtype, f2s_dtype in ((torch.int32, torch.int64), (torch.int64, torch.int32)):
        c["r2t"], c["f2s"] = c["r2t"].to(r2t_dtype), c["f2s"].to(f2s_dtype)
        cu = {k: c[k].cuda() for k in ("rids", "L", "E", "r2t", "f2s")}
        for nq in (c["nq"], max(1, int(c["E"].sum()) // 2)):
            case = dict(c, nq=nq)
            rc, rw = ref_plans(case, True)
            p = dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], num_q_tokens=nq,
                                           **c["kw"])
            assert torch.equal(p.plan.cpu(), rc), (r2t_dtype, nq)
            assert torch.equal(p.plan_w.cpu(), rw), (r2t_dtype, nq)


@cuda_only
@pytest.mark.parametrize("ratio,ring", [(4, 128), (128, 256)], ids=["c4", "c128"])
def test_gpu_path_full_batch_at_the_token_bound(ratio, ring):
    """1024 requests of 64 tokens each (num_q_tokens = 65536), rings wide enough that every token is written:
    the one-launch planner at its largest row sums (65536 write rows; for c4 16384 compress rows), which its
    first scan packs into one word."""
    B = 1024
    c = random_case(B, ratio, ring, False, "token-bound", invalid_lookups=False)
    c["L"] = torch.randint(64, 3000, (B,), generator=gen("token-bound", ratio)).int()
    c["E"] = torch.full((B,), 64, dtype=torch.int64)
    c["nq"] = 65536
    rc, rw = ref_plans(c, True)
    assert int(ref.unpack_plan(rw, "write")["valid"].sum()) == 65536
    cu = {k: c[k].cuda() for k in ("rids", "L", "E", "r2t", "f2s")}
    p = dsv4.plan_compress_prefill(cu["rids"], cu["L"], cu["E"], cu["r2t"], cu["f2s"], num_q_tokens=c["nq"],
                                   **c["kw"])
    assert torch.equal(p.plan.cpu(), rc) and torch.equal(p.plan_w.cpu(), rw)


def test_no_duplicate_write_loc_outside_owner0():
    """Requests owning distinct pages / slots: no two valid writes of one call share a row."""
    cases = [(4, 16, True, 10), (4, 8, False, 1), (128, 256, False, 130), (128, 128, False, 1)]
    for ratio, ring, paged, draft in cases:
        e = Engine(ratio, 128 if ratio == 4 else 512, ring, paged=paged, num_requests=6, max_tokens=3000)
        g = gen("dup", ratio, ring)
        L = torch.randint(draft + 1, 2900, (6,), generator=g)
        for E in (L.clone(), torch.full((6,), draft)):
            p = dsv4.plan_compress_prefill(torch.arange(1, 7), L, E, *e.tables(), num_q_tokens=int(E.sum()),
                                           **e.plan_kwargs())
            w = ref.unpack_plan(p.plan_w, "write")
            locs = w["write_loc"][w["valid"]].tolist()
            assert len(locs) == len(set(locs)) and min(locs) >= ring


# ---------------------------------------------------------------------------------------------------------
# Write sets (§3.3, §3.5)


def write_positions(plan, rids, seq_lens, extend_lens):
    """{batch index: sorted written positions} from the valid WritePlan rows."""
    w = ref.unpack_plan(plan.plan_w, "write")
    offsets = torch.cumsum(torch.tensor([0] + list(extend_lens)), 0).tolist()
    out = {b: [] for b in range(len(rids))}
    for q, valid in zip(w["ragged_id"].tolist(), w["valid"].tolist()):
        if not valid:
            continue
        b = max(i for i in range(len(rids)) if offsets[i] <= q and extend_lens[i] > 0 and q < offsets[i + 1])
        out[b].append(seq_lens[b] - extend_lens[b] + q - offsets[b])
    return out


def planner_call(device, e, rids, seq_lens, extend_lens, path="gpu"):
    r2t, f2s = e.tables()
    rid_t = torch.tensor(rids).to(device)
    if device == "cuda" and path == "host":
        L_t, E_t = torch.tensor(seq_lens), torch.tensor(extend_lens)
    else:
        L_t, E_t = torch.tensor(seq_lens).to(device), torch.tensor(extend_lens).to(device)
    return dsv4.plan_compress_prefill(rid_t, L_t, E_t, r2t, f2s, num_q_tokens=sum(extend_lens), **e.plan_kwargs())


RESIDENCY = [(4, 16, True), (4, 16, False), (128, 256, False), (4, 32, True), (128, 384, False)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,ring,paged", RESIDENCY,
                         ids=["c4-paged", "c4-reqring", "c128", "c4-paged-ring32", "c128-ring384"])
@pytest.mark.parametrize("bs", [1, 3])
def test_ring_residency_under_speculation(device, ratio, ring, paged, bs):
    """Every verify writes all of [prefix, prefix + D_v) for D_v up to capacity, including D_v > 4 (the historical
    bug: a pad hard-coded for 4 drafts) and rings wider than the default ones (26 and 258 drafts: no cap)."""
    e = Engine(ratio, 128 if ratio == 4 else 512, ring, paged=paged, num_requests=3, max_tokens=1024, device=device)
    max_d = capacity(ratio, ring)
    drafts = sorted({1, 2, 3, 4, 5, 6, 8, max_d - 1, max_d})
    prefixes = list(range(512, 516)) + (list(range(253, 260)) if (ratio == 4 and paged) else [])
    for prefix in prefixes:
        for d in drafts:
            rids = [1, 2, 3][:bs]
            pre = [prefix + i for i in range(bs)]
            plan = planner_call(device, e, rids, [p + d for p in pre], [d] * bs)
            written = write_positions(plan, rids, [p + d for p in pre], [d] * bs)
            for b in range(bs):
                missing = set(range(pre[b], pre[b] + d)) - set(written[b])
                assert not missing, f"prefix {pre[b]} D_v {d}: positions {sorted(missing)} unwritten"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,ring,paged", [(4, 8, True), (4, 8, False), (128, 128, False)],
                         ids=["c4-paged256", "c4-reqring", "c128"])
def test_plain_prefill_write_set(device, ratio, ring, paged):
    e = Engine(ratio, 128 if ratio == 4 else 512, ring, paged=paged, sps=256, num_requests=3, max_tokens=1024,
               device=device)
    lens = [512, 600, 777]
    written = write_positions(planner_call(device, e, [1, 2, 3], lens, lens), [1, 2, 3], lens, lens)
    for b, L in enumerate(lens):
        last_c = (L // ratio) * ratio
        want = {p for p in range(L) if p >= last_c - (4 if ratio == 4 else 0)}
        if ratio == 4 and paged:
            want |= {p for p in range(L) if p % 256 >= 252}
        assert written[b] == sorted(want), f"L={L}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,ring", [(4, 16), (128, 256)])
def test_over_capacity_verify_under_writes(device, ratio, ring):
    e = Engine(ratio, 128 if ratio == 4 else 512, ring, paged=False, num_requests=1, max_tokens=2048, device=device)
    d = capacity(ratio, ring) + ratio + 1
    with pytest.raises(ValueError, match="grow the ring"):
        dsv4.check_ring_serves_draft_tokens(ratio, ring, d)
    written = write_positions(planner_call(device, e, [1], [512 + d], [d]), [1], [512 + d], [d])[0]
    assert set(range(512, 512 + d)) - set(written), "an over-capacity verify must leave a position unwritten"


def test_c128_ring128_verify_reads_an_unwritten_row():
    """Why ring 128 serves no verify: D_v = 2 at prefix 254 writes nothing (first_w = 256); after
    accepting 1, the next verify from 255 reads position 254 from the ring (buffer_len 127)."""
    kw = dict(compress_ratio=128, ring_size=128, use_req_ring=True)
    first = dsv4.plan_compress_prefill(torch.tensor([1]), torch.tensor([256]), torch.tensor([2]), num_q_tokens=2, **kw)
    assert first.plan_w.shape[0] == 0, "positions 254 and 255 are not written"
    second = dsv4.plan_compress_prefill(torch.tensor([1]), torch.tensor([257]), torch.tensor([2]), num_q_tokens=2,
                                        **kw)
    c = ref.unpack_plan(second.plan, "compress")
    assert c["seq_len"].tolist() == [256] and c["buffer_len"].tolist() == [127]  # slot 126 = position 254


# ---------------------------------------------------------------------------------------------------------
# uint16 / batch bounds and sentinels (§3.7, §8.2)


def paths(device):
    return ["gpu", "host"] if device == "cuda" else ["cpu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,paged", [(4, True), (4, False), (128, False)], ids=["c4-paged", "c4-reqring", "c128"])
def test_65536_tokens_accepted(device, ratio, paged):
    ring = 8 if ratio == 4 else 128
    e = Engine(ratio, 128 if ratio == 4 else 512, ring, paged=paged, num_requests=16, max_tokens=4096, device=device)
    rids = list(range(1, 17))
    for path in paths(device):
        plan = planner_call(device, e, rids, [4096] * 16, [4096] * 16, path)
        c = ref.unpack_plan(plan.plan, "compress")
        assert sorted(c["ragged_id"][c["valid"]].tolist()) == list(range(ratio - 1, 65536, ratio))
        w = ref.unpack_plan(plan.plan_w, "write")
        if ratio == 128:
            assert not w["valid"].any()
        else:
            last = (w["ragged_id"] == 65535) & w["valid"]
            assert int(last.sum()) == 1 and int(w["write_loc"][last]) == e.slot(16, 4095)


@pytest.mark.parametrize("device", DEVICES)
def test_num_q_tokens_bound(device):
    one = torch.tensor([1], device=device)
    kw = dict(compress_ratio=128, ring_size=128, use_req_ring=True)
    for path in paths(device):
        lengths = one.cpu() if path == "host" else one
        with pytest.raises(RuntimeError, match=r"plan_compress_prefill: num_q_tokens=65537 exceeds 65536 "
                                               r"\(ragged ids are uint16\)"):
            dsv4.plan_compress_prefill(one, lengths, lengths, num_q_tokens=65537, **kw)
    pc = torch.empty(65537, 16, dtype=torch.uint8, device=device)
    pw = torch.empty(65537, 8, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="num_q_tokens=65537 exceeds 65536"):
        dsv4.plan_compress_prefill(one, one, one, num_q_tokens=65537, out=(pc, pw), **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_batch_size_bound(device):
    kw = dict(compress_ratio=4, ring_size=8, use_req_ring=True)
    for B in (65535, 65536):
        ones = torch.ones(B, dtype=torch.int32, device=device)
        for path in paths(device):
            lengths = ones.cpu() if path == "host" else ones
            with pytest.raises(RuntimeError, match=f"plan_compress_prefill: batch_size={B}"):
                dsv4.plan_compress_prefill(ones, lengths, lengths, num_q_tokens=B if B <= 65536 else 65536, **kw)
    ones = torch.ones(65534, dtype=torch.int32, device=device)
    p = dsv4.plan_compress_prefill(ones, ones, ones, num_q_tokens=65534, use_cuda_graph=True, **kw)
    assert p.plan_w.shape == (65534, 8)


@pytest.mark.parametrize("device", DEVICES)
def test_sentinel_boundary_ragged_id_65535(device):
    """65534 requests, the last with 3 tokens: the final WritePlan row (ragged id 65535, word 0 =
    0x0000FFFF) is valid and compress_forward writes its state row; a CompressPlan row with ragged id
    65535 fills its output row. The whole state (pad page included) and every output row are compared with
    closed forms, on compact plans and on plans padded with sentinel rows (which must be skipped)."""
    B = 65534
    rids = torch.zeros(B, dtype=torch.int32)
    rids[-1] = 1
    L = torch.ones(B, dtype=torch.int32)
    L[-1] = 3
    kw = dict(compress_ratio=4, ring_size=8, use_req_ring=True)
    x = torch.zeros(65536, 512)
    x[-3:] = torch.randn(3, 512, generator=gen("sentinel"))
    # padded rows (rid 0, p = 0) write zero rows to owner 0's row 0; request 1 writes positions 0..2 to rows 8..10
    expected = dsv4.alloc_compress_state(4, 128, 2, 8)
    expected[8:11] = x[65533:]
    for path in paths(device):
        for use_cuda_graph in ((False, True) if path != "gpu" else (True,)):
            r_dev = rids.to(device)
            lens = (L, L) if path == "host" else (L.to(device), L.to(device))
            p = dsv4.plan_compress_prefill(r_dev, *lens, num_q_tokens=65536, use_cuda_graph=use_cuda_graph, **kw)
            w = ref.unpack_plan(p.plan_w, "write")
            last = int(w["valid"].nonzero()[-1])
            assert int(w["word0"][last]) == 0xFFFF and int(w["write_loc"][last]) == 8 + 2
            assert p.plan.shape[0] == (65536 if use_cuda_graph else 0)  # no token closes a chunk
            state = dsv4.alloc_compress_state(4, 128, 2, 8, device=device)
            out = dsv4.compress_forward(state, x.to(device), torch.zeros(8, 128, device=device), p, head_dim=128)
            assert torch.equal(state.cpu(), expected), (path, use_cuda_graph)
            assert out.shape == (p.plan.shape[0], 128) and torch.all(out == 0)
    # A CompressPlan row with ragged id 65535: the 16 x 4096 case, c4 D=128, padded with sentinel rows so that
    # invalid rows exist on every path (a compact plan has none).
    e = Engine(4, 128, 8, paged=False, num_requests=16, max_tokens=4096, device=device, seed=("65535",))
    x = e.rows(65536)
    plan = dsv4.plan_compress_prefill(*(torch.tensor(v, device=device) for v in (list(range(1, 17)), [4096] * 16,
                                                                                  [4096] * 16)),
                                      num_q_tokens=65536, use_cuda_graph=True, **e.plan_kwargs())
    out = dsv4.compress_forward(e.state, x.to(device), e.ape.to(device), plan, head_dim=128).cpu()
    c = ref.unpack_plan(plan.plan, "compress")
    valid = c["valid"]
    assert int(valid.sum()) == 16384 and int((~valid).sum()) == 65536 - 16384
    k = int(((c["ragged_id"] == 65535) & valid).nonzero())
    truth = torch.stack([ref.compress_entries_fp64(x[4096 * b:4096 * (b + 1)], e.ape, 4, 128) for b in range(16)])
    torch.testing.assert_close(out[k].double(), truth[15, -1], atol=2e-5, rtol=2e-5)
    q, g = c["ragged_id"][valid], c["seq_len"][valid] // 4 - 1
    torch.testing.assert_close(out[valid].double(), truth[q // 4096, g], atol=2e-5, rtol=2e-5)
    assert torch.all(out[~valid] == 0)
    # each request writes its last chunk, positions 4092..4095, to ring rows rid * 8 + 4..7
    state = dsv4.alloc_compress_state(4, 128, 17, 8)
    for rid in range(1, 17):
        state[rid * 8 + 4:rid * 8 + 8] = x[4096 * rid - 4:4096 * rid]
    assert torch.equal(e.state.cpu(), state)


# ---------------------------------------------------------------------------------------------------------
# Invalid lookups (§2.2): -1 fields, unchanged counts


@pytest.mark.parametrize("device", DEVICES)
def test_invalid_lookups_keep_counts(device):
    e = Engine(4, 128, 16, paged=True, sps=64, num_requests=4, max_tokens=512, device=device)
    rids, L, E = [1, 2, 3, 4], [200, 300, 64, 9], [30, 12, 64, 9]
    good = planner_call(device, e, rids, L, E)
    e.full_to_swa[e.req_to_token[2, 290:]] = -1            # swa < 0
    e.req_to_token[3, 10:20] = -5                          # loc < 0
    e.req_to_token[1, 180:190] = e.full_to_swa.numel()     # loc >= F
    bad = planner_call(device, e, rids + [9], L + [5], E + [5])  # rid 9 is beyond req_to_token
    gc, bc = ref.unpack_plan(good.plan, "compress"), ref.unpack_plan(bad.plan, "compress")
    gw, bw = ref.unpack_plan(good.plan_w, "write"), ref.unpack_plan(bad.plan_w, "write")
    n_c, n_w = int(gc["valid"].sum()), int(gw["valid"].sum())
    assert int(bc["valid"].sum()) >= n_c and int(bw["valid"].sum()) == n_w + 5
    for key in ("seq_len", "ragged_id", "buffer_len"):
        assert torch.equal(gc[key][:n_c], bc[key][:n_c])
    assert torch.equal(gw["ragged_id"][:n_w], bw["ragged_id"][:n_w])
    assert (bw["write_loc"][:n_w] == -1).sum() > 0 and torch.all(bw["write_loc"][n_w:n_w + 5] == -1)
    changed = bw["write_loc"][:n_w] != gw["write_loc"][:n_w]
    assert torch.all(bw["write_loc"][:n_w][changed] == -1)
    rc, rw = ref.plan_compress_prefill(torch.tensor(rids + [9]), torch.tensor(L + [5]), torch.tensor(E + [5]),
                                       e.req_to_token, e.full_to_swa, sum(E) + 5, 4, 64, 16, False, device == "cuda")
    assert torch.equal(bad.plan.cpu(), rc) and torch.equal(bad.plan_w.cpu(), rw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio,ring", [(4, 16), (128, 256)], ids=["c4-reqring", "c128"])
@pytest.mark.parametrize("shape", [(0, 64), (2, 0), (0, 0)], ids=["no-rows", "no-cols", "empty"])
def test_request_rings_bound_rids_by_an_empty_req_to_token(device, ratio, ring, shape):
    """A given req_to_token bounds request-ring rids by its row count (§2.2) even when it holds no element (no data
    pointer): with 0 rows every lookup is invalid; with rows but no columns, rids below the row count stay valid
    (p is not bounded by the column count)."""
    r2t = torch.zeros(shape, dtype=torch.int32)
    rids, L, E = torch.tensor([0, 1, 2, 5]), torch.tensor([9, 16, 300, 40]), torch.tensor([1, 5, 40, 8])
    kw = dict(compress_ratio=ratio, swa_page_size=0, ring_size=ring, use_req_ring=True)
    want_d = ref.plan_compress_decode(rids, L, r2t, None, ratio, 0, ring, True)
    want_c, want_w = ref.plan_compress_prefill(rids, L, E, r2t, None, 54, ratio, 0, ring, True, True)
    assert torch.all(ref.unpack_plan(want_d, "decode")["write_loc"][rids >= shape[0]] == -1)
    got_d = dsv4.plan_compress_decode(rids.to(device), L.to(device), r2t.to(device), **kw).plan
    assert torch.equal(got_d.cpu(), want_d)
    lens = [(L.to(device), E.to(device))] + ([(L, E)] if device == "cuda" else [])  # GPU-input and host paths
    for L_t, E_t in lens:
        got = dsv4.plan_compress_prefill(rids.to(device), L_t, E_t, r2t.to(device), num_q_tokens=54,
                                         use_cuda_graph=True, **kw)
        assert torch.equal(got.plan.cpu(), want_c) and torch.equal(got.plan_w.cpu(), want_w)


# ---------------------------------------------------------------------------------------------------------
# Validation (§3.7) and opcheck


def _decode_args(device="cpu"):
    return dict(req_pool_indices=torch.tensor([1, 2], device=device), seq_lens=torch.tensor([5, 9], device=device),
                req_to_token=torch.zeros(4, 64, dtype=torch.int32, device=device),
                full_to_swa=torch.zeros(300, dtype=torch.int64, device=device), compress_ratio=4, swa_page_size=64,
                ring_size=16, use_req_ring=False)


def _prefill_args(device="cpu"):
    a = _decode_args(device)
    a.update(extend_lens=torch.tensor([2, 3], device=device), num_q_tokens=5, use_cuda_graph=False)
    return a


def _decode(a):
    return torch.ops.dsv4.plan_compress_decode(a["req_pool_indices"], a["seq_lens"], a["req_to_token"],
                                               a["full_to_swa"], a["compress_ratio"], a["swa_page_size"],
                                               a["ring_size"], a["use_req_ring"])


def _prefill(a):
    return torch.ops.dsv4.plan_compress_prefill(a["req_pool_indices"], a["seq_lens"], a["extend_lens"],
                                                a["req_to_token"], a["full_to_swa"], a["num_q_tokens"],
                                                a["compress_ratio"], a["swa_page_size"], a["ring_size"],
                                                a["use_req_ring"], a["use_cuda_graph"])


COMMON_BAD = [
    ("ratio", dict(compress_ratio=2), "compress_ratio"),
    ("ring_multiple", dict(ring_size=18), "ring_size"),
    ("ring_small", dict(ring_size=4), "ring_size"),
    ("c128_ring", dict(compress_ratio=128, ring_size=64, use_req_ring=True), "ring_size"),
    ("sps_zero", dict(swa_page_size=0), "swa_page_size"),
    ("sps_multiple", dict(swa_page_size=24), "swa_page_size"),
    ("sps_too_large", dict(swa_page_size=2**31), "swa_page_size"),
    ("no_req_to_token", dict(req_to_token=None), "req_to_token"),
    ("no_full_to_swa", dict(full_to_swa=None), "full_to_swa"),
    ("r2t_dtype", dict(req_to_token=torch.zeros(4, 64, dtype=torch.int16)), "req_to_token"),
    ("r2t_dim", dict(req_to_token=torch.zeros(64, dtype=torch.int32)), "req_to_token"),
    ("r2t_overlapping_rows", dict(req_to_token=torch.zeros(64, dtype=torch.int32).expand(4, 64)), "req_to_token"),
    ("f2s_dtype", dict(full_to_swa=torch.zeros(300)), "full_to_swa"),
    ("rids_dtype", dict(req_pool_indices=torch.tensor([1.0, 2.0])), "req_pool_indices"),
    ("seq_lens_len", dict(seq_lens=torch.tensor([5])), "seq_lens"),
]
PREFILL_BAD = COMMON_BAD + [
    ("num_q_negative", dict(num_q_tokens=-1), "num_q_tokens"),
    ("extend_len", dict(extend_lens=torch.tensor([2])), "extend_lens"),
    ("extend_gt_seq", dict(extend_lens=torch.tensor([6, 3]), num_q_tokens=9), "extend_lens"),
    ("extend_negative", dict(extend_lens=torch.tensor([-1, 3])), "extend_lens"),
    ("seq_too_long", dict(seq_lens=torch.tensor([2**31, 9])), "seq_lens"),
    ("seq_negative", dict(seq_lens=torch.tensor([-3, 9]), extend_lens=torch.tensor([0, 3])),
     r"seq_lens\[0\]=-3 must lie in \[0, 2\^31 - 1\]"),
    ("sum_extend", dict(num_q_tokens=4), "extend_lens"),
]
VALUE_CHECKS = {"extend_gt_seq", "extend_negative", "seq_too_long", "seq_negative", "sum_extend"}


@pytest.mark.parametrize("arg", ["compress_ratio", "swa_page_size", "ring_size"])
def test_wrappers_pass_integers_unconverted(arg):
    """A float integer argument reaches the op's schema, which rejects it naming the op and the argument (an
    int() in the wrapper would truncate 16.5 to 16 and plan with it)."""
    a = _decode_args()
    a[arg] = a[arg] + 0.5
    kwargs = {k: a[k] for k in ("compress_ratio", "swa_page_size", "ring_size")}
    with pytest.raises(RuntimeError, match=rf"plan_compress_decode\(\) .* argument '{arg}'"):
        dsv4.plan_compress_decode(a["req_pool_indices"], a["seq_lens"], a["req_to_token"], a["full_to_swa"], **kwargs)
    p = _prefill_args()
    p[arg] = p[arg] + 0.5
    kwargs = {k: p[k] for k in ("num_q_tokens", "compress_ratio", "swa_page_size", "ring_size")}
    with pytest.raises(RuntimeError, match=rf"plan_compress_prefill\(\) .* argument '{arg}'"):
        dsv4.plan_compress_prefill(p["req_pool_indices"], p["seq_lens"], p["extend_lens"], p["req_to_token"],
                                   p["full_to_swa"], **kwargs)


@pytest.mark.parametrize("name,change,arg", COMMON_BAD, ids=[b[0] for b in COMMON_BAD])
def test_decode_validation(name, change, arg):
    a = _decode_args()
    a.update(change)
    with pytest.raises(RuntimeError, match=rf"plan_compress_decode: .*{arg}"):
        _decode(a)
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    with mode, pytest.raises(RuntimeError, match=rf"plan_compress_decode: .*{arg}"):
        _decode(fake)


@pytest.mark.parametrize("name,change,arg", PREFILL_BAD, ids=[b[0] for b in PREFILL_BAD])
def test_prefill_validation(name, change, arg):
    a = _prefill_args()
    a.update(change)
    with pytest.raises(RuntimeError, match=rf"plan_compress_prefill: .*{arg}"):
        _prefill(a)
    if name not in VALUE_CHECKS:  # fakes read no values
        mode = torch._subclasses.fake_tensor.FakeTensorMode()
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
        # use_cuda_graph: fixed output sizes, so that the fake fails on its checks, not on the data-dependent
        # sizes of compact host plans (DynamicOutputShapeException, a RuntimeError naming the op).
        fake["use_cuda_graph"] = True
        with mode, pytest.raises(RuntimeError, match=rf"plan_compress_prefill: .*{arg}"):
            _prefill(fake)


def test_out_buffers_validated():
    a = _prefill_args()
    args = [a[k] for k in ("req_pool_indices", "seq_lens", "extend_lens", "req_to_token", "full_to_swa",
                           "num_q_tokens", "compress_ratio", "swa_page_size", "ring_size", "use_req_ring")]
    good_c, good_w = torch.empty(5, 16, dtype=torch.uint8), torch.empty(5, 8, dtype=torch.uint8)
    for bad_c, bad_w, arg in [(torch.empty(4, 16, dtype=torch.uint8), good_w, "plan_c"),
                              (good_c, torch.empty(5, 16, dtype=torch.uint8), "plan_w"),
                              (good_c.view(torch.int32).view(torch.uint8)[:, :8], good_w, "plan_c"),
                              (torch.empty(5 * 16 + 8, dtype=torch.uint8)[8:].view(5, 16), good_w, "plan_c")]:
        with pytest.raises(RuntimeError, match=f"plan_compress_prefill_out: {arg}"):
            torch.ops.dsv4.plan_compress_prefill_out(*args, bad_c, bad_w)
    with pytest.raises(RuntimeError, match="plan_compress_decode_out: plan_d"):
        torch.ops.dsv4.plan_compress_decode_out(*args[:2], *args[3:5], 4, 64, 16, False,
                                                torch.empty(3, 16, dtype=torch.uint8))


@cuda_only
def test_device_placement_errors():
    a = _prefill_args("cuda")
    for name in ("req_to_token", "full_to_swa"):
        b = dict(a)
        b[name] = a[name].cpu()
        with pytest.raises(RuntimeError, match=f"plan_compress_prefill: {name} must be on cuda"):
            _prefill(b)
    b = dict(a, extend_lens=a["extend_lens"].cpu())  # seq_lens on CUDA selects the GPU path
    with pytest.raises(RuntimeError, match="plan_compress_prefill: extend_lens must be on cuda"):
        _prefill(b)
    b = dict(a, seq_lens=a["seq_lens"].cpu())  # host path: extend_lens must be on the CPU too
    with pytest.raises(RuntimeError, match="plan_compress_prefill: extend_lens must be on cpu"):
        _prefill(b)
    b = dict(a, seq_lens=a["seq_lens"].cpu(), extend_lens=a["extend_lens"].cpu())
    pc, pw = _prefill(b)  # the host-input path
    assert pc.is_cuda and pw.is_cuda
    d = _decode_args("cuda")
    d["seq_lens"] = d["seq_lens"].cpu()
    with pytest.raises(RuntimeError, match="plan_compress_decode: seq_lens must be on cuda"):
        _decode(d)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_planners(device):
    a = _prefill_args(device)
    a["req_to_token"] = torch.arange(4 * 64, dtype=torch.int32, device=device).view(4, 64)
    a["full_to_swa"] = torch.randperm(300, device=device)
    torch.library.opcheck(torch.ops.dsv4.plan_compress_decode.default,
                          tuple(a[k] for k in ("req_pool_indices", "seq_lens", "req_to_token", "full_to_swa",
                                               "compress_ratio", "swa_page_size", "ring_size", "use_req_ring")))
    plan_d = torch.empty(2, 16, dtype=torch.uint8, device=device)
    torch.library.opcheck(torch.ops.dsv4.plan_compress_decode_out.default,
                          tuple(a[k] for k in ("req_pool_indices", "seq_lens", "req_to_token", "full_to_swa",
                                               "compress_ratio", "swa_page_size", "ring_size", "use_req_ring"))
                          + (plan_d,))
    prefill = tuple(a[k] for k in ("req_pool_indices", "seq_lens", "extend_lens", "req_to_token", "full_to_swa",
                                   "num_q_tokens", "compress_ratio", "swa_page_size", "ring_size", "use_req_ring"))
    torch.library.opcheck(torch.ops.dsv4.plan_compress_prefill.default, prefill + (True,))
    pc = torch.empty(5, 16, dtype=torch.uint8, device=device)
    pw = torch.empty(5, 8, dtype=torch.uint8, device=device)
    torch.library.opcheck(torch.ops.dsv4.plan_compress_prefill_out.default, prefill + (pc, pw))
    if device == "cpu":  # compact host plans: data-dependent sizes
        torch.library.opcheck(torch.ops.dsv4.plan_compress_prefill.default, prefill + (False,),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_planners(device):
    torch._dynamo.reset()
    a = _prefill_args(device)

    def step(rids, L, E, r2t, f2s, plan_d):
        torch.ops.dsv4.plan_compress_decode_out(rids, L, r2t, f2s, 4, 64, 16, False, plan_d)
        return torch.ops.dsv4.plan_compress_prefill(rids, L, E, r2t, f2s, 5, 4, 64, 16, False, True)

    args = [a[k] for k in ("req_pool_indices", "seq_lens", "extend_lens", "req_to_token", "full_to_swa")]
    d_eager, d_comp = (torch.empty(2, 16, dtype=torch.uint8, device=device) for _ in range(2))
    eager = step(*args, d_eager)
    got = torch.compile(step, fullgraph=True)(*args, d_comp)
    assert torch.equal(d_eager, d_comp) and all(torch.equal(x, y) for x, y in zip(eager, got))
