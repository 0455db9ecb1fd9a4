"""Tests of the ratio-1 and ratio-2 decode compressors (compressors.md §5, §8.3): c1_decode_norm_rope_store and
c2_decode_or_verify_norm_rope_store against the pure-torch reference, verify == successive decodes, ring wrap
after rejected drafts, padded rows, validation, opcheck, torch.compile, CUDA graphs, PDL and streams.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import KVLayout
from sgl_dsv4_kernels import reference as R

from norm_orders import WRONG_NORM_ORDERS, pinned_ss, y_from_ss
from samples import huge_cpu_tensor, overlapping_rows

torch.set_flush_denormal(False)

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]
LAYOUTS = list(KVLayout)
INDEX_DTYPES = [torch.int32, torch.int64]
PAGE_SIZES = [1, 64, 128, 256]

EPS = 1e-6
MAX_POS = 4096
# A YaRN table as in a compressed layer (cache-writers §1.3); built once on the CPU.
TABLE = dsv4.precompute_rope_table(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0)
LATENT_TOL = dict(rtol=2**-7, atol=2**-14)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cuda_only(fn):
    for mark in CUDA_MARKS:
        fn = mark(fn)
    return fn


# ------------------------------------------------------------------------------------------------------
# Inputs


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def norm_weight(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16 (the spec's type) or fp32 (also accepted): fp32 weights keep bits a bf16 weight cannot hold, so a
    kernel that rounded them to bf16 would show."""
    g = gen(seed)
    w = 1.0 + 0.25 * torch.randn(512, generator=g)
    w[torch.randperm(512, generator=g)[:8]] = 0.0
    return w.to(dtype)


def general_rows(n: int, width: int, seed: int) -> torch.Tensor:
    """randn * 2^U[-6, 6] per row, with a zero row and a large row when n allows."""
    g = gen(seed)
    x = torch.randn(n, width, generator=g) * torch.exp2(torch.randint(-6, 7, (n, 1), generator=g).float())
    if n >= 3:
        x[1] = 0.0
        x[2] *= 1e4
    return x


def pair_rows(n: int, seed: int) -> torch.Tensor:
    """fp32 [n, 1024] c2 projection rows: kv then scores spread over a few units."""
    g = gen(seed)
    kv = general_rows(n, 512, seed)
    scores = torch.randn(n, 512, generator=g) * 3.0
    return torch.cat([kv, scores], dim=1)


def make_cache(layout: KVLayout, page_size: int, num_pages: int, seed: int, device, wide: bool = False):
    """A poisoned cache (random bytes). wide: a column slice of a wider buffer (page stride > page_bytes).
    Returns (cache view, whole buffer)."""
    width = layout.page_bytes(page_size) + (48 if wide else 0)
    buf = torch.randint(0, 256, (num_pages, width), dtype=torch.uint8, generator=gen(seed)).to(device)
    return buf[:, : layout.page_bytes(page_size)], buf


def misaligned(x: torch.Tensor, device, offset: int = 3, pad: int = 12):
    """x (fp32 rows) as a column slice of a wider NaN-filled buffer at an odd element offset, with a row stride
    that is a multiple of 16 bytes: no row starts 16-byte aligned, so the kernels take their element-wise loads and
    stores (vec_io.cuh), and a read outside the view would bring a NaN in. Returns (view, whole buffer)."""
    n, width = x.shape
    whole = torch.full((n, width + pad), float("nan"), dtype=x.dtype)
    whole[:, offset:offset + width] = x
    whole = whole.to(device)
    view = whole[:, offset:offset + width]
    assert view.data_ptr() % 16 and (view.stride(0) * view.element_size()) % 16 == 0
    return view, whole


def num_pages_for(page_size: int, tokens: int) -> int:
    return max(2, -(-tokens // page_size))


def idx(values, dtype, device) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int64).to(dtype).to(device)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.int16)


def assert_bits_equal(got: torch.Tensor, expected: torch.Tensor, what: str):
    g, e = bits(got), bits(expected)
    if not torch.equal(g, e):
        bad = (g != e).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}")


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str):
    g, e = got.detach().cpu(), expected.detach().cpu()
    if not torch.equal(g, e):
        bad = (g != e).nonzero()
        raise AssertionError(f"{what}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}")


def expected_cache(cache_before, latent, slots, rope_positions, page_size, layout) -> torch.Tensor:
    """§5.4 applied with the reference quantizers to the op's own latent: t = bf16(rope_tail(latent, freqs[pos]));
    V41_FP4 stores t, V41 stores fp8 of fake_quant_compressed_kv(t), V4 is fused_store_cache(V4) of that row.
    Rows with slot < 0 write nothing (the caller encodes every skip rule into slots). Computed on the CPU."""
    cache = cache_before.detach().cpu().clone()
    slots = torch.as_tensor(slots, dtype=torch.int64)
    keep = slots >= 0
    if not bool(keep.any()):
        return cache
    lat = latent.detach().cpu()[keep]
    pos = torch.as_tensor(rope_positions, dtype=torch.int64)[keep]
    t = R.rope_tail(lat, TABLE[pos]).to(torch.bfloat16)
    slots = slots[keep]
    if layout == KVLayout.V41_FP4:
        R.store_k_cache(cache, t.float(), slots, page_size, int(layout))
    elif layout == KVLayout.V41:
        R.store_k_cache(cache, R.fake_quant_compressed_kv(t).float(), slots, page_size, int(layout))
    else:
        R.fused_store_cache(R.fake_quant_compressed_kv(t), cache, slots, page_size=page_size, layout=int(layout))
    return cache


def expected_whole_buffer(buf, view, latent, slots, positions, page_size, layout) -> torch.Tensor:
    """expected_cache on the whole buffer that `view` is a column slice of."""
    whole = buf.detach().cpu().clone()
    sub = whole[:, : view.shape[1]]
    sub.copy_(expected_cache(view, latent, slots, positions, page_size, layout))
    return whole


# ------------------------------------------------------------------------------------------------------
# Reference pins and the ring-size utility


def test_pair_pool_reference_pins():
    f = lambda v: torch.tensor([v], dtype=torch.float32)  # noqa: E731
    # Equal scores: exactly the mean, whatever the values.
    assert R.pair_pool(f(1.0), f(0.5), f(3.0), f(0.5)).item() == 2.0
    assert R.pair_pool(f(1e-3), f(-7.0), f(3.0), f(-7.0)).item() == torch.tensor(1e-3 + 3.0).float().item() / 2
    # The pad partner (kv 0, score -inf) leaves the odd token's own kv.
    assert R.pair_pool(f(0.0), f(float("-inf")), f(-2.75), f(4.0)).item() == -2.75
    # A score gap of 1 weights the larger-score token by 1 / (1 + e^-1), either way round.
    w = 1.0 / (1.0 + torch.exp(torch.tensor(-1.0, dtype=torch.float64)).item())
    assert abs(R.pair_pool(f(1.0), f(1.0), f(0.0), f(0.0)).item() - w) < 1e-7
    assert abs(R.pair_pool(f(0.0), f(0.0), f(1.0), f(1.0)).item() - w) < 1e-7


def test_state_ring_size():
    assert [dsv4.state_ring_size(2, d) for d in (0, 1, 2, 5, 6, 9, 14, 15)] == [2, 2, 4, 8, 8, 16, 16, 32]
    assert [dsv4.state_ring_size(4, d) for d in (0, 1, 2, 10, 11)] == [8, 8, 16, 16, 32]
    assert [dsv4.state_ring_size(128, d) for d in (1, 2, 130, 131)] == [128, 256, 256, 512]
    for d in range(2, 40):
        ring = dsv4.state_ring_size(2, d)
        assert ring > d and ring & (ring - 1) == 0
    with pytest.raises(ValueError, match="ratio"):
        dsv4.state_ring_size(1, 2)


# ------------------------------------------------------------------------------------------------------
# c1


def c1_case(layout, page_size, idx_dtype, device, seed, n=37, wide=False, strided=False,
            weight_dtype=torch.bfloat16):
    """Distinct valid slots plus every skip kind: out_loc 0 and -1 (padded), slot == capacity and far past it,
    positions max_pos and -1."""
    g = gen(seed)
    pages = num_pages_for(page_size, n + 40)
    cache, buf = make_cache(layout, page_size, pages, seed, device, wide=wide)
    capacity = pages * page_size
    slots = (1 + torch.randperm(capacity - 1, generator=g)[:n]).tolist()
    positions = torch.randint(0, MAX_POS, (n,), generator=g).tolist()
    far = 2**31 - 1 if idx_dtype == torch.int32 else 2**40
    for row, loc in zip(range(0, n, 6), (0, -1, capacity, far, -capacity)):
        slots[row] = loc
    if n > 4:
        positions[3], positions[4] = MAX_POS, -1
    x = general_rows(n, 512, seed).to(torch.bfloat16)
    if strided:
        wide_x = torch.zeros(n, 700, dtype=torch.bfloat16)
        wide_x[:, 5:517] = x
        x = wide_x[:, 5:517]
    store = [s if 0 < s < capacity and 0 <= pos < MAX_POS else -1 for s, pos in zip(slots, positions)]
    return dict(
        kv_input=x.to(device), norm_weight=norm_weight(seed, weight_dtype).to(device),
        positions=idx(positions, idx_dtype, device),
        out_loc=idx(slots, idx_dtype, device), cache=cache, buf=buf, store=store, raw_positions=positions,
    )


