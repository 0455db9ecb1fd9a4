"""KV I/O ops against the spec and the pure-torch reference: fused_store_cache (main layouts and indexer
formats, per-row RoPE), dequantize_k_cache_paged, fake_quant_compressed_kv and fake_quant_fp4.

Test ids follow kv-layouts-and-quant.md section 9 (T2..T10, T12) and cache-writers.md section 7.3.
Expected values come from the spec (hand tables) or from `sgl_dsv4_kernels.reference` run on the CPU,
never from the ops themselves. torch.compile, CUDA graphs and opcheck (T11) live in test_cache_compile.py.
"""
import math

import numpy as np
import pytest
import torch

import sgl_dsv4_kernels as dsv4
from samples import (
    ALL_FORMATS,
    BOUNDARY_M,
    CACHE_KINDS,
    FP4_DIV_TILE,
    FP4_SUBNORMAL_BLOCK,
    FP4_TIE_BLOCK,
    FP4_TIE_TILE,
    IDX_FP4,
    IDX_FP8,
    IDX_FP8_CLIP_M,
    INDEXER_FORMATS,
    MAIN_FORMATS,
    V4,
    V41,
    V41_FP4,
    V41_SPECIAL_TILE,
    assert_bits_equal,
    assert_bytes_equal,
    bits_from_f32,
    clone_view,
    contiguous_rows,
    cuda_only,
    flat_bytes,
    fmt_id,
    generator,
    huge_cpu_tensor,
    invalid_slots,
    make_cache,
    make_rows,
    make_slots,
    op_store,
    padded_tile,
    read_rows,
    ref_quantize,
    ref_store,
    rope_rows,
    seed_of,
    slot_offsets,
    strided_rows,
    tensor_from_bits,
    uniform_tile,
    write_row_bytes,
)

pytestmark = pytest.mark.usefixtures("single_thread")

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
PAGE_SIZES = [1, 2, 64, 256]
NUM_PAGES = {1: 400, 2: 200, 64: 9, 256: 3}  # capacity > N = 333 rows for every P
N_ROWS = 333


def dtype_id(d):
    return str(d).replace("torch.", "")


def ref_dequant_rows(ref, fmt, data, scale):
    """Reference decode of (data, used scale bytes) rows of a main layout (V4's pad byte re-added as 0)."""
    if fmt is V4:
        scale = torch.cat([scale, torch.zeros(scale.shape[0], 1, dtype=torch.uint8)], dim=-1)
    return ref.dequantize_rows(data, scale, fmt.id)


# ====================================================================================================
# T2: worked offsets of section 2 / 3 through the real op


# name -> (format, P, page stride or None for page_bytes, slot, num_pages, written byte ranges [start, end))
WORKED_OFFSETS = {
    "v4": (V4, 64, None, 130, 3, [(76032, 76480), (76480, 76608), (111760, 111767)]),
    "v41": (V41, 64, None, 130, 3, [(68608, 69120), (100384, 100400)]),
    "v41_fp4": (V41_FP4, 64, None, 130, 3, [(37376, 37632), (53312, 53344)]),
    "v4_stride40960": (V4, 64, 40960, 130, 3, [(83072, 83648), (118800, 118807)]),
    "indexer_fp8": (IDX_FP8, 64, None, 130, 3, [(17152, 17280), (25096, 25100)]),
    "indexer_fp4": (IDX_FP4, 64, None, 130, 3, [(8832, 8896), (12808, 12812)]),
}


def _store_into_filled(fmt, p, stride, slot, num_pages, fill, x, device):
    pb = fmt.page_bytes(p)
    stride = pb if stride is None else stride
    buf = torch.full((num_pages, stride), fill, dtype=torch.uint8, device=device)
    cache = buf[:, :pb]
    op_store(fmt, x, cache, torch.tensor([slot], device=device), p)
    return buf.reshape(-1).cpu()


@pytest.mark.parametrize("case", list(WORKED_OFFSETS))
def test_T2_worked_offsets(device, case):
    fmt, p, stride, slot, num_pages, ranges = WORKED_OFFSETS[case]
    x = make_rows(1, fmt.width, tile=fmt.tile, seed=seed_of("T2", case), special=False).to(device)
    b0 = _store_into_filled(fmt, p, stride, slot, num_pages, 0x00, x, device)
    b1 = _store_into_filled(fmt, p, stride, slot, num_pages, 0xFF, x, device)
    expected = torch.zeros_like(b0, dtype=torch.bool)
    for lo, hi in ranges:
        expected[lo:hi] = True
    same = b0 == b1
    written = same.nonzero().squeeze(-1)
    assert torch.equal(same, expected), (
        f"written bytes {written[:4].tolist()}..{written[-4:].tolist()} ({written.numel()}), "
        f"expected ranges {ranges}")
    assert bool((b0[~expected] == 0x00).all()) and bool((b1[~expected] == 0xFF).all())


@pytest.mark.parametrize("case", list(WORKED_OFFSETS))
def test_T2_worked_offsets_bytes_equal_quantizer(ref, device, case):
    fmt, p, stride, slot, num_pages, ranges = WORKED_OFFSETS[case]
    x = make_rows(1, fmt.width, tile=fmt.tile, seed=seed_of("T2", case), special=False)
    got = _store_into_filled(fmt, p, stride, slot, num_pages, 0xA5, x.to(device), device)
    data, scale = ref_quantize(ref, fmt, x)
    d_lo, s_lo = ranges[0][0], ranges[-1][0]
    assert_bytes_equal(got[d_lo: d_lo + fmt.data_bytes], data[0], what="data row")
    assert_bytes_equal(got[s_lo: s_lo + fmt.scale_used], scale[0], what="scale row")


def test_T2_v4_64bit_example_arithmetic():
    # section 2: V4, P = 256, slot 2^24 + 5 -> page 65536, row 5 (all in Python integers).
    pb, p, slot = V4.page_bytes(256), 256, 2**24 + 5
    assert pb == 149760
    page, row = slot >> 8, slot & (p - 1)
    assert (page, row) == (65536, 5)
    assert page * pb == 9_814_671_360 > 2**31
    assert page * pb + row * 576 == 9_814_674_240
    assert page * pb + p * 576 + row * 8 == 9_814_818_856


def _large_case(fmt):
    """(P, num_pages, slot) for a cache of more than 2^31 bytes, writing to its last page."""
    if fmt is V4:
        return 256, 65537, 2**24 + 5  # the section 2 example
    p = 256
    num_pages = 2**31 // fmt.page_bytes(p) + 2
    return p, num_pages, (num_pages - 1) * p + p - 3


def _large_offset(device, fmt, slot_dtype, ref, tmp_dir=None):
    p, num_pages, slot = _large_case(fmt)
    pb = fmt.page_bytes(p)
    if device == "cpu":
        cache = huge_cpu_tensor(num_pages * pb, tmp_dir).view(num_pages, pb)
    else:
        cache = torch.empty(num_pages, pb, dtype=torch.uint8, device=device)
    try:
        assert num_pages * pb > 2**31
        page, row = slot // p, slot % p
        assert page == num_pages - 1
        if fmt is V4:
            assert (page, row) == (65536, 5)
            assert cache[page].data_ptr() - cache.data_ptr() == 9_814_671_360
        for k in (0, page - 1, page):
            cache[k].fill_(0xFF)
        x = make_rows(2, fmt.width, tile=fmt.tile, seed=seed_of("large", fmt.name), special=False)
        slots = torch.tensor([slot, -1], dtype=slot_dtype)
        op_store(fmt, x.to(device), cache, slots.to(device), p)
        last = cache[page: page + 1].cpu()
        first, before = cache[0].cpu(), cache[page - 1].cpu()
        # exactly the row's footprint changed, with the quantizer's bytes
        expected = torch.full_like(last, 0xFF)
        d_off, s_off = row * fmt.data_bytes, p * fmt.data_bytes + row * fmt.scale_bytes
        if fmt is V4:
            assert page * pb + d_off == 9_814_674_240 and page * pb + s_off == 9_814_818_856
        data, scale = ref_quantize(ref, fmt, x[:1])
        expected[0, d_off: d_off + fmt.data_bytes] = data[0]
        expected[0, s_off: s_off + fmt.scale_used] = scale[0]
        assert_bytes_equal(last, expected, fmt, p, pb, what="last page")
        assert bool((first == 0xFF).all()) and bool((before == 0xFF).all())
        if not fmt.indexer:
            out = dsv4.dequantize_k_cache_paged(cache, torch.tensor([slot, slot - 1, -1], dtype=slot_dtype,
                                                                     device=device), p, layout=fmt.id)
            d2, s2 = read_rows(fmt, last, p, [row, row - 1])
            exp = torch.zeros(3, 1, 512, dtype=torch.bfloat16)
            exp[:2, 0] = ref_dequant_rows(ref, fmt, d2, s2)
            assert_bits_equal(out, exp, "dequant of the last page")
    finally:
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T2_large_offset_cpu(ref, fmt, slot_dtype, tmp_path):
    """A real > 2^31-byte cache (virtual memory, only three pages touched) on the CPU."""
    _large_offset("cpu", fmt, slot_dtype, ref, tmp_path)


@cuda_only
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T2_large_offset_cuda(ref, fmt, slot_dtype):
    """Store into and dequantize the last page of a > 2^31-byte cache on the GPU (T8 large-offset item)."""
    _large_offset("cuda", fmt, slot_dtype, ref)


@cuda_only
@pytest.mark.parametrize("fmt", [V41_FP4, IDX_FP4], ids=fmt_id)
def test_T2_page_stride_beyond_32_bits_cuda(ref, fmt):
    """A page stride above 2^32 bytes: two pages 4 GiB apart, rows stored into both and read back, against the
    same rows in a contiguous cache."""
    p, stride = 64, 2**32 + 4096
    pb = fmt.page_bytes(p)
    buffer = torch.full((stride + pb,), 0xFF, dtype=torch.uint8, device="cuda")
    try:
        cache = buffer.as_strided((2, pb), (stride, 1))
        x = make_rows(3, fmt.width, tile=fmt.tile, seed=seed_of("stride32", fmt.name), special=False)
        slots = torch.tensor([p + 7, 3, -1], dtype=torch.int64)
        op_store(fmt, x.cuda(), cache, slots.cuda(), p)
        expected = torch.full((2, pb), 0xFF, dtype=torch.uint8)
        ref_store(ref, fmt, x, expected, slots, p)
        assert_bytes_equal(cache.cpu(), expected, fmt, p, pb, what="pages 4 GiB apart")
        if not fmt.indexer:
            read = torch.tensor([p + 7, 3, -1], dtype=torch.int64)
            got = dsv4.dequantize_k_cache_paged(cache, read.cuda(), p, layout=fmt.id).cpu()
            assert_bits_equal(got, dsv4.dequantize_k_cache_paged(expected, read, p, layout=fmt.id), "dequant")
    finally:
        del buffer
        torch.cuda.empty_cache()


