"""Tests of the norm + RoPE cache writers fused_k_norm_rope_flashmla and compress_norm_rope_store
(cache-writers.md §7): byte-exact against the reference on CPU and CUDA, poisoned caches compared
whole, hand-built plans, the §7.4 pins, validation, opcheck, torch.compile, CUDA graphs and PDL.
"""
from __future__ import annotations

import contextlib
import math
import re
import textwrap
import zlib
from types import SimpleNamespace

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import IndexerFormat, KVLayout
from sgl_dsv4_kernels import reference as ref
from sgl_dsv4_kernels.rope import _yarn_correction_dim

from norm_orders import WRONG_NORM_ORDERS, pinned_ss, y_from_ss
from samples import run_with_pdl_off_and_on

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS)]

MAX_POS = 4096
# A compressed-layer table (YaRN, typical V4 values), built once on CPU as a user would.
TABLE = dsv4.precompute_rope_table(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0)
_TABLES = {}

# (page_size, num_pages, rows): capacity > rows (§7.1 matrix), and the P = 1 / 1024 smoke runs.
MATRIX = [(2, 40, 37), (64, 9, 333), (256, 3, 500)]
SMOKE = [(1, 50, 20), (1024, 2, 300)]
KINDS = ["exact", "general", "boundary"]
# Per call: kv dtype, weight dtype, the two index dtypes, kv shape, cache as a slice of a larger pool.
COMBOS = [
    (torch.bfloat16, torch.bfloat16, torch.int32, torch.int32, "contiguous", False),
    (torch.bfloat16, torch.float32, torch.int64, torch.int32, "strided", True),
    (torch.float32, torch.bfloat16, torch.int32, torch.int64, "odd_stride", False),
    (torch.float32, torch.float32, torch.int64, torch.int64, "strided", True),
    # bf16 rows at an odd row stride and a 6-byte offset: the CUDA kernels' element-by-element load fallback.
    (torch.bfloat16, torch.float32, torch.int64, torch.int32, "odd_stride", False),
]
MAIN_VARIANTS = ["v4", "v41", "v41_fp4"]
INDEXER_VARIANTS = ["indexer_fp8", "indexer_fp4"]

BOUNDARY_MAGNITUDES = [0.0, 2**-12, 6 * 2**-9, 0.01, 6 * 1.0625, 6 * 1.1875, 2688.0, 1e6, 8.25, 448.0, 449.0]
TIE_BLOCK = [8.25, 4.125, 3.4375, -4.8125, 0.0, -0.0, 2.5, -3.5]


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    # The reference is thousands of tiny torch ops; intra-op threads only add contention on small machines.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _table(device) -> torch.Tensor:
    device = torch.device(device)
    if device not in _TABLES:
        _TABLES[device] = TABLE.to(device)
    return _TABLES[device]