def run_c1(case, page_size, layout):
    return dsv4.c1_decode_norm_rope_store(
        case["kv_input"], case["norm_weight"], case["positions"], case["out_loc"], EPS, TABLE.to(case["cache"].device),
        case["cache"], page_size=page_size, layout=layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", INDEX_DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.str_name)
def test_c1_matches_reference(device, layout, page_size, idx_dtype):
    seed = 100 * int(layout) + page_size + (7 if idx_dtype == torch.int64 else 0)
    # fp32 norm weights (accepted besides the spec's bf16) on two page sizes: every layout and index dtype.
    weight_dtype = torch.float32 if page_size in (1, 256) else torch.bfloat16
    case = c1_case(layout, page_size, idx_dtype, device, seed, wide=page_size == 64, strided=page_size == 128,
                   weight_dtype=weight_dtype)
    before = case["buf"].cpu().clone()
    width = case["cache"].shape[1]
    latent = run_c1(case, page_size, layout)
    assert latent.dtype == torch.bfloat16 and latent.shape == (37, 512) and latent.is_contiguous()
    ref_cache = before[:, :width].clone()  # the same poisoned bytes
    ref = R.c1_decode_norm_rope_store(case["kv_input"].cpu(), case["norm_weight"].cpu(), case["positions"].cpu(),
                                      case["out_loc"].cpu(), EPS, TABLE, ref_cache, page_size, int(layout))
    torch.testing.assert_close(latent.cpu().float(), ref.float(), **LATENT_TOL)
    assert_bits_equal(latent, ref, "latent (no exp on this path: exact on every device)")
    want = expected_whole_buffer(before, before[:, :width], latent, case["store"], case["raw_positions"], page_size,
                                 layout)
    assert_same(case["buf"], want, "c1 cache bytes")
    # The reference's own cache, whole: the latents are exact, so the bytes are too.
    assert_same(case["buf"][:, :width], ref_cache, "c1 cache bytes against the reference")


@pytest.mark.parametrize("device", DEVICES)
def test_c1_empty_batch_and_fresh_output(device):
    case = c1_case(KVLayout.V41, 64, torch.int64, device, 3, n=5)
    latent = run_c1(case, 64, KVLayout.V41)
    for t in (case["kv_input"], case["cache"]):
        assert latent.data_ptr() != t.data_ptr()
    empty = dsv4.c1_decode_norm_rope_store(
        case["kv_input"][:0], case["norm_weight"], case["positions"][:0], case["out_loc"][:0], EPS,
        TABLE.to(device), case["cache"], page_size=64, layout="v41")
    assert empty.shape == (0, 512) and empty.dtype == torch.bfloat16


MAX_ROWS = 2**31 - 1  # grid x of the c1 / c2 rows launches: one block per kv row
LOW_RATIO_OPS = ["c1_decode_norm_rope_store", "c2_decode_or_verify_norm_rope_store", "c2_prefill_norm_rope_store"]


def _args_with_rows_past_the_grid(op: str, device: str, tmp_path) -> list:
    """op's arguments with MAX_ROWS + 1 kv rows: a broadcast kv_input and, on the CPU, index vectors of virtual
    memory (8 GiB each) that the op must never touch."""
    rows = MAX_ROWS + 1

    def row_vector(name):
        if device == "meta":
            return torch.empty(rows, dtype=torch.int32, device="meta")
        (tmp_path / name).mkdir()
        return huge_cpu_tensor(4 * rows, tmp_path / name).view(torch.int32)

    weight = torch.ones(512, dtype=torch.bfloat16, device=device)
    table = torch.zeros(8, 64, device=device)
    cache = torch.zeros(2, KVLayout.V4.page_bytes(64), dtype=torch.uint8, device=device)
    if op == "c1_decode_norm_rope_store":
        kv = torch.zeros(1, 512, dtype=torch.bfloat16, device=device).expand(rows, 512)
        return [kv, weight, row_vector("positions"), row_vector("out_loc"), EPS, table, cache, 64, 0]
    kv = torch.zeros(1, 1024, device=device).expand(rows, 1024)
    state = torch.zeros(8, 1024, device=device)
    head = [kv, state, weight, row_vector("positions"), row_vector("req_pool_indices"), row_vector("raw_out_loc"),
            EPS, table, cache]
    if op == "c2_decode_or_verify_norm_rope_store":
        return head + [64, 8, 0, 0]
    one = torch.zeros(1, dtype=torch.int32, device=device)
    return head + [one, one, 64, 8, 0]


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("op", LOW_RATIO_OPS)
def test_row_count_bounded_by_the_rows_grid(op, device, tmp_path):
    """2^31 kv rows would overflow the rows launch's grid x (one block per row): the host check and the fake reject
    them before anything is allocated or runs, naming the op and kv_input."""
    args = _args_with_rows_past_the_grid(op, device, tmp_path)
    with pytest.raises(RuntimeError, match=rf"dsv4\.{op}: kv_input has 2147483648 rows; at most 2147483647"):
        getattr(torch.ops.dsv4, op)(*args)


def test_c1_accepts_complex_freqs_cis():
    case = c1_case(KVLayout.V4, 64, torch.int32, "cpu", 5, n=9)
    cache2 = case["cache"].clone()
    a = run_c1(case, 64, KVLayout.V4)
    fc = dsv4.precompute_freqs_cis(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0)
    b = dsv4.c1_decode_norm_rope_store(case["kv_input"], case["norm_weight"], case["positions"], case["out_loc"],
                                       EPS, fc, cache2, page_size=64, layout=KVLayout.V4)
    assert_bits_equal(a, b, "latent")
    assert_same(case["cache"], cache2, "cache")


# ------------------------------------------------------------------------------------------------------
# c2: decode batches against the reference


class C2Setup:
    """The pair-state pool and cache shared by a sequence of c2 calls."""

    def __init__(self, layout, page_size, ring, owners, seed, device, cache_tokens=2048, pad_rows=2,
                 weight_dtype=torch.bfloat16, strided=False):
        """strided: the ring is a misaligned column slice of a wider NaN-filled buffer (`state_buf`, see
        misaligned) and the cache a column slice of a wider one (page stride > page_bytes)."""
        self.layout, self.page_size, self.ring, self.owners = layout, page_size, ring, owners
        self.device = device
        g = gen(seed)
        # Parked rows from earlier steps: random fp32 (kv, score) rows.
        state = torch.randn(owners * ring + pad_rows, 1024, generator=g) * 2
        if strided:
            self.state, self.state_buf = misaligned(state, device, offset=1)
        else:
            self.state = self.state_buf = state.to(device)
        pages = num_pages_for(page_size, cache_tokens)
        self.cache, self.buf = make_cache(layout, page_size, pages, seed + 1, device, wide=strided)
        self.capacity = pages * page_size
        self.weight = norm_weight(seed + 2, weight_dtype).to(device)
        self.table = TABLE.to(device)

    def call(self, kv_input, positions, req, raw, draft_len=0, state=None, cache=None):
        return dsv4.c2_decode_or_verify_norm_rope_store(
            kv_input, self.state if state is None else state, self.weight, positions, req, raw, EPS, self.table,
            self.cache if cache is None else cache, page_size=self.page_size, ring_size=self.ring,
            draft_len=draft_len, layout=self.layout)

    def reference(self, kv_input, positions, req, raw, state, cache, draft_len=0):
        """The reference on CPU copies of `state` and `cache` (updated in place)."""
        return R.c2_decode_or_verify_norm_rope_store(
            kv_input.cpu(), state, self.weight.cpu(), positions.cpu(), req.cpu(), raw.cpu(), EPS, TABLE, cache,
            self.page_size, self.ring, draft_len, int(self.layout))


def c2_store_slots(setup: C2Setup, positions, raw):
    """§5.3: the cache slot raw >> 1 of each row that stores (odd p >= 0, raw > 0, slot < capacity, p - 1 in the
    table), else -1."""
    return [(loc >> 1) if p >= 0 and p % 2 and loc > 0 and (loc >> 1) < setup.capacity and 0 <= p - 1 < MAX_POS
            else -1 for p, loc in zip(positions, raw)]


def assert_ring_buffer(setup: C2Setup, state_buf0: torch.Tensor, want_state: torch.Tensor):
    """The whole buffer of the ring (state_buf0 before the call) holds want_state in the ring's columns and is
    bitwise unchanged elsewhere (the NaN padding of a strided ring included)."""
    want = state_buf0.clone()
    offset = (setup.state.data_ptr() - setup.state_buf.data_ptr()) // 4  # 0 unless strided
    want[:, offset:offset + 1024] = want_state
    assert_same(setup.state_buf.view(torch.int32), want.view(torch.int32), "whole ring buffer (bits)")


def c2_decode_rows(setup: C2Setup, seed: int, wide: bool = False):
    """One decode batch that exercises every row kind of §5.3 (one row per live request, distinct requests),
    with `wide` also rows whose int64 indices do not fit int32 (the CUDA kernel plans those in 64 bits, the
    others in 32): returns (kv_input, positions, req, raw, kinds)."""
    g = gen(seed)
    reqs = (1 + torch.randperm(setup.owners - 1, generator=g)).tolist()
    kinds, positions, req, raw = [], [], [], []

    def add(kind, p, r, loc):
        kinds.append(kind)
        positions.append(p)
        req.append(r)
        raw.append(loc)

    cslots = (1 + torch.randperm(setup.capacity - 1, generator=g)).tolist()
    for i in range(10):  # live odd rows (ring partner) and live even rows (ring write)
        p = int(torch.randint(1, MAX_POS // 2, (1,), generator=g)) * 2 - (i % 2)
        add("odd" if p % 2 else "even", p, reqs.pop(), 2 * cslots.pop() + (p % 2))
    p_eq = 2 * int(torch.randint(1, 200, (1,), generator=g)) + 1
    add("equal", p_eq, reqs.pop(), 2 * cslots.pop() + 1)  # partner scores equal to its own
    add("odd", 1, reqs.pop(), 2 * cslots.pop() + 1)  # p = 1: RoPE at 0
    add("odd", MAX_POS + 1, reqs.pop(), 2 * cslots.pop() + 1)  # p - 1 = max_pos: no store
    add("odd", 33, reqs.pop(), 2 * setup.capacity + 1)  # slot == capacity: no store
    add("odd", 35, reqs.pop(), 1)  # raw 1 -> compressed slot 0, a live store
    add("odd", 37, setup.owners + 3, 2 * cslots.pop() + 1)  # req out of range: pad partner
    add("even", 38, -1, 2 * cslots.pop())  # req out of range: no ring write
    if wide:
        add("odd", 2**32 + 7, reqs.pop(), 2 * cslots.pop() + 1)  # pools with its ring partner; p - 1 past the table
        add("even", 2**32 + 10, reqs.pop(), 2 * cslots.pop())  # parks at (2^32 + 10) % ring
        add("odd", 45, reqs.pop(), 2**40 + 1)  # compressed slot far past the cache: pools, no store
        add("odd", 47, 2**33, 2 * cslots.pop() + 1)  # req far out of range: pad partner
    live_req = req[0]
    add("pad_odd", 41, live_req, 0)  # padded rows aliasing a live request
    add("pad_even", 42, live_req, -3)
    add("pad_odd", 43, 0, 0)  # padded rows of the dummy request
    add("pad_even", 44, 0, 0)
    add("negative", -1, req[1], 2 * cslots.pop() + 1)  # p < 0: nothing at all, whatever raw holds
    add("negative", -2, req[2], 2 * cslots.pop())
    n = len(kinds)
    x = pair_rows(n, seed + 5)
    eq = kinds.index("equal")
    x_cpu_state = setup.state.cpu()
    partner_row = req[eq] * setup.ring + (positions[eq] - 1) % setup.ring
    state_row = x_cpu_state[partner_row].clone()
    state_row[512:] = x[eq, 512:]
    setup.state[partner_row] = state_row.to(setup.device)
    return x, positions, req, raw, kinds


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", INDEX_DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.str_name)
@pytest.mark.parametrize("ring", [8, 2, 1], ids=lambda r: f"ring{r}")
def test_c2_decode_matches_reference(ring, device, layout, page_size, idx_dtype):
    """Ring 2 is the default without speculation (state_ring_size(2, 0)); ring 1 is the smallest §5.2 allows, where
    an even row's write and an odd row's read share the request's only row."""
    seed = 1000 + 100 * int(layout) + page_size + (7 if idx_dtype == torch.int64 else 0)
    if ring != 8:  # ring 8 keeps its original inputs
        seed += 5000 * ring
    # fp32 norm weights (accepted besides the spec's bf16) on two page sizes, a misaligned strided ring and a cache
    # wider than its pages on a third: every ring, layout and index dtype.
    weight_dtype = torch.float32 if page_size in (1, 256) else torch.bfloat16
    setup = C2Setup(layout, page_size, ring=ring, owners=24, seed=seed, device=device, weight_dtype=weight_dtype,
                    strided=page_size == 128)
    x, positions, req, raw, kinds = c2_decode_rows(setup, seed, wide=idx_dtype == torch.int64)
    state0, buf0, state_buf0 = setup.state.cpu().clone(), setup.buf.cpu().clone(), setup.state_buf.cpu().clone()
    args = [x.to(device)] + [idx(v, idx_dtype, device) for v in (positions, req, raw)]
    latent = setup.call(*args)

    ref_state, ref_cache = state0.clone(), setup.cache.cpu().clone()
    ref = setup.reference(*args, ref_state, ref_cache)
    # The padded odd row aliasing a live request may pool with a ring row that a live row of this call
    # writes: its latent is unspecified on CUDA (compressors.md §5.3), so it is left out here.
    specified = torch.tensor([not (k == "pad_odd" and r == req[0]) for k, r in zip(kinds, req)])
    torch.testing.assert_close(latent.cpu().float()[specified], ref.float()[specified], **LATENT_TOL)
    if device == "cpu":  # the CPU kernel's exp is the reference's correctly rounded one (pair_pool.cuh)
        assert_bits_equal(latent, ref, "CPU latent")
        assert_same(setup.cache, ref_cache, "CPU cache bytes against the reference")

    # Exactly zero latents for even rows and p < 0; padded odd rows still pool.
    lat = latent.cpu()
    for i, kind in enumerate(kinds):
        if kind in ("even", "pad_even", "negative"):
            assert not bits(lat[i]).any(), f"row {i} ({kind}) must return a zero latent"
        else:
            assert bits(lat[i]).any(), f"row {i} ({kind}) must return a latent"
    # Equal scores: the exact mean, so the whole chain is exact and the latent matches bit for bit.
    eq = kinds.index("equal")
    assert_bits_equal(lat[eq], ref[eq], "equal-scores latent")
    # A pad partner pools to the odd token's own kv.
    out_of_range = [i for i, r in enumerate(req) if r >= setup.owners and kinds[i] == "odd"][0]
    own = R.rms_norm_fp32(x[out_of_range, :512].to(torch.bfloat16), setup.weight.cpu(), EPS).to(torch.bfloat16)
    assert_bits_equal(lat[out_of_range], own, "pad-partner latent")

    # Ring: exactly the live even rows of requests in range were parked; nothing else changed.
    want_state = state0.clone()
    for i, kind in enumerate(kinds):
        if kind == "even" and 0 <= req[i] < setup.owners:
            want_state[req[i] * setup.ring + positions[i] % setup.ring] = x[i]
    assert_same(setup.state, want_state, "ring state")
    assert_same(ref_state, want_state, "reference ring state")
    assert_ring_buffer(setup, state_buf0, want_state)

    # Cache: the live odd rows with slot < capacity and p - 1 in the table, from the op's own latent.
    store = [(loc >> 1) if k in ("odd", "equal") and loc > 0 and (loc >> 1) < setup.capacity
             and 0 <= p - 1 < MAX_POS else -1 for k, p, loc in zip(kinds, positions, raw)]
    want = expected_whole_buffer(buf0, buf0[:, : setup.cache.shape[1]], latent, store,
                                 [p - 1 for p in positions], page_size, layout)
    assert_same(setup.buf, want, "c2 cache bytes")


# ------------------------------------------------------------------------------------------------------
# c2: verify == draft_len successive decodes


def verify_batch(setup: C2Setup, bs: int, draft_len: int, padded: int, seed: int, starts=None, rows=None,
                 alias_live: bool = False):
    """Request-major blocks of draft_len consecutive positions for bs live requests (distinct requests, mixed
    start parity, distinct cache slots), then `padded` padded blocks on the dummy request 0, as engines pad, or,
    with alias_live, on the first live request. An aliasing padded odd row may read a ring row that a live row
    writes in the same call, so its latent is unspecified (compressors.md §5.3): only tests that compare live
    rows alone use alias_live."""
    g = gen(seed)
    reqs = (1 + torch.randperm(setup.owners - 1, generator=g))[:bs].tolist()
    if starts is None:
        starts = torch.randint(1, 300, (bs,), generator=g).tolist()
    positions, req, raw = [], [], []
    cslots = (1 + torch.randperm(setup.capacity - 1, generator=g)).tolist()
    for b in range(bs):
        for k in range(draft_len):
            p = starts[b] + k
            positions.append(p)
            req.append(reqs[b])
            raw.append(2 * cslots.pop() + (p & 1))
    for j in range(padded):
        start = int(torch.randint(0, 300, (1,), generator=g))
        for k in range(draft_len):
            positions.append(start + k)
            req.append(reqs[0] if alias_live else 0)
            raw.append(-1 if k % 3 == 0 else 0)
    n = len(positions)
    x = pair_rows(n, seed + 9) if rows is None else rows
    return x, positions, req, raw


def decode_replay(setup, x, positions, req, raw, draft_len, idx_dtype, state, cache):
    """draft_len decode calls; call k holds row k of every block. Returns the latents in verify row order."""
    n = x.shape[0]
    latent = torch.empty(n, 512, dtype=torch.bfloat16, device=setup.device)
    for k in range(draft_len):
        rows = list(range(k, n, draft_len))
        sel = lambda v: idx([v[r] for r in rows], idx_dtype, setup.device)  # noqa: E731
        latent[rows] = setup.call(x[rows], sel(positions), sel(req), sel(raw), 0, state, cache)
    return latent


def rings_for(draft_len):
    pow2, narrowest = dsv4.state_ring_size(2, draft_len), draft_len + 1
    return [("pow2", pow2)] + ([("narrowest", narrowest)] if narrowest != pow2 else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padded", [0, 1])
@pytest.mark.parametrize("draft_len", [1, 2, 5, 6, 9])
@pytest.mark.parametrize("bs", [1, 3, 8])
def test_c2_verify_equals_successive_decodes(device, bs, draft_len, padded):
    for ring_kind, ring in rings_for(draft_len):
        layout = LAYOUTS[(bs + draft_len + padded) % 3]
        idx_dtype = INDEX_DTYPES[(bs + draft_len) % 2]
        seed = 10000 + 100 * bs + 10 * draft_len + padded + ring
        setup = C2Setup(layout, 64, ring=ring, owners=bs + 3, seed=seed, device=device)
        x, positions, req, raw = verify_batch(setup, bs, draft_len, padded, seed, alias_live=True)
        x = x.to(device)
        state_d, cache_d = setup.state.clone(), setup.cache.clone()
        latent_v = setup.call(x, *(idx(v, idx_dtype, device) for v in (positions, req, raw)), draft_len=draft_len)
        latent_d = decode_replay(setup, x, positions, req, raw, draft_len, idx_dtype, state_d, cache_d)
        what = f"ring {ring_kind}={ring}"
        assert_same(setup.state, state_d, f"{what}: ring state")
        assert_same(setup.cache, cache_d, f"{what}: cache bytes")
        live = [i for i, loc in enumerate(raw) if loc > 0]
        assert_bits_equal(latent_v[live], latent_d[live], f"{what}: latents of live rows")
        # Padded odd rows still return a latent (pooled with their input predecessor in verify).
        padded_odd = [i for i, (p, loc) in enumerate(zip(positions, raw)) if loc <= 0 and p % 2 and i % draft_len]
        assert all(bits(latent_v[i]).any() for i in padded_odd)


def check_c2_against_reference(setup: C2Setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, positions, raw,
                               specified=None):
    """The checks shared by the c2 reference comparisons, after the op ran on `setup` and the reference on CPU
    copies (ref_state, ref_cache) of its ring and cache view, whose whole buffers were state_buf0 and buf0: latents
    within tolerance (rows in `specified` only, a bool mask), the ring view equal to the reference's and the rest of
    its buffer unchanged, the whole cache buffer byte-exact against §5.4 on the op's own latents (bytes outside the
    view unchanged), and on the CPU the reference's latents and cache bytes bit for bit."""
    if specified is None:
        specified = torch.ones(latent.shape[0], dtype=torch.bool)
    torch.testing.assert_close(latent.cpu().float()[specified], ref.float()[specified], **LATENT_TOL)
    assert_same(setup.state, ref_state, "ring state")
    assert_ring_buffer(setup, state_buf0, ref_state)
    width = setup.cache.shape[1]
    want = expected_whole_buffer(buf0, buf0[:, :width], latent, c2_store_slots(setup, positions, raw),
                                 [p - 1 for p in positions], setup.page_size, setup.layout)
    assert_same(setup.buf, want, "whole cache buffer")
    if setup.device == "cpu":  # the CPU exp is the reference's correctly rounded one; on CUDA it may differ in a bit
        assert_bits_equal(latent, ref, "CPU latent")
        assert_same(setup.cache, ref_cache, "CPU cache bytes against the reference")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring,draft_len,weight_dtype", [
    (8, 5, torch.bfloat16), (8, 5, torch.float32), (2, 1, torch.bfloat16), (2, 1, torch.float32),
    (3, 2, torch.float32)], ids=["ring8-d5-wbf16", "ring8-d5-wfp32", "ring2-d1-wbf16", "ring2-d1-wfp32",
                                 "ring3-d2-wfp32"])
def test_c2_verify_matches_reference(device, ring, draft_len, weight_dtype):
    """Ring 2 (the default without speculation) serves draft_len 1 only; ring 1 serves no verify."""
    layout = LAYOUTS[(ring + draft_len) % 3]
    setup = C2Setup(layout, 64, ring=ring, owners=8, seed=77 + ring, device=device, weight_dtype=weight_dtype)
    x, positions, req, raw = verify_batch(setup, 4, draft_len, 1, 77 + draft_len)
    state_buf0, buf0 = setup.state_buf.cpu().clone(), setup.buf.cpu().clone()
    ref_state, ref_cache = setup.state.cpu().clone(), setup.cache.cpu().clone()
    args = [x.to(device)] + [idx(v, torch.int64, device) for v in (positions, req, raw)]
    latent = setup.call(*args, draft_len=draft_len)
    ref = setup.reference(*args, ref_state, ref_cache, draft_len=draft_len)
    check_c2_against_reference(setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, positions, raw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_len", [0, 1, 5])
def test_c2_strided_misaligned_rows_match_reference(device, draft_len):
    """kv_input and kv_state as column slices of wider NaN-filled buffers at odd offsets (free row strides, no
    16-byte aligned row: the kernels' element-wise paths) and a cache whose page stride exceeds page_bytes. Matches
    the reference run on contiguous copies; nothing outside the views changes (the input buffer included)."""
    layout = LAYOUTS[draft_len % 3]
    ring = dsv4.state_ring_size(2, draft_len)
    seed = 4000 + draft_len
    setup = C2Setup(layout, 64, ring=ring, owners=24, seed=seed, device=device, strided=True)
    if draft_len:
        x, positions, req, raw = verify_batch(setup, 4, draft_len, 1, seed)
        specified = None
    else:
        x, positions, req, raw, kinds = c2_decode_rows(setup, seed)
        # The padded odd row aliasing a live request: unspecified latent on CUDA (see the decode test).
        specified = torch.tensor([not (k == "pad_odd" and r == req[0]) for k, r in zip(kinds, req)])
    x_view, x_buf = misaligned(x, device)
    x_buf0 = x_buf.cpu().clone()
    state_buf0, buf0 = setup.state_buf.cpu().clone(), setup.buf.cpu().clone()
    ref_state, ref_cache = setup.state.cpu().clone(), setup.cache.cpu().clone()
    assert ref_state.is_contiguous() and ref_cache.is_contiguous()
    indices = [idx(v, torch.int64, device) for v in (positions, req, raw)]
    latent = setup.call(x_view, *indices, draft_len=draft_len)
    ref = setup.reference(x, *indices, ref_state, ref_cache, draft_len=draft_len)
    check_c2_against_reference(setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, positions, raw,
                               specified)
    assert_same(x_buf.view(torch.int32), x_buf0.view(torch.int32), "input buffer (bits)")
    assert bits(latent.cpu()).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stride", [0, 1, 300], ids=lambda s: f"stride{s}")
def test_overlapping_input_rows_match_reference(device, stride):
    """kv_input may have any row stride, repeated or overlapping rows included (the ops only read it): c1 and c2
    (decode and verify) match the reference run on contiguous copies of the same rows."""
    case = c1_case(KVLayout.V41_FP4, 64, torch.int64, device, 61 + stride)
    x = overlapping_rows(case["kv_input"], stride)
    ref_cache = case["cache"].cpu().clone()
    latent = run_c1(dict(case, kv_input=x), 64, KVLayout.V41_FP4)
    ref = R.c1_decode_norm_rope_store(x.cpu().contiguous(), case["norm_weight"].cpu(), case["positions"].cpu(),
                                      case["out_loc"].cpu(), EPS, TABLE, ref_cache, 64, int(KVLayout.V41_FP4))
    assert_bits_equal(latent, ref, "c1 latent")
    assert_same(case["cache"], ref_cache, "c1 cache bytes")
    for draft_len in (0, 4):
        setup = C2Setup(LAYOUTS[draft_len % 3], 64, ring=8, owners=8, seed=62 + stride, device=device)
        rows, positions, req, raw = verify_batch(setup, 4, max(draft_len, 1), 1, 62 + draft_len)
        x = overlapping_rows(rows.to(device), stride)
        state_buf0, buf0 = setup.state_buf.cpu().clone(), setup.buf.cpu().clone()
        ref_state, ref_cache = setup.state.cpu().clone(), setup.cache.cpu().clone()
        indices = [idx(v, torch.int64, device) for v in (positions, req, raw)]
        latent = setup.call(x, *indices, draft_len=draft_len)
        ref = setup.reference(x.cpu().contiguous(), *indices, ref_state, ref_cache, draft_len=draft_len)
        # Padded odd rows' latents are unspecified (§5.3): compare the live rows'.
        check_c2_against_reference(setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, positions, raw,
                                   torch.tensor([loc > 0 for loc in raw]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_len", [0, 3])
def test_c2_empty_batch_and_fresh_output(device, draft_len):
    """§7: the latent is a fresh contiguous bf16 [N, 512] tensor that shares no storage with any input."""
    a = c2_args(device, draft_len=draft_len)
    latent = c2_op(a)
    assert latent.dtype == torch.bfloat16 and latent.shape == (a["kv_input"].shape[0], 512)
    assert latent.is_contiguous()
    for name, t in a.items():
        if isinstance(t, torch.Tensor):
            assert latent.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), name
    n0 = {k: a[k][:0] for k in ("kv_input", "positions", "req_pool_indices", "raw_out_loc")}
    empty = c2_op(dict(a, **n0, draft_len=0))
    assert empty.shape == (0, 512) and empty.dtype == torch.bfloat16


def device_pair_pool(partner: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """§1.5 with fp32 torch ops on the rows' device: separately rounded products and sums, an IEEE division by a
    tensor, and on CUDA tensors torch.exp is CUDA's accurate expf, the exp of the c2 kernel (pair_pool.cuh)."""
    k_even, s_even, k_odd, s_odd = partner[:, :512], partner[:, 512:], own[:, :512], own[:, 512:]
    d = s_even - s_odd
    e = torch.exp(-d.abs())
    numerator = torch.where(d >= 0, k_even + e * k_odd, e * k_even + k_odd)
    return numerator / (e + 1.0)


def with_special_channels(rows: torch.Tensor, seed: int) -> torch.Tensor:
    """c2 rows whose kv channels sit at the edges of the kernel's division (pair_pool_channels): zeros of both
    signs, subnormals, magnitudes around 2^-64; and equal scores (e = 1) wherever both rows of a pair have them."""
    g = gen(seed)
    rows = rows.clone()
    rows[:, 0:16] = 0.0
    rows[:, 16:32] = -0.0
    rows[:, 32:48] = torch.randn(rows.shape[0], 16, generator=g) * 1e-40
    rows[:, 48:64] = torch.randn(rows.shape[0], 16, generator=g) * 2.0**-64
    rows[:, 64:80] = torch.randn(rows.shape[0], 16, generator=g) * 2.0**-70
    rows[:, 512 + 80:512 + 96] = 1.5
    return rows


@cuda_only
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["wbf16", "wfp32"])
@pytest.mark.parametrize("draft_len", [0, 3])
def test_c2_cuda_latents_are_the_device_fp32_pooling(draft_len, weight_dtype):
    """Bit for bit: every CUDA latent equals the reference RMSNorm of bf16(device_pair_pool(partner, row)). The
    tolerance tests cannot see a last-bit change of the pooling; this one pins the kernel's division and exp to the
    GPU's IEEE division and expf, including the inputs that take pair_pool_channels' fallback. With fp32 norm
    weights it also pins their load (a weight rounded to bf16 would stay within the latent tolerance)."""
    setup = C2Setup(KVLayout.V41, 64, ring=8, owners=12, seed=51, device="cuda", weight_dtype=weight_dtype)
    bs = 8
    x, positions, req, raw = verify_batch(setup, bs, max(draft_len, 1), 0, 51)
    x = with_special_channels(x, 52)
    # Infinite score gaps (e = 0) against finite partners: neighbouring rows, and ring rows, use other channels.
    x[0::2, 512 + 96:512 + 104] = float("inf")
    x[1::2, 512 + 104:512 + 112] = float("inf")
    state = with_special_channels(setup.state.cpu(), 53)
    state[:, 512 + 112:512 + 120] = float("-inf")
    setup.state.copy_(state.cuda())
    # A huge odd row: pooled magnitudes past 2^64 (the fallback); its sum of squares overflows, so its latent
    # keeps only the signs of the pooled values.
    x[[p % 2 for p in positions].index(1), :512] *= 2.0**70
    state0 = setup.state.cpu().clone()
    latent = setup.call(x.cuda(), *(idx(v, torch.int64, "cuda") for v in (positions, req, raw)), draft_len=draft_len)

    partner = torch.empty_like(x)
    for i, (p, r) in enumerate(zip(positions, req)):
        if draft_len and i % draft_len:
            partner[i] = x[i - 1]
        else:
            partner[i] = state0[r * setup.ring + (p - 1) % setup.ring]
    pooled = device_pair_pool(partner.cuda(), x.cuda()).cpu().to(torch.bfloat16)
    want = R.rms_norm_fp32(pooled, setup.weight.cpu(), EPS).to(torch.bfloat16)
    odd = torch.tensor([p % 2 == 1 for p in positions])
    want[~odd] = 0
    assert_bits_equal(latent, want, "latents")
    assert bits(latent[odd]).any()


@pytest.mark.parametrize("device", DEVICES)
def test_verify_rejects_narrow_ring(device):
    for draft_len, ring in ((2, 2), (5, 4), (5, 5), (9, 8)):
        setup = C2Setup(KVLayout.V41, 64, ring=ring, owners=4, seed=5, device=device)
        x, positions, req, raw = verify_batch(setup, 2, draft_len, 0, 5)
        args = [x.to(device)] + [idx(v, torch.int64, device) for v in (positions, req, raw)]
        with pytest.raises(RuntimeError, match="c2_decode_or_verify_norm_rope_store: ring_size must be wider "
                                               "than the draft length"):
            setup.call(*args, draft_len=draft_len)
    setup = C2Setup(KVLayout.V41, 64, ring=8, owners=4, seed=5, device=device)
    x, positions, req, raw = verify_batch(setup, 2, 5, 0, 5)
    args = [x[:9].to(device)] + [idx(v[:9], torch.int64, device) for v in (positions, req, raw)]
    with pytest.raises(RuntimeError, match="c2_decode_or_verify_norm_rope_store: kv_input rows .* multiple of "
                                           "draft_len"):
        setup.call(*args, draft_len=5)


# ------------------------------------------------------------------------------------------------------
# c2: speculative trajectory with rejected drafts, over several ring wraps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("idx_dtype", INDEX_DTYPES, ids=["i32", "i64"])
@pytest.mark.parametrize("ring", [8, 7])
def test_c2_ring_wrap_after_rejected_drafts(device, idx_dtype, ring):
    """Verify, accept a random prefix of the drafts, verify again from there (redrawn rows), for many steps.
    Each call must equal its decode replay bitwise, and every live odd latent must equal the pooling of the
    committed partner row (or, inside a block, of the call's own previous row)."""
    draft_len, bs, steps = 5, 3, 16
    setup = C2Setup(KVLayout.V41, 64, ring=ring, owners=5, seed=ring, device=device, cache_tokens=4096)
    g = gen(ring + 31)
    state_d, cache_d = setup.state.clone(), setup.cache.clone()
    reqs = [1, 3, 4]
    prefix = [0, 1, 3]
    history = {r: {} for r in reqs}  # committed (kv, score) rows by position
    for b, r in enumerate(reqs):  # commit the rows before each start, parking the even ones
        for q in range(prefix[b]):
            row = pair_rows(1, 500 + 10 * b + q)[0]
            history[r][q] = row
            if q % 2 == 0:
                for st in (setup.state, state_d):
                    st[r * ring + q % ring] = row.to(device)
    weight = setup.weight.cpu()
    wraps = 0
    for step in range(steps):
        x = pair_rows(draft_len * (bs + 1), 7000 + 13 * step + ring)
        positions, req, raw = [], [], []
        for b, r in enumerate(reqs):
            for k in range(draft_len):
                p = prefix[b] + k
                positions.append(p)
                req.append(r)
                raw.append(1024 * r + p)  # the raw slot of a position is fixed: re-verified drafts rewrite it
        for k in range(draft_len):  # a padded request on the dummy request 0
            positions.append(k)
            req.append(0)
            raw.append(0)
        xd = x.to(device)
        latent_v = setup.call(xd, *(idx(v, idx_dtype, device) for v in (positions, req, raw)), draft_len=draft_len)
        latent_d = decode_replay(setup, xd, positions, req, raw, draft_len, idx_dtype, state_d, cache_d)
        assert_same(setup.state, state_d, f"step {step}: ring state")
        assert_same(setup.cache, cache_d, f"step {step}: cache bytes")
        live = list(range(draft_len * bs))
        assert_bits_equal(latent_v[live], latent_d[live], f"step {step}: latents")
        # Truth from the committed history.
        for i in live:
            p, r, k = positions[i], req[i], i % draft_len
            if p % 2 == 0:
                continue
            partner = x[i - 1] if k > 0 else history[r][p - 1]
            pooled = R.pair_pool(partner[:512], partner[512:], x[i, :512], x[i, 512:]).to(torch.bfloat16)
            truth = R.rms_norm_fp32(pooled, weight, EPS).to(torch.bfloat16)
            torch.testing.assert_close(latent_v[i].cpu().float(), truth.float(), **LATENT_TOL)
        for b, r in enumerate(reqs):
            accept = int(torch.randint(1, draft_len + 1, (1,), generator=g))
            for k in range(accept):
                history[r][prefix[b] + k] = x[b * draft_len + k]
            wraps += (prefix[b] + accept) // ring - prefix[b] // ring
            prefix[b] += accept
    assert wraps >= 3 * bs  # several wraps per request


# ------------------------------------------------------------------------------------------------------
# Padded rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("draft_len", [0, 3])
def test_c2_padded_rows_touch_nothing(device, draft_len):
    """A batch of padded rows only (raw_out_loc <= 0, some aliasing live requests, some with p < 0) leaves the
    ring and the cache bitwise unchanged; odd padded rows return latents, p < 0 rows zeros."""
    setup = C2Setup(KVLayout.V4, 64, ring=4, owners=6, seed=21, device=device)
    n = 12
    positions = [5, 6, 7, 8, 9, 10, -1, -2, -3, 11, 12, 13]
    req = [1, 1, 2, 2, 0, 0, 3, 3, 3, 4, 4, 5]
    raw = [0, 0, -1, -5, 0, 0, 7, 9, -1, 0, -2, 0]
    x = pair_rows(n, 21).to(device)
    state0, buf0 = setup.state.clone(), setup.buf.clone()
    latent = setup.call(x, *(idx(v, torch.int32, device) for v in (positions, req, raw)), draft_len=draft_len)
    assert_same(setup.state, state0, "ring state")
    assert_same(setup.buf, buf0, "cache")
    for i, p in enumerate(positions):
        nonzero = bool(bits(latent[i]).any())
        assert nonzero == (p >= 0 and p % 2 == 1), f"row {i} (p={p})"


@pytest.mark.parametrize("device", DEVICES)
def test_c1_padded_rows_touch_nothing(device):
    case = c1_case(KVLayout.V41, 64, torch.int64, device, 8, n=6)
    case["out_loc"].copy_(idx([0, -1, 0, -7, 0, 0], torch.int64, device))
    buf0 = case["buf"].clone()
    latent = run_c1(case, 64, KVLayout.V41)
    assert_same(case["buf"], buf0, "cache")
    ref = R.rms_norm_fp32(case["kv_input"].cpu(), case["norm_weight"].cpu(), EPS).to(torch.bfloat16)
    torch.testing.assert_close(latent.cpu().float(), ref.float(), **LATENT_TOL)


# ------------------------------------------------------------------------------------------------------
# The norm's order (§1.6: cache-writers.md §1.2) on rows chosen to expose a wrong one


_LATENT_ORDER_ROWS = {}


# The wrong orders that can change a c1 / c2 norm: the FMA-contracted ones of norm_orders cannot, since the rows
# normed are bf16 (c1's input, c2's bf16(pooled)), whose squares are exact in fp32.
LATENT_WRONG_ORDERS = ("sequential", "adjacent_pairs")


def latent_order_rows(per_order: int = 2):
    """Per wrong order of LATENT_WRONG_ORDERS, `per_order` pairs (x, w): a bf16 row x [1, 512] and a bf16 norm
    weight w whose bf16 latent bf16((x * r) * w) under the pinned sum of squares differs from that under the wrong
    one. The rows span 2^12 in magnitude, so that the orders round differently; w is random but at one dim k, where
    a bf16 weight is picked that puts x_k * r * w_k and its wrong-order twin on either side of a bf16 rounding
    edge."""
    if _LATENT_ORDER_ROWS:
        return _LATENT_ORDER_ROWS
    g = gen(77)
    n = 64
    x = torch.randn(n, 512, generator=g) * torch.exp2(torch.randint(-12, 1, (n, 512), generator=g).float())
    x = x.to(torch.bfloat16).float()
    base_w = norm_weight(78).float()
    weights = torch.arange(0x3F00, 0x4000, dtype=torch.int16).view(torch.bfloat16).float()  # every bf16 in [0.5, 2)
    latent = lambda rows, w, ss: y_from_ss(rows, w, EPS, ss).to(torch.bfloat16)  # noqa: E731
    ss = pinned_ss(x)
    for name in LATENT_WRONG_ORDERS:
        wrong_ss = WRONG_NORM_ORDERS[name]
        ss_wrong = wrong_ss(x)
        found = []
        for i in range(n):
            # x_k * r under each order, times every candidate weight ([512, 256]).
            a = y_from_ss(x[i:i + 1], 1.0, EPS, ss[i:i + 1])[0].unsqueeze(1) * weights
            b = y_from_ss(x[i:i + 1], 1.0, EPS, ss_wrong[i:i + 1])[0].unsqueeze(1) * weights
            flips = (a.to(torch.bfloat16) != b.to(torch.bfloat16)).nonzero()
            if flips.numel():
                k, j = flips[0].tolist()
                w = base_w.clone()
                w[k] = weights[j]
                found.append((x[i:i + 1].to(torch.bfloat16), w.to(torch.bfloat16)))
            if len(found) == per_order:
                break
        assert len(found) == per_order, f"{name}: only {len(found)} rows expose it"
        # The rows are the ones meant: the pinned order's latent differs from the wrong one's.
        for row, w in found:
            r32, w32 = row.float(), w.float()
            assert not torch.equal(latent(r32, w32, pinned_ss(r32)), latent(r32, w32, wrong_ss(r32))), name
        _LATENT_ORDER_ROWS[name] = found
    return _LATENT_ORDER_ROWS


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["c1", "c2"])
def test_norm_order_exposing_rows(device, op):
    """c1 and c2 on rows whose bf16 latent under the §1.2 order differs from that under a sequential sum or adjacent
    pairing: a kernel reducing in either order fails here (latent and cache bytes against the reference op). c2
    runs a verify block of two rows, each the same kv with equal scores: the odd row pools to that kv exactly
    (§1.5), so its latent is the norm of the chosen row."""
    layout, page_size, slot, position = KVLayout.V41, 64, 5, 101
    for name, rows in latent_order_rows().items():
        for x, w in rows:
            what = f"{op}, {name}"
            cache, _ = make_cache(layout, page_size, 2, 7, device)
            ref_cache = cache.cpu().clone()
            if op == "c1":
                args = (x, w, idx([position], torch.int64, "cpu"), idx([slot], torch.int64, "cpu"))
                got = dsv4.c1_decode_norm_rope_store(*(t.to(device) for t in args), EPS, TABLE.to(device), cache,
                                                     page_size=page_size, layout=layout)
                want = R.c1_decode_norm_rope_store(*args, EPS, TABLE, ref_cache, page_size, int(layout))
            else:
                setup = C2Setup(layout, page_size, ring=4, owners=2, seed=7, device=device)
                setup.weight = w.to(device)
                setup.cache = cache
                kv = torch.cat([x.float(), torch.zeros(1, 512)], dim=1).repeat(2, 1)
                positions, req, raw = (idx(v, torch.int64, "cpu") for v in ([position - 1, position], [1, 1],
                                                                           [2 * slot, 2 * slot + 1]))
                ref_state = setup.state.cpu().clone()
                got = setup.call(kv.to(device), positions.to(device), req.to(device), raw.to(device), draft_len=2)[1:]
                want = setup.reference(kv, positions, req, raw, ref_state, ref_cache, draft_len=2)[1:]
            assert_bits_equal(got, want, f"{what}: latent")
            # The reference's latent is the pinned order's, which the wrong order's is not (latent_order_rows).
            pinned = y_from_ss(x.float(), w.float(), EPS, pinned_ss(x.float())).to(torch.bfloat16)
            assert_bits_equal(want, pinned, f"{what}: the reference's latent is the pinned order's")
            assert_same(cache, ref_cache, f"{what}: cache bytes")


# ------------------------------------------------------------------------------------------------------
# Validation


def c1_args(device="cpu", n=4):
    case = c1_case(KVLayout.V41, 64, torch.int64, device, 11, n=n)
    return dict(kv_input=case["kv_input"], norm_weight=case["norm_weight"], positions=case["positions"],
                out_loc=case["out_loc"], eps=EPS, freqs_cis=TABLE.to(device), k_cache=case["cache"],
                page_size=64, layout=1)


def c2_args(device="cpu", draft_len=0, bs=3, ring=8, slice_pools=False, layout=KVLayout.V41):
    setup = C2Setup(layout, 64, ring=ring, owners=bs + 2, seed=12, device=device)
    if draft_len:
        x, positions, req, raw = verify_batch(setup, bs, draft_len, 1, 12)
    else:
        x, positions, req, raw = verify_batch(setup, bs, 1, 1, 12)
    state, cache = setup.state, setup.cache
    if slice_pools:  # dim-0 slices of larger pools
        big_state = torch.zeros(state.shape[0] + 3, 1024, device=device)
        big_state[2:-1] = state
        state = big_state[2:-1]
        big_cache = torch.zeros(cache.shape[0] + 2, cache.shape[1], dtype=torch.uint8, device=device)
        big_cache[1:-1] = cache
        cache = big_cache[1:-1]
    return dict(kv_input=x.to(device), kv_state=state, norm_weight=setup.weight,
                positions=idx(positions, torch.int64, device), req_pool_indices=idx(req, torch.int32, device),
                raw_out_loc=idx(raw, torch.int64, device), eps=EPS, freqs_cis=setup.table, k_cache=cache,
                page_size=64, ring_size=ring, draft_len=draft_len, layout=int(layout))


def c1_op(a):
    return torch.ops.dsv4.c1_decode_norm_rope_store(
        a["kv_input"], a["norm_weight"], a["positions"], a["out_loc"], a["eps"], a["freqs_cis"], a["k_cache"],
        a["page_size"], a["layout"])


def c2_op(a):
    return torch.ops.dsv4.c2_decode_or_verify_norm_rope_store(
        a["kv_input"], a["kv_state"], a["norm_weight"], a["positions"], a["req_pool_indices"], a["raw_out_loc"],
        a["eps"], a["freqs_cis"], a["k_cache"], a["page_size"], a["ring_size"], a["draft_len"], a["layout"])


C1_BAD = [
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"].float()), "kv_input must be bfloat16"),
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"][:, :256]), "kv_input must have 512 columns"),
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"].t().contiguous().t()), "kv_input"),
    ("norm_weight", lambda a: a.update(norm_weight=a["norm_weight"][:100]), "norm_weight must have 512"),
    ("norm_weight", lambda a: a.update(norm_weight=a["norm_weight"].half()), "norm_weight must be"),
    ("positions", lambda a: a.update(positions=a["positions"].float()), "positions must be int32 or int64"),
    ("positions", lambda a: a.update(positions=a["positions"][:2]), "positions must have 4 entries"),
    ("out_loc", lambda a: a.update(out_loc=a["out_loc"].view(2, 2)), "out_loc must be 1-D"),
    ("out_loc", lambda a: a.update(out_loc=a["out_loc"][:3]), "out_loc must have 4 entries"),
    ("eps", lambda a: a.update(eps=-1.0), "eps must be finite and >= 0"),
    ("eps", lambda a: a.update(eps=float("nan")), "eps must be finite"),
    ("freqs_cis", lambda a: a.update(freqs_cis=a["freqs_cis"][:, :32]), "freqs_cis must be"),
    ("freqs_cis", lambda a: a.update(freqs_cis=a["freqs_cis"].double()), "freqs_cis must be float32"),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"].view(torch.int8)), "k_cache must be uint8"),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][:, :1000]), "k_cache rows hold 1000 bytes"),
    ("page_size", lambda a: a.update(page_size=48), "page_size must be a power of two"),
    ("layout", lambda a: a.update(layout=3), "layout must be a KVLayout id"),
]

C2_BAD = [
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"].bfloat16()), "kv_input must be float32"),
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"][:, :512]), "kv_input must have 1024 columns"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"].bfloat16()), "kv_state must be float32"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"][:, :512]), "kv_state must have 1024 columns"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"][:5]), "kv_state must hold at least ring_size=8 rows"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"].t().contiguous().t()), "kv_state"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"][:1].expand(a["kv_state"].shape[0], 1024)),
     "kv_state row stride 0 overlaps rows (the ring is written)"),
    ("norm_weight", lambda a: a.update(norm_weight=a["norm_weight"][:511]), "norm_weight must have 512"),
    ("positions", lambda a: a.update(positions=a["positions"][1:]), "positions must have"),
    ("req_pool_indices", lambda a: a.update(req_pool_indices=a["req_pool_indices"].short()),
     "req_pool_indices must be int32 or int64"),
    ("req_pool_indices", lambda a: a.update(req_pool_indices=a["req_pool_indices"][1:]),
     "req_pool_indices must have"),
    ("raw_out_loc", lambda a: a.update(raw_out_loc=a["raw_out_loc"][::2]), "raw_out_loc must"),
    ("eps", lambda a: a.update(eps=float("inf")), "eps must be finite"),
    ("freqs_cis", lambda a: a.update(freqs_cis=a["freqs_cis"].t()), "freqs_cis must be"),
    ("k_cache", lambda a: a.update(k_cache=a["k_cache"][:, :-16]), "k_cache rows hold"),
    ("page_size", lambda a: a.update(page_size=2048), "page_size must be a power of two in"),
    ("ring_size", lambda a: a.update(ring_size=0), "ring_size must be >= 1"),
    ("draft_len", lambda a: a.update(draft_len=-1), "draft_len must be >= 0"),
    ("ring_size", lambda a: a.update(draft_len=8), "ring_size must be wider than the draft length"),
    ("draft_len", lambda a: a.update(draft_len=5), "multiple of draft_len=5"),
    ("layout", lambda a: a.update(layout=-1), "layout must be a KVLayout id"),
]


