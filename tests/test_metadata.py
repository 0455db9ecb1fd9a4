"""Tests of the metadata ops (spec/metadata.md §9): the CPU and CUDA implementations against the
pure-torch oracles over the input envelope, the oracles against the spec's worked examples, argument
errors, registration (opcheck, torch.compile), and on a GPU: CUDA-graph replay with poisoned outputs,
no host sync, streams, compute-sanitizer and DeepGEMM parity.
"""
from __future__ import annotations

import pytest
import torch

import sgl_dsv4_kernels as dk
from sanitizer import assert_memcheck_clean
from sgl_dsv4_kernels import reference as ref

ops = torch.ops.dsv4
HAS_CUDA = torch.cuda.is_available()
_skip_no_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def cuda_test(fn):
    return pytest.mark.cuda(_skip_no_cuda(fn))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, _skip_no_cuda])]
ROWS = [1, 17, 32, 128, 129, 1024, 1025, 4096, 65536]
# Per-argument index dtypes (cycled over an op's integer inputs) and whether 1-D inputs are strided.
VARIANTS = [("i32", False), ("i64", True), ("mixed", True)]
POISONS = (123, -7777)
H200_SMS = 132


def special_lengths(cap):
    return [-3, -1, 0, 1, 2, 3, 4, 5, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, cap, cap + 1]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def lengths(rows, cap, g, lo=-3):
    """Random lengths in [lo, cap + 1] with every special value of §9.1 at a random row."""
    values = torch.randint(lo, cap + 2, (rows,), generator=g)
    special = torch.tensor(special_lengths(cap))[: rows]
    values[torch.randperm(rows, generator=g)[: special.numel()]] = special
    return values


def dtypes_of(mix, n):
    cycle = {"i32": [torch.int32], "i64": [torch.int64], "mixed": [torch.int32, torch.int64]}[mix]
    return [cycle[i % len(cycle)] for i in range(n)]


def vector(values, dtype, strided, device):
    """`values` as a 1-D `dtype` tensor on `device`; strided: every third element of a poisoned buffer."""
    values = values.to(dtype)
    if not strided:
        return values.to(device)
    buf = torch.full((3 * values.numel() + 1,), 999_999, dtype=dtype)
    buf[1::3] = values
    return buf.to(device)[1::3]


def table(values, dtype, device, pad=0):
    """A 2-D table on `device` whose row stride exceeds its width by `pad` (poisoned) elements."""
    rows, cols = values.shape
    buf = torch.full((rows, cols + pad), -999_999, dtype=dtype)
    buf[:, :cols] = values.to(dtype)
    return buf.to(device)[:, :cols]


def locs(rows, dtype, g):
    """Write slots: negative, 0, 2^33 (int64 only) and random."""
    if dtype == torch.int64:
        special = [0, -1, -3, 2**33, 2**33 + 1, -(2**33), 1003, 2**40 + 7]
        values = torch.randint(-(2**34), 2**34, (rows,), generator=g)
    else:
        special = [0, -1, -3, 1003, 2**31 - 1, -(2**31)]
        values = torch.randint(-(2**31), 2**31, (rows,), generator=g)
    special = torch.tensor(special)[:rows]
    values[: special.numel()] = special
    return values


def assert_same(actual, expected):
    """torch.equal with dtype and shape, for tensors or (named) tuples of them."""
    if isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
        return
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.cpu(), expected.cpu()
    if not torch.equal(a, e):
        bad = (a != e).nonzero()[:5].tolist()
        raise AssertionError(f"mismatch at {bad}: got {[a[tuple(i)].item() for i in bad]}, "
                             f"expected {[e[tuple(i)].item() for i in bad]}")


def cpu_args(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def poisoned_like(tensors):
    return [torch.full_like(t, POISONS[i % 2]) for i, t in enumerate(tensors)]


# ---------------------------------------------------------------------------------------------
# Per-op checkers: pure op and _out twin on `args` (device tensors) against the oracle on CPU
# copies; on CUDA also the CPU implementation against the CUDA result.


def check_page_table(args, max_seq_len, page_size, swa_window):
    req_to_token, req_pool_indices, seq_lens = args
    expected = ref.build_page_table_positions_small(*cpu_args(args), max_seq_len, page_size, swa_window)
    got = ops.build_page_table_positions_small(*args, max_seq_len, page_size, swa_window)
    assert_same(got, expected)
    bufs = poisoned_like(got)
    ops.build_page_table_positions_small_out(*args, page_size, swa_window, *bufs)
    assert_same(bufs, expected)
    if seq_lens.is_cuda:
        assert_same(ops.build_page_table_positions_small(*cpu_args(args), max_seq_len, page_size, swa_window), got)
    return got


def check_low_ratio(args, topk):
    expected = ref.build_low_ratio_metadata(*cpu_args(args), topk)
    got = ops.build_low_ratio_metadata(*args, topk)
    assert_same(got, expected)
    bufs = poisoned_like(got)
    ops.build_low_ratio_metadata_out(*args, topk, *bufs)
    assert_same(bufs, expected)
    if args[0].is_cuda:
        assert_same(ops.build_low_ratio_metadata(*cpu_args(args), topk), got)
    return got


def check_fill_all(page_table, lens, width, ratio, page_size, with_raw=True):
    device = lens.device
    rows = lens.numel()
    expected_pages = torch.empty((rows, width), dtype=torch.int32)
    expected_raw = torch.empty((rows, width), dtype=torch.int32) if with_raw else None
    ref.fill_all_compressed_indices(page_table.cpu(), lens.cpu(), expected_pages, ratio, page_size, expected_raw)
    pages = torch.full((rows, width), POISONS[0], dtype=torch.int32, device=device)
    raw = torch.full((rows, width), POISONS[1], dtype=torch.int32, device=device) if with_raw else None
    ops.fill_all_compressed_indices(page_table, lens, pages, ratio, page_size, raw)
    assert_same(pages, expected_pages)
    if with_raw:
        assert_same(raw, expected_raw)
    if device.type == "cuda":
        cpu_pages = torch.empty((rows, width), dtype=torch.int32)
        cpu_raw = torch.empty((rows, width), dtype=torch.int32) if with_raw else None
        ops.fill_all_compressed_indices(page_table.cpu(), lens.cpu(), cpu_pages, ratio, page_size, cpu_raw)
        assert_same(cpu_pages, pages)
        if with_raw:
            assert_same(cpu_raw, raw)
    return pages, raw


def check_compression(args, page_table, page_size, compute=True):
    expected = ref.init_compression_metadata(
        *cpu_args(args), None if page_table is None else page_table.cpu(), page_size, compute
    )
    got = ops.init_compression_metadata(*args, page_table, page_size, compute)
    assert_same(got, expected)
    bufs = poisoned_like(got)
    ops.init_compression_metadata_out(*args, page_table, page_size, *bufs)
    assert_same(bufs, expected)
    if args[0].is_cuda:
        cpu_table = None if page_table is None else page_table.cpu()
        assert_same(ops.init_compression_metadata(*cpu_args(args), cpu_table, page_size, compute), got)
    return got


def check_schedule(context_lens, num_sms, block_kv=64, loop_oracle=True):
    expected = ref.get_paged_mqa_logits_metadata(context_lens.cpu(), block_kv, num_sms)
    if loop_oracle:
        assert_same(ref.get_paged_mqa_logits_metadata_loop(context_lens.cpu(), block_kv, num_sms), expected)
    got = ops.get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms)
    assert_same(got, expected)
    out = torch.full_like(got, POISONS[1])
    ops.get_paged_mqa_logits_metadata_out(context_lens, block_kv, out)
    assert_same(out, expected)
    if context_lens.is_cuda:
        assert_same(ops.get_paged_mqa_logits_metadata(context_lens.cpu(), block_kv, num_sms), got)
    return got


# ---------------------------------------------------------------------------------------------
# The oracles pinned by the spec's worked examples (and the ops on the same vectors).


def test_reference_page_table_example():
    # §2: page 256, max_seq_len 600 -> 3 pages, window 128.
    req_to_token = torch.zeros((1, 768), dtype=torch.int32)
    req_to_token[0, [0, 256, 512]] = torch.tensor([2560, 7936, -1], dtype=torch.int32)
    rows = ref.build_page_table_positions_small(
        req_to_token, torch.tensor([0, 0]), torch.tensor([300, -1]), 600, 256, 128
    )
    assert rows[0].tolist() == [300, -1]
    assert rows[1].tolist() == [299, -2]
    assert rows[2].tolist() == [[10, 31, 0], [10, 31, 0]]
    assert rows[3].tolist() == [128, -1]
    # Truncation: -1/256 = 0, -256/256 = -1, -257/256 = -1; an unknown request gives page 0.
    req_to_token = torch.tensor([[-1, -256, -257]], dtype=torch.int64)
    req, lens = torch.tensor([0, 5, -1]), torch.tensor([3, 3, 3])
    rows = ref.build_page_table_positions_small(req_to_token, req, lens, 3, 1, 9)
    assert rows[2].tolist() == [[-1, -256, -257], [0, 0, 0], [0, 0, 0]]


def test_reference_low_ratio_example():
    # §3 table, topk 512.
    L = torch.tensor([1, 4, 7, 1100, -2, -3])
    loc = torch.tensor([0, 1003, 1006, 5000, -3, 9])
    c1_loc, c1_len, c1_sparse, c1_pages, c2_loc, c2_len, c2_sparse, c2_pages = ref.build_low_ratio_metadata(L, loc, 512)
    assert c1_loc.tolist() == [0, 1003, 1006, 5000, -3, 9]
    assert c1_len.tolist() == [1, 4, 7, 1100, 1, 1]
    assert c1_sparse.tolist() == [1, 4, 7, 512, 1, 1]
    assert c2_loc.tolist() == [-1, 501, -1, 2500, -2, -1]
    assert c2_len.tolist() == [1, 2, 3, 550, 1, 1]
    assert c2_sparse.tolist() == [1, 2, 3, 512, 1, 1]
    assert c1_pages.shape == c2_pages.shape == (6, 512)
    assert bool((c1_pages == -1).all()) and bool((c2_pages == -1).all())
    assert c1_loc.dtype == torch.int64 and c1_len.dtype == torch.int32