# ====================================================================================================
# T3: stores vs the reference, poisoned cache compared whole


def _store_case(ref, device, fmt, p, num_pages, slot_dtype, in_dtype, seed, *, kind="contiguous",
                n_rows=N_ROWS, strided=False):
    capacity = num_pages * p
    n_valid = min(n_rows - len(invalid_slots(capacity, slot_dtype)), capacity)
    x = make_rows(n_valid + len(invalid_slots(capacity, slot_dtype)), fmt.width, tile=fmt.tile, seed=seed,
                  dtype=in_dtype)
    slots = make_slots(n_valid, capacity, seed=seed + 1, dtype=slot_dtype)
    cache, buf = make_cache(fmt, p, num_pages, kind=kind, device=device, seed=seed + 2)
    exp_cache, exp_buf = clone_view(cache, buf, device="cpu")
    x_dev = x.to(device)
    if strided:
        x_dev = strided_rows(x_dev, extra=3)
        assert x_dev.stride(0) == fmt.width + 3
    op_store(fmt, x_dev, cache, slots.to(device), p)
    ref_store(ref, fmt, x, exp_cache, slots, p)
    assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0))


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T3_store_matches_reference(ref, device, fmt, p, slot_dtype, in_dtype):
    _store_case(ref, device, fmt, p, NUM_PAGES[p], slot_dtype, in_dtype,
                seed_of("T3", fmt.name, p, slot_dtype, in_dtype))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T3_store_page_size_1024_smoke(ref, device, fmt):
    _store_case(ref, device, fmt, 1024, 2, torch.int64, FP32, seed_of("T3-1024", fmt.name), n_rows=120)


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T3_store_row_strided_input(ref, device, fmt, in_dtype):
    """Input as a column slice of a wider tensor, row stride width + 3 (not a multiple of 8 elements)."""
    _store_case(ref, device, fmt, 64, 9, torch.int32, in_dtype, seed_of("T3-strided", fmt.name, in_dtype),
                strided=True)


@pytest.mark.parametrize("stride", [0, 1, 100], ids=lambda s: f"stride{s}")
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T3_store_overlapping_rows(ref, device, fmt, stride):
    """Input rows may have any row stride, overlapping or repeated rows included (the store only reads them):
    the bytes equal the reference's for the same rows made contiguous."""
    p, num_pages = 2, 6
    slots = make_slots(9, num_pages * p, seed=seed_of("overlap-slots", stride))  # invalid slots added
    n = slots.numel()
    values = make_rows(n, fmt.width, tile=fmt.tile, seed=seed_of("overlap", fmt.name, stride), dtype=BF16)
    flat = values.reshape(-1)[: (n - 1) * stride + fmt.width]
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed_of("overlap-cache", stride))
    exp_cache, exp_buf = clone_view(cache, buf, device="cpu")
    op_store(fmt, flat.to(device).as_strided((n, fmt.width), (stride, 1)), cache, slots.to(device), p)
    ref_store(ref, fmt, flat.as_strided((n, fmt.width), (stride, 1)).contiguous(), exp_cache, slots, p)
    assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0))


def test_T3_store_into_pool_slice_keeps_rest_of_pool(ref, device):
    """A cache that is a dim-0 slice of a larger pool: pages outside the slice are untouched."""
    for i, fmt in enumerate(ALL_FORMATS):
        _store_case(ref, device, fmt, 2, 40, torch.int64, BF16, seed_of("pool", i), kind="pool_slice",
                    n_rows=37 + 5)


def _footprint_mask(fmt, cache, p, slots):
    """Bool mask over the flat cache bytes: the data row and used scale bytes of each given slot."""
    mask = torch.zeros(flat_bytes(cache).numel(), dtype=torch.bool)
    for s in slots:
        d, c = slot_offsets(fmt, p, cache.stride(0), int(s))
        mask[d: d + fmt.data_bytes] = True
        mask[c: c + fmt.scale_used] = True
    return mask


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_store_duplicate_slots_touch_only_their_footprint(ref, device, fmt):
    """Two rows with the same slot: that slot's bytes are unspecified, every other byte is exact."""
    p, num_pages = 2, 40
    seed = seed_of("dup", fmt.name)
    x = make_rows(42, fmt.width, tile=fmt.tile, seed=seed)
    slots = make_slots(37, p * num_pages, seed=seed + 1)
    dup = [int(v) for v in slots if 0 <= v < p * num_pages][:3]
    slots = torch.cat([slots, torch.tensor(dup)])
    x = torch.cat([x, make_rows(3, fmt.width, tile=fmt.tile, seed=seed + 2)])
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed + 3)
    exp_cache, _ = clone_view(cache, buf, device="cpu")
    op_store(fmt, x.to(device), cache, slots.to(device), p)
    keep = torch.tensor([int(v) not in dup for v in slots])
    ref_store(ref, fmt, x[keep], exp_cache, slots[keep], p)
    mask = _footprint_mask(fmt, exp_cache, p, dup)
    got, exp = flat_bytes(cache).cpu(), flat_bytes(exp_cache)
    assert_bytes_equal(got[~mask], exp[~mask], what="bytes outside the duplicated slots")


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_store_nonfinite_rows_stay_in_their_footprint(ref, device, fmt):
    """NaN / inf rows: bytes unspecified, but only inside their own footprint, and no crash."""
    p, num_pages = 64, 4
    seed = seed_of("nonfinite", fmt.name)
    x = make_rows(105, fmt.width, tile=fmt.tile, seed=seed)
    slots = make_slots(100, p * num_pages, seed=seed + 1)
    bad_rows = torch.arange(0, 105, 7)
    g = generator(seed + 2)
    for i, r in enumerate(bad_rows.tolist()):
        cols = torch.randint(0, fmt.width, (3,), generator=g)
        x[r, cols] = [float("nan"), float("inf"), float("-inf")][i % 3]
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed + 3)
    exp_cache, _ = clone_view(cache, buf, device="cpu")
    for dtype in (FP32, BF16):
        op_store(fmt, x.to(dtype).to(device), cache, slots.to(device), p)
        if not fmt.indexer:
            dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id)
    finite = torch.ones(105, dtype=torch.bool)
    finite[bad_rows] = False
    ref_store(ref, fmt, x[finite].to(BF16), exp_cache, slots[finite], p)
    bad_slots = [int(v) for v in slots[~finite] if 0 <= v < p * num_pages]
    mask = _footprint_mask(fmt, exp_cache, p, bad_slots)
    got, exp = flat_bytes(cache).cpu(), flat_bytes(exp_cache)
    assert_bytes_equal(got[~mask], exp[~mask], what="bytes outside the non-finite rows")


# ====================================================================================================
# T4: the 4.7 boundary tiles through the op (hand-computed bytes of the spec)

# m -> V4 (b, q+, q-), V41 (b, q+, q-), V41_FP4 (S, byte), IDX_FP4 (b, byte), IDX_FP8 (s bits, q+, q-)
BOUNDARY_TABLE = {
    0.0: ((105, 0x00, 0x80), (114, 0x00, 0x80), (0x01, 0x80), (112, 0x00), (0x346FACAD, 0x00, 0x80)),
    2.0**-12: ((107, 0x78, 0xF8), (114, 0x40, 0xC0), (0x01, 0x80), (113, 0xE6), (0x35124925, 0x7E, 0xFE)),
    6 * 2.0**-9: ((112, 0x7C, 0xFC), (114, 0x6C, 0xEC), (0x01, 0xF7), (118, 0xF7), (0x37DB6DB7, 0x7E, 0xFE)),
    0.01: ((112, 0x7A, 0xFA), (114, 0x6A, 0xEA), (0x01, 0xF7), (118, 0xF7), (0x37BB3EE7, 0x7E, 0xFE)),
    6 * 1.0625: ((121, 0x7D, 0xFD), (121, 0x7D, 0xFD), (0x38, 0xF7), (128, 0xD5), (0x3C692492, 0x7E, 0xFE)),
    6 * 1.1875: ((122, 0x76, 0xF6), (122, 0x76, 0xF6), (0x3A, 0xF7), (128, 0xE6), (0x3C824925, 0x7E, 0xFE)),
    8.25: ((122, 0x78, 0xF8), (122, 0x78, 0xF8), (0x3B, 0xF7), (128, 0xE6), (0x3C96DB6E, 0x7E, 0xFE)),
    448.0: ((127, 0x7E, 0xFE), (127, 0x7E, 0xFE), (0x69, 0xF7), (134, 0xD5), (0x3F800000, 0x7E, 0xFE)),
    449.0: ((128, 0x76, 0xF6), (128, 0x76, 0xF6), (0x69, 0xF7), (134, 0xE6), (0x3F804925, 0x7E, 0xFE)),
    2688.0: ((130, 0x7A, 0xFA), (130, 0x7A, 0xFA), (0x7E, 0xF7), (136, 0xF7), (0x40C00000, 0x7E, 0xFE)),
    1e6: ((139, 0x77, 0xF7), (139, 0x77, 0xF7), (0x7E, 0xF7), (145, 0xE6), (0x450B8249, 0x7E, 0xFE)),
}
# bf16 input: 449 rounds to 448; 0.01 and 1e6 keep their bytes except the IDX_FP8 scale.
BF16_IDX_FP8_SCALE = {0.01: 0x37BB6DB7, 1e6: 0x450B6DB7}


def _boundary_expectation(fmt, m, in_dtype):
    row = BOUNDARY_TABLE[448.0 if (in_dtype == BF16 and m == 449.0) else m]
    v4, v41, fp4, i4, i8 = row
    data = torch.empty(fmt.data_bytes, dtype=torch.uint8)
    if fmt is V4 or fmt is V41:
        b, qp, qm = v4 if fmt is V4 else v41
        data[0::2], data[1::2] = qp, qm
        scale = [b] * fmt.num_scales
    elif fmt is V41_FP4:
        data[:] = fp4[1]
        scale = [fp4[0]] * 32
    elif fmt is IDX_FP4:
        data[:] = i4[1]
        scale = [i4[0]] * 4
    else:
        s_bits, qp, qm = i8
        if in_dtype == BF16:
            s_bits = BF16_IDX_FP8_SCALE.get(m, s_bits)
        data[0::2], data[1::2] = qp, qm
        scale = list(int(s_bits).to_bytes(4, "little"))
    if fmt is V4:  # RoPE dims 448..511 stored as bf16 of (+m, -m, ...), little-endian
        rope = uniform_tile(m, 64).to(in_dtype).to(BF16).view(torch.uint8)
        data[448:] = rope
    return data, torch.tensor(scale, dtype=torch.uint8)