def assert_rejects(op_name, op, args, mutate, arg, message):
    """op(args) after mutate(args) raises the host error of op_name that names arg and says message."""
    mutate(args)
    with pytest.raises(RuntimeError, match=f"dsv4.{op_name}: .*{arg}") as info:
        op(args)
    assert message in str(info.value)


@pytest.mark.parametrize("arg,mutate,message", C1_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(C1_BAD)])
def test_c1_validation(arg, mutate, message):
    assert_rejects("c1_decode_norm_rope_store", c1_op, c1_args(), mutate, arg, message)


@pytest.mark.parametrize("arg,mutate,message", C2_BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(C2_BAD)])
def test_c2_validation(arg, mutate, message):
    assert_rejects("c2_decode_or_verify_norm_rope_store", c2_op, c2_args(), mutate, arg, message)


def test_validation_runs_before_empty_batch():
    a = c2_args()
    a.update(kv_input=a["kv_input"][:0], positions=a["positions"][:0], req_pool_indices=a["req_pool_indices"][:0],
             raw_out_loc=a["raw_out_loc"][:0], ring_size=0)
    with pytest.raises(RuntimeError, match="ring_size must be >= 1"):
        c2_op(a)
    a["ring_size"] = 8
    assert c2_op(a).shape == (0, 512)