def test_reference_fill_all_example():
    # §4: page 256, ratio 2 -> spp 128, page row [7, 3], len 130, W 512.
    pages = torch.empty((1, 512), dtype=torch.int32)
    raw = torch.empty((1, 512), dtype=torch.int32)
    ref.fill_all_compressed_indices(torch.tensor([[7, 3]]), torch.tensor([130]), pages, 2, 256, raw)
    assert pages[0, :128].tolist() == list(range(896, 1024))
    assert pages[0, 128:130].tolist() == [384, 385]
    assert bool((pages[0, 130:] == -1).all())
    assert raw[0, :130].tolist() == list(range(130)) and bool((raw[0, 130:] == -1).all())


def test_reference_compression_example():
    # §5 table: page 256, page row [5, 9] -> cap 4, width 64.
    s = torch.tensor([128, 258, 1, -5])
    pos = torch.tensor([127, 257, 0, -6])
    loc = torch.tensor([1024, 777, 0, -7])
    out = ref.init_compression_metadata(s, pos, loc, torch.tensor([[5, 9]] * 4), 256, True)
    assert [t.tolist() for t in out[:4]] == [[256, 0, 0, 0], [124, 256, 0, -8], [32, 64, 0, -1], [32, 64, 1, 1]]
    assert [t.tolist() for t in out[4:8]] == [[8, 0, 0, 0], [0, 256, 0, -128], [1, 2, 0, 0], [1, 2, 1, 1]]
    assert out[8].shape == (4, 64)
    assert out[8][:, :3].tolist() == [[10, -1, -1], [10, 11, -1], [-1, -1, -1], [-1, -1, -1]]
    assert bool((out[8][:, 3:] == -1).all())
    assert ref.init_compression_metadata(s, pos, loc, None, 0, False)[8].shape == (4, 0)


SCHEDULE_EXAMPLES = [
    ([300, 0, 513, -5, 256, 1], 4, [(0, 0), (0, 1), (2, 1), (4, 0), (6, 0)]),
    ([10, 0], 4, [(0, 0), (0, 0), (0, 0), (0, 0), (2, 0)]),
    ([0, 0, 0], 3, [(3, 0)] * 4),
    ([255, 256, 257], 2, [(0, 0), (2, 0), (3, 0)]),
    ([256], 2, [(0, 0), (0, 0), (1, 0)]),
    ([], 3, [(0, 0)] * 4),
]