def _store_rows_and_read(fmt, x, device, p=16):
    """Stores rows 0..n-1 into a zeroed contiguous cache and returns (data, used scale) of each row."""
    n = x.shape[0]
    num_pages = -(-n // p)
    cache = torch.zeros(num_pages, fmt.page_bytes(p), dtype=torch.uint8, device=device)
    op_store(fmt, x.to(device), cache, torch.arange(n, device=device), p)
    data, scale = contiguous_rows(fmt, cache.cpu(), p)
    return data[:n], scale[:n]


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T4_uniform_boundary_tiles(device, fmt, in_dtype):
    x = torch.stack([uniform_tile(m, fmt.width) for m in BOUNDARY_M]).to(in_dtype)
    data, scale = _store_rows_and_read(fmt, x, device)
    for i, m in enumerate(BOUNDARY_M):
        exp_data, exp_scale = _boundary_expectation(fmt, m, in_dtype)
        assert_bytes_equal(data[i], exp_data, what=f"{fmt.name} m={m!r} data")
        assert_bytes_equal(scale[i], exp_scale, what=f"{fmt.name} m={m!r} scale")


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T4_v41_special_tile(device, in_dtype):
    x = padded_tile(V41_SPECIAL_TILE, 512)[None].to(in_dtype)
    data, scale = _store_rows_and_read(V41, x, device)
    exp = torch.zeros(512, dtype=torch.uint8)
    exp[:12] = torch.tensor([0x7E, 0x58, 0x5A, 0x00, 0x02, 0x80, 0x80, 0x78, 0x7E, 0x00, 0x74, 0x80])
    assert_bytes_equal(data[0], exp, what="data")
    assert_bytes_equal(scale[0], torch.tensor([127] + [114] * 15, dtype=torch.uint8), what="scale")


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T4_fp4_tie_tile(device, in_dtype):
    x = padded_tile(FP4_TIE_TILE, 512)[None].to(in_dtype)
    data, scale = _store_rows_and_read(V41_FP4, x, device)
    exp = torch.zeros(256, dtype=torch.uint8)
    exp[:8] = torch.tensor([0x07, 0x22, 0x44, 0x66, 0xE8, 0x0F, 0x08, 0x67])
    assert_bytes_equal(data[0], exp, what="V41_FP4 data")
    assert_bytes_equal(scale[0], torch.tensor([0x38] + [0x01] * 31, dtype=torch.uint8), what="V41_FP4 scale")
    # the same 16 values as the first tile of an indexer-fp4 row
    xi = padded_tile(FP4_TIE_TILE, 128)[None].to(in_dtype)
    data, scale = _store_rows_and_read(IDX_FP4, xi, device)
    exp = torch.zeros(64, dtype=torch.uint8)
    exp[:8] = torch.tensor([0x07, 0x21, 0x43, 0x65, 0xE0, 0x0F, 0x00, 0x67])
    assert_bytes_equal(data[0], exp, what="IDX_FP4 payload")
    assert_bytes_equal(scale[0], torch.tensor([0x7F, 0x70, 0x70, 0x70], dtype=torch.uint8), what="IDX_FP4 scale")


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T4_fp4_tie_block(device, in_dtype):
    x = padded_tile(FP4_TIE_BLOCK, 512)[None].to(in_dtype)
    data, scale = _store_rows_and_read(V41_FP4, x, device)
    exp = torch.zeros(256, dtype=torch.uint8)
    exp[:8] = torch.tensor([0x57, 0xE4, 0x80, 0xD4, 0x57, 0xE4, 0x80, 0xD4])
    assert_bytes_equal(data[0], exp, what="data")
    assert int(scale[0, 0]) == 0x3B


def test_T4_fp4_scale_needs_ieee_division(device):
    """amax 0x40E3FFFF: fl(a / 6) gives S = 1.125 (0x39); a * fl(1/6) would give 0x3A."""
    x = padded_tile(FP4_DIV_TILE, 512)[None]
    data, scale = _store_rows_and_read(V41_FP4, x, device)
    exp = torch.zeros(256, dtype=torch.uint8)
    exp[:2] = torch.tensor([0xD7, 0x02])
    assert_bytes_equal(data[0], exp, what="data")
    assert int(scale[0, 0]) == 0x39


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T4_v4_rope_row(device, in_dtype):
    x = torch.zeros(1, 512)
    x[0, 448], x[0, 449], x[0, 450] = 1.0, -2.5, -0.0
    data, scale = _store_rows_and_read(V4, x.to(in_dtype), device)
    exp = torch.zeros(576, dtype=torch.uint8)
    exp[448:454] = torch.tensor([0x80, 0x3F, 0x20, 0xC0, 0x00, 0x80])
    assert_bytes_equal(data[0], exp, what="data")
    assert_bytes_equal(scale[0], torch.full((7,), 0x69, dtype=torch.uint8), what="scale")


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T4_boundary_rows_match_reference(ref, device, in_dtype):
    """Every special tile of 4.7 in every writer format, against the reference as well."""
    for fmt in ALL_FORMATS:
        x = make_rows(40, fmt.width, tile=fmt.tile, seed=seed_of("T4ref", fmt.name), dtype=in_dtype)
        data, scale = _store_rows_and_read(fmt, x, device)
        exp_data, exp_scale = ref_quantize(ref, fmt, x)
        assert_bytes_equal(data, exp_data, what=f"{fmt.name} data")
        assert_bytes_equal(scale, exp_scale, what=f"{fmt.name} scale")


# ====================================================================================================
# T5(b): scale bytes for tiles whose amax covers every bf16 value, random fp32, the 448*2^k neighbourhoods
# and subnormals, through the CPU / CUDA stores


def _amax_values(n_random, seed):
    g = generator(seed)
    bf16_all = torch.arange(0, 0x7F80, dtype=torch.int64) << 16  # the 32,640 non-negative finite bf16
    rnd = torch.randint(0, 0x7F800000, (n_random,), generator=g, dtype=torch.int64)
    centres = torch.tensor([bits_from_f32(448.0 * 2.0**k) for k in range(-155, 120)], dtype=torch.int64)
    near = (centres[:, None] + torch.arange(-64, 65)[None]).reshape(-1)
    near = near[(near >= 0) & (near < 0x7F800000)]
    subnormal = torch.randint(1, 0x800000, (4096,), generator=g, dtype=torch.int64)
    return tensor_from_bits(torch.cat([bf16_all, rnd, near, subnormal]))


def _tiles_with_amax(amax, tile, seed):
    """Tiles whose amax is exactly `amax`: amax (random sign) at a random lane, fl(u * amax) elsewhere."""
    g = generator(seed)
    m = amax.numel()
    u = torch.rand(m, tile, generator=g) * 2 - 1
    x = u * amax[:, None]
    lane = torch.randint(0, tile, (m,), generator=g)
    sign = torch.where(torch.rand(m, generator=g) < 0.5, -1.0, 1.0)
    x[torch.arange(m), lane] = amax * sign
    return x


T5_RANDOM = {"v41": 2**20, "v4": 2**18, "indexer_fp4": 2**18}


@pytest.mark.parametrize("fmt", [V41, V4, IDX_FP4], ids=fmt_id)
def test_T5b_scale_bytes_exhaustive(ref, device, fmt):
    amax = _amax_values(T5_RANDOM[fmt.name], seed_of("T5", fmt.name))
    per_row = fmt.num_scales if fmt.indexer or fmt is V41 else 7  # V4: the 7 nope tiles
    n_rows = -(-amax.numel() // per_row)
    amax = torch.cat([amax, torch.ones(n_rows * per_row - amax.numel())])
    tiles = _tiles_with_amax(amax, fmt.tile, seed_of("T5-tiles", fmt.name))
    x = tiles.view(n_rows, per_row * fmt.tile)
    if fmt is V4:
        x = torch.cat([x, torch.randn(n_rows, 64, generator=generator(5))], dim=1)
    p = 256
    num_pages = -(-n_rows // p)
    cache = torch.zeros(num_pages, fmt.page_bytes(p), dtype=torch.uint8, device=device)
    op_store(fmt, x.to(device), cache, torch.arange(n_rows, device=device), p)
    data, scale = contiguous_rows(fmt, cache.cpu(), p)
    exp_data, exp_scale = ref_quantize(ref, fmt, x)
    bad = (scale[:n_rows] != exp_scale).any(-1).nonzero().squeeze(-1)
    if bad.numel():
        r = int(bad[0])
        t = int((scale[r] != exp_scale[r]).nonzero()[0])
        a = x[r, t * fmt.tile:(t + 1) * fmt.tile].abs().max().item()
        raise AssertionError(f"{bad.numel()} rows with wrong scale bytes; first: row {r} tile {t} amax "
                             f"{a!r} (0x{bits_from_f32(a):08X}): got {int(scale[r, t])}, "
                             f"expected {int(exp_scale[r, t])}")
    assert_bytes_equal(data[:n_rows], exp_data, what="payload")


# ====================================================================================================
# T6: indexer formats through fused_store_cache(type="indexer")


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("fmt", INDEXER_FORMATS, ids=fmt_id)
def test_T6_indexer_store_matches_reference(ref, device, fmt, p, slot_dtype, in_dtype):
    _store_case(ref, device, fmt, p, NUM_PAGES[p], slot_dtype, in_dtype,
                seed_of("T6", fmt.name, p, slot_dtype, in_dtype))


@pytest.mark.parametrize("in_dtype", [FP32, BF16], ids=dtype_id)
def test_T6_indexer_fp8_clip_cases(device, in_dtype):
    """4.4: amax 0x3C030000 gives s = 0x3795B6DB and fl(amax * inv) = 448.00003, clipped to 0x7E;
    amax 1000 gives 447.99997 -> 0x7E by rounding."""
    m_clip, m_1000 = IDX_FP8_CLIP_M
    x = torch.stack([uniform_tile(m_clip, 128), uniform_tile(m_1000, 128)]).to(in_dtype)
    data, scale = _store_rows_and_read(IDX_FP8, x, device)
    s_1000 = np.float32(1000.0) / np.float32(448.0)  # IEEE binary32 division
    for i, s_bits in enumerate([0x3795B6DB, int(np.array(s_1000).view(np.uint32))]):
        assert_bytes_equal(scale[i], torch.tensor(list(s_bits.to_bytes(4, "little")), dtype=torch.uint8),
                           what=f"row {i} scale")
        exp = torch.empty(128, dtype=torch.uint8)
        exp[0::2], exp[1::2] = 0x7E, 0xFE
        assert_bytes_equal(data[i], exp, what=f"row {i} payload")


def test_T6_indexer_fp4_ties_toward_zero_and_no_negative_zero(device):
    # 4.5: 448 -> 3.5 exactly (ties down to code 5), 449 -> 3.508 (code 6); -0.0 and tiny negatives give 0x0.
    x = torch.zeros(2, 128)
    x[0, :32] = uniform_tile(448.0, 32)
    x[1, :32] = uniform_tile(449.0, 32)
    x[:, 32:34] = torch.tensor([-0.0, -1e-30])
    data, scale = _store_rows_and_read(IDX_FP4, x, device)
    assert data[0, :16].tolist() == [0xD5] * 16 and data[1, :16].tolist() == [0xE6] * 16
    assert data[:, 16].tolist() == [0x00, 0x00]
    assert scale[:, 0].tolist() == [134, 134]


# ====================================================================================================
# T7: page strides, column slices, alignment


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_store_cache_kinds(ref, device, fmt, kind):
    _store_case(ref, device, fmt, 64, 4, torch.int64, BF16, seed_of("T7", fmt.name, kind), kind=kind,
                n_rows=200)


@pytest.mark.parametrize("kind", CACHE_KINDS)
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T7_dequant_cache_kinds(ref, device, fmt, kind):
    p, num_pages = 64, 4
    cache, buf = make_cache(fmt, p, num_pages, kind=kind, device=device, seed=seed_of("T7d", fmt.name, kind))
    slots = make_slots(150, p * num_pages, seed=3, dtype=torch.int32)
    before = buf.clone()
    out = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id)
    exp_cache, _ = clone_view(cache, buf, device="cpu")
    assert_bits_equal(out, ref.dequantize_k_cache_paged(exp_cache, slots, p, layout=fmt.id))
    assert torch.equal(buf, before)  # a reader writes nothing into the cache


def _check_both_ops_raise(fmt, cache, p, device, match_arg="cache"):
    x = torch.zeros(2, fmt.width, device=device)
    slots = torch.tensor([0, 1], device=device)
    with pytest.raises(RuntimeError, match=rf"dsv4\.fused_store_cache.*\b{match_arg}\b"):
        op_store(fmt, x, cache, slots, p)
    if not fmt.indexer:
        with pytest.raises(RuntimeError, match=rf"dsv4\.dequantize_k_cache_paged.*\b{match_arg}\b"):
            dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
        out = torch.empty(2, 1, 512, dtype=BF16, device=device)
        with pytest.raises(RuntimeError, match=rf"dsv4\.dequantize_k_cache_paged.*\b{match_arg}\b"):
            dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id, out=out)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_width_below_page_bytes_raises(device, fmt):
    p = 2
    pb = fmt.page_bytes(p)
    buf = torch.zeros(3, pb, dtype=torch.uint8, device=device)
    _check_both_ops_raise(fmt, buf[:, : pb - 1], p, device)
    _check_both_ops_raise(fmt, torch.zeros(3, pb - fmt.align, dtype=torch.uint8, device=device), p, device)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_unaligned_page_stride_raises(device, fmt):
    p = 2
    pb = fmt.page_bytes(p)
    _check_both_ops_raise(fmt, torch.zeros(2, pb + 1, dtype=torch.uint8, device=device), p, device)
    _check_both_ops_raise(fmt, torch.zeros(3, pb + 2, dtype=torch.uint8, device=device), p, device)
    if not fmt.indexer:  # A = 16: a stride of page_bytes + 8 is not enough
        _check_both_ops_raise(fmt, torch.zeros(2, pb + 8, dtype=torch.uint8, device=device), p, device)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_stride_smaller_than_width_raises(device, fmt):
    p = 2
    pb = fmt.page_bytes(p)
    buf = torch.zeros(4 * pb, dtype=torch.uint8, device=device)
    cache = buf.as_strided((3, pb), (pb - 2 * fmt.align, 1))
    _check_both_ops_raise(fmt, cache, p, device)


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_base_alignment(ref, device, fmt, offset):
    """The base pointer must be a multiple of A (16 for main layouts, 4 for indexer formats)."""
    p = 2
    pb = fmt.page_bytes(p)
    buf = torch.zeros(3 * pb + 64, dtype=torch.uint8, device=device)
    assert buf.data_ptr() % 64 == 0
    cache = buf[offset: offset + 3 * pb].view(3, pb)
    if offset % fmt.align:
        _check_both_ops_raise(fmt, cache, p, device)
        assert bool((buf == 0).all())
        return
    # aligned enough for an indexer cache (A = 4): accepted and correct
    x = make_rows(6, fmt.width, tile=fmt.tile, seed=offset)
    slots = torch.tensor([0, 5, 2, -1, 3, 6])
    op_store(fmt, x.to(device), cache, slots.to(device), p)
    exp = torch.zeros(3 * pb, dtype=torch.uint8)
    ref_store(ref, fmt, x, exp.view(3, pb), slots, p)
    assert_bytes_equal(cache.reshape(-1), exp, fmt, p, pb)
    assert bool((buf[:offset] == 0).all()) and bool((buf[offset + 3 * pb:] == 0).all())


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_one_page_cache_with_unaligned_stride_is_accepted(ref, device, fmt):
    p = 4
    pb = fmt.page_bytes(p)
    extra = 8 if not fmt.indexer else 2
    cache = torch.randint(0, 256, (1, pb + extra), generator=generator(9), dtype=torch.uint8).to(device)
    assert cache.stride(0) % fmt.align != 0
    exp = cache.cpu().clone()
    x = make_rows(6, fmt.width, tile=fmt.tile, seed=11)
    slots = torch.tensor([3, 4, 0, -1, 2, 1])
    op_store(fmt, x.to(device), cache, slots.to(device), p)
    ref_store(ref, fmt, x, exp, slots, p)
    assert_bytes_equal(cache, exp, fmt, p, pb + extra)
    if not fmt.indexer:
        out = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id)
        assert_bits_equal(out, ref.dequantize_k_cache_paged(exp, slots, p, layout=fmt.id))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T7_zero_page_cache_is_accepted(device, fmt):
    p = 64
    cache = torch.empty(0, fmt.page_bytes(p), dtype=torch.uint8, device=device)
    x = make_rows(4, fmt.width, tile=fmt.tile, seed=1).to(device)
    slots = torch.tensor([0, 1, 63, -1], device=device)
    op_store(fmt, x, cache, slots, p)  # every slot is invalid: nothing happens
    if not fmt.indexer:
        out = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
        assert out.shape == (4, 1, 512) and out.dtype == BF16
        assert bool((out.view(torch.int16) == 0).all())