def test_wrapper_errors_name_the_op_and_the_argument():
    """The Python wrappers' own errors (a layout that is no KVLayout, a complex table that is not complex64
    [max_pos, 32]) name the op and the argument; nothing is written."""
    fc = dsv4.precompute_freqs_cis(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0)
    c1, c2 = c1_args(), c2_args()
    p = dict(c2)
    del p["draft_len"]
    p.update(extend_starts=torch.tensor([0], dtype=torch.int32), extend_lens=torch.tensor([1], dtype=torch.int32),
             **{k: p[k][:1] for k in ("kv_input", "positions", "req_pool_indices", "raw_out_loc")})
    wrappers = (("c1_decode_norm_rope_store", dsv4.c1_decode_norm_rope_store, c1),
                ("c2_decode_or_verify_norm_rope_store", dsv4.c2_decode_or_verify_norm_rope_store, c2),
                ("c2_prefill_norm_rope_store", dsv4.c2_prefill_norm_rope_store, p))
    for op, wrapper, args in wrappers:
        cache_before = args["k_cache"].clone()
        for layout in ("v5", 3):
            with pytest.raises(ValueError, match=rf"^{op}: layout: unknown KVLayout"):
                wrapper(**dict(args, layout=layout))
        with pytest.raises(TypeError, match=rf"^{op}: layout: cannot interpret"):
            wrapper(**dict(args, layout=1.0))
        for freqs in (fc.to(torch.complex128), fc[:, 0]):
            with pytest.raises(ValueError, match=rf"^{op}: freqs_cis: .*complex64"):
                wrapper(**dict(args, freqs_cis=freqs))
        assert torch.equal(args["k_cache"], cache_before), op
        wrapper(**dict(args, freqs_cis=fc, layout="v41"))  # the accepted forms still run


