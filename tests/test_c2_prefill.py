"""Tests of c2_prefill_norm_rope_store (compressors.md §5.5): the binding contract (latents, cache bytes and final
ring rows equal running the decode op row by row in position order) for rings 2 and 8, an odd ring and ring 1, mixed
start parity and chunks longer than the ring, in every layout; the reference module (fp32 norm weights, strided and
misaligned rows too); requests outside the rows; validation; opcheck, torch.compile and CUDA-graph replay.
"""
from __future__ import annotations

import types

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import KVLayout
from sgl_dsv4_kernels import reference as R

from test_low_ratio import (DEVICES, EPS, INDEX_DTYPES, LAYOUTS, C2Setup, _assert_no_pool_copy, _generated_code,
                            assert_bits_equal, assert_rejects, assert_same, bits, replay_against_eager,
                            check_c2_against_reference, cuda_only, gen, idx, misaligned, pair_rows)
from samples import huge_cpu_tensor


class Chunk:
    """A prefill chunk: request r (request slot reqs[r]) owns rows [starts[r], starts[r] + lens[r]) at positions
    first[r], first[r] + 1, ...; every row live with its own cache slot. `tail_pad` padded rows (p = -1) follow
    the requests and belong to none. far: the last request's positions lie beyond int32 (int64 indices only; the
    CUDA kernel plans such rows in 64 bits, the others in 32)."""

    def __init__(self, setup: C2Setup, lens, seed: int, tail_pad: int = 0, far: bool = False):
        g = gen(seed)
        self.lens = list(lens)
        self.reqs = (1 + torch.randperm(setup.owners - 1, generator=g))[: len(lens)].tolist()
        self.first = torch.randint(1, 300, (len(lens),), generator=g).tolist()  # mixed parity
        if far:
            self.first[-1] += 2**33
        cslots = (1 + torch.randperm(setup.capacity - 1, generator=g)).tolist()
        self.starts, self.positions, self.req, self.raw = [], [], [], []
        for r, length in enumerate(self.lens):
            self.starts.append(len(self.positions))
            for k in range(length):
                p = self.first[r] + k
                self.positions.append(p)
                self.req.append(self.reqs[r])
                self.raw.append(2 * cslots.pop() + (p & 1))
        for _ in range(tail_pad):
            self.positions.append(-1)
            self.req.append(self.reqs[0])
            self.raw.append(0)
        self.x = pair_rows(len(self.positions), seed + 1)

    def call(self, setup: C2Setup, idx_dtype, state=None, cache=None, kv_input=None):
        d = setup.device
        return dsv4.c2_prefill_norm_rope_store(
            self.x.to(d) if kv_input is None else kv_input, setup.state if state is None else state, setup.weight,
            idx(self.positions, idx_dtype, d), idx(self.req, idx_dtype, d), idx(self.raw, idx_dtype, d), EPS,
            setup.table, setup.cache if cache is None else cache, idx(self.starts, torch.int32, d),
            idx(self.lens, torch.int32, d), page_size=setup.page_size, ring_size=setup.ring, layout=setup.layout)

    def decode_replay(self, setup: C2Setup, idx_dtype, state, cache):
        """The contract: decode calls in position order, call k holding row k of every request that has one."""
        d = setup.device
        latent = torch.zeros(len(self.positions), 512, dtype=torch.bfloat16, device=d)
        for k in range(max(self.lens, default=0)):
            rows = [s + k for s, length in zip(self.starts, self.lens) if k < length]
            sel = lambda v: idx([v[r] for r in rows], idx_dtype, d)  # noqa: E731
            latent[rows] = setup.call(self.x[rows].to(d), sel(self.positions), sel(self.req), sel(self.raw), 0,
                                      state, cache)
        return latent


def _lens(ring: int):
    """One row, a run shorter than the ring, runs of exactly and past lcm(2, ring), and an empty request."""
    period = ring if ring % 2 == 0 else 2 * ring
    return [1, max(1, ring - 1), period, 3 * period + 1, 0, 2 * period + 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [2, 8, 5, 1])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.str_name)