def _f32(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


# ---------------------------------------------------------------------------------------------------------
# Inputs (§7.1)


def _rows(kind: str, gen: torch.Generator, n: int, d: int):
    """(x fp32 [n, d], w fp32 [d], eps) for one row kind."""
    if kind == "general":
        x = torch.randn(n, d, generator=gen) * torch.exp2(torch.randint(-10, 6, (n, 1), generator=gen).float())
        x[0, 64:128] = 0.0  # a zero tile
        x[min(1, n - 1), 32:48] = -0.0  # a -0.0 half tile
        x[min(2, n - 1), 5] = -1e-10
        w = torch.randn(d, generator=gen) * 0.5 + 1.0
        return x, w, 1e-6
    # Exact-norm rows: x_i = +-2^k, eps = 0, so y = +-w exactly.
    signs = torch.randint(0, 2, (n, d), generator=gen).float() * 2 - 1
    x = signs * torch.exp2(torch.randint(-10, 11, (n, 1), generator=gen).float())
    if kind == "exact":
        w = torch.randn(d, generator=gen).to(torch.bfloat16).float()
        w[torch.randperm(d, generator=gen)[: d // 16]] = 0.0
    else:  # boundary: the quantizer boundary magnitudes reach the quantizer through w
        w = torch.empty(d)
        for t in range(d // 16):
            if t % 12 == 11:
                w[16 * t: 16 * t + 16] = torch.tensor(TIE_BLOCK * 2)
            else:
                m = BOUNDARY_MAGNITUDES[t % 12]
                w[16 * t: 16 * t + 16] = torch.tensor([m, -m] * 8)
    return x, w, 0.0


def _place(x: torch.Tensor, dtype, shape: str, device):
    """(cpu view, device view) of the rows in dtype: contiguous, a column slice of a 4x wider buffer, or
    a slice with a row stride that is not a multiple of 8 elements (misaligned for vector loads)."""
    n, d = x.shape
    if shape == "contiguous":
        buf, cols = x.to(dtype), slice(None)
    elif shape == "strided":
        buf, cols = torch.zeros(n, 4 * d, dtype=dtype), slice(d, 2 * d)
    else:
        buf, cols = torch.zeros(n, d + 5, dtype=dtype), slice(3, 3 + d)
    if shape != "contiguous":
        buf[:, cols] = x.to(dtype)
    return buf[:, cols], buf.to(device)[:, cols]


def _fmt(variant: str):
    return {"v4": KVLayout.V4, "v41": KVLayout.V41, "v41_fp4": KVLayout.V41_FP4,
            "indexer_fp8": IndexerFormat.FP8, "indexer_fp4": IndexerFormat.FP4}[variant]


class PoisonedCache:
    """A cache filled with 0xA5 or random bytes, 32 bytes wider than a page, optionally a dim-0 slice
    of a larger pool. The whole pool is compared, so skipped rows, V4 scale byte 7, page padding and the
    bytes past page_bytes are all checked."""

    def __init__(self, fmt, page_size, num_pages, device, gen, random_fill, pool):
        width = fmt.page_bytes(page_size) + 32
        rows = num_pages + (3 if pool else 0)
        if random_fill:
            self.expected = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=gen)
        else:
            self.expected = torch.full((rows, width), 0xA5, dtype=torch.uint8)
        self.pages = slice(1, 1 + num_pages) if pool else slice(None)
        self.pool = self.expected.to(device)
        self.expected = self.expected.clone()

    @property
    def ref(self):
        return self.expected[self.pages]

    @property
    def dev(self):
        return self.pool[self.pages]

    def check(self, what=""):
        assert_same_bytes(self.pool, self.expected, what)


def assert_same_bytes(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    got = got.cpu()
    if torch.equal(got, expected):
        return
    diff = (got != expected).nonzero()
    first = diff[:6].tolist()
    detail = [(tuple(i), int(got[tuple(i)]), int(expected[tuple(i)])) for i in first]
    raise AssertionError(f"{what}: {diff.shape[0]} bytes differ; (index, got, expected): {detail}")


def assert_rows_written(cache: torch.Tensor, poison: torch.Tensor, fmt, page_size: int, slots) -> None:
    """Every slot's data row (§0 addressing) differs from the poison's: a comparison of two op outputs
    then means something."""
    cache, poison = cache.cpu(), poison.cpu()
    for slot in torch.as_tensor(slots).tolist():
        page, row = divmod(slot, page_size)
        at = slice(row * fmt.data_bytes, (row + 1) * fmt.data_bytes)
        assert not torch.equal(cache[page, at], poison[page, at]), f"slot {slot} was not written"


def _slots(gen, n, capacity, dtype, lowest=0):
    """n slots: distinct valid ones from [lowest, capacity) plus the invalid values of §7.1."""
    slots = torch.randperm(capacity - lowest, generator=gen)[:n] + lowest
    invalid = [-1, -capacity, capacity, capacity + 5, 2**40 if dtype == torch.int64 else 2**31 - 1]
    where = torch.randperm(n, generator=gen)[: len(invalid)]
    slots[where] = torch.tensor(invalid[: where.numel()])
    return slots.to(dtype)


def _positions(gen, n, dtype):
    """Random positions in [0, MAX_POS) plus out-of-range ones."""
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    bad = [MAX_POS, -1, 2**40 if dtype == torch.int64 else 2**31 - 1]
    where = torch.randperm(n, generator=gen)[: min(n, 2)]
    pos[where] = torch.tensor([bad[int(torch.randint(0, 3, (1,), generator=gen))] for _ in range(where.numel())])
    return pos.to(dtype)


def _plan(seq_lens, word1, gen) -> torch.Tensor:
    """uint8 [N, 16] little-endian plan: u32 seq_len at byte 0, u32 word1 at byte 4 (prefill: ragged_id |
    buffer_len << 16), and random read pages at bytes 8..15, which the writer must ignore."""
    seq = torch.as_tensor(seq_lens, dtype=torch.int64)
    w1 = torch.as_tensor(word1, dtype=torch.int64)
    n = seq.shape[0]
    plan = torch.randint(0, 256, (n, 16), dtype=torch.uint8, generator=gen)
    for k in range(4):
        plan[:, k] = ((seq >> (8 * k)) & 0xFF).to(torch.uint8)
        plan[:, 4 + k] = ((w1 >> (8 * k)) & 0xFF).to(torch.uint8)
    return plan


def decode_case(gen, n, ratio, capacity, dtype):
    """(plan, out_loc) of a decode call mixing every row type of §4; rows that may not write carry a
    real slot, except non-boundary rows, which carry slot 0 like the metadata emits. Block-closing rows with an
    invalid slot take the §7.1 values, the extreme ones first (calls of 20 rows already get both)."""
    invalid = [2**40 if dtype == torch.int64 else 2**31 - 1, capacity + 5, -1, capacity, -capacity]
    slots = (torch.randperm(capacity - 1, generator=gen)[:n] + 1).tolist()
    seq, loc = [], []
    for i in range(n):
        m = int(torch.randint(1, MAX_POS // ratio + 1, (1,), generator=gen))
        kind = i % 8
        if kind in (0, 1, 2):  # closes a block: written
            seq.append(ratio * m)
            loc.append(slots[i])
        elif kind == 3:  # does not close a block: out_loc 0, skipped by the modulo test
            seq.append(ratio * m + 1 + i % (ratio - 1))
            loc.append(0)
        elif kind == 4:  # seq_len 0 or seq_len < ratio
            seq.append(0 if i % 16 == 4 else 1 + i % (ratio - 1))
            loc.append(slots[i])
        elif kind == 5:  # position seq_len - ratio == max_pos
            seq.append(MAX_POS + ratio)
            loc.append(slots[i])
        elif kind == 6:  # closes a block, invalid slot
            seq.append(ratio * m)
            loc.append(invalid[(i // 8) % len(invalid)])
        else:  # a decode sentinel
            seq.append(0xFFFFFFFF)
            loc.append(slots[i])
    junk = torch.randint(-(2**31), 2**31, (n,), generator=gen)  # write_loc: ignored by the writer
    return _plan(seq, junk, gen), torch.tensor(loc, dtype=dtype)


def prefill_case(gen, n, ratio, capacity, dtype, short_out_loc):
    """(plan, out_loc) of a prefill call: distinct ragged ids into an out_loc longer than N (or shorter,
    as context parallelism passes), sentinel entries, out-of-range ragged ids, a non-multiple seq_len
    (written: no modulo test in prefill), out-of-range positions, and entries whose slot takes the §7.1
    invalid values (the extreme ones first)."""
    m_len = n // 2 if short_out_loc else n + 7
    out_loc = torch.randperm(capacity, generator=gen)[:m_len]
    ragged = torch.randperm(max(m_len, n), generator=gen)[:n].tolist()
    seq = []
    for i in range(n):
        m = int(torch.randint(1, MAX_POS // ratio + 1, (1,), generator=gen))
        kind = i % 7
        if kind == 3:
            seq.append(0xFFFFFFFF)  # padding entry
        elif kind == 4:
            seq.append(ratio * m)
            ragged[i] = [m_len, m_len + 3, 65535][i % 3]  # ragged_id >= out_loc.size(0)
        elif kind == 5:
            seq.append([MAX_POS + ratio, ratio - 1, 0][i % 3])  # position out of range
        elif kind == 6:
            seq.append(min(ratio * m + 1, MAX_POS + ratio - 1))  # no modulo test in prefill
        else:
            seq.append(ratio * m)
    invalid = [2**40 if dtype == torch.int64 else 2**31 - 1, capacity + 5, -1, capacity, -capacity]
    invalid_at = [ragged[i] for i in range(0, n, 7) if ragged[i] < m_len][: len(invalid)]
    out_loc[invalid_at] = torch.tensor(invalid[: len(invalid_at)])
    buffer_len = torch.randint(0, 65536, (n,), generator=gen)
    word1 = torch.tensor(ragged, dtype=torch.int64) | (buffer_len << 16)
    return _plan(seq, word1, gen), out_loc.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Running an op and the reference on the same inputs


def run_k_writer(device, x, w, eps, combo, page_size, num_pages, layout, gen, random_fill):
    kv_dtype, w_dtype, pos_dtype, loc_dtype, shape, pool = combo
    n = x.shape[0]
    kv_cpu, kv_dev = _place(x, kv_dtype, shape, device)
    weight = w.to(w_dtype)
    pos = _positions(gen, n, pos_dtype)
    loc = _slots(gen, n, num_pages * page_size, loc_dtype)
    cache = PoisonedCache(layout, page_size, num_pages, device, gen, random_fill, pool)
    ref.fused_k_norm_rope_flashmla(kv_cpu, weight, eps, TABLE, pos, loc, cache.ref, page_size=page_size, layout=layout)
    dsv4.fused_k_norm_rope_flashmla(kv_dev, weight.to(device), eps, _table(device), pos.to(device), loc.to(device),
                                    cache.dev, page_size=page_size, layout=layout)
    return cache


def run_compress(device, variant, x, w, eps, combo, page_size, num_pages, is_decode, ratio, gen, random_fill,
                 short_out_loc=False):
    kv_dtype, w_dtype, _, loc_dtype, shape, pool = combo
    fmt = _fmt(variant)
    indexer = variant.startswith("indexer")
    n = x.shape[0]
    capacity = num_pages * page_size
    if is_decode:
        plan, out_loc = decode_case(gen, n, ratio, capacity, loc_dtype)
    else:
        plan, out_loc = prefill_case(gen, n, ratio, capacity, loc_dtype, short_out_loc)
    kv_cpu, kv_dev = _place(x, kv_dtype, shape, device)
    weight = w.to(w_dtype)
    cache = PoisonedCache(fmt, page_size, num_pages, device, gen, random_fill, pool)
    layout = KVLayout.V4 if indexer else fmt
    use_fp4 = fmt is IndexerFormat.FP4
    ref.compress_norm_rope_store(kv_cpu, plan, norm_weight=weight, norm_eps=eps, freq_cis=TABLE, out_loc=out_loc,
                                 kvcache=cache.ref, page_size=page_size, layout=layout, use_fp4=use_fp4,
                                 compress_ratio=ratio, is_decode=is_decode)
    dsv4.compress_norm_rope_store(kv_dev, plan.to(device), norm_weight=weight.to(device), norm_eps=eps,
                                  freq_cis=_table(device), out_loc=out_loc.to(device), kvcache=cache.dev,
                                  page_size=page_size, layout=layout, use_fp4=use_fp4, compress_ratio=ratio,
                                  is_decode=is_decode)
    return cache


# ---------------------------------------------------------------------------------------------------------
# Byte-exact against the reference (§7.2, §7.3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size,num_pages,n", MATRIX)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
def test_k_writer_matches_reference(device, layout, page_size, num_pages, n, kind):
    for i, combo in enumerate(COMBOS):
        gen = _gen("k", layout, page_size, kind, i)
        x, w, eps = _rows(kind, gen, n, 512)
        cache = run_k_writer(device, x, w, eps, combo, page_size, num_pages, layout, gen, random_fill=i % 2 == 0)
        cache.check(f"combo {i}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stride", [0, 1, 100], ids=lambda s: f"stride{s}")
def test_overlapping_rows_match_reference(device, stride):
    """Activations may have any row stride (§0), rows that overlap or repeat included (the writers only read
    them): both writers, every variant, bf16 and fp32 rows, against the reference on the same views."""
    n, page_size, num_pages = 37, 16, 5
    for variant in MAIN_VARIANTS + INDEXER_VARIANTS:
        fmt = _fmt(variant)
        indexer = variant.startswith("indexer")
        d = 128 if indexer else 512
        gen = _gen("overlap", variant, stride)
        x, w, eps = _rows("general", gen, n, d)
        for kv_dtype in (torch.bfloat16, torch.float32):
            flat = x.reshape(-1)[: (n - 1) * stride + d].to(kv_dtype)
            kv_cpu = flat.as_strided((n, d), (stride, 1))
            kv_dev = flat.to(device).as_strided((n, d), (stride, 1))
            what = f"{variant} {kv_dtype}"
            if not indexer:
                pos, loc = _positions(gen, n, torch.int64), _slots(gen, n, num_pages * page_size, torch.int64)
                cache = PoisonedCache(fmt, page_size, num_pages, device, gen, True, False)
                ref.fused_k_norm_rope_flashmla(kv_cpu, w, eps, TABLE, pos, loc, cache.ref, page_size=page_size,
                                               layout=fmt)
                dsv4.fused_k_norm_rope_flashmla(kv_dev, w.to(device), eps, _table(device), pos.to(device),
                                                loc.to(device), cache.dev, page_size=page_size, layout=fmt)
                cache.check(f"K writer {what}")
            plan, out_loc = decode_case(gen, n, 4, num_pages * page_size, torch.int64)
            cache = PoisonedCache(fmt, page_size, num_pages, device, gen, True, False)
            layout = KVLayout.V4 if indexer else fmt
            common = dict(norm_eps=eps, page_size=page_size, layout=layout, use_fp4=fmt is IndexerFormat.FP4,
                          compress_ratio=4, is_decode=True)
            ref.compress_norm_rope_store(kv_cpu, plan, norm_weight=w, freq_cis=TABLE, out_loc=out_loc,
                                         kvcache=cache.ref, **common)
            dsv4.compress_norm_rope_store(kv_dev, plan.to(device), norm_weight=w.to(device), freq_cis=_table(device),
                                          out_loc=out_loc.to(device), kvcache=cache.dev, **common)
            cache.check(f"compress writer {what}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("stride", [0, 8, 256], ids=lambda s: f"stride{s}")
def test_k_writer_pipeline_overlapping_rows(stride):
    """The pipelined K writer (n >= 4096) bulk-copies rows whose addresses are 16-byte aligned, repeated (stride
    0) or overlapping (strides of 8 and 256 bf16: 16 and 512 bytes) ones included; against the reference."""
    n, page_size, num_pages = 4133, 64, 80
    for layout in KVLayout:
        gen = _gen("k-overlap", layout, stride)
        x, w, eps = _rows("general", gen, n, 512)
        flat = x.reshape(-1)[: (n - 1) * stride + 512].to(torch.bfloat16)
        pos, loc = _positions(gen, n, torch.int32), _slots(gen, n, num_pages * page_size, torch.int64)
        cache = PoisonedCache(layout, page_size, num_pages, "cuda", gen, True, False)
        ref.fused_k_norm_rope_flashmla(flat.as_strided((n, 512), (stride, 1)), w, eps, TABLE, pos, loc, cache.ref,
                                       page_size=page_size, layout=layout)
        dsv4.fused_k_norm_rope_flashmla(flat.cuda().as_strided((n, 512), (stride, 1)), w.cuda(), eps,
                                        _table("cuda"), pos.cuda(), loc.cuda(), cache.dev, page_size=page_size,
                                        layout=layout)
        cache.check(f"{layout.str_name} stride {stride}")


@pytest.mark.parametrize("n", [5007, 4097, 4098])
@pytest.mark.parametrize("kind", ["general", "boundary"])
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_k_writer_large_n_matches_reference(layout, kind, n):
    """At n >= 4096 the CUDA K writer prefetches rows by bulk copies when they are 16-byte aligned (the
    contiguous and strided combos) and falls back otherwise (odd_stride). Below one wave of 16-row warps the
    rows spread over the resident warps: here 1 or 2 rows to a warp (fewer rows than pipeline stages: its first
    copies stop at its rows); invalid slots and positions are spread through the rows."""
    for i, combo in enumerate(COMBOS):
        gen = _gen("k-large", layout, kind, i, n)
        x, w, eps = _rows(kind, gen, n, 512)
        cache = run_k_writer("cuda", x, w, eps, combo, 64, 80, layout, gen, random_fill=i % 2 == 0)
        cache.check(f"combo {i}")


# (rows, COMBOS indices) above one wave of 16-row warps (59136 rows on an H100 or H200: 3696 resident warps).
WHOLE_WAVE_CASES = [(70007, (0, 3)), (88703, (0,)), (108135, (3,))]


@pytest.mark.parametrize("n,combos", WHOLE_WAVE_CASES, ids=[str(n) for n, _ in WHOLE_WAVE_CASES])
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_k_writer_large_n_whole_waves_matches_reference(layout, n, combos):
    """Above one wave of 16-row warps the pipelined K writer gives every warp 16 rows and the last one what is
    left (108135 rows: 7), unless the last wave would be at most half full; then the rows spread over the whole
    waves' warps (70007 rows: 18 or 19 a warp; 88703: 23 or 24, the most a warp takes). bf16 rows into a
    compact cache, and fp32 strided rows into a pool slice."""
    for i in combos:
        gen = _gen("k-whole-waves", layout, i, n)
        x, w, eps = _rows("general", gen, n, 512)
        cache = run_k_writer("cuda", x, w, eps, COMBOS[i], 64, n // 64 + 4, layout, gen, random_fill=False)
        cache.check(f"combo {i}")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_k_writer_pipeline_refills_after_reads(layout, kv_dtype):
    """The large-N K writer refills each shared-memory stage by a bulk copy once the warp has read it. The
    refill must be ordered after those reads across proxies: without the fence, on an H200, V41_FP4 with fp32
    rows wrote a wrong row on the first run here. Repeated runs on the same inputs must all give the
    reference bytes."""
    gen = _gen("k-refill", layout, str(kv_dtype))
    # Just above one wave of 16-row warps on an H100 or H200 (3696 resident warps), whose few extra rows spread:
    # 16 or 17 rows to a warp, so every warp refills its stages several times.
    n, pages = 60000 + 77, 60000 // 64 + 4
    x, w, eps = _rows("general", gen, n, 512)
    kv = x.to(kv_dtype)
    pos, loc = _positions(gen, n, torch.int64), _slots(gen, n, pages * 64, torch.int64)
    cache = PoisonedCache(layout, 64, pages, "cuda", gen, random_fill=False, pool=False)
    ref.fused_k_norm_rope_flashmla(kv, w, eps, TABLE, pos, loc, cache.ref, page_size=64, layout=layout)
    args = (kv.cuda(), w.cuda(), eps, _table("cuda"), pos.cuda(), loc.cuda())
    for run in range(16):
        cache.pool.fill_(0xA5)
        dsv4.fused_k_norm_rope_flashmla(*args, cache.dev, page_size=64, layout=layout)
        cache.check(f"run {run}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size,num_pages,n", MATRIX)
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
def test_compress_matches_reference(device, variant, page_size, num_pages, n, kind, is_decode):
    d = 128 if variant.startswith("indexer") else 512
    for i, combo in enumerate(COMBOS):
        ratio = 4 if d == 128 else (4, 128)[i % 2]
        gen = _gen("c", variant, page_size, kind, is_decode, i)
        x, w, eps = _rows(kind, gen, n, d)
        cache = run_compress(device, variant, x, w, eps, combo, page_size, num_pages, is_decode, ratio, gen,
                             random_fill=i % 2 == 1, short_out_loc=i >= 2)
        cache.check(f"combo {i}, ratio {ratio}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("page_size,num_pages,n", SMOKE)
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
def test_page_size_smoke(device, variant, page_size, num_pages, n):
    gen = _gen("smoke", variant, page_size)
    d = 128 if variant.startswith("indexer") else 512
    x, w, eps = _rows("general", gen, n, d)
    combo = COMBOS[1]
    if d == 512:
        run_k_writer(device, x, w, eps, combo, page_size, num_pages, _fmt(variant), gen, True).check("k writer")
    for is_decode in (True, False):
        run_compress(device, variant, x, w, eps, combo, page_size, num_pages, is_decode, 4, gen, False).check(
            f"compress decode={is_decode}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [KVLayout.V41, KVLayout.V41_FP4], ids=lambda l: l.str_name)
def test_k_writer_v41_composition(device, layout):
    """Exact-norm rows: the V4.1 K writer equals fused_store_cache(bf16(y), freqs_cis=freqs[positions])."""
    gen = _gen("composition", layout)
    n, page_size, num_pages = 100, 64, 4
    x, w, _ = _rows("exact", gen, n, 512)
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n]
    y = ref.rms_norm_fp32(x, w, 0.0)
    assert torch.equal(y.abs(), w.abs().expand(n, -1)), "exact-norm rows must give y = +-w"
    dev = lambda t: t.to(device)  # noqa: E731
    a = torch.full((num_pages, layout.page_bytes(page_size)), 0xA5, dtype=torch.uint8, device=device)
    b = a.clone()
    dsv4.fused_k_norm_rope_flashmla(dev(x.to(torch.bfloat16)), dev(w), 0.0, _table(device), dev(pos), dev(loc), a,
                                    page_size=page_size, layout=layout)
    dsv4.fused_store_cache(dev(y.to(torch.bfloat16)), b, dev(loc), page_size=page_size, layout=layout,
                           freqs_cis=dev(TABLE[pos]))
    assert_same_bytes(a, b.cpu(), "K writer vs fused_store_cache")
    assert_rows_written(a, torch.full_like(a, 0xA5), layout, page_size, loc)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
def test_k_writer_equals_compress_writer_on_exact_rows(device, layout):
    """§4: with bf16-representable weights, y = +-w is bf16-representable, so both writers give the same bytes."""
    gen = _gen("cross", layout)
    n, page_size, num_pages, ratio = 90, 64, 3, 4
    x, w, _ = _rows("exact", gen, n, 512)
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n]
    plan = _plan(pos + ratio, torch.arange(n), gen)  # prefill: ragged_id i -> out_loc[i], no modulo test
    dev = lambda t: t.to(device)  # noqa: E731
    a = torch.randint(0, 256, (num_pages, layout.page_bytes(page_size)), dtype=torch.uint8, generator=gen).to(device)
    b, poison = a.clone(), a.clone()
    dsv4.fused_k_norm_rope_flashmla(dev(x), dev(w), 0.0, _table(device), dev(pos), dev(loc), a,
                                    page_size=page_size, layout=layout)
    dsv4.compress_norm_rope_store(dev(x), dev(plan), norm_weight=dev(w), norm_eps=0.0, freq_cis=_table(device),
                                  out_loc=dev(loc), kvcache=b, page_size=page_size, layout=layout,
                                  compress_ratio=ratio, is_decode=False)
    assert_same_bytes(a, b.cpu(), "K writer vs compress writer")
    assert_rows_written(a, poison, layout, page_size, loc)


# V4 nope-tile amaxes at the edges of the V4 quantizer (§1.5): 448 (scale exactly 2^0), 2688 = 6 * 448, 2^-12 and
# 6 * 2^-9 (small scales), 450 (just past a power of two), an all-zero tile (the 1e-4 floor) and 1.0. All are
# bf16 values, so both writers see them unrounded.
V4_TILE_AMAX = [448.0, 2**-12, 6 * 2**-9, 2688.0, 450.0, 0.0, 1.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("writer", ["k_writer", "compress"])
def test_v4_tile_amax_edges(device, writer):
    """Exact-norm rows make y = +-w, so w places each V4 tile's amax: every tile holds its amax once (random sign
    and place) and smaller bf16 values. Bytes equal the reference and the scale bytes the closed form
    127 + ceil(log2(max(amax, 1e-4) / 448))."""
    gen = _gen("v4 amax", writer)
    n, page_size, num_pages, ratio = 24, 16, 4, 4
    x, _, _ = _rows("exact", gen, n, 512)
    w = torch.randn(512, generator=gen).to(torch.bfloat16).float()  # the rope dims keep random weights
    for t, amax in enumerate(V4_TILE_AMAX):
        tile = (amax * torch.rand(64, generator=gen)).to(torch.bfloat16).float()
        sign = 1 - 2 * int(torch.randint(0, 2, (1,), generator=gen))
        tile[int(torch.randint(0, 64, (1,), generator=gen))] = sign * amax
        w[64 * t: 64 * t + 64] = tile
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    loc = torch.randperm(num_pages * page_size, generator=gen)[:n]
    cache = PoisonedCache(KVLayout.V4, page_size, num_pages, device, gen, random_fill=False, pool=False)
    dev = lambda t: t.to(device)  # noqa: E731
    if writer == "k_writer":
        ref.fused_k_norm_rope_flashmla(x, w, 0.0, TABLE, pos, loc, cache.ref, page_size=page_size, layout=0)
        dsv4.fused_k_norm_rope_flashmla(dev(x), dev(w), 0.0, _table(device), dev(pos), dev(loc), cache.dev,
                                        page_size=page_size, layout=0)
    else:
        plan = _plan(pos + ratio, torch.arange(n), gen)  # prefill: ragged_id i -> out_loc[i]
        args = dict(norm_weight=w, norm_eps=0.0, out_loc=loc, page_size=page_size, compress_ratio=ratio,
                    is_decode=False)
        ref.compress_norm_rope_store(x, plan, freq_cis=TABLE, kvcache=cache.ref, **args)
        dsv4.compress_norm_rope_store(dev(x), dev(plan), freq_cis=_table(device), kvcache=cache.dev,
                                      **{k: dev(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    cache.check(writer)
    expected_scales = [127 + math.ceil(math.log2(max(a, 1e-4) / 448)) for a in V4_TILE_AMAX]
    assert expected_scales == [127, 107, 112, 130, 128, 105, 119]
    got = cache.pool.cpu()
    for slot in loc.tolist():
        page, row = divmod(slot, page_size)
        at = page_size * 576 + row * 8
        assert got[page, at: at + 7].tolist() == expected_scales, f"slot {slot}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ratio", [4, 128])
def test_compress_rope_position_is_seq_len_minus_ratio(device, ratio):
    """Decode rows rotate at p = seq_len - ratio: the reference at that p matches, at p + 1 it does not
    (checked with the V41 K writer reference, whose algorithm §4 shares)."""
    gen = _gen("position", ratio)
    n, page_size, num_pages = 16, 64, 1
    x, w, eps = _rows("general", gen, n, 512)
    seq = ratio * torch.randint(1, MAX_POS // ratio, (n,), generator=gen)
    loc = torch.randperm(page_size, generator=gen)[:n]
    plan = _plan(seq, torch.zeros(n, dtype=torch.int64), gen)
    cache = torch.zeros(num_pages, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8, device=device)
    dsv4.compress_norm_rope_store(x.to(device), plan.to(device), norm_weight=w.to(device), norm_eps=eps,
                                  freq_cis=_table(device), out_loc=loc.to(device), kvcache=cache,
                                  page_size=page_size, layout="v41", compress_ratio=ratio, is_decode=True)
    for shift, should_match in ((0, True), (1, False)):
        expected = torch.zeros(num_pages, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8)
        ref.fused_k_norm_rope_flashmla(x, w, eps, TABLE, seq - ratio + shift, loc, expected, page_size=page_size,
                                       layout=KVLayout.V41)
        assert torch.equal(cache.cpu(), expected) == should_match, f"position shift {shift}"


# Ratios besides the model's 4 and 128: odd, even non-power-of-two, 2^32 - 1 (seq_len 0xFFFFFFFF then closes a
# block at position 0), and ratios >= 2^32, whose positions are all negative.
ANY_RATIOS = [1, 3, 6, 100, 2**32 - 1, 2**32, 2**40]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["v41", "indexer_fp4"])
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("ratio", ANY_RATIOS)
def test_compress_row_rule_any_ratio(device, variant, is_decode, ratio):
    """§4 row selection for any compress_ratio >= 1, which the writers evaluate with 32-bit operations prepared
    on the host (writer_rows.cuh): seq_len around the first multiples of the ratio, below it, at the end of the
    table and near 2^32."""
    gen = _gen("any ratio", variant, is_decode, ratio)
    candidates = {s for k in range(1, 6) for s in (k * ratio - 1, k * ratio, k * ratio + 1)}
    candidates |= {0, 1, ratio + MAX_POS - 1, ratio + MAX_POS, 2**31, 2**32 - 2, 2**32 - 1}
    seq = sorted(s for s in candidates if s < 2**32)
    n, page_size, num_pages = len(seq), 64, 1
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    x, w, eps = _rows("general", gen, n, 128 if indexer else 512)
    out_loc = torch.randperm(page_size, generator=gen)[:n]
    plan = _plan(seq, torch.arange(n), gen)  # prefill: ragged_id i -> out_loc[i]
    cache = PoisonedCache(fmt, page_size, num_pages, device, gen, random_fill=False, pool=False)
    args = dict(norm_weight=w, norm_eps=eps, out_loc=out_loc, page_size=page_size,
                layout=KVLayout.V4 if indexer else fmt, use_fp4=fmt is IndexerFormat.FP4, compress_ratio=ratio,
                is_decode=is_decode)
    ref.compress_norm_rope_store(x, plan, freq_cis=TABLE, kvcache=cache.ref, **args)
    dev = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    dsv4.compress_norm_rope_store(x.to(device), plan.to(device), freq_cis=_table(device), kvcache=cache.dev, **dev)
    cache.check(f"ratio {ratio}")
    closes = [s % ratio == 0 if is_decode else s != 0xFFFFFFFF for s in seq]
    written = any(c and ratio <= s < ratio + MAX_POS for s, c in zip(seq, closes))
    assert written == (ratio < 2**32 - 1 or (ratio == 2**32 - 1 and is_decode))  # the case is the one meant
    assert torch.equal(cache.expected, torch.full_like(cache.expected, 0xA5)) != written


@pytest.mark.cuda
@pytest.mark.parametrize("variant", ["v41_fp4", "indexer_fp4"])
def test_page_stride_beyond_32_bits(variant):
    """A cache whose page stride passes 2^32 bytes is not compact (PagedCache::rows_of takes its 64-bit
    offsets): the writer's bytes in two pages 4 GiB apart equal those it writes into a contiguous cache."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    fmt, p, n = _fmt(variant), 64, 8
    gen = _gen("stride32", variant)
    pb, stride = fmt.page_bytes(p), 2**32 + 4096
    buffer = torch.full((stride + pb,), 0xA5, dtype=torch.uint8, device="cuda")
    try:
        strided = buffer.as_strided((2, pb), (stride, 1))
        contiguous = torch.full((2, pb), 0xA5, dtype=torch.uint8, device="cuda")
        if variant.startswith("indexer"):
            x, w, eps = _rows("general", gen, n, 128)
            plan = _plan([8 * (i + 1) for i in range(n)], [0] * n, gen).cuda()
            out_loc = torch.tensor([p + 5, 3, p + 60, 0, 17, p + 1, 63, p], device="cuda")
            for cache in (strided, contiguous):
                dsv4.compress_norm_rope_store(x.cuda(), plan, norm_weight=w.cuda(), norm_eps=eps,
                                              freq_cis=_table("cuda"), out_loc=out_loc, kvcache=cache, page_size=p,
                                              layout=KVLayout.V4, use_fp4=True, compress_ratio=4, is_decode=True)
        else:
            x, w, eps = _rows("general", gen, n, 512)
            positions = torch.arange(n, device="cuda")
            out_loc = torch.tensor([p + 5, 3, p + 60, 0, 17, p + 1, 63, -1], device="cuda")
            for cache in (strided, contiguous):
                dsv4.fused_k_norm_rope_flashmla(x.cuda(), w.cuda(), eps, _table("cuda"), positions, out_loc, cache,
                                                page_size=p, layout=fmt)
        assert not torch.equal(contiguous.cpu(), torch.full_like(contiguous.cpu(), 0xA5))
        assert_same_bytes(strided.cpu(), contiguous.cpu(), "pages 4 GiB apart")
    finally:
        del buffer
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# Reference pins (§7.4), also run through the ops


def _identity_table(rows: int = 8) -> torch.Tensor:
    t = torch.zeros(rows, 64)
    t[:, 0::2] = 1.0
    return t


# §7.4 norm-order pin (the reference itself is pinned in test_reference.py): D -> (y_0, y_j) for
# x = [1, 2^-12 x (D - 1)], w = 1, eps = 0.
NORM_PIN = {512: (0x41B5043E, 0x3BB5043E), 128: (0x413504C6, 0x3B3504C6)}


def _norm_pin_row(d):
    x = torch.full((1, d), 2.0**-12)
    x[0, 0] = 1.0
    return x


def _norm_pin_y(d):
    y0, yj = NORM_PIN[d]
    y = torch.full((1, d), _f32(yj))
    y[0, 0] = _f32(y0)
    return y


def _pin_expected(fmt, y, slot, page_size, k_writer):
    """Cache bytes for the pinned y, rotated by an identity table, through the §1.6 rounding chain."""
    expected = torch.full((1, fmt.page_bytes(page_size)), 0xA5, dtype=torch.uint8)
    if isinstance(fmt, IndexerFormat):
        ref.store_indexer_cache(expected, ref.hadamard128(y), slot, page_size, int(fmt))
        return expected
    rounded = y.to(torch.bfloat16).float()
    if fmt is not KVLayout.V4:
        values = rounded
    elif k_writer:
        values = y
    else:
        values = torch.cat([rounded[:, :448], y[:, 448:]], 1)
    ref.store_k_cache(expected, values, slot, page_size, int(fmt))
    return expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
def test_norm_order_pin_through_ops(device, variant):
    """The §7.4 norm-order row through each op: the stored bytes are those of the hand-computed y."""
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    d = 128 if indexer else 512
    x, w, y = _norm_pin_row(d).to(device), torch.ones(d, device=device), _norm_pin_y(d)
    table = _identity_table().to(device)
    page_size, slot = 2, torch.tensor([1])
    if not indexer:
        cache = torch.full((1, fmt.page_bytes(page_size)), 0xA5, dtype=torch.uint8, device=device)
        dsv4.fused_k_norm_rope_flashmla(x, w, 0.0, table, torch.tensor([3], device=device), slot.to(device), cache,
                                        page_size=page_size, layout=fmt)
        assert_same_bytes(cache, _pin_expected(fmt, y, slot, page_size, k_writer=True), "K writer")
    cache = torch.full((1, fmt.page_bytes(page_size)), 0xA5, dtype=torch.uint8, device=device)
    plan = _plan([8], [0], _gen("pin")).to(device)  # closes a block, p = 4
    dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=0.0, freq_cis=table, out_loc=slot.to(device),
                                  kvcache=cache, page_size=page_size, layout=KVLayout.V4 if indexer else fmt,
                                  use_fp4=fmt is IndexerFormat.FP4, compress_ratio=4, is_decode=True)
    assert_same_bytes(cache, _pin_expected(fmt, y, slot, page_size, k_writer=False), "compress writer")


# §1.2 order through the ops on rows chosen to expose a wrong order (the orders: norm_orders.py).


def _quantizer_input(writer, variant, y, table_rows):
    """The fp32 values a writer hands its quantizer for norm output y (§1.6), rotated with table_rows."""
    fmt = _fmt(variant)
    if isinstance(fmt, IndexerFormat):
        return ref.hadamard128(ref.rope_tail(y, table_rows))
    rounded = y.to(torch.bfloat16).float()
    if fmt is not KVLayout.V4:
        return ref.rope_tail(rounded, table_rows).to(torch.bfloat16).float()
    v = ref.rope_tail(y, table_rows)
    if writer == "compress":
        v[:, :448] = rounded[:, :448]
    return v


def _row_bytes(variant, v):
    """Data and scale bytes per row of quantizer input v."""
    fmt = _fmt(variant)
    if fmt is IndexerFormat.FP8:
        data, scale = ref.quantize_indexer_fp8(v)
        return torch.cat([data, scale.unsqueeze(-1).view(torch.uint8)], 1)
    data, scale = ref.quantize_indexer_fp4(v) if fmt is IndexerFormat.FP4 else ref.quantize_rows(v, int(fmt))
    return torch.cat([data, scale], 1)


def _store_values(variant, cache, v, slots, page_size):
    fmt = _fmt(variant)
    if isinstance(fmt, IndexerFormat):
        ref.store_indexer_cache(cache, v, slots, page_size, int(fmt))
    else:
        ref.store_k_cache(cache, v, slots, page_size, int(fmt))


# The y at which a lone nonzero value of a quantizer tile changes the stored bytes. K writer V4: y = 448 has
# scale 2^0 and code 448, just above the scale doubles. Compress V4: bf16(y) first, so the bf16 midpoint 449
# (448 wins the tie). V41: bf16(y) is 1.0625 (scaled 272, a tie that goes to code 256) or 1.0703125 (code 288)
# on either side of 1.06640625. V41_FP4: bf16(y) 6.375 or 6.40625, whose amax / 6 round to the e4m3 scales
# 1.0 and 1.125. Indexer: WHT of a lone y_k is +-c*y_k in every dim; fp8 stores its fp32 scale (any y shows),
# fp4's scaled magnitude 5 is the threshold between codes 4 and 6.
_LONE_VALUE_EDGE = {"v4": 448.0, "v41": 1.06640625, "v41_fp4": 6.390625, "indexer_fp8": 1.0,
                    "indexer_fp4": 5.0 / _f32(0x3DB504F3)}
_NORM_ORDER_ROWS = {}


def _norm_order_rows(writer, variant, per_order=2):
    """Per wrong order, rows (x, w, position, wrong sum) whose stored bytes under the pinned order differ from
    those under that order.

    Candidate rows span 2^12 in magnitude, so the orders round differently. For a row where a wrong order
    changes x_k * r at a dim k outside the RoPE dims, w zeroes k's quantizer tile except w_k, chosen (and
    nudged a few ulps) so that y_k falls on either side of the tile's edge under the two sums; the other tiles
    keep random weights. Candidates whose bytes really differ are kept.
    """
    key = (writer, variant)
    if key in _NORM_ORDER_ROWS:
        return _NORM_ORDER_ROWS[key]
    d = 128 if variant.startswith("indexer") else 512
    tile = {"v4": 64, "v41": 32, "v41_fp4": 16}.get(variant, 128)
    edge = 449.0 if (writer, variant) == ("compress", "v4") else _LONE_VALUE_EDGE[variant]
    gen = _gen("norm-order", writer, variant)
    n, eps = 128, 1e-6
    x = torch.randn(n, d, generator=gen) * torch.exp2(torch.randint(-12, 1, (n, d), generator=gen).float())
    base_w = torch.randn(d, generator=gen).to(torch.bfloat16).float()
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    ss = pinned_ss(x)
    r = lambda s: torch.reciprocal(torch.sqrt((s / d + torch.full_like(s, eps)).double()).float())  # noqa: E731
    selected = {}
    for name, wrong_ss in WRONG_NORM_ORDERS.items():
        ss_wrong = wrong_ss(x)
        a, a_wrong = x * r(ss).unsqueeze(1), x * r(ss_wrong).unsqueeze(1)
        differs = (a != a_wrong)[:, : d - 64]
        rows = differs.any(1).nonzero().flatten()
        k = differs[rows].float().argmax(1)
        w_k = (edge / ((a[rows, k].double() + a_wrong[rows, k].double()) / 2)).float()
        w = torch.where(torch.arange(d) // tile == (k // tile).unsqueeze(1), 0.0, base_w)
        cand_rows, cand_w = [], []
        for nudge in range(5):  # 0, +1, -1, +2, -2 ulps
            step = torch.full_like(w_k, torch.inf if nudge % 2 else -torch.inf)
            wk = w_k
            for _ in range((nudge + 1) // 2):
                wk = torch.nextafter(wk, step)
            cand_w.append(w.index_put((torch.arange(rows.numel()), k), wk))
            cand_rows.append(rows)
        cand_rows, cand_w = torch.cat(cand_rows), torch.cat(cand_w)
        xs, table_rows = x[cand_rows], TABLE[pos[cand_rows]]
        good = _row_bytes(variant, _quantizer_input(writer, variant, y_from_ss(xs, cand_w, eps, ss[cand_rows]),
                                                    table_rows))
        bad = _row_bytes(variant, _quantizer_input(writer, variant,
                                                   y_from_ss(xs, cand_w, eps, ss_wrong[cand_rows]), table_rows))
        hits = (good != bad).any(1).nonzero().flatten()[:per_order].tolist()
        assert len(hits) == per_order, f"{name}: only {len(hits)} rows expose it"
        selected[name] = [(xs[i: i + 1], cand_w[i], int(pos[cand_rows[i]]), ss_wrong[cand_rows[i]: cand_rows[i] + 1])
                          for i in hits]
    _NORM_ORDER_ROWS[key] = (selected, eps)
    return selected, eps


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("writer,variant", [("k_writer", v) for v in MAIN_VARIANTS] +
                         [("compress", v) for v in MAIN_VARIANTS + INDEXER_VARIANTS])
def test_norm_order_exposing_rows_through_ops(device, writer, variant):
    """Each op on rows whose stored bytes under the §1.2 order differ from those under a sequential sum,
    adjacent pairing or an FMA-contracted square: a kernel reducing in any of these orders fails here."""
    selected, eps = _norm_order_rows(writer, variant)
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    page_size, slot, ratio = 2, torch.tensor([1]), 4
    dev = lambda t: t.to(device)  # noqa: E731
    for order, rows in selected.items():
        for x, w, p, ss_wrong in rows:
            what = f"{order}, position {p}"
            poison = torch.full((1, fmt.page_bytes(page_size)), 0xA5, dtype=torch.uint8)
            expected, cache = poison.clone(), dev(poison)
            if writer == "k_writer":
                ref.fused_k_norm_rope_flashmla(x, w, eps, TABLE, torch.tensor([p]), slot, expected,
                                               page_size=page_size, layout=fmt)
                dsv4.fused_k_norm_rope_flashmla(dev(x), dev(w), eps, _table(device), dev(torch.tensor([p])),
                                                dev(slot), cache, page_size=page_size, layout=fmt)
            else:
                plan = _plan([p + ratio], [0], _gen("norm-order-plan"))  # prefill: ragged_id 0 -> out_loc[0]
                args = dict(norm_weight=w, norm_eps=eps, out_loc=slot, page_size=page_size,
                            layout=KVLayout.V4 if indexer else fmt, use_fp4=fmt is IndexerFormat.FP4,
                            compress_ratio=ratio, is_decode=False)
                ref.compress_norm_rope_store(x, plan, freq_cis=TABLE, kvcache=expected, **args)
                dev_args = {k: dev(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
                dsv4.compress_norm_rope_store(dev(x), dev(plan), freq_cis=_table(device), kvcache=cache, **dev_args)
            assert_same_bytes(cache, expected, what)
            # The row is the one meant: the test's §1.6 chain reproduces the reference, and a wrong order does not.
            table_row = TABLE[p].unsqueeze(0)
            for ss, should_match in ((pinned_ss(x), True), (ss_wrong, False)):
                stored = poison.clone()
                _store_values(variant, stored, _quantizer_input(writer, variant, y_from_ss(x, w, eps, ss), table_row),
                              slot, page_size)
                assert torch.equal(stored, expected) == should_match, what


@pytest.mark.parametrize("device", DEVICES)
def test_no_fma_pin_k_writer_v4(device):
    """§7.4: a contracted re*c - im*s would store 80 33 or 80 B3 at bytes 448..449."""
    a = _f32(0x3F800800)  # 1 + 2^-12
    x = torch.ones(1, 512)
    w = torch.ones(512)
    w[448] = w[449] = a
    table = _identity_table()
    table[2, 0] = table[2, 1] = a
    page_size = 2
    cache = torch.full((1, KVLayout.V4.page_bytes(page_size)), 0xA5, dtype=torch.uint8, device=device)
    dsv4.fused_k_norm_rope_flashmla(x.to(device), w.to(device), 0.0, table.to(device), torch.tensor([2], device=device),
                                    torch.tensor([0], device=device), cache, page_size=page_size, layout="v4")
    row = cache[0, :576].cpu()
    scale = cache[0, 2 * 576: 2 * 576 + 8].cpu()
    assert (row[:448] == 0x78).all()
    assert row[448:452].tolist() == [0x00, 0x00, 0x00, 0x40]
    assert row[452:576].tolist() == [0x80, 0x3F] * 62
    assert scale.tolist() == [0x77] * 7 + [0xA5]
    expected = torch.full((1, KVLayout.V4.page_bytes(page_size)), 0xA5, dtype=torch.uint8)
    ref.fused_k_norm_rope_flashmla(x, w, 0.0, table, torch.tensor([2]), torch.tensor([0]), expected,
                                   page_size=page_size, layout=0)
    assert_same_bytes(cache, expected, "reference")


# ---------------------------------------------------------------------------------------------------------
# RoPE tables (§1.3)


def test_yarn_worked_example():
    assert round(_yarn_correction_dim(32, 64, 160000, 65536), 2) == 15.45
    assert round(_yarn_correction_dim(1, 64, 160000, 65536), 2) == 24.71
    fc = dsv4.precompute_freqs_cis(64, 64, 65536, 160000.0, 16.0, 32.0, 1.0)
    assert fc.dtype == torch.complex64 and fc.shape == (64, 32)
    base = torch.reciprocal(torch.pow(torch.tensor(160000.0), torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    p = torch.arange(64, dtype=torch.float32)
    plain = torch.polar(torch.ones(64, 32), torch.outer(p, base))
    scaled = torch.polar(torch.ones(64, 32), torch.outer(p, base / 16.0))
    lo, hi = 15, 25  # pairs i <= lo keep their frequency, pairs i >= hi are divided by factor
    assert torch.equal(fc[:, : lo + 1], plain[:, : lo + 1])
    assert torch.equal(fc[:, hi:], scaled[:, hi:])
    for i in range(lo + 1, hi):
        assert not torch.equal(fc[:, i], plain[:, i]) and not torch.equal(fc[:, i], scaled[:, i])
    # No YaRN: plain frequencies everywhere.
    assert torch.equal(dsv4.precompute_freqs_cis(64, 64, 0, 160000.0), plain)


def _yarn_frequencies(dim, base, original_seq_len, factor, beta_fast, beta_slow):
    """§1.3 steps 1-2 written independently: step 1 in torch fp32 (pinned above), step 2 in numpy fp32, one
    rounded operation at a time; corr in float64 from the formula."""
    import numpy as np

    f = torch.reciprocal(torch.pow(torch.tensor(base), torch.arange(0, dim, 2, dtype=torch.float32) / dim)).numpy()
    corr = [dim * math.log(original_seq_len / (2 * math.pi * r)) / (2 * math.log(base)) for r in (beta_fast, beta_slow)]
    lo, hi = max(math.floor(corr[0]), 0), min(math.ceil(corr[1]), dim - 1)
    if lo == hi:
        hi += 0.001
    i = np.arange(dim // 2, dtype=np.float32)
    ramp = np.clip((i - np.float32(lo)) / np.float32(hi - lo), np.float32(0), np.float32(1))
    smooth = np.float32(1) - ramp
    blended = (f / np.float32(factor)) * (np.float32(1) - smooth) + f * smooth
    assert blended.dtype == np.float32
    return torch.from_numpy(blended), torch.from_numpy(f), lo, hi


@pytest.mark.parametrize("params,lo_hi", [
    ((64, 160000.0, 65536, 16.0, 32.0, 1.0), (15, 25)),  # the worked example: a blend over pairs 16..24
    ((64, 10000.0, 65536, 4.0, 32.0, 34.0), (20, 20.001)),  # corr 20.1 / 19.9: floor == ceil, so hi = lo + 0.001
    ((64, 10000.0, 5, 8.0, 32.0, 1.0), (0, 0.001)),  # corr -12.8 / -0.79: lo = hi = 0 after the clamps
], ids=["worked_example", "lo_equals_hi", "lo_equals_hi_clamped"])
def test_yarn_blend_pinned(params, lo_hi):
    """Every pair's YaRN frequency equals the spec formula evaluated independently, blended pairs included; the
    lo == hi branch (hi += 0.001) keeps pair lo's own frequency and divides the next ones by factor."""
    dim, base, original, factor, beta_fast, beta_slow = params
    freqs, plain, lo, hi = _yarn_frequencies(*params)
    assert (lo, hi) == lo_hi
    p = torch.arange(32, dtype=torch.float32)
    fc = dsv4.precompute_freqs_cis(dim, 32, original, base, factor, beta_fast, beta_slow)
    assert torch.equal(fc, torch.polar(torch.ones(32, dim // 2), torch.outer(p, freqs)))
    lo = int(lo)
    if hi - lo < 1:
        assert torch.equal(freqs[: lo + 1], plain[: lo + 1])
        assert torch.equal(freqs[lo + 1:], plain[lo + 1:] / factor)
    else:
        middle, own = freqs[lo + 1: int(hi)], plain[lo + 1: int(hi)]
        assert not torch.equal(middle, own) and not torch.equal(middle, own / factor)


def test_rope_table_layout():
    fc = dsv4.precompute_freqs_cis(64, 32, 0, 10000.0)
    table = dsv4.rope_table_from_freqs_cis(fc)
    assert table.dtype == torch.float32 and table.shape == (32, 64)
    assert table.data_ptr() == fc.data_ptr()  # zero-copy for a contiguous input
    assert torch.equal(table[:, 0::2], fc.real) and torch.equal(table[:, 1::2], fc.imag)
    strided = fc[::2]
    copied = dsv4.rope_table_from_freqs_cis(strided)
    assert copied.is_contiguous() and torch.equal(copied, table[::2])
    assert torch.equal(dsv4.precompute_rope_table(64, 32, 0, 10000.0), table)
    with pytest.raises(ValueError, match="complex64"):
        dsv4.rope_table_from_freqs_cis(table)


def test_empty_complex_table_reaches_the_op_check():
    """An empty complex table (max_pos = 0; precompute_freqs_cis accepts seqlen = 0) converts to fp32 [0, 64]
    like any other, so the writers reject it with their own message naming the op and the argument, exactly
    as they reject the fp32 [0, 64] table."""
    empty = dsv4.precompute_freqs_cis(64, 0, 0, 10000.0)
    assert empty.shape == (0, 32)
    for table in (dsv4.rope_table_from_freqs_cis(empty), dsv4.precompute_rope_table(64, 0, 0, 10000.0)):
        assert table.dtype == torch.float32 and table.shape == (0, 64)
    n, page_size = 2, 16
    x, w = torch.ones(n, 512), torch.ones(512)
    cache = torch.zeros(2, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_k_norm_rope_flashmla: freqs must be \[max_pos >= 1"):
        dsv4.fused_k_norm_rope_flashmla(x, w, 0.0, empty, torch.arange(n), torch.arange(n), cache,
                                        page_size=page_size, layout=1)
    with pytest.raises(RuntimeError, match=r"dsv4\.compress_norm_rope_store: freqs must be \[max_pos >= 1"):
        dsv4.compress_norm_rope_store(x, _plan([4] * n, [0] * n, _gen("empty table")), norm_weight=w, norm_eps=0.0,
                                      freq_cis=empty, out_loc=torch.arange(n), kvcache=cache, page_size=page_size,
                                      layout=1, compress_ratio=4, is_decode=True)
    assert not cache.any()


# ---------------------------------------------------------------------------------------------------------
# Wrappers


def test_wrapper_accepts_plan_object_and_complex_freqs():
    gen = _gen("wrapper")
    n, page_size = 12, 16
    x, w, eps = _rows("general", gen, n, 512)
    fc = dsv4.precompute_freqs_cis(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0)
    plan, loc = decode_case(gen, n, 4, 4 * page_size, torch.int64)
    obj = SimpleNamespace(plan=plan, plan_w=None, compress_ratio=4, is_decode=True)
    a = torch.zeros(4, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8)
    b = a.clone()
    dsv4.compress_norm_rope_store(x, obj, norm_weight=w, norm_eps=eps, freq_cis=fc, out_loc=loc, kvcache=a,
                                  page_size=page_size, layout="v41")
    dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=eps, freq_cis=TABLE, out_loc=loc, kvcache=b,
                                  page_size=page_size, layout=KVLayout.V41, compress_ratio=4, is_decode=True)
    assert torch.equal(a, b) and a.any()
    with pytest.raises(TypeError, match="compress_ratio and is_decode"):
        dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=eps, freq_cis=fc, out_loc=loc, kvcache=a,
                                      page_size=page_size)
    with pytest.raises(ValueError, match="compress_ratio"):
        dsv4.compress_norm_rope_store(x, obj, norm_weight=w, norm_eps=eps, freq_cis=fc, out_loc=loc, kvcache=a,
                                      page_size=page_size, compress_ratio=128)
    c = torch.zeros_like(a)
    d = torch.zeros_like(a)
    pos = torch.randint(0, MAX_POS, (n,), generator=gen)
    dsv4.fused_k_norm_rope_flashmla(x, w, eps, fc, pos, loc, c, page_size=page_size, layout=1)
    dsv4.fused_k_norm_rope_flashmla(x, w, eps, TABLE, pos, loc, d, page_size=page_size, layout="V41")
    assert torch.equal(c, d)


def test_wrapper_errors_name_the_op_and_the_argument():
    """Errors raised by the Python wrappers themselves (before the op) name the op and the argument, with the
    wrappers' exception types: ValueError for a bad value, TypeError for an object that is not a plan."""
    gen = _gen("wrapper errors")
    n, page_size = 4, 16
    x, w, eps = _rows("general", gen, n, 512)
    pos, loc = torch.arange(n), torch.arange(n)
    cache = torch.zeros(2, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8)
    plan = _plan([4] * n, [0] * n, gen)
    fc = dsv4.precompute_freqs_cis(64, MAX_POS, 0, 10000.0)

    def k_writer(freqs=TABLE, layout="v41"):
        dsv4.fused_k_norm_rope_flashmla(x, w, eps, freqs, pos, loc, cache, page_size=page_size, layout=layout)

    def compress(plan=plan, freqs=TABLE, layout="v41"):
        dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=eps, freq_cis=freqs, out_loc=loc,
                                      kvcache=cache, page_size=page_size, layout=layout, compress_ratio=4,
                                      is_decode=True)

    for call, op, freqs_name in ((k_writer, "fused_k_norm_rope_flashmla", "freqs"),
                                 (compress, "compress_norm_rope_store", "freq_cis")):
        for layout in ("v5", 7, -1):
            with pytest.raises(ValueError, match=rf"^{op}: layout: unknown KVLayout"):
                call(layout=layout)
        with pytest.raises(TypeError, match=rf"^{op}: layout: cannot interpret"):
            call(layout=1.0)
        for freqs in (fc.to(torch.complex128), fc[:, 0], fc.unsqueeze(0)):
            with pytest.raises(ValueError, match=rf"^{op}: {freqs_name}: .*complex64"):
                call(freqs=freqs)
    for bad_plan in (None, plan.numpy(), [plan]):
        with pytest.raises(TypeError, match=r"^compress_norm_rope_store: plan must be"):
            compress(plan=bad_plan)
    # Integers reach the op unconverted: its schema rejects 4.5 (an int() would have run ratio 4).
    with pytest.raises(RuntimeError, match=r"compress_norm_rope_store\(\) .* argument 'compress_ratio'"):
        dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=eps, freq_cis=TABLE, out_loc=loc,
                                      kvcache=cache, page_size=page_size, compress_ratio=4.5, is_decode=True)
    assert not cache.any(), "no error path writes"
    k_writer(freqs=fc, layout=KVLayout.V41)  # the accepted forms still work
    compress(freqs=fc, layout=1)
    assert cache.any()


# ---------------------------------------------------------------------------------------------------------
# Host validation (§0): every violation names the op and the argument


def _k_args(device="cpu", n=4, page_size=16, layout=0):
    fmt = KVLayout(layout)
    return dict(
        kv=torch.randn(n, 512, device=device), weight=torch.ones(512, device=device), eps=1e-6,
        freqs=_table(device), positions=torch.arange(n, device=device), out_loc=torch.arange(n, device=device),
        kvcache=torch.zeros(2, fmt.page_bytes(page_size), dtype=torch.uint8, device=device),
        page_size=page_size, layout=layout,
    )


def _call_k(a):
    torch.ops.dsv4.fused_k_norm_rope_flashmla(a["kv"], a["weight"], a["eps"], a["freqs"], a["positions"],
                                              a["out_loc"], a["kvcache"], page_size=a["page_size"],
                                              layout=a["layout"])


def _c_args(device="cpu", n=4, d=512, page_size=16, layout=0, use_fp4=False, is_decode=True):
    fmt = IndexerFormat(int(use_fp4)) if d == 128 else KVLayout(layout)
    return dict(
        kv=torch.randn(n, d, device=device), plan=_plan([4] * n, [0] * n, _gen("args")).to(device),
        norm_weight=torch.ones(d, device=device), norm_eps=1e-6, freqs=_table(device),
        out_loc=torch.arange(n, device=device),
        kvcache=torch.zeros(2, fmt.page_bytes(page_size), dtype=torch.uint8, device=device),
        page_size=page_size, compress_ratio=4, is_decode=is_decode, layout=layout, use_fp4=use_fp4,
    )


def _call_c(a):
    torch.ops.dsv4.compress_norm_rope_store(a["kv"], a["plan"], a["norm_weight"], a["norm_eps"], a["freqs"],
                                            a["out_loc"], a["kvcache"], page_size=a["page_size"],
                                            compress_ratio=a["compress_ratio"], is_decode=a["is_decode"],
                                            layout=a["layout"], use_fp4=a["use_fp4"])


def _misaligned_cache(width, pages=2):
    buf = torch.zeros(pages * width + 16, dtype=torch.uint8)
    return buf[1: 1 + pages * width].view(pages, width)


COMMON_BAD = [  # (argument, replacement builder, whether the fake can see it)
    ("kv", lambda a: a["kv"].half(), True),
    ("kv", lambda a: a["kv"][:, :256], True),
    ("kv", lambda a: a["kv"].unsqueeze(0), True),
    ("kv", lambda a: a["kv"].t().contiguous().t(), True),
    ("freqs", lambda a: a["freqs"].double(), True),
    ("freqs", lambda a: a["freqs"][:, :32].contiguous(), True),
    ("freqs", lambda a: a["freqs"][:0], True),
    ("freqs", lambda a: a["freqs"][:, ::1].t().contiguous().t(), True),
    ("freqs", lambda a: a["freqs"].flatten(), True),
    ("out_loc", lambda a: a["out_loc"].float(), True),
    ("out_loc", lambda a: a["out_loc"][:-1], True),
    ("out_loc", lambda a: torch.stack([a["out_loc"], a["out_loc"]], 1)[:, 0], True),
    ("kvcache", lambda a: a["kvcache"].to(torch.int8), True),
    ("kvcache", lambda a: a["kvcache"][:, :-64], True),
    ("kvcache", lambda a: a["kvcache"].flatten(), True),
    ("kvcache", lambda a: a["kvcache"].t().contiguous().t(), True),
    ("kvcache", lambda a: torch.zeros(2, a["kvcache"].shape[1] + 8, dtype=torch.uint8)[:, : a["kvcache"].shape[1]],
     True),  # stride(0) not a multiple of the alignment
    ("kvcache", lambda a: _misaligned_cache(a["kvcache"].shape[1]), False),
    ("page_size", lambda a: 24, True),
    ("page_size", lambda a: 2048, True),
    ("layout", lambda a: 3, True),
]


def _bad_cases(extra):
    return [pytest.param(name, fn, fake, id=f"{name}-{i}") for i, (name, fn, fake) in enumerate(COMMON_BAD + extra)]


K_BAD = _bad_cases([
    ("weight", lambda a: a["weight"].half(), True),
    ("weight", lambda a: a["weight"][:128], True),
    ("weight", lambda a: a["weight"].view(1, 512), True),
    ("weight", lambda a: torch.ones(1024)[::2], True),
    ("eps", lambda a: -1e-6, True),
    ("eps", lambda a: float("nan"), True),
    ("eps", lambda a: float("inf"), True),
    ("eps", lambda a: 1e300, True),
    ("positions", lambda a: a["positions"].to(torch.int16), True),
    ("positions", lambda a: a["positions"][:-1], True),
])

C_BAD = _bad_cases([
    ("norm_weight", lambda a: a["norm_weight"][:128], True),
    ("norm_weight", lambda a: a["norm_weight"].half(), True),
    ("norm_eps", lambda a: -1.0, True),
    ("norm_eps", lambda a: float("nan"), True),
    ("norm_eps", lambda a: float("inf"), True),
    ("norm_eps", lambda a: 1e300, True),
    ("plan", lambda a: a["plan"].to(torch.int8), True),
    ("plan", lambda a: a["plan"][:, :8].contiguous(), True),
    ("plan", lambda a: a["plan"][:-1], True),
    ("plan", lambda a: a["plan"].t().contiguous().t(), True),
    ("plan", lambda a: torch.zeros(a["plan"].numel() + 16, dtype=torch.uint8)[1: 1 + a["plan"].numel()].view(-1, 16),
     False),
    ("compress_ratio", lambda a: 0, True),
])


def _expect_error(call, args, op, name):
    with pytest.raises(RuntimeError, match=rf"dsv4\.{op}: .*{name}"):
        call(args)


@pytest.mark.parametrize("name,bad,fake_sees", K_BAD)
def test_k_writer_validation(name, bad, fake_sees):
    args = _k_args()
    args[name] = bad(args)
    _expect_error(_call_k, args, "fused_k_norm_rope_flashmla", name)
    if fake_sees:
        _expect_fake_error(_call_k, args, "fused_k_norm_rope_flashmla", name)


@pytest.mark.parametrize("name,bad,fake_sees", C_BAD)
def test_compress_validation(name, bad, fake_sees):
    args = _c_args()
    args[name] = bad(args)
    _expect_error(_call_c, args, "compress_norm_rope_store", name)
    if fake_sees:
        _expect_fake_error(_call_c, args, "compress_norm_rope_store", name)


# The indexer variant (kv [N, 128]): its own cache rule (A = 4, width >= 132P for fp8 or 68P for fp4).
def _shifted_cache(width, pages, offset):
    buf = torch.zeros(pages * width + 16, dtype=torch.uint8)
    return buf[offset: offset + pages * width].view(pages, width)


# COMMON_BAD less kv[:, :256] (the whole indexer row) and a page stride of width + 8 (a multiple of A = 4).
_INDEXER_COMMON_BAD = [c for i, c in enumerate(COMMON_BAD) if i not in (1, 16)]
_INDEXER_ONLY_BAD = [
    ("kv", lambda a: a["kv"][:, :64], True),
    ("kvcache", lambda a: a["kvcache"][:, :-1], True),  # one byte short of 132P / 68P
    ("kvcache", lambda a: torch.zeros(2, a["kvcache"].shape[1] + 2, dtype=torch.uint8)[:, : a["kvcache"].shape[1]],
     True),  # stride(0) = width + 2: not a multiple of 4
    ("kvcache", lambda a: _shifted_cache(a["kvcache"].shape[1], 2, 2), False),  # base pointer 2 mod 4
    ("norm_weight", lambda a: torch.ones(512), True),
    ("norm_weight", lambda a: a["norm_weight"][:64], True),
]
INDEXER_C_BAD = [pytest.param(name, fn, fake, id=f"{name}-{i}")
                 for i, (name, fn, fake) in enumerate(_INDEXER_COMMON_BAD + _INDEXER_ONLY_BAD)]


@pytest.mark.parametrize("use_fp4", [False, True], ids=["fp8", "fp4"])
@pytest.mark.parametrize("name,bad,fake_sees", INDEXER_C_BAD)
def test_compress_indexer_validation(name, bad, fake_sees, use_fp4):
    args = _c_args(d=128, use_fp4=use_fp4)
    args[name] = bad(args)
    _expect_error(_call_c, args, "compress_norm_rope_store", name)
    if fake_sees:
        _expect_fake_error(_call_c, args, "compress_norm_rope_store", name)


def test_compress_indexer_fp8_rejects_an_fp4_sized_cache():
    args = _c_args(d=128, use_fp4=False)
    args["kvcache"] = torch.zeros(2, IndexerFormat.FP4.page_bytes(16), dtype=torch.uint8)  # 68P < 132P
    _expect_error(_call_c, args, "compress_norm_rope_store", "kvcache")
    _expect_fake_error(_call_c, args, "compress_norm_rope_store", "kvcache")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_fp4", [False, True], ids=["fp8", "fp4"])
def test_compress_indexer_caches_need_only_4_byte_alignment(device, use_fp4):
    """A = 4 for the indexer formats: a cache at a base pointer 4 mod 16 with a page stride 4 mod 16 (two pages),
    a one-page cache with an odd stride(0) and a zero-page cache are accepted, and the first is written as the
    reference writes it (on CUDA, at a vector width the alignment allows)."""
    fmt = IndexerFormat(int(use_fp4))
    page_size, n = 16, 12
    gen = _gen("indexer align", use_fp4)
    x, w, eps = _rows("general", gen, n, 128)
    plan, out_loc = decode_case(gen, n, 4, 2 * page_size, torch.int64)
    width = fmt.page_bytes(page_size) + 4
    pool = torch.randint(0, 256, (2 * width + 32,), dtype=torch.uint8, generator=gen).to(device)
    cache = pool[4: 4 + 2 * width].view(2, width)
    assert cache.data_ptr() % 16 == 4 and cache.stride(0) % 16 == 4
    expected, before = pool.cpu().clone(), pool.cpu().clone()
    args = dict(norm_weight=w, norm_eps=eps, out_loc=out_loc, page_size=page_size, use_fp4=use_fp4, compress_ratio=4,
                is_decode=True)
    ref.compress_norm_rope_store(x, plan, freq_cis=TABLE, kvcache=expected[4: 4 + 2 * width].view(2, width), **args)
    dsv4.compress_norm_rope_store(x.to(device), plan.to(device), freq_cis=_table(device), kvcache=cache,
                                  **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    assert_same_bytes(pool, expected, "4-byte aligned indexer cache")
    assert not torch.equal(expected, before), "rows were written"
    a = _c_args(device, d=128, use_fp4=use_fp4)
    a["kvcache"] = torch.zeros(1, a["kvcache"].shape[1] + 3, dtype=torch.uint8, device=device)  # stride(0) odd
    _call_c(a)
    a["kvcache"] = torch.zeros(0, a["kvcache"].shape[1], dtype=torch.uint8, device=device)  # every slot invalid
    _call_c(a)


def test_compress_variant_rules_in_the_fake():
    """The fake checks the variant rules too: layout != 0 with the indexer kv, use_fp4 with the main kv."""
    _expect_fake_error(_call_c, _c_args(d=128, layout=1), "compress_norm_rope_store", "layout")
    _expect_fake_error(_call_c, _c_args(d=128, layout=2, use_fp4=True), "compress_norm_rope_store", "layout")
    _expect_fake_error(_call_c, _c_args(use_fp4=True), "compress_norm_rope_store", "use_fp4")


def _expect_fake_error(call, args, op, name):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        with pytest.raises(RuntimeError, match=rf"dsv4\.{op}: .*{name}"):
            call(fake)


def test_compress_variant_rules():
    op = "compress_norm_rope_store"
    _expect_error(_call_c, _c_args(d=128, layout=1), op, "layout")  # indexer variant requires layout 0
    _expect_error(_call_c, _c_args(use_fp4=True), op, "use_fp4")  # main variant rejects use_fp4
    args = _c_args(d=256)
    args["kv"] = torch.randn(4, 256)
    _expect_error(_call_c, args, op, "kv")
    args = _c_args()
    args["out_loc"] = torch.arange(7)  # decode needs one slot per row ...
    _expect_error(_call_c, args, op, "out_loc")
    args["is_decode"] = False  # ... prefill checks no size relation
    _call_c(args)


@pytest.mark.parametrize("call,make", [(_call_k, _k_args), (_call_c, _c_args)], ids=["k_writer", "compress"])
def test_unaligned_single_page_and_zero_page_caches_accepted(call, make):
    args = make()
    width = args["kvcache"].shape[1]
    args["kvcache"] = torch.zeros(1, width + 8, dtype=torch.uint8)  # stride(0) not a multiple of 16: one page
    call(args)
    args["kvcache"] = torch.zeros(0, width, dtype=torch.uint8)  # every slot invalid
    call(args)


@pytest.mark.parametrize("call,make", [(_call_k, _k_args), (_call_c, _c_args)], ids=["k_writer", "compress"])
def test_zero_rows_are_a_no_op_after_validation(call, make):
    args = make(n=0)
    before = args["kvcache"].clone()
    call(args)
    assert torch.equal(args["kvcache"], before)
    args["kvcache"] = args["kvcache"][:, :-64]
    with pytest.raises(RuntimeError, match="kvcache"):
        call(args)


# ---------------------------------------------------------------------------------------------------------
# opcheck and torch.compile


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda l: l.str_name)
def test_opcheck_k_writer(device, layout):
    a = _k_args(device, n=6, layout=int(layout))
    a["out_loc"][2] = -1
    torch.library.opcheck(
        torch.ops.dsv4.fused_k_norm_rope_flashmla.default,
        (a["kv"], a["weight"], a["eps"], a["freqs"], a["positions"], a["out_loc"], a["kvcache"]),
        dict(page_size=a["page_size"], layout=a["layout"]),
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
def test_opcheck_compress(device, variant, is_decode):
    indexer = variant.startswith("indexer")
    fmt = _fmt(variant)
    a = _c_args(device, n=6, d=128 if indexer else 512, layout=0 if indexer else int(fmt),
                use_fp4=fmt is IndexerFormat.FP4, is_decode=is_decode)
    torch.library.opcheck(
        torch.ops.dsv4.compress_norm_rope_store.default,
        (a["kv"], a["plan"], a["norm_weight"], a["norm_eps"], a["freqs"], a["out_loc"], a["kvcache"]),
        dict(page_size=a["page_size"], compress_ratio=4, is_decode=is_decode, layout=a["layout"],
             use_fp4=a["use_fp4"]),
    )


def _compiled_code(fn, *args):
    from torch._inductor.utils import run_and_get_code

    _, codes = run_and_get_code(fn, *args)
    return "\n".join(codes)


def _assert_no_cache_copy(code: str):
    """The compiled code calls the op on the cache itself: no clone, no copy back, no new buffer."""
    found = re.findall(r"\bclone\(|\bcopy_\(|empty_strided\w*\(", code)
    assert not found, f"compiled code copies the cache ({found}):\n{code}"


@pytest.mark.parametrize("device", DEVICES)
def test_compile_k_writer_without_cache_clone(device):
    torch._dynamo.reset()
    page_size, layout = 16, KVLayout.V41
    table = _table(device)

    def step(kv, w, pos, loc, pool):
        cache = pool[1:5]  # a dim-0 slice of a pool graph input
        dsv4.fused_k_norm_rope_flashmla(kv, w, 1e-6, table, pos, loc, cache, page_size=page_size, layout=layout)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (5, 11):  # dynamic over N
        gen = _gen("compile-k", n)
        x, w, _ = _rows("general", gen, n, 512)
        pos = _positions(gen, n, torch.int64).to(device)
        loc = _slots(gen, n, 4 * page_size, torch.int32).to(device)
        pool = torch.randint(0, 256, (6, layout.page_bytes(page_size)), dtype=torch.uint8, generator=gen).to(device)
        expected = pool.clone()
        step(x.to(device), w.to(device), pos, loc, expected)
        code = _compiled_code(compiled, x.to(device), w.to(device), pos, loc, pool)
        _assert_no_cache_copy(code)
        assert_same_bytes(pool, expected.cpu(), f"compiled n={n}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
def test_compile_compress_without_cache_clone(device, variant):
    """Decode and prefill plans in one compiled function (dynamic over N), each writing a dim-0 slice of a pool
    graph input: equal to eager, and the generated code copies no cache."""
    torch._dynamo.reset()
    page_size = 16
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    layout, use_fp4 = (KVLayout.V4 if indexer else fmt), fmt is IndexerFormat.FP4
    d = 128 if indexer else 512
    table = _table(device)

    def step(kv, decode_plan, prefill_plan, w, decode_loc, prefill_loc, pool):
        for plan, loc, cache, is_decode in ((decode_plan, decode_loc, pool[1:5], True),
                                            (prefill_plan, prefill_loc, pool[6:10], False)):
            dsv4.compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=table, out_loc=loc,
                                          kvcache=cache, page_size=page_size, layout=layout, use_fp4=use_fp4,
                                          compress_ratio=4, is_decode=is_decode)

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for n in (9, 17):
        gen = _gen("compile-c", variant, n)
        x, w, _ = _rows("general", gen, n, d)
        decode_plan, decode_loc = decode_case(gen, n, 4, 4 * page_size, torch.int64)
        prefill_plan, prefill_loc = prefill_case(gen, n, 4, 4 * page_size, torch.int32, short_out_loc=False)
        pool = torch.randint(0, 256, (11, fmt.page_bytes(page_size)), dtype=torch.uint8, generator=gen).to(device)
        expected = pool.clone()
        args = tuple(t.to(device) for t in (x, decode_plan, prefill_plan, w, decode_loc, prefill_loc))
        step(*args, expected)
        assert not torch.equal(expected, pool), "rows were written"
        _assert_no_cache_copy(_compiled_code(compiled, *args, pool))
        assert_same_bytes(pool, expected.cpu(), f"compiled n={n}")


# ---------------------------------------------------------------------------------------------------------
# CUDA only: peak memory under compile, graphs, PDL, streams, 64-bit offsets


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("writer,variant", [("k_writer", "v4"), ("compress", "v41"), ("compress", "indexer_fp4")])
def test_compile_peak_memory_below_half_the_cache(writer, variant):
    """§7.3: compiled with the whole cache (>= 64 MiB) as a graph input, equal to eager, and the call's peak-memory
    increase stays below half the cache (a clone of it would not)."""
    torch._dynamo.reset()
    page_size, n = 64, 256
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    pages = (64 << 20) // fmt.page_bytes(page_size) + 1
    cache = torch.zeros(pages, fmt.page_bytes(page_size), dtype=torch.uint8, device="cuda")
    table = _table("cuda")
    gen = _gen("compile-peak", writer, variant)
    kv, w, _ = _rows("general", gen, n, 128 if indexer else 512)
    kv, w = kv.cuda(), w.cuda()
    if writer == "k_writer":
        pos = torch.arange(n, device="cuda")
        loc = torch.randperm(pages * page_size, device="cuda")[:n]

        def step(cache):
            dsv4.fused_k_norm_rope_flashmla(kv, w, 1e-6, table, pos, loc, cache, page_size=page_size, layout=fmt)
    else:
        plan, loc = (t.cuda() for t in decode_case(gen, n, 4, pages * page_size, torch.int64))

        def step(cache):
            dsv4.compress_norm_rope_store(kv, plan, norm_weight=w, norm_eps=1e-6, freq_cis=table, out_loc=loc,
                                          kvcache=cache, page_size=page_size,
                                          layout=KVLayout.V4 if indexer else fmt, use_fp4=fmt is IndexerFormat.FP4,
                                          compress_ratio=4, is_decode=True)

    expected = cache.clone()
    step(expected)
    compiled = torch.compile(step, fullgraph=True)
    compiled(cache)  # compile outside the measurement
    torch.cuda.synchronize()
    assert_same_bytes(cache, expected.cpu(), "compiled")
    del expected
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    compiled(cache)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base < cache.numel() // 2


@contextlib.contextmanager
def _no_host_sync():
    """Any host<->device sync inside raises (the writers' host code never syncs, eager or under capture)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


# At n >= kPipelineMinRows (csrc/cache/writers_kernels.cu) the CUDA K writer takes its pipelined path for
# 16-byte aligned rows and a compact cache.
K_WRITER_PIPELINE_MIN_ROWS = 4096


def _graph_inputs(variant, is_decode, trial, n, capacity, big_n, big_capacity):
    """One set of static inputs (CUDA, made before any sync-free region): compress rows, weight, plan and slots,
    and for the main layouts K writer rows at decode size and at a pipelined size. Padded rows (slot -1 or a
    sentinel plan entry) sit in the last quarter, rolled by the trial so they move between replays."""
    gen = _gen("graph", variant, is_decode, trial)
    d = 128 if variant.startswith("indexer") else 512
    t = {}
    t["c_kv"], t["c_w"], _ = _rows("general", gen, n, d)
    if is_decode:
        t["plan"], t["out_loc"] = decode_case(gen, n, 4, capacity, torch.int64)
        t["out_loc"][n - n // 4:] = -1
    else:
        t["plan"], t["out_loc"] = prefill_case(gen, n, 4, capacity, torch.int64, short_out_loc=False)
        t["plan"][n - n // 4:, :4] = 0xFF  # padding entries
    t["plan"], t["out_loc"] = t["plan"].roll(trial, 0), t["out_loc"].roll(trial)
    if d == 512:
        t["k_w"] = torch.randn(512, generator=gen)
        sizes = (("k", n, capacity, torch.float32), ("big", big_n, big_capacity, torch.bfloat16))
        for prefix, rows, cap, dtype in sizes:
            x, _, _ = _rows("general", gen, rows, 512)
            loc = _slots(gen, rows, cap, torch.int32)
            loc[rows - rows // 4:] = -1
            t[f"{prefix}_kv"] = x.to(dtype)
            t[f"{prefix}_pos"], t[f"{prefix}_loc"] = _positions(gen, rows, torch.int64), loc.roll(trial)
    return {k: v.cuda() for k, v in t.items()}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("is_decode", [True, False], ids=["decode", "prefill"])
@pytest.mark.parametrize("variant", MAIN_VARIANTS + INDEXER_VARIANTS)
def test_cuda_graph_replay_equals_eager(variant, is_decode):
    """One graph holds the variant's writers: the compress writer with a decode or prefill plan and, for the
    main layouts, the K writer at decode size and at a size that takes its pipelined path. The static inputs
    are refilled in place between replays (new rows, weights, positions, slots and seq_lens; padded rows move);
    each replay equals eager calls on cloned caches. Neither the eager calls nor the captured host code may
    sync, and neither capture nor replay allocates."""
    page_size, pages, n = 64, 8, 48
    big_n, big_pages = K_WRITER_PIPELINE_MIN_ROWS + 37, 72
    fmt = _fmt(variant)
    indexer = isinstance(fmt, IndexerFormat)
    layout, use_fp4 = (KVLayout.V4 if indexer else fmt), fmt is IndexerFormat.FP4
    table = _table("cuda")
    sizes = (n, pages * page_size, big_n, big_pages * page_size)
    static = _graph_inputs(variant, is_decode, 0, *sizes)
    gen = _gen("graph caches", variant, is_decode)
    caches = {"c": torch.randint(0, 256, (pages, fmt.page_bytes(page_size)), dtype=torch.uint8, generator=gen)}
    if not indexer:
        caches["k"] = torch.randint(0, 256, (pages, fmt.page_bytes(page_size)), dtype=torch.uint8, generator=gen)
        caches["big"] = torch.randint(0, 256, (big_pages, fmt.page_bytes(page_size)), dtype=torch.uint8, generator=gen)
    caches = {k: v.cuda() for k, v in caches.items()}

    def calls(t, target):
        dsv4.compress_norm_rope_store(t["c_kv"], t["plan"], norm_weight=t["c_w"], norm_eps=1e-6, freq_cis=table,
                                      out_loc=t["out_loc"], kvcache=target["c"], page_size=page_size, layout=layout,
                                      use_fp4=use_fp4, compress_ratio=4, is_decode=is_decode)
        if not indexer:
            for prefix in ("k", "big"):
                dsv4.fused_k_norm_rope_flashmla(t[f"{prefix}_kv"], t["k_w"], 1e-6, table, t[f"{prefix}_pos"],
                                                t[f"{prefix}_loc"], target[prefix], page_size=page_size, layout=layout)

    def cloned(target):
        return {k: v.clone() for k, v in target.items()}

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        warm = cloned(caches)
        with _no_host_sync():
            calls(static, warm)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Measured inside the capture: beginning a capture may itself allocate (generator state).
        allocated = torch.cuda.memory_allocated()
        with _no_host_sync():
            calls(static, caches)
        allocated_by_writers = torch.cuda.memory_allocated() - allocated
    assert allocated_by_writers == 0, "the writers allocate nothing during capture"
    for trial in range(1, 4):
        refill = _graph_inputs(variant, is_decode, trial, *sizes)
        for key, value in refill.items():
            static[key].copy_(value)
        previous, expected = cloned(caches), cloned(caches)
        with _no_host_sync():
            calls(static, expected)
        torch.cuda.synchronize()
        before_replay = torch.cuda.memory_allocated()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before_replay, "replay allocates nothing"
        for key in caches:
            assert not torch.equal(expected[key], previous[key]), f"{key}: trial {trial} writes rows"
            assert_same_bytes(caches[key], expected[key].cpu(), f"{key} replay {trial}")


_PDL_SCRIPT = textwrap.dedent("""
    import sys, torch
    import sgl_dsv4_kernels as dsv4
    from sgl_dsv4_kernels import KVLayout
    torch.manual_seed(0)
    table = dsv4.precompute_rope_table(64, 4096, 65536, 160000.0, 16.0, 32.0, 1.0).cuda()
    P, pages, n = 64, 16, 256
    out = {}
    for layout in KVLayout:
        cache = torch.zeros(pages, layout.page_bytes(P), dtype=torch.uint8, device="cuda")
        ccache = cache.clone()
        deq = []
        for step in range(20):
            x = torch.randn(n, 512, device="cuda") * (step + 1)
            w = torch.randn(512, device="cuda")
            slots = torch.randperm(pages * P, device="cuda")[:n]
            pos = torch.randint(0, 4096, (n,), device="cuda")
            # Back-to-back writers on the same slots: the last one must win with and without PDL.
            dsv4.fused_store_cache(x, cache, slots, page_size=P, layout=layout)
            # The K writer reads a tensor that the previous kernel (ours, also under PDL) has just written.
            produced = dsv4.fake_quant_compressed_kv(x)
            dsv4.fused_k_norm_rope_flashmla(produced, w, 1e-6, table, pos, slots, cache, page_size=P, layout=layout)
            plan = torch.zeros(n, 16, dtype=torch.uint8, device="cuda")
            plan[:, 0] = 8
            dsv4.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=1e-6, freq_cis=table, out_loc=slots,
                                          kvcache=ccache, page_size=P, layout=layout, compress_ratio=4,
                                          is_decode=True)
            deq.append(dsv4.dequantize_k_cache_paged(cache, slots, P, layout=layout))
        out[layout.str_name] = (cache.cpu(), ccache.cpu(), torch.stack(deq).cpu())
    idx = torch.randn(n, 128, device="cuda")
    for fmt in dsv4.IndexerFormat:
        icache = torch.zeros(4, fmt.page_bytes(64), dtype=torch.uint8, device="cuda")
        for step in range(10):
            plan = torch.zeros(n, 16, dtype=torch.uint8, device="cuda")
            plan[:, 0] = 4 * (step + 1)
            slots = torch.randperm(256, device="cuda")[:n]
            dsv4.compress_norm_rope_store(idx * (step + 1), plan, norm_weight=torch.ones(128, device="cuda"),
                                          norm_eps=1e-6, freq_cis=table, out_loc=slots, kvcache=icache, page_size=64,
                                          use_fp4=fmt is dsv4.IndexerFormat.FP4, compress_ratio=4, is_decode=True)
        out["indexer_" + fmt.str_name] = (icache.cpu(),)
    # Prefill plans: entry k -> out_loc[ragged_id k] (random ids, every 5th entry padding), main and indexer.
    seq = torch.randint(1, 1024, (n,), device="cuda") * 4
    seq[::5] = 0xFFFFFFFF
    ragged = torch.randperm(n + 9, device="cuda")[:n]
    plan = torch.stack([(seq >> s) & 0xFF for s in (0, 8, 16, 24)] + [ragged & 0xFF, ragged >> 8], 1)
    plan = torch.cat([plan, torch.zeros(n, 10, dtype=plan.dtype, device="cuda")], 1).to(torch.uint8)
    out_loc = torch.randperm(256, device="cuda")[: n + 9]
    main = torch.randn(n, 512, device="cuda")
    for name, rows, layout, use_fp4 in (("prefill_v41", main, KVLayout.V41, False),
                                        ("prefill_v4", main, KVLayout.V4, False),
                                        ("prefill_indexer_fp4", idx, KVLayout.V4, True)):
        fmt = dsv4.IndexerFormat.FP4 if use_fp4 else layout
        pcache = torch.zeros(4, fmt.page_bytes(64), dtype=torch.uint8, device="cuda")
        dsv4.compress_norm_rope_store(rows, plan, norm_weight=torch.ones(rows.shape[1], device="cuda"), norm_eps=1e-6,
                                      freq_cis=table, out_loc=out_loc, kvcache=pcache, page_size=64, layout=layout,
                                      use_fp4=use_fp4, compress_ratio=4, is_decode=False)
        out[name] = (pcache.cpu(),)
    # The K writer's pipelined path (n >= 4096, 16-byte aligned rows, compact cache), back to back.
    big = 4096 + 300
    for layout in KVLayout:
        cache = torch.zeros(big // P + 8, layout.page_bytes(P), dtype=torch.uint8, device="cuda")
        for step in range(3):
            xb = torch.randn(big, 512, device="cuda").to(torch.bfloat16 if step % 2 else torch.float32)
            slots = torch.randperm(cache.shape[0] * P, device="cuda")[:big]
            slots[::7] = -1
            pos = torch.randint(0, 4096, (big,), device="cuda")
            dsv4.fused_k_norm_rope_flashmla(xb, torch.randn(512, device="cuda"), 1e-6, table, pos, slots, cache,
                                            page_size=P, layout=layout)
        out["pipelined_" + layout.str_name] = (cache.cpu(),)
    torch.save(out, sys.argv[1])
""")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_pdl_on_and_off_give_identical_bytes(tmp_path):
    off, on = run_with_pdl_off_and_on(_PDL_SCRIPT, tmp_path)
    assert off.keys() == on.keys()
    for key in off:
        for a, b in zip(off[key], on[key]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_non_default_stream():
    gen = _gen("stream")
    n, page_size, pages = 200, 64, 8
    x, w, eps = _rows("general", gen, n, 512)
    pos = _positions(gen, n, torch.int64)
    loc = _slots(gen, n, pages * page_size, torch.int64)
    plan, out_loc = prefill_case(gen, n, 4, pages * page_size, torch.int32, short_out_loc=False)
    k_exp = torch.zeros(pages, KVLayout.V41.page_bytes(page_size), dtype=torch.uint8)
    c_exp = k_exp.clone()
    ref.fused_k_norm_rope_flashmla(x, w, eps, TABLE, pos, loc, k_exp, page_size=page_size, layout=1)
    ref.compress_norm_rope_store(x, plan, norm_weight=w, norm_eps=eps, freq_cis=TABLE, out_loc=out_loc,
                                 kvcache=c_exp, page_size=page_size, layout=1, compress_ratio=4, is_decode=False)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        k_cache = torch.zeros_like(k_exp, device="cuda")
        c_cache = torch.zeros_like(c_exp, device="cuda")
        table = TABLE.cuda()
        dsv4.fused_k_norm_rope_flashmla(x.cuda(), w.cuda(), eps, table, pos.cuda(), loc.cuda(), k_cache,
                                        page_size=page_size, layout=1)
        dsv4.compress_norm_rope_store(x.cuda(), plan.cuda(), norm_weight=w.cuda(), norm_eps=eps, freq_cis=table,
                                      out_loc=out_loc.cuda(), kvcache=c_cache, page_size=page_size, layout=1,
                                      compress_ratio=4, is_decode=False)
    stream.synchronize()
    assert_same_bytes(k_cache, k_exp, "K writer on a side stream")
    assert_same_bytes(c_cache, c_exp, "compress writer on a side stream")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_large_offset_last_page():
    """A cache over 2^31 bytes: the last slot of the last page is written at a 64-bit offset."""
    page_size, layout = 64, KVLayout.V4
    page_bytes = layout.page_bytes(page_size)
    pages = (1 << 31) // page_bytes + 2
    cache = torch.zeros(pages, page_bytes, dtype=torch.uint8, device="cuda")
    gen = _gen("large")
    x, w, eps = _rows("general", gen, 2, 512)
    last = pages * page_size - 1
    slots = torch.tensor([last, pages * page_size], device="cuda")  # the second one is out of range
    dsv4.fused_k_norm_rope_flashmla(x.cuda(), w.cuda(), eps, _table("cuda"), torch.tensor([5, 6], device="cuda"),
                                    slots, cache, page_size=page_size, layout=layout)
    expected = torch.zeros(1, page_bytes, dtype=torch.uint8)
    ref.fused_k_norm_rope_flashmla(x, w, eps, TABLE, torch.tensor([5, 6]), torch.tensor([page_size - 1, -1]),
                                   expected, page_size=page_size, layout=layout)
    assert_same_bytes(cache[-1:], expected, "last page")
    assert not cache[:-1].any().item()
    # The compress writer (indexer fp8) at the same kind of offset.
    idx_bytes = IndexerFormat.FP8.page_bytes(page_size)
    del cache
    icache = torch.zeros((1 << 31) // idx_bytes + 2, idx_bytes, dtype=torch.uint8, device="cuda")
    last = icache.shape[0] * page_size - 1
    xi, wi, _ = _rows("general", gen, 1, 128)
    plan = _plan([12], [0], gen)
    dsv4.compress_norm_rope_store(xi.cuda(), plan.cuda(), norm_weight=wi.cuda(), norm_eps=eps,
                                  freq_cis=_table("cuda"), out_loc=torch.tensor([last], device="cuda"),
                                  kvcache=icache, page_size=page_size, compress_ratio=4, is_decode=True)
    expected = torch.zeros(1, idx_bytes, dtype=torch.uint8)
    ref.compress_norm_rope_store(xi, plan, norm_weight=wi, norm_eps=eps, freq_cis=TABLE,
                                 out_loc=torch.tensor([page_size - 1]), kvcache=expected, page_size=page_size,
                                 compress_ratio=4, is_decode=True)
    assert_same_bytes(icache[-1:], expected, "indexer last page")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kv", "weight", "freqs", "positions", "out_loc"])
def test_k_writer_rejects_tensors_on_another_device(name):
    args = _k_args("cuda")
    args[name] = args[name].cpu()
    _expect_error(_call_k, args, "fused_k_norm_rope_flashmla", name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["kv", "plan", "norm_weight", "freqs", "out_loc"])
def test_compress_rejects_tensors_on_another_device(name):
    args = _c_args("cuda")
    args[name] = args[name].cpu()
    _expect_error(_call_c, args, "compress_norm_rope_store", name)