@cuda_only
def test_device_mismatch_is_rejected():
    a = c2_args("cuda")
    a["positions"] = a["positions"].cpu()
    with pytest.raises(RuntimeError, match="c2_decode_or_verify_norm_rope_store: positions must be on cuda"):
        c2_op(a)
    b = c1_args("cuda")
    b["kv_input"] = b["kv_input"].cpu()
    with pytest.raises(RuntimeError, match="c1_decode_norm_rope_store: kv_input must be on cuda"):
        c1_op(b)


# ------------------------------------------------------------------------------------------------------
# opcheck and torch.compile


def _opcheck_args(a, names):
    return tuple(a[k] for k in names)


C1_NAMES = ("kv_input", "norm_weight", "positions", "out_loc", "eps", "freqs_cis", "k_cache", "page_size", "layout")
C2_NAMES = ("kv_input", "kv_state", "norm_weight", "positions", "req_pool_indices", "raw_out_loc", "eps",
            "freqs_cis", "k_cache", "page_size", "ring_size", "draft_len", "layout")


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    torch.library.opcheck(torch.ops.dsv4.c1_decode_norm_rope_store.default, _opcheck_args(c1_args(device), C1_NAMES))
    for draft_len in (0, 3):
        a = c2_args(device, draft_len=draft_len)
        if draft_len:  # the fake accepts the fp32 norm weights the op accepts
            a["norm_weight"] = a["norm_weight"].float()
        torch.library.opcheck(torch.ops.dsv4.c2_decode_or_verify_norm_rope_store.default, _opcheck_args(a, C2_NAMES))