def test_prefill_equals_successive_decodes(device, layout, ring):
    idx_dtype = INDEX_DTYPES[(ring + int(layout)) % 2]
    seed = 500 + 10 * ring + int(layout)
    # fp32 norm weights on ring 5: the prefill kernel's fp32 load against the decode kernel's, bit for bit.
    weight_dtype = torch.float32 if ring == 5 else torch.bfloat16
    setup = C2Setup(layout, 64, ring=ring, owners=10, seed=seed, device=device, weight_dtype=weight_dtype)
    chunk = Chunk(setup, _lens(ring), seed, tail_pad=3, far=idx_dtype == torch.int64)
    state_d, cache_d = setup.state.clone(), setup.cache.clone()
    latent = chunk.call(setup, idx_dtype)
    latent_d = chunk.decode_replay(setup, idx_dtype, state_d, cache_d)
    assert_bits_equal(latent, latent_d, "latents")
    assert_same(setup.state, state_d, "ring state")
    assert_same(setup.cache, cache_d, "cache bytes")
    # The chunk wrote ring rows: each request's newest even positions, the old rows elsewhere.
    assert not torch.equal(setup.state.cpu(), C2Setup(layout, 64, ring, 10, seed, "cpu").state)


def _reference(setup: C2Setup, chunk: Chunk, ref_state, ref_cache):
    """The reference on contiguous CPU copies of the ring and the cache view (updated in place)."""
    return R.c2_prefill_norm_rope_store(
        chunk.x, ref_state, setup.weight.cpu(), torch.tensor(chunk.positions), torch.tensor(chunk.req),
        torch.tensor(chunk.raw), EPS, setup.table.cpu(), ref_cache, torch.tensor(chunk.starts),
        torch.tensor(chunk.lens), setup.page_size, setup.ring, int(setup.layout))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["wbf16", "wfp32"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: l.str_name)
def test_prefill_matches_reference(device, layout, weight_dtype):
    """Latents, the whole ring and the whole poisoned cache against the reference, with bf16 and fp32 norm weights;
    the latent is a fresh contiguous tensor (§7)."""
    setup = C2Setup(layout, 128, ring=8, owners=8, seed=71, device=device, weight_dtype=weight_dtype)
    chunk = Chunk(setup, [5, 19, 2, 8], 71, tail_pad=2)
    state_buf0, buf0 = setup.state_buf.cpu().clone(), setup.buf.cpu().clone()
    ref_state, ref_cache = setup.state.cpu().clone(), setup.cache.cpu().clone()
    kv_input = chunk.x.to(device)
    latent = chunk.call(setup, torch.int64, kv_input=kv_input)
    ref = _reference(setup, chunk, ref_state, ref_cache)
    check_c2_against_reference(setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, chunk.positions,
                               chunk.raw)
    assert latent.dtype == torch.bfloat16 and latent.shape == (len(chunk.positions), 512) and latent.is_contiguous()
    for t in (kv_input, setup.state, setup.cache, setup.weight, setup.table):
        assert latent.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    # Even rows and the padded rows past the requests return zeros; odd rows a latent.
    for i, p in enumerate(chunk.positions):
        assert bool(bits(latent[i].cpu()).any()) == (p >= 0 and p % 2 == 1), f"row {i} (p = {p})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring", [2, 8])
def test_prefill_strided_misaligned_rows_match_reference(device, ring):
    """kv_input and kv_state as column slices of wider NaN-filled buffers at odd offsets (free row strides, no
    16-byte aligned row: the element-wise paths of both kernels) and a cache whose page stride exceeds page_bytes.
    Matches the reference run on contiguous copies; nothing outside the views changes (the input buffer
    included)."""
    layout = KVLayout.V41 if ring == 2 else KVLayout.V4
    setup = C2Setup(layout, 64, ring=ring, owners=8, seed=81 + ring, device=device, strided=True)
    chunk = Chunk(setup, _lens(ring), 81 + ring, tail_pad=2)
    x_view, x_buf = misaligned(chunk.x, device)
    x_buf0 = x_buf.cpu().clone()
    state_buf0, buf0 = setup.state_buf.cpu().clone(), setup.buf.cpu().clone()
    ref_state, ref_cache = setup.state.cpu().clone(), setup.cache.cpu().clone()
    assert ref_state.is_contiguous() and ref_cache.is_contiguous()
    latent = chunk.call(setup, torch.int64, kv_input=x_view)
    ref = _reference(setup, chunk, ref_state, ref_cache)
    check_c2_against_reference(setup, latent, ref, ref_state, ref_cache, state_buf0, buf0, chunk.positions,
                               chunk.raw)
    assert_same(x_buf.view(torch.int32), x_buf0.view(torch.int32), "input buffer (bits)")
    assert not torch.equal(ref_state, state_buf0[:, 1:1025])  # the chunk parked rows