# ====================================================================================================
# T8: dequantization of arbitrary bytes


def _poison_special_scales(fmt, cache, p, capacity, seed):
    """Makes sure scale bytes 0, 255, 254, 127, payload NaN codes and negative fp4 scales all occur."""
    g = generator(seed)
    slots = torch.randperm(capacity, generator=g)[:8].tolist()
    specials = [0, 255, 254, 127, 0x7F, 0xFF, 0xB8, 0x80]
    for slot, b in zip(slots, specials):
        write_row_bytes(fmt, cache, p, slot, scale=[b] * fmt.scale_bytes)
    write_row_bytes(fmt, cache, p, slots[0], data=[0x7F, 0xFF, 0x7E, 0x08, 0x04, 0x0C, 0x86, 0x01] * 8)
    return slots


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=dtype_id)
@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T8_dequant_random_bytes(ref, device, fmt, p, slot_dtype):
    num_pages = NUM_PAGES[p]
    capacity = num_pages * p
    seed = seed_of("T8", fmt.name, p, slot_dtype)
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed)
    forced = _poison_special_scales(fmt, cache, p, capacity, seed + 1)
    slots = make_slots(N_ROWS - 6, capacity, seed=seed + 2, dtype=slot_dtype)
    slots = torch.cat([torch.tensor(forced, dtype=slot_dtype), slots])
    exp_cache, _ = clone_view(cache, buf, device="cpu")
    expected = ref.dequantize_k_cache_paged(exp_cache, slots, p, layout=fmt.id)
    # functional overload
    out = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id)
    assert out.shape == (slots.numel(), 1, 512) and out.dtype == BF16 and out.is_contiguous()
    assert out.device == cache.device
    assert_bits_equal(out, expected)
    invalid = (slots < 0) | (slots >= capacity)
    assert bool((out.cpu().view(torch.int16)[invalid] == 0).all()), "invalid slots must give +0.0 rows"
    # out= a row slice of a poisoned workspace: workspace[:5] untouched
    n = slots.numel()
    workspace = torch.randint(-(2**15), 2**15, (n + 5, 1, 512), generator=generator(seed + 3),
                              dtype=torch.int16).view(BF16).to(device)
    before = workspace.clone()
    out2 = workspace[5:]
    ret = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id, out=out2)
    assert ret is out2
    assert_bits_equal(workspace[:5], before[:5], "workspace[:5]")
    assert_bits_equal(out2, expected)


@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T8_dequant_out_with_odd_row_stride(ref, device, fmt):
    """out rows 515 elements apart (not a multiple of 8): the 3 columns between rows stay untouched."""
    p, num_pages = 2, 40
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed_of("T8-stride", fmt.name))
    slots = make_slots(30, p * num_pages, seed=2, dtype=torch.int64)
    ws = torch.randint(-(2**15), 2**15, (slots.numel(), 1, 515), generator=generator(4),
                       dtype=torch.int16).view(BF16).to(device)
    before = ws.clone()
    out = ws[:, :, :512]
    assert out.stride() == (515, 515, 1)
    dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id, out=out)
    exp_cache, _ = clone_view(cache, buf, device="cpu")
    assert_bits_equal(out, ref.dequantize_k_cache_paged(exp_cache, slots, p, layout=fmt.id))
    assert_bits_equal(ws[:, :, 512:], before[:, :, 512:], "gap columns")


@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T8_dequant_zero_rows(device, fmt):
    p = 64
    cache, _ = make_cache(fmt, p, 2, device=device, seed=1)
    for dtype in (torch.int32, torch.int64):
        slots = torch.empty(0, dtype=dtype, device=device)
        out = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
        assert out.shape == (0, 1, 512) and out.dtype == BF16 and out.device == cache.device
        o = torch.empty(0, 1, 512, dtype=BF16, device=device)
        assert dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id, out=o) is o