@pytest.mark.parametrize("lens,num_sms,rows", SCHEDULE_EXAMPLES)
def test_reference_schedule_examples(lens, num_sms, rows):
    lens = torch.tensor(lens, dtype=torch.int32)
    for oracle in (ref.get_paged_mqa_logits_metadata, ref.get_paged_mqa_logits_metadata_loop):
        got = oracle(lens, 64, num_sms)
        assert got.dtype == torch.int32 and got.shape == (num_sms + 1, 2)
        assert [tuple(r) for r in got.tolist()] == rows
    # The older first-SMs-get-more order must not be produced.
    if num_sms == 4 and len(lens) == 6:
        assert ref.get_paged_mqa_logits_metadata(lens, 64, 4).tolist() != [[0, 0], [2, 0], [2, 2], [5, 0], [6, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_ops_on_spec_examples(device):
    # §2
    req_to_token = torch.zeros((1, 768), dtype=torch.int32)
    req_to_token[0, [0, 256, 512]] = torch.tensor([2560, 7936, -1], dtype=torch.int32)
    r = dk.build_page_table_positions_small(
        req_to_token.to(device), torch.tensor([0, 0], device=device), torch.tensor([300, -1], device=device),
        max_seq_len=600,
    )
    assert r.page_table.tolist() == [[10, 31, 0]] * 2 and r.positions_casual.tolist() == [299, -2]
    assert r.swa_topk_lengths.tolist() == [128, -1] and r.seq_lens_casual.tolist() == [300, -1]
    # §3
    m = dk.build_low_ratio_metadata(
        torch.tensor([1, 4, 7, 1100, -2, -3], device=device),
        torch.tensor([0, 1003, 1006, 5000, -3, 9], device=device),
        512,
    )
    assert m.c2_out_loc.tolist() == [-1, 501, -1, 2500, -2, -1] and m.c2_seq_lens.tolist() == [1, 2, 3, 550, 1, 1]
    # §4
    pages = torch.empty((1, 512), dtype=torch.int32, device=device)
    raw = torch.empty((1, 512), dtype=torch.int32, device=device)
    dk.fill_all_compressed_indices(
        torch.tensor([[7, 3]], device=device), torch.tensor([130], device=device), pages,
        compress_ratio=2, raw_indices=raw,
    )
    assert pages[0, 126:131].tolist() == [1022, 1023, 384, 385, -1] and raw[0, 128:131].tolist() == [128, 129, -1]
    # §5
    c = dk.init_compression_metadata(
        torch.tensor([128, 258, 1, -5], device=device), torch.tensor([127, 257, 0, -6], device=device),
        torch.tensor([1024, 777, 0, -7], device=device), torch.tensor([[5, 9]] * 4, device=device),
    )
    assert c.c4_out_loc.tolist() == [256, 0, 0, 0] and c.c128_positions.tolist() == [0, 256, 0, -128]
    assert c.c128_page_indices[:, :3].tolist() == [[10, -1, -1], [10, 11, -1], [-1, -1, -1], [-1, -1, -1]]
    none = dk.init_compression_metadata(
        torch.tensor([4], device=device), torch.tensor([3], device=device), torch.tensor([8], device=device),
        compute_page_indices=False,
    )
    assert none.c128_page_indices is None and none.c4_out_loc.tolist() == [2]
    # §6.3
    for lens, num_sms, rows in SCHEDULE_EXAMPLES:
        got = dk.get_paged_mqa_logits_metadata(torch.tensor(lens, dtype=torch.int32, device=device), 64, num_sms)
        assert [tuple(x) for x in got.tolist()] == rows


# ---------------------------------------------------------------------------------------------
# §9.1-2 build_page_table_positions_small


def negative_page_starts(values, page_size, g):
    """Rewrites half of the page-start slots of `values` [requests, C] (a checkerboard over requests and
    pages) in place with slots in [-257, 0), -1, -256 and -257 first: truncation and floor of
    slot / page_size differ on all but the multiples of the page size (§1.2, §9.2)."""
    starts = values[:, ::page_size]  # a view: column p holds the first slot of page p
    if starts.numel() == 0:
        return values
    checker = (torch.arange(starts.size(0))[:, None] + torch.arange(starts.size(1))[None, :]) % 2 == 0
    negative = torch.randint(-257, 0, starts.shape, generator=g)
    first = checker.flatten().nonzero()[:3, 0]
    negative.view(-1)[first] = torch.tensor([-1, -256, -257])[: first.numel()]
    starts[checker] = negative[checker]
    return values


def floor_differs(args, pages, page_size):
    """(reads, reads on which truncation and floor differ): page-table reads of known requests."""
    req_to_token, req, _ = cpu_args(args)
    req = req.to(torch.int64)
    known = req[(req >= 0) & (req < req_to_token.size(0))]
    slots = req_to_token[known][:, : pages * page_size : page_size].to(torch.int64)
    return slots.numel(), int(((slots < 0) & (slots % page_size != 0)).sum())


def page_table_case(rows, pages, page_size, mix, strided, device, seed, num_requests=None, pad=512):
    g = gen(seed)
    t_dtype, q_dtype, l_dtype = dtypes_of(mix, 3)
    capacity = pages * page_size
    num_requests = num_requests if num_requests is not None else min(rows, 64) + 1
    values = negative_page_starts(torch.randint(-256, 2**24, (num_requests, capacity), generator=g), page_size, g)
    req_to_token = table(values, t_dtype, device, pad=pad)
    req = torch.randint(-2, num_requests + 2, (rows,), generator=g)  # some unknown request ids
    req[: min(rows, 3)] = 0  # padded CUDA-graph rows use the dummy request 0
    lens = lengths(rows, capacity, g)
    args = (req_to_token, vector(req, q_dtype, strided, device), vector(lens, l_dtype, strided, device))
    return args, capacity


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_page_table_envelope(device, rows, mix, strided):
    args, capacity = page_table_case(rows, 17, 256, mix, strided, device, seed=rows)
    check_page_table(args, capacity, 256, 128)
    check_page_table(args, capacity - 300, 256, 1000)  # a partial last page, a wide window
    reads, differ = floor_differs(args, 17, 256)
    assert differ >= max(reads // 4, 1)  # truncation is pinned on many reads, not by one value


# 4098 pages at page size 256 (C = 2^20 + 512): more than 4096 pages per row at the real page size.
PAGE_TABLE_SHAPES = [(p, s) for p in (0, 1, 17, 256, 257, 4098) for s in (1, 64, 256, 1024)
                     if p * s <= 2**20 or (p, s) == (4098, 256)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pages,page_size", PAGE_TABLE_SHAPES)
def test_page_table_pages(device, pages, page_size):
    args, capacity = page_table_case(9, pages, page_size, "mixed", True, device, seed=pages + page_size, num_requests=3)
    got = check_page_table(args, capacity, page_size, 128)
    assert got[2].shape == (9, pages)
    reads, differ = floor_differs(args, pages, page_size)
    if page_size > 1 and reads:  # page size 1: truncation and floor agree
        assert differ >= max(reads // 4, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_page_table_zero_pages_and_unknown_requests(device):
    req_to_token = torch.arange(2 * 512, dtype=torch.int32, device=device).view(2, 512) * 256
    lens = torch.tensor([5, -1, 0, 2**31 - 1, -(2**31)], dtype=torch.int64, device=device)
    req = torch.tensor([0, 1, 2, -1, 10**12], device=device)
    r = dk.build_page_table_positions_small(req_to_token, req, lens, max_seq_len=0)
    assert r.page_table.shape == (5, 0)
    assert r.seq_lens_casual.tolist() == [5, -1, 0, 2**31 - 1, -(2**31)]
    assert r.positions_casual.tolist() == [4, -2, -1, 2**31 - 2, 2**31 - 1]
    assert r.swa_topk_lengths.tolist() == [5, -1, 0, 128, -(2**31)]
    r = dk.build_page_table_positions_small(req_to_token, req, lens, page_size=256)
    assert r.page_table[:, :2].tolist() == [[0, 256], [512, 768], [0, 0], [0, 0], [0, 0]]
    # An empty request pool: every row is unknown.
    check_page_table((req_to_token[:0], req, lens), 512, 256, 128)


@pytest.mark.parametrize("device", DEVICES)
def test_page_table_rejects_bad_arguments(device):
    op = "dsv4.build_page_table_positions_small"
    req_to_token = torch.zeros((2, 512), dtype=torch.int32, device=device)
    req = torch.zeros(3, dtype=torch.int64, device=device)
    lens = torch.ones(3, dtype=torch.int32, device=device)
    call = ops.build_page_table_positions_small
    with pytest.raises(RuntimeError, match=f"{op}: max_seq_len"):
        call(req_to_token, req, lens, 513, 256, 128)
    with pytest.raises(RuntimeError, match=f"{op}: max_seq_len"):
        call(req_to_token, req, lens, -1, 256, 128)
    with pytest.raises(RuntimeError, match=f"{op}: page_size"):
        call(req_to_token, req, lens, 512, 96, 128)
    with pytest.raises(RuntimeError, match=f"{op}: page_size"):
        call(req_to_token, req, lens, 512, 2048, 128)
    with pytest.raises(RuntimeError, match=f"{op}: swa_window"):
        call(req_to_token, req, lens, 512, 256, 0)
    with pytest.raises(RuntimeError, match=f"{op}: req_pool_indices"):
        call(req_to_token, req[:2], lens, 512, 256, 128)
    with pytest.raises(RuntimeError, match=f"{op}: req_to_token must be int32 or int64"):
        call(req_to_token.float(), req, lens, 512, 256, 128)
    with pytest.raises(RuntimeError, match=f"{op}: req_to_token must have stride"):
        call(torch.zeros((512, 2), dtype=torch.int32, device=device).t(), req, lens, 512, 256, 128)
    with pytest.raises(RuntimeError, match=f"{op}: seq_lens must be 1-D"):
        call(req_to_token, req, lens.view(3, 1), 512, 256, 128)
    bufs = [torch.empty(3, dtype=torch.int32, device=device) for _ in range(3)]
    table_ = torch.empty((3, 2), dtype=torch.int32, device=device)
    out = ops.build_page_table_positions_small_out
    out(req_to_token, req, lens, 256, 128, bufs[0], bufs[1], table_, bufs[2])
    with pytest.raises(RuntimeError, match=f"{op}_out: page_table has 3 columns"):
        too_wide = torch.empty((3, 3), dtype=torch.int32, device=device)
        out(req_to_token, req, lens, 256, 128, bufs[0], bufs[1], too_wide, bufs[2])
    with pytest.raises(RuntimeError, match=f"{op}_out: positions must be int32"):
        out(req_to_token, req, lens, 256, 128, bufs[0], bufs[1].long(), table_, bufs[2])
    with pytest.raises(RuntimeError, match=f"{op}_out: page_table must be contiguous"):
        wide = torch.empty((3, 4), dtype=torch.int32, device=device)[:, :2]
        out(req_to_token, req, lens, 256, 128, bufs[0], bufs[1], wide, bufs[2])
    with pytest.raises(RuntimeError, match=f"{op}_out: swa_lengths must have size 3"):
        out(req_to_token, req, lens, 256, 128, bufs[0], bufs[1], table_, bufs[2][:2])


# ---------------------------------------------------------------------------------------------
# §9.1, 9.3 build_low_ratio_metadata


def low_ratio_args(rows, mix, strided, device, seed):
    g = gen(seed)
    l_dtype, loc_dtype = dtypes_of(mix, 2) if mix != "mixed" else (torch.int64, torch.int32)
    if mix == "mixed" and seed % 2:
        l_dtype, loc_dtype = torch.int32, torch.int64
    return (
        vector(lengths(rows, 4096, g), l_dtype, strided, device),
        vector(locs(rows, loc_dtype, g), loc_dtype, strided, device),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_low_ratio_envelope(device, rows, mix, strided):
    topk = 512 if rows <= 4096 else 100
    check_low_ratio(low_ratio_args(rows, mix, strided, device, seed=rows + 1), topk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk,padded", [(1, 64), (100, 128), (512, 512), (1024, 1024)])
def test_low_ratio_topk(device, topk, padded):
    for seed in (1, 2):
        got = check_low_ratio(low_ratio_args(300, "mixed", True, device, seed), topk)
        assert got[3].shape == got[7].shape == (300, padded)


def test_low_ratio_matches_floor_and_shift_formulations():
    # The op equals the torch-floor formulation of §3 and the arithmetic-shift spelling of §1.2.
    L = torch.arange(-600, 600, dtype=torch.int32)
    loc = torch.arange(-600, 600, dtype=torch.int64) * 3 + 2**33
    got = dk.build_low_ratio_metadata(L, loc, 512)
    for r, (out_loc, seq, sparse) in ((1, got[0:3]), (2, got[4:7])):
        clamp1 = torch.clamp(L // r, min=1)
        assert torch.equal(out_loc, torch.where(L % r == 0, loc // r, -1))
        assert torch.equal(seq, clamp1) and torch.equal(sparse, torch.clamp(clamp1, max=512))
    assert torch.equal(got.c2_out_loc, torch.where((L & 1) == 0, loc >> 1, -1))
    assert torch.equal(got.c2_seq_lens, torch.clamp(L >> 1, min=1))
    # Floor, not truncation: L = -2 gives -1 -> clamp 1; loc -3 gives -2.
    m = dk.build_low_ratio_metadata(torch.tensor([-2]), torch.tensor([-3]), 512)
    assert m.c2_out_loc.tolist() == [-2]


@pytest.mark.parametrize("device", DEVICES)
def test_low_ratio_rejects_bad_arguments(device):
    op = "dsv4.build_low_ratio_metadata"
    lens = torch.ones(4, dtype=torch.int32, device=device)
    loc = torch.zeros(4, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=f"{op}: topk"):
        ops.build_low_ratio_metadata(lens, loc, 0)
    with pytest.raises(RuntimeError, match=f"{op}: out_loc must have 4"):
        ops.build_low_ratio_metadata(lens, loc[:3], 512)
    with pytest.raises(RuntimeError, match=f"{op}: out_loc must be int32 or int64"):
        ops.build_low_ratio_metadata(lens, loc.float(), 512)
    bufs = list(ops.build_low_ratio_metadata(lens, loc, 100))
    bad = bufs.copy()
    bad[3] = torch.empty((4, 100), dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=f"{op}_out: c1_page_indices must have size 128"):
        ops.build_low_ratio_metadata_out(lens, loc, 100, *bad)
    bad = bufs.copy()
    bad[4] = bufs[4].int()
    with pytest.raises(RuntimeError, match=f"{op}_out: c2_out_loc must be int64"):
        ops.build_low_ratio_metadata_out(lens, loc, 100, *bad)


# ---------------------------------------------------------------------------------------------
# §9.1, 9.4 fill_all_compressed_indices


def fill_all_args(rows, num_pages, cap, mix, strided, device, seed, pad=3):
    g = gen(seed)
    t_dtype, l_dtype = dtypes_of(mix, 2)
    page_table = table(torch.randint(0, 2**20, (rows, num_pages), generator=g), t_dtype, device, pad=pad)
    return page_table, vector(lengths(rows, cap, g), l_dtype, strided, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_fill_all_envelope(device, rows, mix, strided):
    width = 512 if rows <= 4096 else 64
    page_table, lens = fill_all_args(rows, 5, 5 * 64, mix, strided, device, seed=rows + 2)
    check_fill_all(page_table, lens, width, ratio=4, page_size=256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_raw", [True, False])
@pytest.mark.parametrize("width", [64, 512, 1024])
@pytest.mark.parametrize("ratio", [1, 2, 4, 128])
def test_fill_all_cases(device, ratio, width, with_raw):
    spp = 256 // ratio
    num_pages = 3
    page_table, _ = fill_all_args(40, num_pages, 1, "mixed", True, device, seed=ratio + width)
    special = [0, -1, -(2**31), 1, spp - 1, spp, spp + 1, spp * num_pages - 1, spp * num_pages, spp * num_pages + 1,
               width - 1, width, width + 1, 2**31 - 1]
    lens = torch.tensor(special + list(range(0, 40 - len(special))), dtype=torch.int64)
    pages, raw = check_fill_all(page_table, lens.to(device), width, ratio, 256, with_raw)
    # Columns beyond the page table are -1 whatever the length.
    assert bool((pages[:, spp * num_pages:] == -1).all())


@pytest.mark.parametrize("device", DEVICES)
def test_fill_all_hostile_page_ids_wrap(device):
    # int32 wrap arithmetic: page id 2^31 - 1 times spp overflows like the oracle's cast.
    page_table = torch.tensor([[2**31 - 1, -5], [2**40 + 3, -(2**31)]], dtype=torch.int64, device=device)
    check_fill_all(page_table, torch.tensor([64, 1000], device=device), 64, ratio=4, page_size=256)
    check_fill_all(page_table.int()[:, :0], torch.tensor([64, 1000], device=device), 8, ratio=4, page_size=256)


@pytest.mark.parametrize("device", DEVICES)
def test_fill_all_rejects_bad_arguments(device):
    op = "dsv4.fill_all_compressed_indices"
    page_table = torch.zeros((4, 2), dtype=torch.int32, device=device)
    lens = torch.ones(4, dtype=torch.int32, device=device)
    pages = torch.empty((4, 64), dtype=torch.int32, device=device)
    call = ops.fill_all_compressed_indices
    with pytest.raises(RuntimeError, match=f"{op}: compress_ratio"):
        call(page_table, lens, pages, 3, 256, None)
    with pytest.raises(RuntimeError, match=f"{op}: page_size 64 must be a multiple of compress_ratio 128"):
        call(page_table, lens, pages, 128, 64, None)
    with pytest.raises(RuntimeError, match=f"{op}: page_size"):
        call(page_table, lens, pages, 4, 2048, None)
    with pytest.raises(RuntimeError, match=f"{op}: raw_indices must have size 64"):
        call(page_table, lens, pages, 4, 256, torch.empty((4, 32), dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match=f"{op}: page_table must have 4 rows"):
        call(page_table[:3], lens, pages, 4, 256, None)
    with pytest.raises(RuntimeError, match=f"{op}: page_indices must be int32"):
        call(page_table, lens, pages.long(), 4, 256, None)
    with pytest.raises(RuntimeError, match=f"{op}: page_indices must be contiguous"):
        call(page_table, lens, torch.empty((4, 128), dtype=torch.int32, device=device)[:, ::2], 4, 256, None)


# ---------------------------------------------------------------------------------------------
# §9.1, 9.5 init_compression_metadata


def compression_args(bs, num_locs, cap_tokens, mix, strided, device, seed):
    g = gen(seed)
    s_dtype, p_dtype, l_dtype = dtypes_of(mix, 3)
    s = lengths(bs, cap_tokens, g)
    pos = s - 1
    pos[::7] = torch.randint(-300, 300, pos[::7].shape, generator=g)  # positions are independent inputs
    return (
        vector(s, s_dtype, strided, device),
        vector(pos, p_dtype, strided, device),
        vector(locs(num_locs, l_dtype, g), l_dtype, strided, device),
    )


def compression_table(bs, max_pages, mix, device, seed):
    values = torch.randint(-5, 2**20, (bs, max_pages), generator=gen(seed))
    return table(values, dtypes_of(mix, 4)[-1], device, pad=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("rows", ROWS)
def test_compression_envelope(device, rows, mix, strided):
    num_locs = rows - rows // 3  # context parallelism: fewer write rows than metadata rows
    args = compression_args(rows, num_locs, 3 * 256, mix, strided, device, seed=rows + 3)
    got = check_compression(args, compression_table(rows, 3, mix, device, rows), 256)
    assert got[8].shape == (rows, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size", [128, 256, 512])
@pytest.mark.parametrize("max_pages", [0, 32, 33, 4097])
def test_compression_cases(device, max_pages, page_size):
    cps = page_size // 128
    cap = cps * max_pages
    bs = 20
    s = torch.tensor([0, 1, 3, 4, 5, 127, 128, 129, 255, 256, 257, 511, cap * 128, cap * 128 + 128, -5, -128, 2**31 - 1,
                      -(2**31), 640, 1])
    pos = s - 1
    args = (s.int().to(device), vector(pos, torch.int64, True, device), torch.arange(bs - 3, device=device) * 4 + 2**33)
    got = check_compression(args, compression_table(bs, max_pages, "mixed", device, max_pages), page_size)
    if page_size == 256:
        assert got[8].shape[1] == {0: 0, 32: 64, 33: 128, 4097: 8256}[max_pages]


@pytest.mark.parametrize("device", DEVICES)
def test_compression_without_page_indices(device):
    args = compression_args(50, 40, 1000, "mixed", True, device, seed=5)
    got = check_compression(args, None, 0, compute=False)
    assert got[8].shape == (50, 0)
    assert dk.init_compression_metadata(*args, compute_page_indices=False).c128_page_indices is None
    # The _out form skips the page indices when given None (or a 0-column buffer).
    out = dk.metadata.CompressionMetadata(*poisoned_like(got[:8]), None)
    dk.init_compression_metadata_out(*args, out=out)
    assert_same(out[:8], got[:8])


@pytest.mark.parametrize("device", DEVICES)
def test_compression_rejects_bad_arguments(device):
    op = "dsv4.init_compression_metadata"
    s = torch.ones(4, dtype=torch.int32, device=device)
    loc = torch.zeros(4, dtype=torch.int64, device=device)
    page_table = torch.zeros((4, 2), dtype=torch.int32, device=device)
    call = ops.init_compression_metadata
    with pytest.raises(RuntimeError, match=f"{op}: page_table is required"):
        call(s, s, loc, None, 256, True)
    with pytest.raises(RuntimeError, match=f"{op}: page_size"):
        call(s, s, loc, page_table, 64, True)
    with pytest.raises(RuntimeError, match=f"{op}: page_size"):
        call(s, s, loc, page_table, 384, True)
    with pytest.raises(RuntimeError, match=f"{op}: raw_out_loc has 5 entries"):
        call(s, s, torch.zeros(5, dtype=torch.int64, device=device), page_table, 256, True)
    with pytest.raises(RuntimeError, match=f"{op}: positions must have 4"):
        call(s, s[:3], loc, page_table, 256, True)
    with pytest.raises(RuntimeError, match=f"{op}: page_table must have 4 rows"):
        call(s, s, loc, page_table[:2], 256, True)
    bufs = list(call(s, s, loc, page_table, 256, True))
    bad = bufs.copy()
    bad[8] = torch.empty((4, 128), dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=f"{op}_out: c128_page_indices must have 0 or 64 columns"):
        ops.init_compression_metadata_out(s, s, loc, page_table, 256, *bad)
    with pytest.raises(RuntimeError, match=f"{op}_out: page_table is required"):
        ops.init_compression_metadata_out(s, s, loc, None, 256, *bufs)
    bad = bufs.copy()
    bad[4] = bufs[4][:3]
    with pytest.raises(RuntimeError, match=f"{op}_out: c128_out_loc must have size 4"):
        ops.init_compression_metadata_out(s, s, loc, page_table, 256, *bad)


# ---------------------------------------------------------------------------------------------
# §9.1, 9.6 get_paged_mqa_logits_metadata


def schedule_lens(batch, max_len, mix, strided, device, seed, column=False):
    g = gen(seed)
    dtype = dtypes_of(mix, 1 + seed % 2)[-1]  # "mixed": int32 or int64 by seed
    values = lengths(batch, max_len, g) if batch else torch.zeros(0, dtype=torch.int64)
    values = torch.clamp(values, max=max_len + 1)
    if column:
        buf = torch.full((batch, 3), -1, dtype=dtype)
        buf[:, 1] = values.to(dtype)
        return buf.to(device)[:, 1:2]  # [B, 1] with row stride 3
    return vector(values, dtype, strided, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_len", [1, 255, 256, 257, 2048, 32768])
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("batch", ROWS)
def test_schedule_envelope(device, batch, mix, strided, max_len):
    lens = schedule_lens(batch, max_len, mix, strided, device, seed=batch + max_len)
    check_schedule(lens, H200_SMS, loop_oracle=batch <= 4096)


HAND_LISTS = {
    "one": [1],
    "one_split": [256],
    "around_split": [255, 256, 257],
    "h200_full_splits": [256] * H200_SMS,
    "one_long": [1] * (H200_SMS - 1) + [32768],
    "multiples_pm1": [k * 256 + d for k in range(1, 40) for d in (-1, 0, 1)],
    "all_zero": [0] * 100,
    "all_negative": [-1, -256, -(2**31)] * 30,
    "empty": [],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_sms", [1, 2, H200_SMS, 257, 1024])
@pytest.mark.parametrize("name", sorted(HAND_LISTS))
def test_schedule_hand_lists(device, name, num_sms):
    lens = torch.tensor(HAND_LISTS[name], dtype=torch.int32, device=device)
    got = check_schedule(lens, num_sms)
    batch = lens.numel()
    assert got[-1].tolist() == [batch, 0]  # the sentinel row
    if name in ("all_zero", "all_negative", "empty"):
        assert bool((got[:, 0] == batch).all()) and bool((got[:, 1] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [63, 64, 65, 2047, 2048, 2049, 4095, 4096, 4097, 8192, 8193, 12289])
def test_schedule_path_boundaries(device, batch):
    for max_len, num_sms in ((300, H200_SMS), (33000, 1024), (2, 257), (5000, 1)):
        check_schedule(schedule_lens(batch, max_len, "i32", False, device, seed=batch), num_sms, loop_oracle=False)


@pytest.mark.parametrize("device", DEVICES)
def test_schedule_int64_prefix(device):
    # Lengths of 2^31 - 1 (2^23 splits each) in a large batch: the split total passes 2^31, so the
    # prefix must be int64.
    batch = 65536
    lens = torch.full((batch,), 2**31 - 1, dtype=torch.int64)
    lens[::3] = 7
    lens[5] = -(2**31)
    got = check_schedule(lens.to(device), 1024, loop_oracle=False)
    n = ref.metadata._split_counts(lens)
    assert int(n.sum()) > 2**31
    assert got[-1].tolist() == [batch, 0]
    check_schedule(lens[:3000].to(device), H200_SMS, loop_oracle=False)


def equal_lengths_schedule(batch, length, num_sms):
    """The schedule of `batch` requests of one length > 0 in closed form (§6.2): n = ceil(length / 256)
    splits each, P_b = n·(b + 1), S = n·B, so b_i = #{b : n·(b + 1) <= start_i} = start_i // n and the
    split is start_i % n; start_i = i·q + max(i − pivot, 0) reaches B·n only at i = num_sms (the sentinel)."""
    n = -(-length // 256)
    q, rem = divmod(n * batch, num_sms)
    rows = []
    for i in range(num_sms + 1):
        start = i * q + max(i - (num_sms - rem), 0)
        rows.append([start // n, start % n] if start // n < batch else [batch, 0])
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch,length", [(1, 1), (5, 513), (131, 256), (4097, 770), (70001, 513)])
def test_schedule_equal_lengths_closed_form(device, batch, length):
    for num_sms in (1, H200_SMS, 1024):
        got = check_schedule(torch.full((batch,), length, dtype=torch.int32, device=device), num_sms,
                             loop_oracle=batch <= 4097)
        assert_same(got, equal_lengths_schedule(batch, length, num_sms))


@cuda_test
def test_schedule_chunked_tile_totals():
    """More than 4096 tiles of 4096 requests (B > 2^24): the large path's resolve kernel scans the tile
    totals in several chunks through shared memory (§6.5), so rows in later chunks depend on the carry.
    Random lengths (three of 2^31 − 1 at the end put many rows into the last tile) against the
    vectorised oracle; equal lengths of 513 (3 splits each, also past 8192 tiles) against the closed
    form of equal_lengths_schedule, since the oracle is slow there. At most ~0.4 GB of device memory."""
    batch = 2**24 + 3000
    lens = torch.randint(-3, 3000, (batch,), generator=gen(51), dtype=torch.int32)
    lens[-3:] = 2**31 - 1
    lens = lens.cuda()
    for num_sms in (1024, H200_SMS):
        got = check_schedule(lens, num_sms, loop_oracle=False)
        assert int((got[:-1, 0] >= 4096 * 4096).sum()) > 0  # rows resolved in the second chunk
    del lens
    for batch in (2**24 + 1, 2**25 + 4097):
        lens = torch.full((batch,), 513, dtype=torch.int32, device="cuda")
        for num_sms in (1024, H200_SMS, 1):
            expected = equal_lengths_schedule(batch, 513, num_sms)
            assert_same(ops.get_paged_mqa_logits_metadata(lens, 64, num_sms), expected)
            out = torch.full((num_sms + 1, 2), POISONS[0], dtype=torch.int32, device="cuda")
            ops.get_paged_mqa_logits_metadata_out(lens.view(-1, 1), 128, out)
            assert_same(out, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_schedule_fewer_splits_than_sms(device):
    # 0 < S < num_sms: the first `pivot` SMs sit on the first non-empty request at split 0.
    lens = torch.tensor([0, -4, 300, 0, 1], dtype=torch.int32, device=device)  # S = 3
    got = check_schedule(lens, 8)
    assert got.tolist() == [[2, 0]] * 5 + [[2, 0], [2, 1], [4, 0], [5, 0]]


@pytest.mark.parametrize("device", DEVICES)
def test_schedule_block_kv_shapes_and_dtypes(device):
    lens64 = schedule_lens(3000, 5000, "i64", False, device, seed=9)
    a = ops.get_paged_mqa_logits_metadata(lens64, 64, H200_SMS)
    assert torch.equal(a, ops.get_paged_mqa_logits_metadata(lens64, 128, H200_SMS))
    assert torch.equal(a, ops.get_paged_mqa_logits_metadata(lens64.int(), 64, H200_SMS))
    assert torch.equal(a, ops.get_paged_mqa_logits_metadata(lens64.view(-1, 1), 64, H200_SMS))
    column = schedule_lens(3000, 5000, "i64", False, device, seed=9, column=True)
    assert column.shape == (3000, 1) and column.stride(0) == 3
    assert torch.equal(a, ops.get_paged_mqa_logits_metadata(column, 64, H200_SMS))
    op = "dsv4.get_paged_mqa_logits_metadata"
    for block_kv in (32, 256, 0):
        with pytest.raises(RuntimeError, match=f"{op}: block_kv"):
            ops.get_paged_mqa_logits_metadata(lens64, block_kv, H200_SMS)
    for num_sms in (0, 1025, -1):
        with pytest.raises(RuntimeError, match=f"{op}: num_sms"):
            ops.get_paged_mqa_logits_metadata(lens64, 64, num_sms)
    with pytest.raises(RuntimeError, match=f"{op}: context_lens must be \\[B\\] or \\[B, 1\\]"):
        ops.get_paged_mqa_logits_metadata(lens64.view(-1, 2), 64, H200_SMS)
    with pytest.raises(RuntimeError, match=f"{op}: context_lens must be int32 or int64"):
        ops.get_paged_mqa_logits_metadata(lens64.float(), 64, H200_SMS)
    for bad in (torch.empty((1, 2), dtype=torch.int32), torch.empty((1026, 2), dtype=torch.int32),
                torch.empty((5, 3), dtype=torch.int32), torch.empty((5, 2), dtype=torch.int64)):
        with pytest.raises(RuntimeError, match=f"{op}_out: "):
            ops.get_paged_mqa_logits_metadata_out(lens64, 64, bad.to(device))
    if device == "cpu":
        with pytest.raises(ValueError, match="num_sms is required"):
            dk.get_paged_mqa_logits_metadata(lens64)


# ---------------------------------------------------------------------------------------------
# Sequences: decode steps that cross page and split boundaries, reusing the _out buffers.


@pytest.mark.parametrize("device", DEVICES)
def test_decode_sequence_reuses_buffers(device):
    rows = 24
    req_to_token = (torch.arange(rows * 1024, device=device).view(rows, 1024) + 5).int()
    req = torch.arange(rows, device=device)
    base = torch.arange(rows, device=device) * 37 - 40
    page_table = torch.arange(rows * 4, device=device).view(rows, 4) * 3
    bufs_pt = bufs_lr = bufs_cm = None
    sched = torch.empty((H200_SMS + 1, 2), dtype=torch.int32, device=device)
    pages = torch.empty((rows, 512), dtype=torch.int32, device=device)
    for step in range(0, 300, 7):  # prefill lengths, then decode across 256-token boundaries
        lens = base + step
        loc = lens * 3 - 7
        if bufs_pt is None:
            bufs_pt = dk.build_page_table_positions_small(req_to_token, req, lens)
            bufs_lr = dk.build_low_ratio_metadata(lens, loc, 512)
            bufs_cm = dk.init_compression_metadata(lens, lens - 1, loc, page_table)
        ptrs = [t.data_ptr() for t in (*bufs_pt, *bufs_lr, *bufs_cm, sched, pages)]
        dk.build_page_table_positions_small_out(req_to_token, req, lens, out=bufs_pt)
        dk.build_low_ratio_metadata_out(lens, loc, topk=512, out=bufs_lr)
        dk.init_compression_metadata_out(lens, lens - 1, loc, page_table, out=bufs_cm)
        dk.get_paged_mqa_logits_metadata_out(lens, out=sched)
        dk.fill_all_compressed_indices(page_table, bufs_cm.c4_seq_lens_raw, pages, compress_ratio=4)
        assert ptrs == [t.data_ptr() for t in (*bufs_pt, *bufs_lr, *bufs_cm, sched, pages)]
        cpu = [t.cpu() for t in (req_to_token, req, lens, loc, page_table)]
        assert_same(bufs_pt, ref.build_page_table_positions_small(cpu[0], cpu[1], cpu[2], 1024, 256, 128))
        assert_same(bufs_lr, ref.build_low_ratio_metadata(cpu[2], cpu[3], 512))
        expected_cm = ref.init_compression_metadata(cpu[2], cpu[2] - 1, cpu[3], cpu[4], 256, True)
        assert_same(bufs_cm, expected_cm)
        assert_same(sched, ref.get_paged_mqa_logits_metadata(cpu[2], 64, H200_SMS))
        expected_pages = torch.empty((rows, 512), dtype=torch.int32)
        ref.fill_all_compressed_indices(cpu[4], expected_cm[2], expected_pages, 4, 256)
        assert_same(pages, expected_pages)


# ---------------------------------------------------------------------------------------------
# An empty batch: rows = 0 gives empty outputs of the spec's shapes and dtypes, and no launch (§2).


def empty_batch_calls(device, mix, strided):
    """name -> (pure call or None for the writer, _out call taking the buffers, oracle call, [(shape,
    dtype)] of the outputs by §2-§6) for every op at rows = 0 (the schedule: B = 0)."""
    l_dtype, q_dtype, t_dtype = dtypes_of(mix, 3)
    empty = torch.empty(0, dtype=torch.int64)
    lens, req = vector(empty, l_dtype, strided, device), vector(empty, q_dtype, strided, device)
    loc = vector(empty, q_dtype, strided, device)
    req_to_token = table(torch.randint(-256, 2**24, (3, 1024), generator=gen(41)), t_dtype, device, pad=512)
    page_table = table(torch.zeros((0, 33), dtype=torch.int64), t_dtype, device, pad=5)
    c = lambda *a: cpu_args(a)  # noqa: E731
    i32, i64 = torch.int32, torch.int64
    pt = (req_to_token, req, lens)
    cm = (lens, lens, loc, page_table)
    width = (2 * 33 + 63) // 64 * 64  # cps 2 at page 256: cap 66 -> width 128

    def fill_all(pages, raw):
        return ops.fill_all_compressed_indices(page_table, lens, pages, 4, 256, raw)

    def fill_all_oracle():
        out = [torch.empty((0, 64), dtype=i32) for _ in range(2)]
        return ref.fill_all_compressed_indices(*c(page_table, lens), out[0], 4, 256, out[1])

    return {
        "page_table": (
            lambda: ops.build_page_table_positions_small(*pt, 1024, 256, 128),
            lambda *b: ops.build_page_table_positions_small_out(*pt, 256, 128, *b),
            lambda: ref.build_page_table_positions_small(*c(*pt), 1024, 256, 128),
            [((0,), i32), ((0,), i32), ((0, 4), i32), ((0,), i32)],
        ),
        "low_ratio": (
            lambda: ops.build_low_ratio_metadata(lens, loc, 100),
            lambda *b: ops.build_low_ratio_metadata_out(lens, loc, 100, *b),
            lambda: ref.build_low_ratio_metadata(*c(lens, loc), 100),
            [((0,), i64), ((0,), i32), ((0,), i32), ((0, 128), i32)] * 2,
        ),
        "fill_all": (None, fill_all, fill_all_oracle, [((0, 64), i32)] * 2),
        "compression": (
            lambda: ops.init_compression_metadata(*cm, 256, True),
            lambda *b: ops.init_compression_metadata_out(*cm, 256, *b),
            lambda: ref.init_compression_metadata(*c(*cm), 256, True),
            [((0,), i64), ((0,), i32), ((0,), i32), ((0,), i32)] * 2 + [((0, width), i32)],
        ),
        "compression_no_pages": (
            lambda: ops.init_compression_metadata(lens, lens, loc, None, 0, False),
            lambda *b: ops.init_compression_metadata_out(lens, lens, loc, None, 0, *b),
            lambda: ref.init_compression_metadata(*c(lens, lens, loc), None, 0, False),
            [((0,), i64), ((0,), i32), ((0,), i32), ((0,), i32)] * 2 + [((0, 0), i32)],
        ),
        "schedule": (  # B = 0 still writes every row: all (0, 0)
            lambda: ops.get_paged_mqa_logits_metadata(lens, 64, H200_SMS),
            lambda *b: ops.get_paged_mqa_logits_metadata_out(lens, 64, *b),
            lambda: ref.get_paged_mqa_logits_metadata(*c(lens), 64, H200_SMS),
            [((H200_SMS + 1, 2), i32)],
        ),
    }


def carved(shape, dtype, device, margin=16):
    """(backing, buffer): a contiguous `shape` buffer at offset `margin` inside a poisoned allocation
    that extends `margin` elements on both sides."""
    numel = 1
    for n in shape:
        numel *= n
    backing = torch.full((numel + 2 * margin,), POISONS[1], dtype=dtype, device=device)
    return backing, backing.as_strided(shape, torch.empty(shape).stride(), margin)


EMPTY_BATCH_CASES = sorted(empty_batch_calls("cpu", "i32", False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mix,strided", VARIANTS)
@pytest.mark.parametrize("name", EMPTY_BATCH_CASES)
def test_empty_batch(device, name, mix, strided):
    pure, out, oracle, shapes = empty_batch_calls(device, mix, strided)[name]
    expected = _as_tuple(oracle())
    assert [(tuple(t.shape), t.dtype) for t in expected] == shapes  # the oracle agrees with §2-§6
    if pure is not None:
        got = _as_tuple(pure())
        assert [(tuple(t.shape), t.dtype) for t in got] == shapes
        assert all(t.device.type == device for t in got)
        assert_same(got, expected)
    # _out twin (the writer itself for fill_all): zero-row buffers inside poisoned allocations stay
    # untouched, and so does everything around every buffer.
    backings, bufs = zip(*(carved(shape, dtype, device) for shape, dtype in shapes))
    out(*bufs)
    assert_same(bufs, expected)
    for backing, buf in zip(backings, bufs):
        margins = torch.cat([backing[:16], backing[16 + buf.numel():]])
        assert bool((margins == POISONS[1]).all())


# ---------------------------------------------------------------------------------------------
# §9.9 registration: opcheck, fakes, torch.compile


def sample_calls(device):
    """(op, args) for every op, small inputs with hostile values, strided where allowed."""
    g = gen(11)
    pt_args, capacity = page_table_case(9, 4, 64, "mixed", True, device, seed=3, num_requests=4)
    lr = low_ratio_args(10, "mixed", True, device, seed=4)
    page_table, lens = fill_all_args(6, 3, 200, "mixed", True, device, seed=5)
    cm = compression_args(12, 9, 900, "mixed", True, device, seed=6)
    cm_table = compression_table(12, 3, "mixed", device, 6)
    ctx = vector(lengths(40, 3000, g), torch.int32, True, device)
    big_ctx = torch.randint(-3, 5000, (5000, 1), generator=g).int().to(device)
    pt_out = [t.clone() for t in ops.build_page_table_positions_small(*pt_args, capacity, 64, 128)]
    lr_out = [t.clone() for t in ops.build_low_ratio_metadata(*lr, 100)]
    cm_out = [t.clone() for t in ops.init_compression_metadata(*cm, cm_table, 256, True)]
    pages = torch.empty((6, 64), dtype=torch.int32, device=device)
    raw = torch.empty((6, 64), dtype=torch.int32, device=device)
    sched = torch.empty((9, 2), dtype=torch.int32, device=device)
    return {
        "page_table": (ops.build_page_table_positions_small.default, (*pt_args, capacity, 64, 128)),
        "page_table_out": (ops.build_page_table_positions_small_out.default, (*pt_args, 64, 128, *pt_out)),
        "low_ratio": (ops.build_low_ratio_metadata.default, (*lr, 100)),
        "low_ratio_out": (ops.build_low_ratio_metadata_out.default, (*lr, 100, *lr_out)),
        "fill_all": (ops.fill_all_compressed_indices.default, (page_table, lens, pages, 4, 256, None)),
        "fill_all_raw": (ops.fill_all_compressed_indices.default, (page_table, lens, pages, 2, 256, raw)),
        "compression": (ops.init_compression_metadata.default, (*cm, cm_table, 256, True)),
        "compression_no_pages": (ops.init_compression_metadata.default, (*cm, None, 0, False)),
        "compression_out": (ops.init_compression_metadata_out.default, (*cm, cm_table, 256, *cm_out)),
        "schedule": (ops.get_paged_mqa_logits_metadata.default, (ctx, 64, 8)),
        "schedule_large": (ops.get_paged_mqa_logits_metadata.default, (big_ctx, 128, H200_SMS)),
        "schedule_out": (ops.get_paged_mqa_logits_metadata_out.default, (ctx, 64, sched)),
        # rows = 0 (B = 0 for the schedule)
        "page_table_empty": (ops.build_page_table_positions_small.default,
                             (pt_args[0], *(t[:0] for t in pt_args[1:]), capacity, 64, 128)),
        "page_table_out_empty": (ops.build_page_table_positions_small_out.default,
                                 (pt_args[0], *(t[:0] for t in pt_args[1:]), 64, 128, *(t[:0] for t in pt_out))),
        "low_ratio_empty": (ops.build_low_ratio_metadata.default, (*(t[:0] for t in lr), 100)),
        "low_ratio_out_empty": (ops.build_low_ratio_metadata_out.default,
                                (*(t[:0] for t in lr), 100, *(t[:0] for t in lr_out))),
        "fill_all_empty": (ops.fill_all_compressed_indices.default,
                           (page_table[:0], lens[:0], pages[:0], 2, 256, raw[:0])),
        "compression_empty": (ops.init_compression_metadata.default, (*(t[:0] for t in cm), cm_table[:0], 256, True)),
        "compression_out_empty": (ops.init_compression_metadata_out.default,
                                  (*(t[:0] for t in cm), cm_table[:0], 256, *(t[:0] for t in cm_out))),
        "schedule_empty": (ops.get_paged_mqa_logits_metadata.default, (ctx[:0], 64, 8)),
        "schedule_out_empty": (ops.get_paged_mqa_logits_metadata_out.default, (ctx[:0], 64, sched)),
    }


OPCHECK_CASES = sorted(sample_calls("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck(device, case):
    op, args = sample_calls(device)[case]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_fakes_match_real_shapes(case):
    # The fakes compute the real op's shapes and dtypes without reading values (meta tensors).
    op, args = sample_calls("cpu")[case]
    real = op(*args)
    meta = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
    if real is None:
        assert meta is None
        return
    real = real if isinstance(real, tuple) else (real,)
    meta = meta if isinstance(meta, tuple) else (meta,)
    assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in meta]


def test_fakes_reject_bad_arguments():
    meta = lambda *shape, dtype=torch.int32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    with pytest.raises(RuntimeError, match="dsv4.build_low_ratio_metadata: topk"):
        ops.build_low_ratio_metadata(meta(4), meta(4), 0)
    with pytest.raises(RuntimeError, match="dsv4.get_paged_mqa_logits_metadata: num_sms"):
        ops.get_paged_mqa_logits_metadata(meta(4), 64, 1025)
    with pytest.raises(RuntimeError, match="dsv4.init_compression_metadata: page_table is required"):
        ops.init_compression_metadata(meta(4), meta(4), meta(4), None, 256, True)
    with pytest.raises(RuntimeError, match="dsv4.build_page_table_positions_small: max_seq_len"):
        ops.build_page_table_positions_small(meta(2, 64), meta(3), meta(3), 65, 64, 128)


def metadata_step(req_to_token, req, lens, loc, page_table, ctx, pages, raw):
    """Every pure op plus the in-place fill, as a model's metadata preparation would call them."""
    pt = ops.build_page_table_positions_small(req_to_token, req, lens, req_to_token.size(1), 256, 128)
    lr = ops.build_low_ratio_metadata(lens, loc, 512)
    cm = ops.init_compression_metadata(lens, pt[1], loc, page_table, 256, True)
    sched = ops.get_paged_mqa_logits_metadata(ctx, 64, 8)
    ops.fill_all_compressed_indices(page_table, cm[2], pages, 4, 256, raw)
    return pt, lr, cm, sched


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    g = gen(12)
    rows = 33
    req_to_token = torch.randint(-256, 2**20, (8, 1024), generator=g).int().to(device)
    req = torch.randint(-1, 9, (rows,), generator=g).to(device)
    lens = lengths(rows, 1024, g).to(device)
    loc = locs(rows, torch.int64, g).to(device)
    page_table = torch.randint(0, 1000, (rows, 4), generator=g).int().to(device)
    ctx = lengths(70, 4000, g).int().to(device)
    bufs = [torch.full((rows, 64), POISONS[i % 2], dtype=torch.int32, device=device) for i in range(4)]
    torch._dynamo.reset()
    compiled = torch.compile(metadata_step, fullgraph=True)
    got = compiled(req_to_token, req, lens, loc, page_table, ctx, bufs[0], bufs[1])
    expected = metadata_step(req_to_token, req, lens, loc, page_table, ctx, bufs[2], bufs[3])
    assert_same(got, expected)
    assert_same(bufs[:2], bufs[2:])
    # Changed values, same shapes: no recompilation needed, results still exact.
    lens2 = lens + 300
    got = compiled(req_to_token, req, lens2, loc, page_table, ctx - 1000, bufs[0], bufs[1])
    assert_same(got, metadata_step(req_to_token, req, lens2, loc, page_table, ctx - 1000, bufs[2], bufs[3]))
    assert_same(bufs[:2], bufs[2:])


# ---------------------------------------------------------------------------------------------
# §9.7-9.8 CUDA graphs: capture, mutate inputs in place, poison outputs, replay, compare.


class GraphCase:
    """Device inputs `args` (rewritten in place between replays), the op call on them (the pure op,
    or the _out twin into buffers made once), and the oracle of their current values."""

    def __init__(self, args, call, oracle, mutate):
        self.args, self.call, self.oracle, self.mutate = args, call, oracle, mutate

    def run(self):
        return _as_tuple(self.call(*self.args))

    def expected(self):
        return _as_tuple(self.oracle(*cpu_args(self.args)))


GRAPH_ROWS = 70


def _base_lengths(device):
    # Replay k adds k (see _shift_lengths): every special length -2 .. +3 crosses -1/0, parity, 256.
    return torch.tensor(special_lengths(4096) * 4)[:GRAPH_ROWS].to(device) - 2


def _shift_lengths(lens, base, k):
    # Replay 2 empties every length: long -> empty -> long across replays 1, 2, 3.
    shifted = base + k if k != 2 else torch.zeros_like(base)
    lens.copy_(shifted.to(lens.dtype))


def _shift_locs(loc, base, k):
    loc.copy_((base + (k - 2) * 2**32 - k).to(loc.dtype))  # crosses negative values and 2^33


def _pure_or_out(pure, out_op, use_out, args, tail_pure, tail_out):
    """`pure(*args, *tail_pure)`, or the _out twin into buffers cloned from one pure call."""
    if not use_out:
        return lambda *a: pure(*a, *tail_pure)
    bufs = [t.clone() for t in pure(*args, *tail_pure)]

    def call(*a):
        out_op(*a, *tail_out, *bufs)
        return bufs

    return call


def graph_page_table(device, use_out, g):
    base_lens = _base_lengths(device)
    values = negative_page_starts(torch.randint(-256, 2**24, (9, 4096 + 512), generator=g), 256, g)
    req_to_token = values.int().to(device)[:, :4096]
    req = torch.randint(-1, 10, (GRAPH_ROWS,), generator=g).to(device)
    base_req = req.clone()
    args = [req_to_token, req, base_lens.int()]
    call = _pure_or_out(ops.build_page_table_positions_small, ops.build_page_table_positions_small_out, use_out,
                        args, (4096, 256, 128), (256, 128))

    def mutate(args, k):
        _shift_lengths(args[2], base_lens, k)
        args[1].copy_(torch.roll(base_req, k))  # the request mapping rotates

    return GraphCase(args, call, lambda *a: ref.build_page_table_positions_small(*a, 4096, 256, 128), mutate)


def graph_low_ratio(device, use_out, g):
    base_lens, base_loc = _base_lengths(device), locs(GRAPH_ROWS, torch.int64, g).to(device)
    args = [base_lens.clone(), base_loc.clone()]
    call = _pure_or_out(ops.build_low_ratio_metadata, ops.build_low_ratio_metadata_out, use_out, args, (512,), (512,))

    def mutate(args, k):
        _shift_lengths(args[0], base_lens, k)
        _shift_locs(args[1], base_loc, k)

    return GraphCase(args, call, lambda *a: ref.build_low_ratio_metadata(*a, 512), mutate)


def graph_compression(device, use_out, g):
    base_lens = _base_lengths(device) * 40
    num_locs = GRAPH_ROWS - 5  # fewer write rows than metadata rows
    base_loc = locs(num_locs, torch.int64, g).to(device)
    page_table = torch.randint(0, 2**20, (GRAPH_ROWS, 33), generator=g).to(device)
    args = [base_lens.int(), base_lens - 1, base_loc.clone(), page_table]
    call = _pure_or_out(ops.init_compression_metadata, ops.init_compression_metadata_out, use_out,
                        args, (256, True), (256,))

    def mutate(args, k):
        _shift_lengths(args[0], base_lens, k)
        _shift_lengths(args[1], base_lens - 1, k)
        _shift_locs(args[2], base_loc, k)

    return GraphCase(args, call, lambda *a: ref.init_compression_metadata(*a, 256, True), mutate)


def graph_fill_all(device, use_out, g):
    # A writer: the op itself writes caller buffers, so both variants are the same call.
    base_lens = _base_lengths(device)
    page_table = torch.randint(0, 2**20, (GRAPH_ROWS, 5), generator=g).int().to(device)
    pages = torch.empty((GRAPH_ROWS, 512), dtype=torch.int32, device=device)
    raw = torch.empty_like(pages)

    def call(page_table, lens):
        ops.fill_all_compressed_indices(page_table, lens, pages, 2, 256, raw)
        return pages, raw

    def oracle(page_table, lens):
        out = [torch.empty((GRAPH_ROWS, 512), dtype=torch.int32) for _ in range(2)]
        return ref.fill_all_compressed_indices(page_table, lens, out[0], 2, 256, out[1])

    return GraphCase([page_table, base_lens.clone()], call, oracle,
                     lambda args, k: _shift_lengths(args[1], base_lens, k))


def graph_schedule(batch):
    def build(device, use_out, g):
        base = torch.randint(-3, 40000, (batch,), generator=g).to(device)
        args = [base.int()]
        if use_out:
            out = torch.empty((H200_SMS + 1, 2), dtype=torch.int32, device=device)

            def call(lens):
                ops.get_paged_mqa_logits_metadata_out(lens, 64, out)
                return out
        else:
            def call(lens):
                return ops.get_paged_mqa_logits_metadata(lens, 64, H200_SMS)

        def mutate(args, k):
            # k = 0..5: all -1 (empty), long, zeros (empty), long, all 3 (one split each), long
            _shift_lengths(args[0], base * (k % 2) + k - 1, k)

        return GraphCase(args, call, lambda lens: ref.get_paged_mqa_logits_metadata(lens, 64, H200_SMS), mutate)

    return build


def graph_empty(device, use_out, g):
    # rows = 0 for every op (empty outputs, no launch), captured with the schedule of B = 0, which
    # still writes its rows (all (0, 0)), so the graph is not empty.
    req_to_token = torch.randint(-256, 2**24, (3, 1024), generator=g).int().to(device)
    lens = torch.empty(0, dtype=torch.int32, device=device)
    loc = torch.empty(0, dtype=torch.int64, device=device)
    page_table = torch.empty((0, 33), dtype=torch.int32, device=device)
    pages = torch.empty((0, 512), dtype=torch.int32, device=device)
    raw = torch.empty_like(pages)
    pt = _pure_or_out(ops.build_page_table_positions_small, ops.build_page_table_positions_small_out, use_out,
                      [req_to_token, loc, lens], (1024, 256, 128), (256, 128))
    lr = _pure_or_out(ops.build_low_ratio_metadata, ops.build_low_ratio_metadata_out, use_out, [lens, loc],
                      (512,), (512,))
    cm = _pure_or_out(ops.init_compression_metadata, ops.init_compression_metadata_out, use_out,
                      [lens, lens, loc, page_table], (256, True), (256,))
    schedule = graph_schedule(0)(device, use_out, g)

    def call(req_to_token, lens, loc, page_table):
        ops.fill_all_compressed_indices(page_table, lens, pages, 2, 256, raw)
        return (*pt(req_to_token, loc, lens), *lr(lens, loc), *cm(lens, lens, loc, page_table), pages, raw,
                schedule.call(lens))

    def oracle(req_to_token, lens, loc, page_table):
        out = [torch.empty((0, 512), dtype=torch.int32) for _ in range(2)]
        return (*ref.build_page_table_positions_small(req_to_token, loc, lens, 1024, 256, 128),
                *ref.build_low_ratio_metadata(lens, loc, 512),
                *ref.init_compression_metadata(lens, lens, loc, page_table, 256, True),
                *ref.fill_all_compressed_indices(page_table, lens, out[0], 2, 256, out[1]),
                ref.get_paged_mqa_logits_metadata(lens, 64, H200_SMS))

    return GraphCase([req_to_token, lens, loc, page_table], call, oracle, lambda args, k: None)


GRAPH_BUILDERS = {
    "empty": graph_empty,
    "page_table": graph_page_table,
    "low_ratio": graph_low_ratio,
    "compression": graph_compression,
    "fill_all": graph_fill_all,
    "schedule_5": graph_schedule(5),  # each path of §6.5: one warp, one CTA, tiles
    "schedule_1000": graph_schedule(1000),
    "schedule_65536": graph_schedule(65536),
}
GRAPH_CASES = sorted(GRAPH_BUILDERS)


def graph_cases(device, use_out):
    g = gen(21)
    return {name: GRAPH_BUILDERS[name](device, use_out, g) for name in GRAPH_CASES}


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


@cuda_test
@pytest.mark.parametrize("use_out", [False, True])
@pytest.mark.parametrize("name", GRAPH_CASES)
def test_cuda_graph_replay_with_poisoned_outputs(name, use_out):
    case = graph_cases("cuda", use_out)[name]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            case.run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = case.run()
    pointers = [t.data_ptr() for t in outputs]
    for k in range(6):
        case.mutate(case.args, k)
        for j, t in enumerate(outputs):
            t.fill_(POISONS[(j + k) % 2])
        graph.replay()
        torch.cuda.synchronize()
        expected = case.expected()
        assert_same(outputs, expected)
        assert [t.data_ptr() for t in outputs] == pointers
        if use_out:  # the caller's buffers: an eager call rewrites the same addresses
            assert [t.data_ptr() for t in case.run()] == pointers
            assert_same(outputs, expected)


@cuda_test
def test_no_host_sync_and_no_allocation_in_replay():
    cases = [c for use_out in (False, True) for c in graph_cases("cuda", use_out).values()]
    for case in cases:
        case.run()  # warm-up (first-use allocations, PDL attribute query)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for case in cases:
            case.run()
        dk.get_paged_mqa_logits_metadata(torch.ones(10, dtype=torch.int32, device="cuda"))  # SM-count default
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for case in cases:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            case.run()
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        for key in ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.allocated"):
            assert after[key] == before[key], key


@cuda_test
def test_non_default_stream():
    # Inputs are rewritten on a side stream behind a long sleep; the ops must run on that stream
    # (the current one), after the rewrite, or they would read the stale values.
    stream = torch.cuda.Stream()
    cases = graph_cases("cuda", False)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for case in cases.values():
            torch.cuda._sleep(20_000_000)
            case.mutate(case.args, 3)
            got = case.run()
            stream.synchronize()
            assert_same(got, case.expected())


@cuda_test
@pytest.mark.parametrize("device_pair", [("cpu", "cuda"), ("cuda", "cpu")])
def test_rejects_mixed_devices(device_pair):
    a, b = device_pair
    with pytest.raises(RuntimeError, match="dsv4.build_page_table_positions_small: req_pool_indices must be on"):
        ops.build_page_table_positions_small(
            torch.zeros((2, 512), device=a, dtype=torch.int32), torch.zeros(3, device=b, dtype=torch.int64),
            torch.ones(3, device=a, dtype=torch.int32), 512, 256, 128)
    bufs = [torch.empty(3, device=a, dtype=torch.int32) for _ in range(3)]
    with pytest.raises(RuntimeError, match="dsv4.build_page_table_positions_small_out: page_table must be on"):
        ops.build_page_table_positions_small_out(
            torch.zeros((2, 512), device=a, dtype=torch.int32), torch.zeros(3, device=a, dtype=torch.int64),
            torch.ones(3, device=a, dtype=torch.int32), 256, 128, bufs[0], bufs[1],
            torch.empty((3, 2), device=b, dtype=torch.int32), bufs[2])
    with pytest.raises(RuntimeError, match="dsv4.build_low_ratio_metadata: out_loc must be on"):
        ops.build_low_ratio_metadata(
            torch.ones(3, device=a, dtype=torch.int32), torch.ones(3, device=b, dtype=torch.int64), 512)
    with pytest.raises(RuntimeError, match="dsv4.fill_all_compressed_indices: page_indices must be on"):
        ops.fill_all_compressed_indices(
            torch.ones((3, 2), device=a, dtype=torch.int32), torch.ones(3, device=a, dtype=torch.int32),
            torch.empty((3, 64), device=b, dtype=torch.int32), 4, 256, None)
    with pytest.raises(RuntimeError, match="dsv4.fill_all_compressed_indices: compressed_seq_lens must be on"):
        ops.fill_all_compressed_indices(
            torch.ones((3, 2), device=a, dtype=torch.int32), torch.ones(3, device=b, dtype=torch.int32),
            torch.empty((3, 64), device=a, dtype=torch.int32), 4, 256, None)
    s, loc = torch.ones(3, device=a, dtype=torch.int32), torch.zeros(3, device=a, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dsv4.init_compression_metadata: positions must be on"):
        ops.init_compression_metadata(s, s.to(b), loc, torch.zeros((3, 2), device=a, dtype=torch.int32), 256, True)
    with pytest.raises(RuntimeError, match="dsv4.init_compression_metadata: page_table must be on"):
        ops.init_compression_metadata(s, s, loc, torch.zeros((3, 2), device=b, dtype=torch.int32), 256, True)
    with pytest.raises(RuntimeError, match="dsv4.get_paged_mqa_logits_metadata_out: out must be on"):
        ops.get_paged_mqa_logits_metadata_out(s, 64, torch.empty((H200_SMS + 1, 2), device=b, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# §9.10 compute-sanitizer memcheck on hostile inputs, one subprocess per case.

SANITIZER_CASES = {
    "page_table": """
req_to_token = torch.tensor([[-(2**31), 2**31 - 1, -1, 5] * 64] * 3, dtype=torch.int32, device=d)
req = torch.tensor([-(2**62), -1, 0, 2, 3, 2**40, 1, 0, 0, 2], device=d)
lens = torch.tensor(big, dtype=torch.int32, device=d)
ops.build_page_table_positions_small(req_to_token, req, lens, 256, 1, 1)
ops.build_page_table_positions_small(req_to_token, req, lens, 256, 64, 2**40)
ops.build_page_table_positions_small(req_to_token[:0], req, lens, 0, 256, 128)
""",
    "low_ratio": """
lens = torch.tensor(big * 7, device=d)[:70]
loc = torch.tensor(huge64 * 10, device=d)
for topk in (1, 100, 1024):
    ops.build_low_ratio_metadata(lens, loc, topk)
    ops.build_low_ratio_metadata(lens[::7], loc[::7], topk)
""",
    "fill_all": """
table = torch.tensor([[-(2**31), 2**31 - 1, 7]] * 10, dtype=torch.int32, device=d)
lens = torch.tensor(big, dtype=torch.int32, device=d)
for ratio in (1, 2, 4, 128):
    for width in (1, 63, 64, 1024):
        ops.fill_all_compressed_indices(table, lens, torch.empty((10, width), dtype=torch.int32, device=d), ratio, 256,
                                        torch.empty((10, width), dtype=torch.int32, device=d))
    pages = torch.empty((10, 64), dtype=torch.int32, device=d)
    ops.fill_all_compressed_indices(table[:, :0], lens, pages, ratio, 256, None)
""",
    "compression": """
lens = torch.tensor(big, dtype=torch.int32, device=d)
loc = torch.tensor(huge64, device=d)
table = torch.tensor([[-(2**31), 2**31 - 1]] * 10, device=d)
ops.init_compression_metadata(lens, lens, loc, table, 512, True)
ops.init_compression_metadata(lens, lens, loc, table[:, :0], 128, True)
ops.init_compression_metadata(lens, lens, loc[:0], None, 0, False)
""",
    "schedule": """
for batch in (0, 1, 64, 65, 2048, 2049, 4097, 65536):
    lens = torch.tensor(big, dtype=torch.int32, device=d).repeat(batch // 10 + 1)[:batch]
    for num_sms in (1, 132, 1024):
        ops.get_paged_mqa_logits_metadata(lens, 64, num_sms)
        ops.get_paged_mqa_logits_metadata(lens.view(-1, 1)[::1], 128, num_sms)
""",
}


@cuda_test
@pytest.mark.parametrize("case", sorted(SANITIZER_CASES))
def test_compute_sanitizer_memcheck(case):
    assert_memcheck_clean(SANITIZER_CASES[case])


# ---------------------------------------------------------------------------------------------
# §9.11 parity with DeepGEMM's get_paged_mqa_logits_metadata (optional package).


@cuda_test
def test_deepgemm_parity():
    deep_gemm = pytest.importorskip("deep_gemm")
    fn = getattr(deep_gemm, "get_paged_mqa_logits_metadata", None)
    if fn is None:
        pytest.skip("deep_gemm has no get_paged_mqa_logits_metadata")
    try:
        probe = fn(torch.tensor([[256]], dtype=torch.int32, device="cuda"), 64, 2)
    except Exception as e:  # unsupported GPU or build
        pytest.skip(f"deep_gemm.get_paged_mqa_logits_metadata unavailable: {e}")
    probe = probe.view(-1, 2).tolist()
    if probe == [[0, 0], [1, 0], [1, 0]]:
        pytest.skip("installed deep_gemm uses the old allocation order (first SMs take the extra split)")
    assert probe == [[0, 0], [0, 0], [1, 0]]
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    g = gen(31)
    compared = 0
    for batch in (1, 64, 1024, 4096, 65536):
        for max_len in (256, 32768):
            lens = torch.randint(1, max_len + 1, (batch,), generator=g, dtype=torch.int32).cuda()
            for num_sms in (sm_count, 1, 257, 1024):
                try:
                    theirs = fn(lens.view(-1, 1), 64, num_sms)
                except Exception as e:
                    if "shared memory" in str(e).lower() or num_sms != sm_count:
                        continue  # DeepGEMM's own limits (shared memory, SM counts it rejects)
                    raise
                ours = ops.get_paged_mqa_logits_metadata(lens, 64, num_sms)
                assert_same(ours, theirs.view(-1, 2).to(torch.int32))
                compared += 1
    assert compared > 0