def _generated_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    out, code = run_and_get_code(fn, *args)
    return out, "\n".join(code)


def _assert_no_pool_copy(code: str):
    """The compiled call allocates nothing (the ops allocate their own latents) and copies no pool."""
    body = code[code.index("def call("):]
    body = body[: body.index("return (")]
    for needle in ("clone", "copy_", "empty_strided", "aten.copy"):
        assert needle not in body, f"compiled code contains {needle!r}:\n{body}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pools", ["base", "slice"])
def test_compile_fullgraph_no_pool_clone(device, pools):
    torch._dynamo.reset()
    a = c2_args(device, draft_len=3, slice_pools=pools == "slice")
    c = c1_args(device)

    def step(kv1, w, pos1, loc1, freqs, cache1, kv2, state, pos2, req2, raw2, cache2):
        l1 = torch.ops.dsv4.c1_decode_norm_rope_store(kv1, w, pos1, loc1, EPS, freqs, cache1, 64, 1)
        l2 = torch.ops.dsv4.c2_decode_or_verify_norm_rope_store(kv2, state, w, pos2, req2, raw2, EPS, freqs, cache2,
                                                                64, a["ring_size"], 3, a["layout"])
        return l1, l2

    cache1 = c["k_cache"]
    if pools == "slice":
        big = torch.zeros(cache1.shape[0] + 2, cache1.shape[1], dtype=torch.uint8, device=device)
        big[1:-1] = cache1
        cache1 = big[1:-1]
    args = (c["kv_input"], a["norm_weight"], c["positions"], c["out_loc"], a["freqs_cis"], cache1, a["kv_input"],
            a["kv_state"], a["positions"], a["req_pool_indices"], a["raw_out_loc"], a["k_cache"])
    eager_args = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in args)
    e1, e2 = step(*eager_args)
    (l1, l2), code = _generated_code(torch.compile(step, fullgraph=True), *args)
    _assert_no_pool_copy(code)
    assert_bits_equal(l1, e1, "c1 latent")
    assert_bits_equal(l2, e2, "c2 latent")
    for got, want, what in ((cache1, eager_args[5], "c1 cache"), (a["kv_state"], eager_args[7], "ring state"),
                            (a["k_cache"], eager_args[11], "c2 cache")):
        assert_same(got, want, what)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_batch(device):
    torch._dynamo.reset()

    def step(kv, state, w, pos, req, raw, freqs, cache):
        return torch.ops.dsv4.c2_decode_or_verify_norm_rope_store(kv, state, w, pos, req, raw, EPS, freqs, cache,
                                                                  64, 8, 0, 1)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for bs in (3, 6):
        a = c2_args(device, bs=bs)
        args = _opcheck_args(a, ("kv_input", "kv_state", "norm_weight", "positions", "req_pool_indices",
                                 "raw_out_loc", "freqs_cis", "k_cache"))
        eager_args = tuple(t.clone() for t in args)
        got, want = compiled(*args), step(*eager_args)
        assert_bits_equal(got, want, f"bs {bs} latent")
        assert_same(args[1], eager_args[1], "ring state")
        assert_same(args[7], eager_args[7], "cache")