# section 5 table: (layout, scale byte of tile 0, payload bytes of elements 0.., expected output bits)
DEQUANT_TABLE_E4M3 = [
    (127, [0x40], [0x4000]),
    (0, [0x7E, 0x08, 0x04, 0x0C, 0x86, 0x01], [0x0460, 0x0001, 0x0000, 0x0002, 0x8001, 0x0000]),
    (254, [0x7E, 0x01], [0x7F80, 0x7A80]),
    (255, [0x00, 0x40, 0x81, 0x7E], [0x7FC0] * 4),
    (127, [0x7F, 0xFF, 0x80], [0x7FC0, 0x7FC0, 0x8000]),
    (0, [0x7F, 0xFF], [0x7FC0, 0x7FC0]),
]


@pytest.mark.parametrize("fmt", [V4, V41], ids=fmt_id)
def test_T8_dequant_table_e4m3(device, fmt):
    p = 4
    cache = torch.zeros(2, fmt.page_bytes(p), dtype=torch.uint8)
    for slot, (sb, payload, _) in enumerate(DEQUANT_TABLE_E4M3):
        write_row_bytes(fmt, cache, p, slot, data=payload, scale=[sb] + [127] * (fmt.num_scales - 1))
    slots = torch.arange(len(DEQUANT_TABLE_E4M3), device=device)
    out = dsv4.dequantize_k_cache_paged(cache.to(device), slots, p, layout=fmt.id).cpu().view(torch.int16)
    for slot, (sb, payload, expected) in enumerate(DEQUANT_TABLE_E4M3):
        got = [int(v) & 0xFFFF for v in out[slot, 0, : len(expected)]]
        assert got == expected, (fmt.name, sb, payload, [hex(v) for v in got])
        tile = out[slot, 0, len(expected): fmt.tile]
        if sb == 255:
            assert bool((tile == 0x7FC0).all()), "a NaN scale makes its whole tile NaN (0x7FC0)"
        else:
            assert bool((tile == 0).all())  # payload 0x00 -> +0.0
        assert bool((out[slot, 0, fmt.tile: 448] == 0).all())


def test_T8_dequant_table_fp4(device):
    fmt, p = V41_FP4, 2
    cache = torch.zeros(1, fmt.page_bytes(p), dtype=torch.uint8)
    write_row_bytes(fmt, cache, p, 0, data=[0xE4, 0x80] + [0] * 6 + [0x12] * 8,
                    scale=[0x3B, 0x7F, 0xFF, 0xBB] + [0x38] * 28)
    out = dsv4.dequantize_k_cache_paged(cache.to(device), torch.tensor([0, 1], device=device), p,
                                        layout=2).cpu().view(torch.int16)
    got = [int(v) & 0xFFFF for v in out[0, 0, :4]]
    assert got == [0x4030, 0xC0B0, 0x0000, 0x8000], [hex(v) for v in got]
    assert bool((out[0, 0, 4:16] == 0).all())
    assert bool((out[0, 0, 16:48] == 0x7FC0).all()), "e4m3 NaN scales (0x7F, 0xFF) give NaN tiles"
    # 0xBB = -1.375: a negative scale flips every sign; payload 0x00 gives -0.0
    assert bool((out[0, 0, 48:64].view(torch.int16) == -0x8000).all())
    assert bool((out[1, 0] == 0).all())


def test_T8_dequant_v4_rope_copied_verbatim(device):
    fmt, p = V4, 2
    cache = torch.zeros(1, fmt.page_bytes(p), dtype=torch.uint8)
    rope_bits = [0x7F81, 0xFFFF, 0x0001, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x3F80] * 8
    rope = torch.tensor(rope_bits, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    write_row_bytes(fmt, cache, p, 1, data=[0] * 448 + rope.tolist(), scale=[255] * 7 + [0])
    out = dsv4.dequantize_k_cache_paged(cache.to(device), torch.tensor([1], device=device), p, layout=0)
    bits = [int(v) & 0xFFFF for v in out.cpu().view(torch.int16)[0, 0]]
    assert bits[448:] == rope_bits, "V4 RoPE dims are copied verbatim (NaN payloads included)"
    assert set(bits[:448]) == {0x7FC0}


# ====================================================================================================
# T9: kernel store -> kernel dequant round trip


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
@pytest.mark.parametrize("p", PAGE_SIZES)
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T9_round_trip(ref, device, fmt, p, in_dtype):
    num_pages = NUM_PAGES[p]
    capacity = num_pages * p
    seed = seed_of("T9", fmt.name, p, in_dtype)
    x = make_rows(N_ROWS, 512, tile=fmt.tile, seed=seed, dtype=in_dtype)
    slots = make_slots(N_ROWS - 5, capacity, seed=seed + 1)
    cache, _ = make_cache(fmt, p, num_pages, device=device, seed=seed + 2)
    op_store(fmt, x.to(device), cache, slots.to(device), p)
    out = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=fmt.id)
    valid = (slots >= 0) & (slots < capacity)
    expected = torch.zeros(N_ROWS, 1, 512, dtype=BF16)
    expected[valid, 0] = ref.dequantize_rows(*ref.quantize_rows(x[valid], fmt.id), fmt.id)
    assert_bits_equal(out, expected)
    if fmt is V41_FP4 and in_dtype == BF16:
        fq = dsv4.fake_quant_compressed_kv(x.to(device))
        assert_bits_equal(out[valid.to(device), 0], fq[valid.to(device)], "dequant vs fake_quant_compressed_kv")


# ====================================================================================================
# T10: fake quantization ops


def _fake_quant_input(shape, dtype, seed, device, layout="contiguous"):
    w = shape[-1]
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    x = make_rows(rows, w, tile=16, seed=seed, exp_range=(-20, 12) if dtype == FP16 else (-20, 20))
    if dtype == FP16:
        x = x.clamp(-60000.0, 60000.0)
    x = x.reshape(shape).to(dtype)
    if layout == "contiguous":
        return x.to(device)
    if layout == "column_slice":  # leading strides of a wider tensor
        wide = torch.full((*shape[:-1], 2 * w), float("nan"), dtype=dtype)
        wide[..., :w] = x
        return wide.to(device)[..., :w]
    if layout == "transposed":  # leading dims swapped: no dim merging possible
        assert len(shape) >= 3
        t = x.transpose(0, 1).contiguous().to(device)
        return t.transpose(0, 1)
    if layout == "reversed":  # leading dims laid out in reverse order: none merges with another
        lead = list(range(len(shape) - 1))[::-1]
        t = x.permute(*lead, -1).contiguous().to(device)
        return t.permute(*lead, -1)
    if layout == "odd_stride":
        wide = torch.zeros((*shape[:-1], w + 3), dtype=dtype)
        wide[..., :w] = x
        return wide.to(device)[..., :w]
    raise ValueError(layout)


FQ_CASES = [([7, 3, 512], "contiguous"), ([1, 128], "contiguous"), ([512], "contiguous"),
            ([7, 3, 512], "column_slice"), ([7, 3, 512], "transposed"), ([33, 256], "odd_stride"),
            ([2, 3, 2, 128], "column_slice"),
            # Ranks above 9: unit dims dropped leave 6 leading dims; 10 and 11 leading dims that do not merge;
            # 11 that merge into one.
            ([2, 1, 3, 2, 1, 2, 2, 1, 2, 128], "reversed"), ([2] * 10 + [128], "reversed"),
            ([2] * 11 + [128], "reversed"), ([2] * 11 + [128], "column_slice")]


def _check_fake_quant(x, op, expected_fn):
    before = x.clone()
    y = op(x)
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == x.device
    assert y.is_contiguous()
    assert y.data_ptr() != x.data_ptr()
    assert_bits_equal(x, before, "input (must stay unchanged)")
    assert_bits_equal(y, expected_fn(x.cpu()))
    return y


@pytest.mark.parametrize("case", range(len(FQ_CASES)))
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=dtype_id)
def test_T10_fake_quant_compressed_kv_matches_reference(ref, device, dtype, case):
    shape, layout = FQ_CASES[case]
    x = _fake_quant_input(shape, dtype, seed_of("T10kv", dtype, case), device, layout)
    _check_fake_quant(x, dsv4.fake_quant_compressed_kv, ref.fake_quant_compressed_kv)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("case", range(len(FQ_CASES)))
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=dtype_id)
def test_T10_fake_quant_fp4_matches_reference(ref, device, dtype, case, block_size):
    shape, layout = FQ_CASES[case]
    x = _fake_quant_input(shape, dtype, seed_of("T10fp4", dtype, case), device, layout)
    _check_fake_quant(x, lambda t: dsv4.fake_quant_fp4(t, block_size=block_size),
                      lambda t: ref.fake_quant_fp4(t, block_size=block_size))


@pytest.mark.parametrize("shape", [[2, 1, 3, 2, 1, 2, 2, 1, 2, 64], [2] * 10 + [64], [3, 1] + [2] * 9 + [64]],
                         ids=lambda s: f"rank{len(s)}")
@pytest.mark.parametrize("layout", ["contiguous", "reversed", "column_slice"])
def test_T10_fake_quant_high_rank_equals_rows(device, shape, layout):
    """Any rank: a rank 10-12 x quantizes bit for bit as its rows do in a contiguous [rows, width] tensor."""
    x = _fake_quant_input(shape, FP32, seed_of("T10rank", len(shape), layout), device, layout)
    rows = x.reshape(-1, shape[-1]).contiguous()
    for op in (dsv4.fake_quant_compressed_kv, lambda t: dsv4.fake_quant_fp4(t, block_size=64)):
        y = op(x)
        assert y.shape == x.shape and y.is_contiguous()
        assert_bits_equal(y.reshape(rows.shape), op(rows))


def test_T10_fake_quant_fp4_default_block_size_is_32(ref, device):
    x = _fake_quant_input([4, 256], FP32, 3, device)
    assert_bits_equal(dsv4.fake_quant_fp4(x), dsv4.fake_quant_fp4(x, block_size=32))
    assert_bits_equal(torch.ops.dsv4.fake_quant_fp4(x), ref.fake_quant_fp4(x.cpu(), block_size=32))


def _values(t):
    return [float(v) for v in t.float().cpu()]


def _signbits(t):
    return [math.copysign(1.0, v) < 0 for v in _values(t)]


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=dtype_id)
def test_T10_fake_quant_fp4_tie_tile(device, dtype):
    x = padded_tile(FP4_TIE_TILE, 32).to(dtype).to(device)
    y = dsv4.fake_quant_fp4(x, block_size=32)
    expected = [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, -6, 0, -0.0, 0, 6, 4] + [0.0] * 16
    assert _values(y) == expected
    assert _signbits(y) == [math.copysign(1.0, v) < 0 for v in expected]