@pytest.mark.parametrize("device", DEVICES)
def test_requests_outside_the_rows_park_nothing(device):
    """Requests whose rows do not lie within the input are skipped by the ring writes; the rows still pool."""
    setup = C2Setup(KVLayout.V41, 64, ring=4, owners=6, seed=90, device=device)
    chunk = Chunk(setup, [6, 6], 90)
    state0 = setup.state.clone()
    n = len(chunk.positions)
    d = setup.device
    latent = dsv4.c2_prefill_norm_rope_store(
        chunk.x.to(d), setup.state, setup.weight, idx(chunk.positions, torch.int32, d), idx(chunk.req, torch.int32, d),
        idx(chunk.raw, torch.int32, d), EPS, setup.table, setup.cache, idx([-1, 6, n + 5], torch.int32, d),
        idx([6, n, 2], torch.int32, d), page_size=64, ring_size=4, layout=KVLayout.V41)
    assert_same(setup.state, state0, "ring state")
    assert bits(latent.cpu()).any()


def _args(device="cpu", **over):
    setup = C2Setup(KVLayout.V41_FP4, 64, ring=8, owners=4, seed=5, device=device)
    chunk = Chunk(setup, [3, 9], 5)
    a = dict(kv_input=chunk.x.to(device), kv_state=setup.state, norm_weight=setup.weight,
             positions=idx(chunk.positions, torch.int64, device), req_pool_indices=idx(chunk.req, torch.int64, device),
             raw_out_loc=idx(chunk.raw, torch.int64, device), eps=EPS, freqs_cis=setup.table, k_cache=setup.cache,
             extend_starts=idx(chunk.starts, torch.int32, device), extend_lens=idx(chunk.lens, torch.int32, device),
             page_size=64, ring_size=8, layout=int(KVLayout.V41_FP4))
    a.update(over)
    return a


NAMES = ("kv_input", "kv_state", "norm_weight", "positions", "req_pool_indices", "raw_out_loc", "eps", "freqs_cis",
         "k_cache", "extend_starts", "extend_lens", "page_size", "ring_size", "layout")


def _op(a):
    return torch.ops.dsv4.c2_prefill_norm_rope_store(*(a[k] for k in NAMES))


BAD = [
    ("kv_input", lambda a: a.update(kv_input=a["kv_input"].bfloat16()), "kv_input must be float32"),
    ("kv_state", lambda a: a.update(kv_state=a["kv_state"][:5]), "kv_state must hold at least ring_size=8 rows"),
    ("positions", lambda a: a.update(positions=a["positions"][1:]), "positions must have"),
    ("ring_size", lambda a: a.update(ring_size=0), "ring_size must be >= 1"),
    ("extend_starts", lambda a: a.update(extend_starts=a["extend_starts"].float()), "int32 or int64"),
    ("extend_lens", lambda a: a.update(extend_lens=a["extend_lens"][:1]), "one entry per request"),
    ("extend_lens", lambda a: a.update(extend_lens=a["extend_lens"].view(1, 2)), "extend_lens must be 1-D"),
    ("layout", lambda a: a.update(layout=3), "layout must be a KVLayout id"),
]