# ------------------------------------------------------------------------------------------------------
# CUDA: graphs, PDL, streams


def _refill(a, seed, pad_rows):
    """New rows, positions, requests and slots for the same static tensors; the last pad_rows rows are padded
    (rid 0, raw 0) and some live rows flip parity, so the skip decisions change between replays."""
    g = gen(seed)
    n = a["kv_input"].shape[0]
    new = {"kv_input": pair_rows(n, seed)}
    positions = torch.randint(0, 400, (n,), generator=g)
    raw = 2 * (1 + torch.randperm(200, generator=g)[:n]) + (positions & 1)
    req = 1 + torch.randperm(a["kv_state"].shape[0] // a["ring_size"] - 1, generator=g)[:n]
    req[n - pad_rows:] = 0
    raw[n - pad_rows:] = 0
    new.update(positions=positions, req_pool_indices=req, raw_out_loc=raw)
    return new


@cuda_only
def test_cuda_graph_replay_matches_eager():
    """Capture c1 and c2 (decode) once; refill the static inputs in place (padded rows included), replay 5 times
    under sync-debug "error", and compare each replay with eager calls on snapshots."""
    c = c1_args("cuda", n=16)
    a = c2_args("cuda", bs=12, ring=8)
    refills = []
    for r in range(5):
        new = {k: v.to("cuda").to(a[k].dtype) for k, v in _refill(a, 300 + r, 3).items()}
        loc = (1 + torch.randperm(c["k_cache"].shape[0] * 64 - 1, generator=gen(r))[:16]).cuda()
        loc[-4:] = torch.tensor([0, -1, 0, 0])
        # New RoPE positions too, with a live row past the table and one at -1 (latents, no store).
        pos = torch.randint(0, MAX_POS, (16,), generator=gen(450 + r))
        pos[r] = MAX_POS
        pos[r + 5] = -1
        refills.append((new, torch.randn(16, 512, generator=gen(400 + r)).to(torch.bfloat16).cuda(), loc,
                        pos.to(c["positions"].dtype).cuda()))

    def run():
        return c1_op(c), c2_op(a)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out1, out2 = run()
    records = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        # The eager ops do not sync either.
        c2_op(dict(a, kv_state=a["kv_state"].clone(), k_cache=a["k_cache"].clone()))
        c1_op(dict(c, k_cache=c["k_cache"].clone()))
        for new, kv1, loc, pos in refills:
            for k, v in new.items():
                a[k].copy_(v)
            c["kv_input"].copy_(kv1)
            c["out_loc"].copy_(loc)
            c["positions"].copy_(pos)
            snap = {k: a[k].clone() for k in ("kv_state", "k_cache")}
            snap_c1 = c["k_cache"].clone()
            graph.replay()
            records.append(({k: a[k].clone() for k in a if isinstance(a[k], torch.Tensor)}, snap, snap_c1,
                            {k: c[k].clone() for k in ("kv_input", "out_loc", "positions")},
                            out1.clone(), out2.clone(), c["k_cache"].clone()))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for i, (a_after, snap, snap_c1, c_in, got1, got2, c1_cache) in enumerate(records):
        e = dict(a_after, kv_state=snap["kv_state"], k_cache=snap["k_cache"], page_size=64, eps=EPS,
                 ring_size=a["ring_size"], draft_len=0, layout=a["layout"])
        want2 = c2_op(e)
        assert_bits_equal(got2, want2, f"replay {i}: c2 latent")
        assert_same(a_after["kv_state"], e["kv_state"], f"replay {i}: ring state")
        assert_same(a_after["k_cache"], e["k_cache"], f"replay {i}: c2 cache")
        e1 = dict(c, k_cache=snap_c1, **c_in)
        want1 = c1_op(e1)
        assert_bits_equal(got1, want1, f"replay {i}: c1 latent")
        assert_same(c1_cache, e1["k_cache"], f"replay {i}: c1 cache")


def capture_c2(op, a):
    """op(a) captured in a CUDA graph, after a warm-up on a side stream that works on copies of the ring and the
    cache (so that it leaves them as they were). Returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(dict(a, kv_state=a["kv_state"].clone(), k_cache=a["k_cache"].clone()))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(a)
    return graph, out


def replay_against_eager(op, a, refills, what):
    """Captures op(a) once (capture_c2); for each refill, copies its tensors into a's static inputs in place,
    replays under sync-debug "error" with an eager op call on snapshots of the ring and the cache after each
    (the eager op does not sync either), and compares latent, ring and cache bit for bit."""
    graph, out = capture_c2(op, a)
    records = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for new in refills:
            for k, v in new.items():
                a[k].copy_(v)
            snap = {k: a[k].clone() for k in ("kv_state", "k_cache")}
            graph.replay()
            got = (out.clone(), a["kv_state"].clone(), a["k_cache"].clone())
            want = op(dict(a, **snap))
            records.append((got, (want, snap["kv_state"], snap["k_cache"])))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for r, ((latent, state, cache), (want, want_state, want_cache)) in enumerate(records):
        assert_bits_equal(latent, want, f"{what} replay {r}: latent")
        assert_same(state, want_state, f"{what} replay {r}: ring state")
        assert_same(cache, want_cache, f"{what} replay {r}: cache")


def _refill_verify(a, seed):
    """New verify blocks for the static inputs of c2_args(draft_len > 0) (verify_batch): other live requests,
    start positions of both parities, other slots and rows, and the padded block on the dummy request 0."""
    pools = types.SimpleNamespace(owners=a["kv_state"].shape[0] // a["ring_size"],
                                  capacity=a["k_cache"].shape[0] * a["page_size"])
    bs = a["kv_input"].shape[0] // a["draft_len"] - 1
    x, positions, req, raw = verify_batch(pools, bs, a["draft_len"], 1, seed)
    return dict(kv_input=x, positions=torch.tensor(positions), req_pool_indices=torch.tensor(req),
                raw_out_loc=torch.tensor(raw))


@cuda_only
def test_cuda_graph_verify_replay_matches_eager():
    """Capture a verify call once; refill every static input in place (rows, positions, requests, slots), replay 5
    times under sync-debug "error" with an eager call on snapshots after each, and compare."""
    a = c2_args("cuda", draft_len=5, bs=4, ring=8)
    refills = [{k: v.to("cuda").to(a[k].dtype) for k, v in _refill_verify(a, 900 + r).items()} for r in range(5)]
    assert len(set(tuple(new["req_pool_indices"].tolist()) for new in refills)) > 1
    replay_against_eager(c2_op, a, refills, "verify")


@cuda_only
def test_non_default_stream():
    a = c2_args("cuda", draft_len=3)
    c = c1_args("cuda")
    a2 = dict(a, kv_state=a["kv_state"].clone(), k_cache=a["k_cache"].clone())
    c2 = dict(c, k_cache=c["k_cache"].clone())
    want2, want1 = c2_op(a2), c1_op(c2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got2, got1 = c2_op(a), c1_op(c)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert_bits_equal(got2, want2, "c2 latent")
    assert_bits_equal(got1, want1, "c1 latent")
    assert_same(a["kv_state"], a2["kv_state"], "ring state")
    assert_same(a["k_cache"], a2["k_cache"], "c2 cache")
    assert_same(c["k_cache"], c2["k_cache"], "c1 cache")


_PDL_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {repo!r}); sys.path.insert(0, {tests!r})
    import test_low_ratio as t
    import test_c2_prefill as tp
    out = {{}}
    for layout in t.LAYOUTS:
        c = t.c1_args("cuda", n=64)
        c["layout"] = int(layout)
        c["k_cache"], _ = t.make_cache(layout, 64, c["k_cache"].shape[0], 3, "cuda")
        out[f"c1_latent_{{layout}}"] = t.c1_op(c)
        out[f"c1_cache_{{layout}}"] = c["k_cache"]
        for draft_len in (0, 5):
            a = t.c2_args("cuda", draft_len=draft_len, bs=6, layout=layout)
            lat = [t.c2_op(a)]
            a["positions"] += draft_len or 1  # a second step from the state the first one left
            lat.append(t.c2_op(a))
            out[f"c2_{{layout}}_{{draft_len}}"] = (lat, a["kv_state"], a["k_cache"])
        # c2 prefill: two kernels in a row (the ring writer after the reader), two chunks on one ring.
        setup = t.C2Setup(layout, 64, ring=8, owners=8, seed=9, device="cuda")
        chunk = tp.Chunk(setup, [3, 9, 1, 17, 6], 9, tail_pad=2)
        lat = [chunk.call(setup, torch.int64)]
        chunk.positions = [p + 5 if p >= 0 else p for p in chunk.positions]  # the next chunk, parities flipped
        lat.append(chunk.call(setup, torch.int64))
        out[f"c2_prefill_{{layout}}"] = (lat, setup.state, setup.cache)
    torch.cuda.synchronize()
    torch.save(out, sys.argv[1])
    """
)


@cuda_only
def test_pdl_on_off_identical(tmp_path):
    script = tmp_path / "pdl_run.py"
    script.write_text(_PDL_SCRIPT.format(repo=REPO, tests=os.path.dirname(os.path.abspath(__file__))))
    results = []
    for flag in ("0", "1"):
        path = tmp_path / f"out_{flag}.pt"
        env = dict(os.environ, SGL_DSV4_PDL=flag)
        proc = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(torch.load(path))
    off, on = results
    assert off.keys() == on.keys()
    for key in off:
        flat_off, flat_on = torch.utils._pytree.tree_flatten(off[key])[0], torch.utils._pytree.tree_flatten(on[key])[0]
        for x, y in zip(flat_off, flat_on):
            assert torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x,
                               y.view(torch.uint8) if y.dtype != torch.uint8 else y), key