@pytest.mark.parametrize("dtype", [BF16, FP32], ids=dtype_id)
def test_T10_fake_quant_fp4_subnormal_block(device, dtype):
    x = padded_tile(FP4_SUBNORMAL_BLOCK, 16).to(dtype).to(device)
    y = dsv4.fake_quant_fp4(x, block_size=16)
    expected = [3 * 2.0**-127, -0.0, 0.0, -0.0] + [0.0] * 12
    assert _values(y) == expected
    assert _signbits(y) == [math.copysign(1.0, v) < 0 for v in expected]


def test_T10_fake_quant_fp4_overflow_is_inf(device):
    x16 = torch.tensor([57344.0, -57344.0, 57312.0] + [0.0] * 13, dtype=FP16, device=device)
    assert _values(dsv4.fake_quant_fp4(x16, block_size=16))[:3] == [math.inf, -math.inf, 49152.0]
    big = 3.5 * 2.0**126
    for dtype in (FP32, BF16):
        x = torch.tensor([big, -big] + [0.0] * 14, dtype=dtype, device=device)
        assert _values(dsv4.fake_quant_fp4(x, block_size=16))[:2] == [math.inf, -math.inf]
        x = torch.tensor([3 * 2.0**126] + [0.0] * 15, dtype=dtype, device=device)
        assert _values(dsv4.fake_quant_fp4(x, block_size=16))[0] == 3 * 2.0**126


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=dtype_id)
def test_T10_fake_quant_compressed_kv_tie_block(device, dtype):
    x = torch.tensor(FP4_TIE_BLOCK, dtype=dtype, device=device)
    y = dsv4.fake_quant_compressed_kv(x)
    expected = [8.25, 4.125, 2.75, -5.5, 0.0, -0.0, 2.75, -4.125] * 2
    assert _values(y) == expected
    assert _signbits(y) == [math.copysign(1.0, v) < 0 for v in expected]


def test_T10_fake_quant_compressed_kv_ieee_division(device):
    x = padded_tile(FP4_DIV_TILE, 16).to(device)
    y = dsv4.fake_quant_compressed_kv(x)
    assert _values(y) == [6.75, -3.375, 1.125] + [0.0] * 13
    assert not any(_signbits(y)[3:])


def _threshold_sweep_blocks(scales, ulps=16):
    """Blocks of 16: element 0 = 6*S (so the tile scale is S), then values within `ulps` ulps of each
    e2m1 decision threshold times S, both signs (kv-layouts-and-quant.md section 10)."""
    thresholds = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blocks = []
    for s in scales:
        centres = torch.tensor([bits_from_f32(t * s) for t in thresholds], dtype=torch.int64)
        vals = tensor_from_bits((centres[:, None] + torch.arange(-ulps, ulps + 1)).reshape(-1))
        vals = torch.cat([vals, -vals])
        pad = (-vals.numel()) % 15
        vals = torch.cat([vals, torch.zeros(pad)]).view(-1, 15)
        head = torch.full((vals.shape[0], 1), 6.0 * s)
        blocks.append(torch.cat([head, vals], dim=1))
    return torch.cat(blocks)


def test_T10_e4m3_scale_threshold_sweep(ref, device):
    """Every positive e4m3 scale x every e2m1 threshold x +-16 ulps: fake_quant_compressed_kv and the
    V41_FP4 store give the codes of the IEEE quotient x / S (the threshold evaluation is only allowed
    if it provably matches it)."""
    scales = [float(v) for v in ref.e4m3_decode(torch.arange(1, 0x7F, dtype=torch.uint8))]
    assert len(scales) == 126 and scales[0] == 2.0**-9 and scales[-1] == 448.0
    blocks = _threshold_sweep_blocks(scales)
    x = blocks.reshape(-1, 16)
    assert_bits_equal(dsv4.fake_quant_compressed_kv(x.to(device)), ref.fake_quant_compressed_kv(x))
    rows = torch.cat([x, torch.zeros((-x.shape[0]) % 32, 16)]).view(-1, 512)
    data, scale = _store_rows_and_read(V41_FP4, rows, device, p=64)
    exp_data, exp_scale = ref_quantize(ref, V41_FP4, rows)
    assert_bytes_equal(scale, exp_scale, what="scales")
    assert_bytes_equal(data, exp_data, what="codes")


def test_T10_pow2_scale_threshold_sweep(ref, device):
    scales = [2.0 ** (b - 127) for b in range(1, 253)]
    x = _threshold_sweep_blocks(scales, ulps=8).reshape(-1, 16)
    y = dsv4.fake_quant_fp4(x.to(device), block_size=16)
    assert_bits_equal(y, ref.fake_quant_fp4(x, block_size=16))


def test_T10_fake_quant_empty_and_zero_width(device):
    for shape in ([0, 512], [3, 0], [2, 0, 64]):
        x = torch.zeros(shape, device=device)
        for y in (dsv4.fake_quant_compressed_kv(x), dsv4.fake_quant_fp4(x, block_size=32)):
            assert y.shape == x.shape and y.dtype == x.dtype


# ====================================================================================================
# cache-writers.md 7.3: fused_store_cache with per-row freqs_cis (V41 / V41_FP4)


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
@pytest.mark.parametrize("fmt", [V41, V41_FP4], ids=fmt_id)
def test_store_with_freqs_cis_matches_reference(ref, device, fmt, in_dtype):
    p, num_pages = 64, 9
    seed = seed_of("freqs", fmt.name, in_dtype)
    n_valid = 200
    x = make_rows(n_valid + 5, 512, tile=fmt.tile, seed=seed, dtype=in_dtype)
    slots = make_slots(n_valid, p * num_pages, seed=seed + 1)
    freqs = rope_rows(x.shape[0], seed=seed + 2)
    freqs[0, :2] = torch.tensor([0.5, 0.75])
    freqs[1] = torch.tensor([1.0, 0.0] * 32)
    cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed + 3)
    exp1, exp1_buf = clone_view(cache, buf, device="cpu")
    exp2, exp2_buf = clone_view(cache, buf, device="cpu")
    op_store(fmt, x.to(device), cache, slots.to(device), p, freqs_cis=freqs.to(device))
    # the reference applied to the T-rounded rope_tail row
    x_rot = ref.rope_tail(x.float(), freqs).to(in_dtype).float()
    assert torch.equal(x_rot[:, :448], x[:, :448].float())
    ref.store_k_cache(exp1, x_rot, slots, p, fmt.id)
    assert_bytes_equal(buf, exp1_buf, fmt, p, cache.stride(0), what="vs store_k_cache(T(rope_tail(x)))")
    ref.fused_store_cache(x, exp2, slots, page_size=p, layout=fmt.id, freqs_cis=freqs)
    assert_bytes_equal(buf, exp2_buf, fmt, p, cache.stride(0), what="vs reference.fused_store_cache")
    # complex64 [N, 32] freqs through the Python wrapper give the same bytes
    cache3, buf3 = make_cache(fmt, p, num_pages, device=device, seed=seed + 3)
    fc = torch.complex(freqs[:, 0::2], freqs[:, 1::2])
    op_store(fmt, x.to(device), cache3, slots.to(device), p, freqs_cis=fc.to(device))
    assert_bytes_equal(buf3, exp1_buf, fmt, p, cache.stride(0), what="complex freqs_cis")
    if fmt is V41_FP4 and in_dtype == BF16:
        valid = (slots >= 0) & (slots < p * num_pages)
        out = dsv4.dequantize_k_cache_paged(cache, slots[valid].to(device), p, layout=fmt.id)
        fq = dsv4.fake_quant_compressed_kv(x_rot[valid].to(BF16).to(device))
        assert_bits_equal(out[:, 0], fq, "dequant vs fake_quant_compressed_kv(T(rope_tail(x)))")


@pytest.mark.parametrize("in_dtype", [BF16, FP32], ids=dtype_id)
def test_store_rope_direction_pin(device, in_dtype):
    """cache-writers.md 7.4: V41, x448 = 1, x449 = 2, pair 0 rotated by (c, s) = (0.5, 0.75)."""
    x = torch.zeros(1, 512)
    x[0, 448], x[0, 449] = 1.0, 2.0
    freqs = torch.tensor([[1.0, 0.0] * 32])
    freqs[0, :2] = torch.tensor([0.5, 0.75])
    cache = torch.zeros(1, V41.page_bytes(1), dtype=torch.uint8, device=device)
    op_store(V41, x.to(in_dtype).to(device), cache, torch.tensor([0], device=device), 1,
             freqs_cis=freqs.to(device))
    data, scale = contiguous_rows(V41, cache.cpu(), 1)
    exp = torch.zeros(512, dtype=torch.uint8)
    exp[448], exp[449] = 0xF8, 0x7E
    assert_bytes_equal(data[0], exp, what="data")
    assert scale[0].tolist() == [0x72] * 14 + [0x77, 0x72]


def test_store_with_freqs_skips_invalid_rows(ref, device):
    fmt, p = V41_FP4, 2
    cache, buf = make_cache(fmt, p, 3, device=device, seed=5)
    before = buf.clone()
    x = make_rows(4, 512, tile=16, seed=6).to(device)
    slots = torch.tensor([-1, 6, 2**40, -(2**40)], device=device)
    op_store(fmt, x, cache, slots, p, freqs_cis=rope_rows(4, seed=1).to(device))
    assert torch.equal(buf, before)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_store_zero_rows_is_a_no_op(device, fmt):
    cache, buf = make_cache(fmt, 2, 3, device=device, seed=8)
    before = buf.clone()
    for dtype in (torch.int32, torch.int64):
        op_store(fmt, torch.empty(0, fmt.width, device=device), cache, torch.empty(0, dtype=dtype, device=device),
                 2)
    if not fmt.indexer and fmt is not V4:
        op_store(fmt, torch.empty(0, 512, device=device, dtype=BF16), cache,
                 torch.empty(0, dtype=torch.int64, device=device), 2,
                 freqs_cis=torch.empty(0, 64, device=device))
        op_store(fmt, torch.empty(0, 512, device=device, dtype=BF16), cache,
                 torch.empty(0, dtype=torch.int64, device=device), 2,
                 freqs_cis=torch.empty(0, 32, device=device, dtype=torch.complex64))
    assert torch.equal(buf, before)


def test_reference_store_accepts_zero_rows_with_complex_freqs(ref, device):
    """The oracle takes what the op takes: zero rows with an empty complex64 freqs_cis [0, 32] are a no-op."""
    cache, buf = make_cache(V41, 2, 3, device=device, seed=8)
    before = buf.clone()
    rows, slots = torch.empty(0, 512, device=device), torch.empty(0, dtype=torch.int64, device=device)
    freqs_cis = torch.empty(0, 32, device=device, dtype=torch.complex64)
    ref.fused_store_cache(rows, cache, slots, page_size=2, layout=V41.id, freqs_cis=freqs_cis)
    assert torch.equal(buf, before)