@pytest.mark.parametrize("arg,mutate,message", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_validation(arg, mutate, message):
    assert_rejects("c2_prefill_norm_rope_store", _op, _args(), mutate, arg, message)


def test_empty_chunk():
    a = _args()
    for k in ("kv_input", "positions", "req_pool_indices", "raw_out_loc", "extend_starts", "extend_lens"):
        a[k] = a[k][:0]
    assert _op(a).shape == (0, 512)


MAX_REQUESTS = 2**31 - 1  # grid x limit of the ring-write launch, one block per request


def _empty_rows_with_requests(requests: int, device: str, tmp_path):
    """Arguments with no kv rows and `requests` entries of extend_starts / extend_lens. On the CPU the index
    vectors are virtual memory (8 GiB each) that the op must never touch: it rejects or, with no rows, returns."""
    a = _args()
    for k in ("kv_input", "positions", "req_pool_indices", "raw_out_loc"):
        a[k] = a[k][:0]
    for k in ("extend_starts", "extend_lens"):
        if device == "meta":
            a[k] = torch.empty(requests, dtype=torch.int32, device="meta")
        else:
            a[k] = huge_cpu_tensor(4 * requests, tmp_path / k).view(torch.int32)
    if device == "meta":
        a = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in a.items()}
    return a


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_request_count_bounded_by_the_park_grid(device, tmp_path):
    """2^31 requests would overflow the ring-write launch's grid x after the rows launch wrote the cache: the host
    check (and the fake) rejects them before anything runs, naming the op and extend_starts; 2^31 - 1 pass."""
    (tmp_path / "extend_starts").mkdir()
    (tmp_path / "extend_lens").mkdir()
    a = _empty_rows_with_requests(MAX_REQUESTS + 1, device, tmp_path)
    with pytest.raises(RuntimeError, match=r"dsv4\.c2_prefill_norm_rope_store: extend_starts has 2147483648 "
                                           r"requests; at most 2147483647"):
        _op(a)
    del a
    a = _empty_rows_with_requests(MAX_REQUESTS, device, tmp_path)
    assert _op(a).shape == (0, 512)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pools", ["base", "slice"])
def test_opcheck_and_compile(device, pools):
    """opcheck, then torch.compile(fullgraph=True) equal to eager with no copy of the ring or the cache, for pools
    passed whole and as dim-0 slices of larger buffers."""
    torch.library.opcheck(torch.ops.dsv4.c2_prefill_norm_rope_store.default, tuple(_args(device)[k] for k in NAMES))
    torch._dynamo.reset()
    a, b = _args(device), _args(device)
    if pools == "slice":
        for k in ("kv_state", "k_cache"):
            big = torch.zeros((a[k].shape[0] + 2,) + tuple(a[k].shape[1:]), dtype=a[k].dtype, device=device)
            big[1:-1] = a[k]
            a[k] = big[1:-1]
    compiled = torch.compile(lambda *args: torch.ops.dsv4.c2_prefill_norm_rope_store(*args), fullgraph=True)
    got, code = _generated_code(compiled, *(a[k] for k in NAMES))
    _assert_no_pool_copy(code)
    want = _op(b)
    assert_bits_equal(got, want, "latent")
    assert_same(a["kv_state"], b["kv_state"], "ring state")
    assert_same(a["k_cache"], b["k_cache"], "cache")


def _refill(a, seed, lens):
    """A new chunk of the same row count for the static inputs of _args: other requests, start positions of both
    parities, slots, rows, and the split of the rows between the requests (extend_starts, extend_lens)."""
    pools = types.SimpleNamespace(owners=a["kv_state"].shape[0] // a["ring_size"],
                                  capacity=a["k_cache"].shape[0] * a["page_size"])
    chunk = Chunk(pools, lens, seed)
    assert len(chunk.positions) == a["kv_input"].shape[0]
    return dict(kv_input=chunk.x, positions=torch.tensor(chunk.positions), req_pool_indices=torch.tensor(chunk.req),
                raw_out_loc=torch.tensor(chunk.raw), extend_starts=torch.tensor(chunk.starts),
                extend_lens=torch.tensor(chunk.lens))


@cuda_only
def test_cuda_graph_replay_matches_eager():
    """Capture once; refill every static input in place (including how the rows split between the requests),
    replay under sync-debug "error" with an eager call on snapshots after each, and compare."""
    a = _args("cuda")
    refills = [{k: v.to("cuda").to(a[k].dtype) for k, v in _refill(a, 700 + r, lens).items()}
               for r, lens in enumerate(([9, 3], [3, 9], [12, 0], [1, 11]))]
    replay_against_eager(_op, a, refills, "prefill")