def test_store_freqs_rejections(device):
    x = torch.zeros(2, 512, device=device)
    slots = torch.tensor([0, 1], device=device)
    freqs = torch.zeros(2, 64, device=device)
    cache, _ = make_cache(V4, 2, 2, device=device, fill=0)
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache.*\bfreqs_cis\b"):
        dsv4.fused_store_cache(x, cache, slots, page_size=2, layout="v4", freqs_cis=freqs)
    icache, _ = make_cache(IDX_FP8, 2, 2, device=device, fill=0)
    xi = torch.zeros(2, 128, device=device)
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache.*\bfreqs_cis\b"):
        dsv4.fused_store_cache(xi, icache, slots, page_size=2, type="indexer", freqs_cis=freqs)
    for layout in (1, 2):
        with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache.*\blayout\b"):
            dsv4.fused_store_cache(xi, icache, slots, page_size=2, type="indexer", layout=layout)
    for layout in (0, 1, 2):
        with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache.*\buse_fp4\b"):
            dsv4.fused_store_cache(x, make_cache(MAIN_FORMATS[layout], 2, 2, device=device, fill=0)[0], slots,
                                   page_size=2, layout=layout, use_fp4=True)


def test_store_complex_freqs_forms(device):
    """complex64 [N, 32] rotations equal their fp32 [N, 64] form; other complex tensors are rejected by the
    wrapper, naming the op and the argument."""
    fc = torch.polar(torch.ones(3, 32), torch.rand(3, 32, generator=torch.Generator().manual_seed(5)) * 6.3)
    x = make_rows(3, 512, tile=16, seed=7).to(device)
    slots = torch.tensor([0, 3, 1], device=device)
    got, _ = make_cache(V41, 2, 2, device=device, fill=0)
    want, _ = make_cache(V41, 2, 2, device=device, fill=0)
    dsv4.fused_store_cache(x, got, slots, page_size=2, layout="v41", freqs_cis=fc.to(device))
    table_rows = torch.view_as_real(fc).reshape(3, 64).to(device)
    dsv4.fused_store_cache(x, want, slots, page_size=2, layout="v41", freqs_cis=table_rows)
    assert torch.equal(got, want) and got.any()
    for bad in (fc.to(torch.complex128), fc[0, 0], fc.unsqueeze(0)):
        with pytest.raises(ValueError, match=r"^fused_store_cache: freqs_cis must be complex64 \[N, 32\]"):
            dsv4.fused_store_cache(x, got, slots, page_size=2, layout="v41", freqs_cis=bad.to(device))


def test_wrapper_layout_errors_name_the_op(device):
    """A layout that is no KVLayout is rejected by the wrappers themselves, naming the op and the argument."""
    x = torch.zeros(2, 512, device=device)
    slots = torch.tensor([0, 1], device=device)
    cache, _ = make_cache(V4, 2, 2, device=device, fill=0)
    for layout in ("v5", 3):
        with pytest.raises(ValueError, match=r"^fused_store_cache: layout: unknown KVLayout"):
            dsv4.fused_store_cache(x, cache, slots, page_size=2, layout=layout)
        with pytest.raises(ValueError, match=r"^dequantize_k_cache_paged: layout: unknown KVLayout"):
            dsv4.dequantize_k_cache_paged(cache, slots, 2, layout=layout)
    assert not cache.any()


def test_wrapper_accepts_layout_names(ref, device):
    p = 2
    x = make_rows(3, 512, tile=16, seed=2)
    slots = torch.tensor([0, 3, 1])
    for fmt in MAIN_FORMATS:
        results = []
        for layout in (fmt.id, fmt.name, fmt.name.upper(), dsv4.KVLayout(fmt.id)):
            cache = torch.zeros(2, fmt.page_bytes(p), dtype=torch.uint8, device=device)
            dsv4.fused_store_cache(x.to(device), cache, slots.to(device), page_size=p, layout=layout)
            results.append(cache.cpu())
            out = dsv4.dequantize_k_cache_paged(cache, slots.to(device), p, layout=layout)
            assert_bits_equal(out, ref.dequantize_k_cache_paged(results[-1], slots, p, layout=fmt.id))
        for r in results[1:]:
            assert torch.equal(r, results[0])
        exp = torch.zeros(2, fmt.page_bytes(p), dtype=torch.uint8)
        ref.store_k_cache(exp, x, slots, p, fmt.id)
        assert torch.equal(results[0], exp)


# ====================================================================================================
# T12: validation


def _store_args(device, fmt=V4, n=3, p=2):
    cache = torch.zeros(3, fmt.page_bytes(p), dtype=torch.uint8, device=device)
    x = torch.zeros(n, fmt.width, dtype=BF16, device=device)
    slots = torch.arange(n, dtype=torch.int64, device=device)
    kw = dict(page_size=p)
    if fmt.indexer:
        kw.update(type="indexer", use_fp4=fmt.id == 1)
    else:
        kw.update(layout=fmt.id)
    return [x, cache, slots], kw


def _bad_cache_variants(fmt, p, device):
    pb = fmt.page_bytes(p)
    flat = torch.zeros(4 * pb + 64, dtype=torch.uint8, device=device)
    yield "int8", torch.zeros(3, pb, dtype=torch.int8, device=device)
    yield "1d", torch.zeros(3 * pb, dtype=torch.uint8, device=device)
    yield "3d", torch.zeros(1, 3, pb, dtype=torch.uint8, device=device)
    yield "stride1", flat.as_strided((3, pb), (1, 3))
    yield "narrow", torch.zeros(3, pb - 1, dtype=torch.uint8, device=device)
    yield "stride_odd", torch.zeros(3, pb + 1, dtype=torch.uint8, device=device)
    yield "stride_lt_width", flat.as_strided((3, pb), (pb - 32, 1))
    yield "misaligned", flat[1: 1 + 3 * pb].view(3, pb)


STORE_BAD_ARGS = [
    # name, mutation of ([x, cache, slots], kwargs), argument named in the error
    ("input_fp16", lambda a, k: a.__setitem__(0, a[0].half()), "input"),
    ("input_fp64", lambda a, k: a.__setitem__(0, a[0].double()), "input"),
    ("input_int32", lambda a, k: a.__setitem__(0, a[0].int()), "input"),
    ("input_1d", lambda a, k: a.__setitem__(0, a[0][0]), "input"),
    ("input_3d", lambda a, k: a.__setitem__(0, a[0][None]), "input"),
    ("input_width", lambda a, k: a.__setitem__(0, a[0][:, :-16]), "input"),
    ("input_stride1", lambda a, k: a.__setitem__(0, a[0].t().contiguous().t()), "input"),
    ("indices_float", lambda a, k: a.__setitem__(2, a[2].float()), "indices"),
    ("indices_int16", lambda a, k: a.__setitem__(2, a[2].short()), "indices"),
    ("indices_2d", lambda a, k: a.__setitem__(2, a[2][None]), "indices"),
    ("indices_strided", lambda a, k: a.__setitem__(2, torch.arange(2 * a[2].numel(), device=a[2].device)[::2]),
     "indices"),
    ("indices_short", lambda a, k: a.__setitem__(2, a[2][:-1]), "indices"),
    ("indices_long", lambda a, k: a.__setitem__(2, torch.cat([a[2], a[2][:1]])), "indices"),
    ("page_size_0", lambda a, k: k.update(page_size=0), "page_size"),
    ("page_size_3", lambda a, k: k.update(page_size=3), "page_size"),
    ("page_size_2048", lambda a, k: k.update(page_size=2048), "page_size"),
    ("page_size_neg", lambda a, k: k.update(page_size=-2), "page_size"),
    ("layout_3", lambda a, k: k.update(layout=3), "layout"),
    ("layout_neg", lambda a, k: k.update(layout=-1), "layout"),
    ("type_unknown", lambda a, k: k.update(type="mla"), "type"),
    ("use_fp4_flashmla", lambda a, k: k.update(use_fp4=True), "use_fp4"),
]


@pytest.mark.parametrize("case", STORE_BAD_ARGS, ids=lambda c: c[0])
def test_T12_store_bad_argument(device, case):
    name, mutate, arg = case
    args, kw = _store_args(device)
    mutate(args, kw)
    with pytest.raises(RuntimeError, match=rf"dsv4\.fused_store_cache\b.*\b{arg}\b"):
        torch.ops.dsv4.fused_store_cache(*args, **kw)


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_T12_store_bad_cache(device, fmt):
    for n in (3, 0):  # validation runs before the N == 0 early return
        for name, cache in _bad_cache_variants(fmt, 2, device):
            args, kw = _store_args(device, fmt, n=n)
            args[1] = cache
            with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache\b.*\bcache\b"):
                torch.ops.dsv4.fused_store_cache(*args, **kw)


def test_T12_store_bad_arguments_before_zero_row_return(device):
    for mutate, arg in [(lambda a, k: a.__setitem__(0, a[0].half()), "input"),
                        (lambda a, k: a.__setitem__(2, a[2].float()), "indices"),
                        (lambda a, k: k.update(page_size=5), "page_size"),
                        (lambda a, k: k.update(layout=7), "layout")]:
        args, kw = _store_args(device, n=0)
        mutate(args, kw)
        with pytest.raises(RuntimeError, match=rf"dsv4\.fused_store_cache\b.*\b{arg}\b"):
            torch.ops.dsv4.fused_store_cache(*args, **kw)


FREQS_BAD = [
    ("bf16", lambda n, d: torch.zeros(n, 64, dtype=BF16, device=d)),
    ("fp64", lambda n, d: torch.zeros(n, 64, dtype=torch.float64, device=d)),
    ("width32", lambda n, d: torch.zeros(n, 32, device=d)),
    ("rows", lambda n, d: torch.zeros(n + 1, 64, device=d)),
    ("1d", lambda n, d: torch.zeros(n * 64, device=d)),
    ("3d", lambda n, d: torch.zeros(n, 64, 1, device=d)),
    ("transposed", lambda n, d: torch.zeros(64, n, device=d).t()),
    ("row_strided", lambda n, d: torch.zeros(n, 128, device=d)[:, :64]),
]


@pytest.mark.parametrize("case", FREQS_BAD, ids=lambda c: c[0])
def test_T12_store_bad_freqs(device, case):
    name, make = case
    for n in ((3,) if name in ("transposed", "row_strided") else (3, 0)):  # an empty tensor is contiguous
        args, kw = _store_args(device, V41, n=n)
        kw["freqs_cis"] = make(n, device)
        with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache\b.*\bfreqs_cis\b"):
            torch.ops.dsv4.fused_store_cache(*args, **kw)


def _dequant_args(device, fmt=V41, n=3, p=2):
    cache = torch.zeros(3, fmt.page_bytes(p), dtype=torch.uint8, device=device)
    slots = torch.arange(n, dtype=torch.int32, device=device)
    out = torch.zeros(n, 1, 512, dtype=BF16, device=device)
    return cache, slots, p, fmt.id, out


def _call_dequant(overload, cache, slots, p, layout, out):
    if overload == "functional":
        return torch.ops.dsv4.dequantize_k_cache_paged(cache, slots, p, layout)
    return torch.ops.dsv4.dequantize_k_cache_paged.out(cache, slots, p, layout, out=out)


DEQUANT_BAD_ARGS = [
    ("slots_float", lambda a: a.__setitem__(1, a[1].float()), "slots"),
    ("slots_int16", lambda a: a.__setitem__(1, a[1].short()), "slots"),
    ("slots_2d", lambda a: a.__setitem__(1, a[1][None]), "slots"),
    ("slots_strided", lambda a: a.__setitem__(1, torch.arange(2 * a[1].numel(), device=a[1].device)[::2]), "slots"),
    ("page_size_0", lambda a: a.__setitem__(2, 0), "page_size"),
    ("page_size_6", lambda a: a.__setitem__(2, 6), "page_size"),
    ("page_size_4096", lambda a: a.__setitem__(2, 4096), "page_size"),
    ("layout_3", lambda a: a.__setitem__(3, 3), "layout"),
    ("layout_neg", lambda a: a.__setitem__(3, -1), "layout"),
]
OUT_BAD = [
    ("fp32", lambda o: o.float()),
    ("fp16", lambda o: o.half()),
    ("2d", lambda o: o[:, 0]),
    ("4d", lambda o: o[None]),
    ("width", lambda o: o[:, :, :-8]),
    ("rows", lambda o: torch.cat([o, o[:1]])),
    ("mid_dim", lambda o: o.expand(o.shape[0], 2, 512).contiguous()),
    ("stride2", lambda o: torch.zeros(o.shape[0], 1, 1024, dtype=o.dtype, device=o.device)[:, :, ::2]),
    ("stride0_small", lambda o: torch.zeros(4096, dtype=o.dtype, device=o.device).as_strided(
        (o.shape[0], 1, 512), (256, 512, 1))),
]


@pytest.mark.parametrize("overload", ["functional", "out"])
@pytest.mark.parametrize("case", DEQUANT_BAD_ARGS, ids=lambda c: c[0])
def test_T12_dequant_bad_argument(device, case, overload):
    name, mutate, arg = case
    for n in ((3,) if name == "slots_strided" else (3, 0)):  # an empty tensor is contiguous
        args = list(_dequant_args(device, n=n))
        mutate(args)
        with pytest.raises(RuntimeError, match=rf"dsv4\.dequantize_k_cache_paged\b.*\b{arg}\b"):
            _call_dequant(overload, *args)


@pytest.mark.parametrize("case", OUT_BAD, ids=lambda c: c[0])
def test_T12_dequant_bad_out(device, case):
    _, make = case
    args = list(_dequant_args(device))
    args[4] = make(args[4])
    with pytest.raises(RuntimeError, match=r"dsv4\.dequantize_k_cache_paged\b.*\bout\b"):
        _call_dequant("out", *args)


@pytest.mark.parametrize("overload", ["functional", "out"])
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_T12_dequant_bad_cache(device, fmt, overload):
    for n in (3, 0):
        for name, cache in _bad_cache_variants(fmt, 2, device):
            args = list(_dequant_args(device, fmt, n=n))
            args[0] = cache
            with pytest.raises(RuntimeError, match=r"dsv4\.dequantize_k_cache_paged\b.*\bcache\b"):
                _call_dequant(overload, *args)


def test_T12_dequant_layout_and_out_are_keyword_only():
    cache, slots, p, layout, out = _dequant_args("cpu")
    with pytest.raises(TypeError):
        dsv4.dequantize_k_cache_paged(cache, slots, p, 1)
    with pytest.raises(TypeError):
        dsv4.dequantize_k_cache_paged(cache, slots, p, out)
    with pytest.raises(TypeError):
        dsv4.dequantize_k_cache_paged(cache, slots, p, out, 1)
    with pytest.raises(TypeError):
        dsv4.dequantize_k_cache_paged(cache, slots, p, 1, out)
    assert torch.equal(out, torch.zeros_like(out))


FQ_BAD = [
    ("fp64", lambda d: torch.zeros(2, 32, dtype=torch.float64, device=d), "x"),
    ("int32", lambda d: torch.zeros(2, 32, dtype=torch.int32, device=d), "x"),
    ("uint8", lambda d: torch.zeros(2, 32, dtype=torch.uint8, device=d), "x"),
    ("rank0", lambda d: torch.tensor(1.0, device=d), "x"),
    ("width24", lambda d: torch.zeros(2, 24, device=d), "x"),
    ("stride2", lambda d: torch.zeros(2, 64, device=d)[:, ::2], "x"),
    ("transposed", lambda d: torch.zeros(64, 4, device=d).t(), "x"),
]


@pytest.mark.parametrize("case", FQ_BAD, ids=lambda c: c[0])
def test_T12_fake_quant_bad_x(device, case):
    _, make, arg = case
    x = make(device)
    with pytest.raises(RuntimeError, match=rf"dsv4\.fake_quant_compressed_kv\b.*\b{arg}\b"):
        torch.ops.dsv4.fake_quant_compressed_kv(x)
    with pytest.raises(RuntimeError, match=rf"dsv4\.fake_quant_fp4\b.*\b{arg}\b"):
        torch.ops.dsv4.fake_quant_fp4(x, block_size=16)


@pytest.mark.parametrize("block_size", [0, 8, 48, 256, -16])
def test_T12_fake_quant_fp4_bad_block_size(device, block_size):
    with pytest.raises(RuntimeError, match=r"dsv4\.fake_quant_fp4\b.*\bblock_size\b"):
        torch.ops.dsv4.fake_quant_fp4(torch.zeros(2, 256, device=device), block_size=block_size)


def test_T12_fake_quant_fp4_block_must_divide_width(device):
    with pytest.raises(RuntimeError, match=r"dsv4\.fake_quant_fp4\b.*\bx\b"):
        torch.ops.dsv4.fake_quant_fp4(torch.zeros(2, 96, device=device), block_size=64)
    with pytest.raises(RuntimeError, match=r"dsv4\.fake_quant_fp4\b.*\bx\b"):
        torch.ops.dsv4.fake_quant_fp4(torch.zeros(2, 48, device=device))


@cuda_only
def test_T12_device_mismatch():
    args, kw = _store_args("cuda", V41)
    for i, arg in ((0, "input"), (2, "indices")):
        bad = list(args)
        bad[i] = bad[i].cpu()
        with pytest.raises(RuntimeError, match=rf"dsv4\.fused_store_cache\b.*\b{arg}\b"):
            torch.ops.dsv4.fused_store_cache(*bad, **kw)
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache\b.*\bfreqs_cis\b"):
        torch.ops.dsv4.fused_store_cache(*args, **kw, freqs_cis=torch.zeros(3, 64))
    cache, slots, p, layout, out = _dequant_args("cuda")
    with pytest.raises(RuntimeError, match=r"dsv4\.dequantize_k_cache_paged\b.*\bslots\b"):
        torch.ops.dsv4.dequantize_k_cache_paged(cache, slots.cpu(), p, layout)
    with pytest.raises(RuntimeError, match=r"dsv4\.dequantize_k_cache_paged\b.*\bout\b"):
        torch.ops.dsv4.dequantize_k_cache_paged.out(cache, slots, p, layout, out=out.cpu())
    # CPU cache, CUDA rows
    args, kw = _store_args("cpu", V41)
    args[0] = args[0].cuda()
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache\b.*\binput\b"):
        torch.ops.dsv4.fused_store_cache(*args, **kw)


def test_T12_fake_impls_check_metadata(device):
    """The fakes (used by torch.compile / FakeTensorMode) reject the same metadata violations."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cases = []
    args, kw = _store_args(device)
    cases.append(("fused_store_cache", "input", torch.ops.dsv4.fused_store_cache,
                  [args[0].half(), args[1], args[2]], kw))
    cases.append(("fused_store_cache", "cache", torch.ops.dsv4.fused_store_cache,
                  [args[0], args[1][:, :-1], args[2]], kw))
    cases.append(("fused_store_cache", "cache", torch.ops.dsv4.fused_store_cache,
                  [args[0], torch.zeros(3, args[1].shape[1] + 1, dtype=torch.uint8, device=device), args[2]], kw))
    cases.append(("fused_store_cache", "indices", torch.ops.dsv4.fused_store_cache,
                  [args[0], args[1], args[2].float()], kw))
    cases.append(("fused_store_cache", "page_size", torch.ops.dsv4.fused_store_cache, args, dict(kw, page_size=3)))
    cases.append(("fused_store_cache", "freqs_cis", torch.ops.dsv4.fused_store_cache, args,
                  dict(kw, freqs_cis=torch.zeros(3, 64, device=device))))
    cache, slots, p, layout, out = _dequant_args(device)
    cases.append(("dequantize_k_cache_paged", "slots", torch.ops.dsv4.dequantize_k_cache_paged,
                  [cache, slots.float(), p, layout], {}))
    cases.append(("dequantize_k_cache_paged", "layout", torch.ops.dsv4.dequantize_k_cache_paged,
                  [cache, slots, p, 5], {}))
    cases.append(("dequantize_k_cache_paged", "out", torch.ops.dsv4.dequantize_k_cache_paged.out,
                  [cache, slots, p, layout], dict(out=out.float())))
    cases.append(("fake_quant_compressed_kv", "x", torch.ops.dsv4.fake_quant_compressed_kv,
                  [torch.zeros(2, 24, device=device)], {}))
    cases.append(("fake_quant_fp4", "block_size", torch.ops.dsv4.fake_quant_fp4,
                  [torch.zeros(2, 64, device=device)], dict(block_size=8)))
    for op_name, arg, op, a, k in cases:
        mode = FakeTensorMode()
        fa = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in a]
        fk = {key: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for key, v in k.items()}
        with mode:
            with pytest.raises(RuntimeError, match=rf"dsv4\.{op_name}\b.*\b{arg}\b"):
                op(*fa, **fk)
