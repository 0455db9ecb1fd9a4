"""Pins the pure-torch reference (sgl_dsv4_kernels.reference) with vectors taken from the spec text:
kv-layouts-and-quant.md sections 1-8 (4.7 table, special tiles, 5 dequant table, 6 examples, 8 edge cases,
T5(a), T13) and cache-writers.md 7.4. Expected bytes are transcribed from the specs or computed independently
with exact rational arithmetic; none are copied from the reference's own output. CPU only.
"""
import math
import struct
from fractions import Fraction

import pytest
import torch

from sgl_dsv4_kernels import reference as ref

torch.set_flush_denormal(False)


# ---------------------------------------------------------------------------------------------------------
# Helpers (independent of the reference)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def next_up(x: float) -> float:
    return f32(bits32(x) + 1)


def next_down(x: float) -> float:
    return f32(bits32(x) - 1)


def hexbytes(s: str) -> list:
    return [int(t, 16) for t in s.split()]


def i32_bits(t: torch.Tensor) -> list:
    return [v & 0xFFFFFFFF for v in t.to(torch.float32).contiguous().view(torch.int32).flatten().tolist()]


def i16_bits(t: torch.Tensor) -> list:
    return [v & 0xFFFF for v in t.contiguous().view(torch.int16).flatten().tolist()]


def bf16_rne_py(x: float) -> int:
    """fp32 -> bf16 bits by exact rational rounding (ties to even), finite inputs."""
    b = bits32(x)
    sign, mag = b & 0x80000000, b & 0x7FFFFFFF
    hi, lo = mag >> 16, mag & 0xFFFF
    if lo > 0x8000 or (lo == 0x8000 and hi & 1):
        hi += 1
    return (sign >> 16) | hi


FLT_MAX = f32(0x7F7FFFFF)

# Section 1 and 3 page tables: P -> (V4, V41, V41_FP4, IDX_FP8, IDX_FP4) page bytes, and the V4/V41/FP4 pads.
PAGE_TABLE = {
    1: ((1152, 568), (1024, 496), (512, 224), 132, 68),
    2: ((1728, 560), (1536, 480), (768, 192), 264, 136),
    16: ((9792, 448), (8704, 256), (4608, 0), 2112, 1088),
    64: ((37440, 64), (33792, 0), (18432, 0), 8448, 4352),
    128: ((74880, 128), (67584, 0), (36864, 0), 16896, 8704),
    256: ((149760, 256), (135168, 0), (73728, 0), 33792, 17408),
    1024: ((598464, 448), (540672, 0), (294912, 0), 135168, 69632),
}
BYTES_PER_TOKEN = {"v4": 584, "v41": 528, "v41_fp4": 288}
DATA_BYTES = {"v4": 576, "v41": 512, "v41_fp4": 256}
SCALE_BYTES = {"v4": 8, "v41": 16, "v41_fp4": 32}
SCALES_USED = {"v4": 7, "v41": 16, "v41_fp4": 32}
LAYOUTS = ["v4", "v41", "v41_fp4"]


def row_bytes(cache_row_page: torch.Tensor, p: int, row: int, layout: str):
    """(data, scale) bytes of `row` inside one page, from the section 1 geometry."""
    db, sb = DATA_BYTES[layout], SCALE_BYTES[layout]
    data = cache_row_page[row * db : (row + 1) * db]
    scale = cache_row_page[p * db + row * sb : p * db + (row + 1) * sb]
    return data.tolist(), scale.tolist()


# ---------------------------------------------------------------------------------------------------------
# Section 1 / 3: geometry


@pytest.mark.parametrize("p", sorted(PAGE_TABLE))
def test_page_tables(p):
    (v4, v4pad), (v41, v41pad), (fp4, fp4pad), idx8, idx4 = PAGE_TABLE[p]
    for layout, (pb, pad) in zip(LAYOUTS, [(v4, v4pad), (v41, v41pad), (fp4, fp4pad)]):
        assert ref.kv_page_bytes(layout, p) == pb
        assert pb - p * BYTES_PER_TOKEN[layout] == pad
    assert ref.indexer_page_bytes("fp8", p) == idx8 == 132 * p
    assert ref.indexer_page_bytes(1, p) == idx4 == 68 * p
    assert tuple(ref.layout_geometry("v4")) == (584, 576, 8, 64, 7, 576)
    assert tuple(ref.layout_geometry(1)) == (528, 512, 16, 32, 16, 512)
    assert tuple(ref.layout_geometry("V41_FP4")) == (288, 256, 32, 16, 32, 256)
    assert tuple(ref.indexer_geometry(0)) == (132, 128, 4, 128, 1, 1)
    assert tuple(ref.indexer_geometry("idx_fp4")) == (68, 64, 4, 32, 4, 1)


def test_layout_arguments_accept_intenum():
    import enum

    class L(enum.IntEnum):
        A = 1

    assert ref.layout_geometry(L.A) == ref.layout_geometry("v41")
    with pytest.raises((ValueError, TypeError)):
        ref.layout_geometry(3)
    with pytest.raises((ValueError, TypeError)):
        ref.layout_geometry("v5")


# ---------------------------------------------------------------------------------------------------------
# Section 4.7 uniform tiles: +m at even, -m at odd positions.
# (m, V4 (b, q+, q-), V41 (b, q+, q-), V41_FP4 (S, byte), IDX_FP4 (b, byte), IDX_FP8 (s bits, q+, q-))

TABLE_47 = [
    (0.0, (105, 0x00, 0x80), (114, 0x00, 0x80), (0x01, 0x80), (112, 0x00), (0x346FACAD, 0x00, 0x80)),
    (2.0**-12, (107, 0x78, 0xF8), (114, 0x40, 0xC0), (0x01, 0x80), (113, 0xE6), (0x35124925, 0x7E, 0xFE)),
    (6 * 2.0**-9, (112, 0x7C, 0xFC), (114, 0x6C, 0xEC), (0x01, 0xF7), (118, 0xF7), (0x37DB6DB7, 0x7E, 0xFE)),
    (0.01, (112, 0x7A, 0xFA), (114, 0x6A, 0xEA), (0x01, 0xF7), (118, 0xF7), (0x37BB3EE7, 0x7E, 0xFE)),
    (6 * 1.0625, (121, 0x7D, 0xFD), (121, 0x7D, 0xFD), (0x38, 0xF7), (128, 0xD5), (0x3C692492, 0x7E, 0xFE)),
    (6 * 1.1875, (122, 0x76, 0xF6), (122, 0x76, 0xF6), (0x3A, 0xF7), (128, 0xE6), (0x3C824925, 0x7E, 0xFE)),
    (8.25, (122, 0x78, 0xF8), (122, 0x78, 0xF8), (0x3B, 0xF7), (128, 0xE6), (0x3C96DB6E, 0x7E, 0xFE)),
    (448.0, (127, 0x7E, 0xFE), (127, 0x7E, 0xFE), (0x69, 0xF7), (134, 0xD5), (0x3F800000, 0x7E, 0xFE)),
    (449.0, (128, 0x76, 0xF6), (128, 0x76, 0xF6), (0x69, 0xF7), (134, 0xE6), (0x3F804925, 0x7E, 0xFE)),
    (2688.0, (130, 0x7A, 0xFA), (130, 0x7A, 0xFA), (0x7E, 0xF7), (136, 0xF7), (0x40C00000, 0x7E, 0xFE)),
    (1e6, (139, 0x77, 0xF7), (139, 0x77, 0xF7), (0x7E, 0xF7), (145, 0xE6), (0x450B8249, 0x7E, 0xFE)),
]
# bf16 variant notes: 449 -> 448 (448 row); 0.01 and 1e6 keep their bytes except the IDX_FP8 scale.
BF16_IDX_FP8_S = {0.01: 0x37BB6DB7, 1e6: 0x450B6DB7}


def _alternating_row(m: float, dtype) -> torch.Tensor:
    return torch.tensor([m, -m] * 256, dtype=torch.float32).to(dtype)


def _expected_47(m, dtype):
    row = next(r for r in TABLE_47 if r[0] == m)
    if dtype == torch.bfloat16 and m == 449.0:
        row = next(r for r in TABLE_47 if r[0] == 448.0)
    v4, v41, fp4, idx4, idx8 = row[1:]
    if dtype == torch.bfloat16 and m in BF16_IDX_FP8_S:
        idx8 = (BF16_IDX_FP8_S[m],) + idx8[1:]
    return v4, v41, fp4, idx4, idx8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [r[0] for r in TABLE_47])
def test_47_uniform_tiles_rows(m, dtype):
    x = _alternating_row(m, dtype)
    (b4, q4p, q4m), (b41, q41p, q41m), (s_fp4, byte_fp4), (bi4, byte_i4), (si8, qi8p, qi8m) = _expected_47(m, dtype)

    data, scale = ref.quantize_rows(x, "v4")
    assert data[:448].tolist() == [q4p, q4m] * 224
    assert scale.tolist() == [b4] * 7 + [0]
    # RoPE dims: bf16 of +-m, little-endian (bf16 computed here by exact rounding of the fp32 bits).
    xv = float(x[0].float())
    pos, neg = bf16_rne_py(xv), bf16_rne_py(-xv)
    assert data[448:].tolist() == [pos & 0xFF, pos >> 8, neg & 0xFF, neg >> 8] * 32

    data, scale = ref.quantize_rows(x, "v41")
    assert data.tolist() == [q41p, q41m] * 256
    assert scale.tolist() == [b41] * 16

    data, scale = ref.quantize_rows(x, "v41_fp4")
    assert data.tolist() == [byte_fp4] * 256
    assert scale.tolist() == [s_fp4] * 32

    data, scale = ref.quantize_indexer_fp4(x[:128])
    assert data.tolist() == [byte_i4] * 64
    assert scale.tolist() == [bi4] * 4

    data, s = ref.quantize_indexer_fp8(x[:128])
    assert data.tolist() == [qi8p, qi8m] * 64
    assert i32_bits(s) == [si8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_47_uniform_tiles_through_writers(dtype):
    """Same table through the reference writers (fused_store_cache main + indexer): P = 2, slot 3."""
    p, slot = 2, 3
    for m in [r[0] for r in TABLE_47]:
        x = _alternating_row(m, dtype)
        (b4, q4p, q4m), (b41, q41p, q41m), (s_fp4, byte_fp4), (bi4, byte_i4), (si8, qi8p, qi8m) = _expected_47(m, dtype)
        for layout, exp_data, exp_scale in [
            ("v4", [q4p, q4m] * 224, [b4] * 7),
            ("v41", [q41p, q41m] * 256, [b41] * 16),
            ("v41_fp4", [byte_fp4] * 256, [s_fp4] * 32),
        ]:
            cache = torch.zeros(2, PAGE_TABLE[p][LAYOUTS.index(layout)][0], dtype=torch.uint8)
            ref.fused_store_cache(x[None], cache, torch.tensor([slot]), page_size=p, layout=layout)
            data, scale = row_bytes(cache[1], p, 1, layout)
            assert data[: len(exp_data)] == exp_data
            assert scale[: len(exp_scale)] == exp_scale
        # Indexer fp4: payload 64 B per row, 4 ue8m0 bytes; fp8: 128 B, fp32 scale LE.
        cache = torch.zeros(2, 68 * p, dtype=torch.uint8)
        ref.fused_store_cache(x[None, :128], cache, torch.tensor([slot]), page_size=p, type="indexer", use_fp4=True)
        assert cache[1, 64:128].tolist() == [byte_i4] * 64
        assert cache[1, 128 + 4 : 128 + 8].tolist() == [bi4] * 4
        cache = torch.zeros(2, 132 * p, dtype=torch.uint8)
        ref.fused_store_cache(x[None, :128], cache, torch.tensor([slot]), page_size=p, type="indexer")
        assert cache[1, 128:256].tolist() == [qi8p, qi8m] * 64
        assert cache[1, 256 + 4 : 256 + 8].tolist() == list(struct.pack("<I", si8))


# ---------------------------------------------------------------------------------------------------------
# Section 4.7 special tiles (remaining elements of the row 0)


def _row(prefix, dtype=torch.float32, width=512):
    x = torch.zeros(width, dtype=torch.float32)
    x[: len(prefix)] = torch.tensor(prefix, dtype=torch.float32)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_47_special_v41_tile(dtype):
    x = _row([448, 17, 19, 2**-10, 3 * 2**-10, -(2**-10), -0.0, 248, 432, 2**-12, 200, -1e-30], dtype)
    data, scale = ref.quantize_rows(x, "v41")
    assert scale.tolist() == [127] + [114] * 15
    assert data[:12].tolist() == hexbytes("7E 58 5A 00 02 80 80 78 7E 00 74 80")
    assert data[12:].tolist() == [0] * 500


TIE_TILE = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, -6, 0.1, -0.0, 0, 5.5, 4.5]


def test_47_special_fp4_tie_tile():
    x = _row(TIE_TILE)
    data, scale = ref.quantize_rows(x, "v41_fp4")
    assert scale[0].item() == 0x38 and scale[1:].tolist() == [0x01] * 31
    assert data[:8].tolist() == hexbytes("07 22 44 66 E8 0F 08 67")
    assert data[8:].tolist() == [0] * 248
    # The same 16 values as indexer-fp4 tile 0.
    data, scale = ref.quantize_indexer_fp4(x[:128])
    assert scale.tolist() == hexbytes("7F 70 70 70")
    assert data[:8].tolist() == hexbytes("07 21 43 65 E0 0F 00 67")
    assert data[8:].tolist() == [0] * 56


TIE_BLOCK = [8.25, 4.125, 3.4375, -4.8125, 0, -0.0, 2.5, -3.5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_47_special_fp4_block_and_fake_quant(dtype):
    x = _row(TIE_BLOCK * 2, dtype)
    data, scale = ref.quantize_rows(x, "v41_fp4")
    assert scale[0].item() == 0x3B
    assert data[:8].tolist() == hexbytes("57 E4 80 D4 57 E4 80 D4")
    y = ref.fake_quant_compressed_kv(x)
    assert y.dtype == dtype
    expect = [8.25, 4.125, 2.75, -5.5, 0.0, -0.0, 2.75, -4.125] * 2
    got = y[:16].float().tolist()
    assert got == expect
    assert [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in expect]
    assert y[16:].float().abs().max().item() == 0


def test_47_special_fp4_division_tile():
    x = _row([f32(0x40E3FFFF), -3, 1])
    data, scale = ref.quantize_rows(x, "v41_fp4")
    assert scale[0].item() == 0x39  # fl(a/6) -> 1.125; a reciprocal product would tie up to 0x3A
    assert data[:2].tolist() == [0xD7, 0x02] and data[2:].tolist() == [0] * 254
    assert ref.fake_quant_compressed_kv(x)[:3].tolist() == [6.75, -3.375, 1.125]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_47_special_v4_rope_row(dtype):
    x = torch.zeros(512, dtype=torch.float32)
    x[448], x[449], x[450] = 1.0, -2.5, -0.0
    data, scale = ref.quantize_rows(x.to(dtype), "v4")
    assert data[448:454].tolist() == hexbytes("80 3F 20 C0 00 80")
    assert scale[:7].tolist() == [0x69] * 7
    assert data[:448].tolist() == [0] * 448


# ---------------------------------------------------------------------------------------------------------
# Section 4.3 / 4.4 / 8 boundary and edge cases


def test_fp4_saturation_and_idx_fp8_clip():
    # amax 6.375 -> r = 1.0625 ties to S = 1.0 -> 6.375 saturates to code 7.
    data, scale = ref.quantize_rows(_row([6.375]), "v41_fp4")
    assert scale[0].item() == 0x38 and data[0].item() == 0x07
    # amax 0x3C030000: s = 0x3795B6DB, fl(amax*inv) = 448.00003 clipped -> 0x7E; amax 1000 -> 0x7E by rounding.
    x = _row([f32(0x3C030000), -f32(0x3C030000)], width=128)
    q, s = ref.quantize_indexer_fp8(x)
    assert i32_bits(s) == [0x3795B6DB] and q[:2].tolist() == [0x7E, 0xFE]
    q, s = ref.quantize_indexer_fp8(_row([1000.0], width=128))
    assert q[0].item() == 0x7E


def test_floor_boundaries():
    def v4_b(a):
        return ref.quantize_rows(_row([a]), "v4")[1][0].item()

    def v41_b(a):
        return ref.quantize_rows(_row([a]), "v41")[1][0].item()

    def fp4_s(a):
        return ref.quantize_rows(_row([a]), "v41_fp4")[1][0].item()

    def i4_b(a):
        return ref.quantize_indexer_fp4(_row([a], width=128))[1][0].item()

    assert v4_b(448 * 2.0**-22) == 105 and v4_b(next_up(448 * 2.0**-22)) == 106
    assert v41_b(0.0546875) == 114 and v41_b(next_up(0.0546875)) == 115
    assert fp4_s(next_down(0.017578125)) == 0x01 and fp4_s(0.017578125) == 0x02  # r = 1.5*2^-9 ties to even
    assert i4_b(6 * 2.0**-15) == 112 and i4_b(next_up(6 * 2.0**-15)) == 113


@pytest.mark.parametrize("neg", [-0.0, -1e-30, -f32(1)])
def test_negative_zero_and_tiny_negatives(neg):
    x = _row([neg, 0.0])
    assert ref.quantize_rows(x, "v4")[0][:2].tolist() == [0x80, 0x00]
    assert ref.quantize_rows(x, "v41")[0][:2].tolist() == [0x80, 0x00]
    assert ref.quantize_rows(x, "v41_fp4")[0][0].item() == 0x08
    assert ref.quantize_indexer_fp8(x[:128])[0][:2].tolist() == [0x80, 0x00]
    assert ref.quantize_indexer_fp4(x[:128])[0][0].item() == 0x00
    y = ref.fake_quant_compressed_kv(x)
    assert math.copysign(1, y[0].item()) == -1 and math.copysign(1, y[1].item()) == 1


def test_subnormal_inputs():
    sub = [f32(1), -f32(5), f32(0x7FFFFF), -f32(0x400000)]
    x = _row(sub * 128)
    data, scale = ref.quantize_rows(x, "v41")
    assert scale.tolist() == [114] * 16 and data.tolist() == [0x00, 0x80] * 256
    data, scale = ref.quantize_rows(x, "v4")
    assert scale.tolist() == [105] * 7 + [0] and data[:448].tolist() == [0x00, 0x80] * 224
    data, scale = ref.quantize_rows(x, "v41_fp4")
    assert scale.tolist() == [0x01] * 32 and data.tolist() == [0x80] * 256
    q, s = ref.quantize_indexer_fp8(x[:128])
    assert i32_bits(s) == [0x346FACAD] and q.tolist() == [0x00, 0x80] * 64
    q, s = ref.quantize_indexer_fp4(x[:128])
    assert s.tolist() == [112] * 4 and q.tolist() == [0] * 64
    # V4 RoPE keeps subnormals (bf16 RNE): 2^-130 -> 0x0008, -2^-140 -> 0x8000, 3*2^-134 -> tie -> 0x0002.
    y = torch.zeros(512)
    y[448], y[449], y[450] = 2.0**-130, -(2.0**-140), 3 * 2.0**-134
    data, _ = ref.quantize_rows(y, "v4")
    assert data[448:454].tolist() == [0x08, 0x00, 0x00, 0x80, 0x02, 0x00]


def test_huge_values():
    for m in (1e6, 1e30, FLT_MAX):
        x = _alternating_row(m, torch.float32)
        for layout in ("v4", "v41"):
            assert ref.quantize_rows(x, layout)[1][:7].max().item() <= 247
        data, scale = ref.quantize_rows(x, "v41_fp4")
        assert scale.tolist() == [0x7E] * 32 and data.tolist() == [0xF7] * 256
        assert ref.quantize_indexer_fp4(x[:128])[1].max().item() <= 253
        q, s = ref.quantize_indexer_fp8(x[:128])
        assert math.isfinite(s.item()) and q.tolist() == [0x7E, 0xFE] * 64
    # FLT_MAX = (2 - 2^-23) * 2^127: b = 247, x * 2^-120 = 255.99998 -> e4m3 256 (0x78); IDX_FP4 b = 253, code 6.
    x = _alternating_row(FLT_MAX, torch.float32)
    for layout in ("v4", "v41"):
        data, scale = ref.quantize_rows(x, layout)
        assert scale[:7].tolist() == [247] * 7 and data[:448].tolist() == [0x78, 0xF8] * 224
    data, scale = ref.quantize_indexer_fp4(x[:128])
    assert scale.tolist() == [253] * 4 and data.tolist() == [0xE6] * 64


def test_nan_inf_inputs_do_not_crash_and_keep_footprint():
    x = torch.randn(1, 512)
    x[0, 3], x[0, 100], x[0, 470] = float("nan"), float("inf"), -float("inf")
    for layout in LAYOUTS:
        p = 2
        pb = ref.kv_page_bytes(layout, p)
        caches = [torch.full((2, pb), fill, dtype=torch.uint8) for fill in (0x00, 0xFF)]
        for c in caches:
            ref.store_k_cache(c, x, torch.tensor([2]), p, layout)
        same = (caches[0] == caches[1]).nonzero()[:, 1].tolist()  # page 1, row 0
        db = DATA_BYTES[layout]
        expected = list(range(db)) + list(range(p * db, p * db + SCALES_USED[layout]))
        assert (caches[0][0] == 0).all() and (caches[1][0] == 0xFF).all()
        assert sorted(set(same)) == expected
    ref.quantize_indexer_fp8(x[:, :128])
    ref.quantize_indexer_fp4(x[:, :128])
    ref.fake_quant_compressed_kv(x)
    ref.fake_quant_fp4(x)


# ---------------------------------------------------------------------------------------------------------
# Section 2: worked address examples, skip rule, footprint


def _two_fill_store(layout, p, slot, width, num_pages, row, stride=None, writer="store"):
    """Stores `row` into a 0x00-filled and a 0xFF-filled buffer; returns (written-byte mask, buffer 0x00)."""
    out = []
    for fill in (0x00, 0xFF):
        buf = torch.full((num_pages, stride or width), fill, dtype=torch.uint8)
        cache = buf[:, :width]
        if writer == "store":
            ref.store_k_cache(cache, row, torch.tensor([slot]), p, layout)
        else:
            ref.fused_store_cache(row, cache, torch.tensor([slot], dtype=torch.int32), page_size=p, layout=layout)
        out.append(buf.flatten())
    return out[0] == out[1], out[0]


def _ranges(*spans):
    idx = []
    for lo, hi in spans:  # inclusive
        idx.extend(range(lo, hi + 1))
    return idx


@pytest.mark.parametrize("writer", ["store", "fused"])
@pytest.mark.parametrize(
    "layout, stride, data_span, scale_span",
    [
        ("v4", None, (76032, 76607), (111760, 111766)),  # 111767 (pad byte) untouched
        ("v41", None, (68608, 69119), (100384, 100399)),
        ("v41_fp4", None, (37376, 37631), (53312, 53343)),
        ("v4", 40960, (83072, 83072 + 575), (118800, 118806)),
    ],
)
def test_section2_worked_addresses(layout, stride, data_span, scale_span, writer):
    p, slot = 64, 130
    width = PAGE_TABLE[p][LAYOUTS.index(layout)][0]
    row = torch.randn(1, 512, generator=torch.Generator().manual_seed(1)) * 3
    written, buf = _two_fill_store(layout, p, slot, width, 3, row, stride, writer)
    assert written.nonzero().squeeze(-1).tolist() == _ranges(data_span, scale_span)
    data, scale = ref.quantize_rows(row[0], layout)
    assert buf[data_span[0] : data_span[1] + 1].tolist() == data.tolist()
    used = scale_span[1] - scale_span[0] + 1
    assert buf[scale_span[0] : scale_span[1] + 1].tolist() == scale[:used].tolist()


@pytest.mark.parametrize(
    "fmt, width, data_span, scale_span",
    [(0, 132 * 64, (17152, 17152 + 127), (25096, 25099)), (1, 68 * 64, (8832, 8832 + 63), (12808, 12811))],
)
def test_section3_indexer_worked_addresses(fmt, width, data_span, scale_span):
    p, slot = 64, 130
    row = torch.randn(1, 128, generator=torch.Generator().manual_seed(2))
    bufs = []
    for fill in (0x00, 0xFF):
        cache = torch.full((3, width), fill, dtype=torch.uint8)
        ref.fused_store_cache(row, cache, torch.tensor([slot]), page_size=p, type="indexer", use_fp4=bool(fmt))
        bufs.append(cache.flatten())
    written = (bufs[0] == bufs[1]).nonzero().squeeze(-1).tolist()
    assert written == _ranges(data_span, scale_span)
    if fmt == 0:
        q, s = ref.quantize_indexer_fp8(row[0])
        assert bufs[0][scale_span[0] : scale_span[1] + 1].tolist() == list(struct.pack("<f", s.item()))
    else:
        q, s = ref.quantize_indexer_fp4(row[0])
        assert bufs[0][scale_span[0] : scale_span[1] + 1].tolist() == s.tolist()
    assert bufs[0][data_span[0] : data_span[1] + 1].tolist() == q.tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_section2_64bit_offsets(dtype):
    # V4, P = 256, slot 2^24 + 5 -> page 65536, row 5 (a 9.8 GB cache, so only the address arithmetic).
    slots = torch.tensor([16777221, -1], dtype=dtype)
    valid, data_off, scale_off = ref.slot_offsets(slots, 256, 65537, 149760, 576, 8)
    assert valid.tolist() == [True, False]
    assert data_off[0].item() == 9_814_674_240
    assert scale_off[0].item() == 9_814_818_856


def test_invalid_slots_write_nothing_and_read_zero():
    p, num_pages = 4, 3
    x = torch.randn(6, 512)
    cap = num_pages * p
    bad64 = torch.tensor([-1, cap, cap + 5, -cap, 2**40, -(2**31)], dtype=torch.int64)
    bad32 = torch.tensor([-1, cap, cap + 5, -cap, 2**31 - 1, -(2**31)], dtype=torch.int32)
    for layout in LAYOUTS:
        for slots in (bad64, bad32):
            cache = torch.full((num_pages, ref.kv_page_bytes(layout, p)), 0xA5, dtype=torch.uint8)
            ref.store_k_cache(cache, x, slots, p, layout)
            assert (cache == 0xA5).all()
            out = ref.dequantize_k_cache_paged(cache, slots, p, layout=layout)
            assert out.shape == (6, 1, 512) and out.dtype == torch.bfloat16
            assert (out.view(torch.int16) == 0).all()  # +0.0, not -0.0
        empty = torch.zeros(0, ref.kv_page_bytes(layout, p), dtype=torch.uint8)
        ref.store_k_cache(empty, x[:1], torch.tensor([0]), p, layout)
        assert (ref.dequantize_k_cache_paged(empty, torch.tensor([0]), p, layout=layout).view(torch.int16) == 0).all()


# ---------------------------------------------------------------------------------------------------------
# Section 5: dequantizer table (exact bf16 bits)

# (scale byte, payload byte, expected bf16 bits) for V41 and V4 (nope dims).
DEQ_E4M3 = [
    (127, 0x40, 0x4000),
    (0, 0x7E, 0x0460),
    (0, 0x08, 0x0001),
    (0, 0x04, 0x0000),
    (0, 0x0C, 0x0002),
    (0, 0x86, 0x8001),
    (0, 0x01, 0x0000),
    (254, 0x7E, 0x7F80),
    (254, 0x01, 0x7A80),
    (255, 0x40, 0x7FC0),
    (255, 0x00, 0x7FC0),
    (127, 0x7F, 0x7FC0),
    (3, 0xFF, 0x7FC0),
    (127, 0x80, 0x8000),
]


@pytest.mark.parametrize("sb, payload, expected", DEQ_E4M3)
def test_section5_dequant_e4m3(sb, payload, expected):
    data = torch.full((576,), payload, dtype=torch.uint8)
    rope = [0x80, 0x3F, 0xFF, 0x7F, 0x01, 0x80] + [0x34, 0x12] * 61  # copied verbatim, even a non-canonical NaN
    data[448:] = torch.tensor(rope, dtype=torch.uint8)
    out = ref.dequantize_rows(data, torch.tensor([sb] * 7 + [0x55], dtype=torch.uint8), "v4")
    bits = i16_bits(out)
    assert bits[:448] == [expected] * 448
    assert bits[448:451] == [0x3F80, 0x7FFF, 0x8001] and bits[451:] == [0x1234] * 61
    out = ref.dequantize_rows(torch.full((512,), payload, dtype=torch.uint8),
                              torch.full((16,), sb, dtype=torch.uint8), 1)
    assert i16_bits(out) == [expected] * 512


@pytest.mark.parametrize(
    "sb, payload, expected",
    [(0x3B, 0xE4, (0x4030, 0xC0B0)), (0x3B, 0x80, (0x0000, 0x8000)), (0x7F, 0x37, (0x7FC0, 0x7FC0)),
     (0xFF, 0x00, (0x7FC0, 0x7FC0))],
)
def test_section5_dequant_fp4(sb, payload, expected):
    out = ref.dequantize_rows(
        torch.full((256,), payload, dtype=torch.uint8), torch.full((32,), sb, dtype=torch.uint8), "v41_fp4"
    )
    assert i16_bits(out) == list(expected) * 256


def test_section5_dequant_paged_mixed():
    """Page-level read of hand-placed rows: P = 2, slot 3 holds the table rows, slot 0 is garbage."""
    p = 2
    cache = torch.full((2, ref.kv_page_bytes("v41", p)), 0x11, dtype=torch.uint8)
    cache[1, 512 : 2 * 512] = 0x40  # row 1 data
    cache[1, 2 * 512 + 16 : 2 * 512 + 32] = 127  # row 1 scales
    out = ref.dequantize_k_cache_paged(cache, torch.tensor([3, 4, -1], dtype=torch.int32), p, layout="v41")
    assert i16_bits(out[0]) == [0x4000] * 512
    assert i16_bits(out[1:]) == [0] * 1024
    # A page stride larger than the width (column slice of a wider buffer).
    buf = torch.full((2, 4096), 0x11, dtype=torch.uint8)
    buf[1, 512:1024] = 0x40
    buf[1, 1024 + 16 : 1024 + 32] = 127
    out = ref.dequantize_k_cache_paged(buf[:, : ref.kv_page_bytes("v41", p)], torch.tensor([3]), p, layout=1)
    assert i16_bits(out) == [0x4000] * 512


# ---------------------------------------------------------------------------------------------------------
# Section 6: fake quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_section6_fake_quant_fp4_tie_tile(dtype):
    x = torch.tensor(TIE_TILE + [0.0] * 16, dtype=torch.float32).to(dtype)
    x_before = x.clone()
    y = ref.fake_quant_fp4(x, block_size=32)
    expect = [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -4, -6, 0, -0.0, 0, 6, 4] + [0] * 16
    assert y.dtype == dtype and y.data_ptr() != x.data_ptr() and torch.equal(x, x_before)
    got = y.float().tolist()
    assert got == [float(v) for v in expect]
    assert [math.copysign(1, v) for v in got] == [math.copysign(1, float(v)) for v in expect]


def test_section6_fake_quant_fp4_subnormal_block():
    x = torch.tensor([3 * 2.0**-127, -(2.0**-128), 2.0**-129, -(2.0**-130)] + [0.0] * 12)
    y = ref.fake_quant_fp4(x, block_size=16)
    assert i32_bits(y) == [bits32(3 * 2.0**-127), 0x80000000, 0x00000000, 0x80000000] + [0] * 12


def test_section6_fake_quant_fp4_overflow_and_blocks():
    # fp16: |x| >= 57344 gives +-inf after the final cast (57344 = 3.5 * 2^14 ties up to 4 * 2^14).
    x = torch.tensor([57344.0, -60000.0] + [0.0] * 14, dtype=torch.float16)
    y = ref.fake_quant_fp4(x, block_size=16)
    assert y[0].item() == float("inf") and y[1].item() == -float("inf")
    with pytest.raises(ValueError):
        ref.fake_quant_fp4(torch.zeros(48), block_size=32)
    with pytest.raises(ValueError):
        ref.fake_quant_fp4(torch.zeros(64), block_size=8)
    # Each block has its own scale: block [1.5, 0...] and block [6, 3, ...] in one row.
    x = torch.zeros(32)
    x[0], x[16], x[17] = 1.5, 48.0, 24.0  # S = 2^-2 ... block 0: amax 1.5 -> a/6 = 0.25 -> S = 0.25
    y = ref.fake_quant_fp4(x, block_size=16)
    assert y[0].item() == 1.5 and y[16].item() == 48.0 and y[17].item() == 24.0


def test_fake_quant_compressed_kv_matches_fp4_dequant_and_shapes():
    g = torch.Generator().manual_seed(3)
    tile_scales = torch.exp2(torch.randint(-20, 20, (7, 3, 32, 1), generator=g)).repeat_interleave(16, -1)
    x = (torch.randn(7, 3, 512, generator=g) * tile_scales.reshape(7, 3, 512)).to(torch.bfloat16)
    y = ref.fake_quant_compressed_kv(x)
    data, scale = ref.quantize_rows(x, "v41_fp4")
    deq = ref.dequantize_rows(data, scale, "v41_fp4")
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert torch.equal(y.view(torch.int16), deq.view(torch.int16))  # signs of zero included
    strided = torch.randn(4, 64)[:, :32]
    assert ref.fake_quant_compressed_kv(strided).is_contiguous()
    with pytest.raises(ValueError):
        ref.fake_quant_compressed_kv(torch.zeros(24))


# ---------------------------------------------------------------------------------------------------------
# Scalars: ue8m0, e4m3 (T13), e2m1 (T13), packing


def test_ue8m0_scalars():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = i32_bits(ref.ue8m0_to_fp32(b))
    assert got[:6] == [0x00400000, 0x00800000, 0x3F000000, 0x3F800000, 0x40000000, 0x7F000000]
    assert math.isnan(f32(got[6]))
    s = torch.tensor([1.0, next_up(1.0), 3.0, 0.75, 2.0**-126, 2.0**-130, 2.0**127])
    assert ref.cast_scale_inv_to_ue8m0(s).tolist() == [1.0, 2.0, 4.0, 1.0, 2.0**-126, 2.0**-126, 2.0**127]
    s = torch.tensor([1.0, 3.0, 0.5, 2.0**-127, 2.0**-126, 2.0**127, float("nan")])
    assert ref.ue8m0_encode(s).tolist() == [127, 129, 126, 0, 1, 254, 255]


def _e4m3_values():
    """Exact values of codes 0x00..0x7E (OCP E4M3FN: bias 7, subnormals m * 2^-9)."""
    vals = []
    for c in range(0x7F):
        e, m = c >> 3, c & 7
        vals.append(Fraction(m, 512) if e == 0 else Fraction(8 + m, 8) * Fraction(2) ** (e - 7))
    return vals


def _e4m3_expected(x: float) -> int:
    """RNE to e4m3 with saturation at 448 and the sign kept, by exact rationals."""
    vals = _e4m3_values()
    sign = 0x80 if math.copysign(1, x) < 0 else 0
    a = abs(Fraction(x)) if math.isfinite(x) else Fraction(10**9)
    if a >= 448:
        return sign | 0x7E
    c = max(i for i, v in enumerate(vals) if v <= a)
    lo, hi = vals[c], vals[c + 1]
    mid = (lo + hi) / 2
    if a < mid or (a == mid and c % 2 == 0):
        return sign | c
    return sign | (c + 1)


def test_t13_e4m3_encode_exhaustive_midpoints():
    vals = _e4m3_values()
    points = set()
    for c in range(len(vals) - 1):
        mid = float((vals[c] + vals[c + 1]) / 2)
        assert Fraction(mid) == (vals[c] + vals[c + 1]) / 2  # every midpoint is an fp32 value
        points.update([mid, next_up(mid), next_down(mid)])
    for v in vals:
        points.add(float(v))
        if v > 0:
            points.update([next_up(float(v)), next_down(float(v))])
    points.update([464.0, next_up(464.0), next_down(464.0), 480.0, 1e6, FLT_MAX, float("inf"), f32(1), 2.0**-10])
    pts = sorted(points)
    pts = pts + [-p for p in pts]
    got = ref.e4m3_encode(torch.tensor(pts, dtype=torch.float32)).tolist()
    expected = [_e4m3_expected(p) for p in pts]
    bad = [(p, g, e) for p, g, e in zip(pts, got, expected) if g != e]
    assert not bad, bad[:10]
    assert len(pts) > 700


def test_e4m3_decode_all_codes():
    vals = _e4m3_values()
    got = ref.e4m3_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    for c in range(256):
        v = got[c].item()
        if c & 0x7F == 0x7F:
            assert math.isnan(v)
        else:
            exp = vals[c & 0x7F] * (-1 if c & 0x80 else 1)
            assert Fraction(v) == exp and math.copysign(1, v) == (-1 if c & 0x80 else 1)


E2M1_MAGS = [Fraction(v) for v in ("0", "0.5", "1", "1.5", "2", "3", "4", "6")]
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
RNE_AT_TIE = [0, 2, 2, 4, 4, 6, 6]  # spec section 0
THR_AT_TIE = [0, 1, 2, 3, 4, 5, 6]  # ties toward zero


def _nearest_index(a: Fraction) -> int:
    d = [abs(a - m) for m in E2M1_MAGS]
    best = min(d)
    assert d.count(best) == 1  # only called off the ties
    return d.index(best)


def test_t13_e2m1_encoders_on_every_tie():
    pts, rne, thr = [], [], []
    for t, r, h in zip(TIES, RNE_AT_TIE, THR_AT_TIE):
        for p in (t, next_up(t), next_down(t)):
            idx_r = r if p == t else _nearest_index(Fraction(p))
            idx_t = h if p == t else _nearest_index(Fraction(p))
            for sgn in (1, -1):
                pts.append(sgn * p)
                rne.append(idx_r | (8 if sgn < 0 else 0))
                thr.append(idx_t | (8 if sgn < 0 and idx_t else 0))
    # Saturation, zeros and the exact values.
    for p, r in [(6.0, 7), (7.0, 7), (1e30, 7), (0.0, 0), (0.1, 0), (0.5, 1), (3.0, 5), (4.0, 6)]:
        for sgn in (1, -1):
            pts.append(sgn * p)
            rne.append(r | (8 if sgn < 0 else 0))
            thr.append(r | (8 if sgn < 0 and r else 0))
    x = torch.tensor(pts, dtype=torch.float32)
    assert ref.e2m1_encode_rne(x).tolist() == rne
    assert ref.e2m1_encode_threshold(x).tolist() == thr
    assert ref.e2m1_encode_rne(torch.tensor([-0.0])).item() == 0x8
    assert ref.e2m1_encode_threshold(torch.tensor([-0.0])).item() == 0x0


def test_e2m1_decode_and_packing():
    codes = torch.arange(16, dtype=torch.uint8)
    got = ref.e2m1_decode(codes).tolist()
    expect = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert got == expect and math.copysign(1, got[8]) == -1
    packed = ref.pack_e2m1(torch.tensor([[0x7, 0x2, 0xF, 0x0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x27, 0x0F]]
    assert ref.unpack_e2m1(packed).tolist() == [[0x7, 0x2, 0xF, 0x0]]


# ---------------------------------------------------------------------------------------------------------
# T5(a): the closed forms of the power-of-two scale bytes, exhaustively


def _ceil_log2(f: Fraction) -> int:
    k = 0
    while Fraction(2) ** k < f:
        k += 1
    while Fraction(2) ** (k - 1) >= f:
        k -= 1
    return k


FLOOR_BITS = 0x38D1B717
# name, odd part and power-of-two shift of the divisor, floor byte from exact 1e-4, floor on the quotient?
T5_FORMS = {
    "v41": (7, 6, _ceil_log2(Fraction(1, 10000)) + 127, True),
    "v4": (7, 6, _ceil_log2(Fraction(1, 10000) / 448) + 127, False),
    "idx_fp4": (3, 1, _ceil_log2(Fraction(1, 10000) / 6) + 127, False),
}


def _bit_length(n: torch.Tensor) -> torch.Tensor:
    """Exact bit length of non-negative integers n < 2^24 (frexp of an exactly converted integer)."""
    return torch.frexp(n.to(torch.float32)).exponent


def _exact_byte(bits: torch.Tensor, odd: int, shift: int, floor_byte: int) -> torch.Tensor:
    """ceil(log2(max(amax/divisor, floor))) + 127 in exact integer arithmetic, amax = m * 2^e."""
    E, M = bits >> 23, bits & 0x7FFFFF
    normal = E > 0
    # Significand normalised to 24 bits for normals and subnormals alike (zero handled at the end).
    lift = torch.where(normal, torch.zeros_like(M), 24 - _bit_length(M))
    m = torch.where(normal, M + 2**23, M << lift.clamp(max=24))
    e = torch.where(normal, E - 150, -149 - lift)
    # amax / (odd * 2^shift) = (m / odd) * 2^(e - shift) with m / odd > 1, so
    # ceil(log2(m / odd)) = bit_length(ceil(m / odd) - 1).
    k = _bit_length(torch.div(m + (odd - 1), odd, rounding_mode="floor") - 1)
    byte = torch.clamp(e - shift + k + 127, min=floor_byte)
    return torch.where(bits == 0, torch.full_like(byte, floor_byte), byte)


def _definition_byte(amax: torch.Tensor, form: str) -> torch.Tensor:
    """ceil2byte of the fp32 quotient as the spec defines it (written here, independent of the reference)."""
    floor = torch.full_like(amax, f32(FLOOR_BITS))
    div = 6.0 if form == "idx_fp4" else 448.0
    if form == "v41":
        s = torch.maximum(amax / torch.full_like(amax, div), floor)
    else:
        a = torch.maximum(amax, floor)
        s = a / torch.full_like(a, div)
    b = s.view(torch.int32)
    return (b >> 23) + ((b & 0x7FFFFF) != 0).to(torch.int32)


def _t5_inputs():
    g = torch.Generator().manual_seed(5)
    bf16 = torch.arange(0, 0x7F80, dtype=torch.int32) << 16  # all 32,640 non-negative finite bf16
    assert bf16.numel() == 32640
    rnd = torch.randint(0, 2**31, (2**24 + 2**18,), generator=g, dtype=torch.int64)
    rnd = rnd[(rnd >> 23) != 255][: 2**24].to(torch.int32)  # non-negative finite fp32 patterns
    assert rnd.numel() == 2**24
    neigh = []
    for base in (448.0, 6.0):
        for k in range(-155, 120):
            v = base * 2.0**k
            if v < f32(0x7F7FFFFF) and bits32(v) != 0:
                neigh.append(bits32(v))
    neigh = torch.tensor(neigh, dtype=torch.int32)
    neigh = (neigh[:, None] + torch.arange(-64, 65, dtype=torch.int32)).flatten()
    neigh = neigh[(neigh >= 0) & ((neigh >> 23) != 255)]
    subnormals = torch.arange(0, 2**23, dtype=torch.int32)  # zero and all 2^23 - 1 subnormals
    return {"bf16": bf16, "random": rnd, "448*2^k and 6*2^k +-64 ulps": neigh, "zero+subnormals": subnormals}


@pytest.fixture(scope="module")
def t5_inputs():
    return _t5_inputs()


@pytest.mark.parametrize("form", sorted(T5_FORMS))
def test_t5a_closed_forms_exhaustive(form, t5_inputs):
    odd, shift, floor_byte, _ = T5_FORMS[form]
    closed = {
        "v41": ref.v41_scale_byte_closed_form,
        "v4": ref.v4_scale_byte_closed_form,
        "idx_fp4": ref.indexer_fp4_scale_byte_closed_form,
    }[form]
    quantizer_path = {
        "v41": ref.quant._v41_scale_byte,
        "v4": ref.quant._v4_scale_byte,
        "idx_fp4": ref.quant._indexer_fp4_scale_byte,
    }[form]
    assert floor_byte == {"v41": 114, "v4": 105, "idx_fp4": 112}[form]
    for name, all_bits in t5_inputs.items():
        for chunk in all_bits.split(2**19):  # small chunks keep the temporaries in cache
            amax = chunk.view(torch.float32)
            exact = _exact_byte(chunk, odd, shift, floor_byte)
            assert torch.equal(_definition_byte(amax, form), exact), (form, name, "definition")
            assert torch.equal(closed(amax).to(torch.int32), exact), (form, name, "closed form")
            assert torch.equal(quantizer_path(amax).to(torch.int32), exact), (form, name, "quantizer")


# ---------------------------------------------------------------------------------------------------------
# cache-writers.md 7.4 pins


@pytest.mark.parametrize("d, ss, r, y_rest",
                         [(512, 0x3F8000FF, 0x41B5043E, 0x3BB5043E), (128, 0x3F80003F, 0x413504C6, 0x3B3504C6)])
def test_pin_norm_order(d, ss, r, y_rest):
    x = torch.full((d,), 2.0**-12)
    x[0] = 1.0
    assert i32_bits(ref.norm_rope._sum_of_squares(x)) == [ss]
    y = ref.rms_norm_fp32(x, torch.ones(d), 0.0)
    assert i32_bits(y) == [r] + [y_rest] * (d - 1)
    # bf16 weights are widened exactly; a batch gives the same rows.
    y2 = ref.rms_norm_fp32(torch.stack([x, x]), torch.ones(d, dtype=torch.bfloat16), 0.0)
    assert i32_bits(y2) == ([r] + [y_rest] * (d - 1)) * 2


def test_pin_norm_halving_order_inside_and_across_groups():
    # Derived by hand from the section 1.2 order. In-group: squares q0 = 1, q1 = q9 = 2^-24 meet as
    # q1 + q9 = 2^-23 at h = 8, then 1 + 2^-23 is exact: ss = 0x3F800001 (adjacent pairing or a sequential sum
    # would absorb each 2^-24 into 1 by ties-to-even and give 0x3F800000). Across groups: partials s0 = 1,
    # s1 = s17 = 2^-24 meet at h = 16, the same way.
    for small in ([1, 9], [16, 17 * 16]):
        x = torch.zeros(512)
        x[0] = 1.0
        x[small] = 2.0**-12
        assert i32_bits(ref.norm_rope._sum_of_squares(x)) == [0x3F800001]


def test_pin_rms_norm_exact_rows():
    # x_i = +-2^k, eps = 0: ss = D 4^k exact, r = 2^-k, y = +-w exactly.
    x = torch.tensor([2.0**-7, -(2.0**-7)] * 256)
    w = torch.linspace(-3, 3, 512).to(torch.bfloat16)
    y = ref.rms_norm_fp32(x, w, 0.0)
    assert torch.equal(y, w.float() * torch.tensor([1.0, -1.0] * 256))


def _rope_freqs(pair0):
    f = torch.tensor([1.0, 0.0] * 32)
    f[0], f[1] = pair0
    return f


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("complex_freqs", [False, True])
def test_pin_rope_direction_and_pairing(dtype, complex_freqs):
    x = torch.zeros(1, 512)
    x[0, 448], x[0, 449] = 1.0, 2.0
    freqs = _rope_freqs((0.5, 0.75))[None]
    if complex_freqs:
        freqs = torch.view_as_complex(freqs.reshape(1, 32, 2).contiguous())
    p, slot = 2, 1
    cache = torch.full((1, ref.kv_page_bytes("v41", p)), 0xA5, dtype=torch.uint8)
    ref.fused_store_cache(x.to(dtype), cache, torch.tensor([slot]), page_size=p, layout="v41", freqs_cis=freqs)
    data, scale = row_bytes(cache[0], p, 1, "v41")
    assert data[448:450] == [0xF8, 0x7E]  # (-1.0, 1.75)
    assert data[:448] == [0] * 448 and data[450:] == [0] * 62
    assert scale == [0x72] * 14 + [0x77, 0x72]
    # The rotation itself, in fp32: forward GPT-J on adjacent pairs.
    out = ref.rope_tail(x[0, 448:], freqs[0] if not complex_freqs else _rope_freqs((0.5, 0.75)))
    assert out[:4].tolist() == [-1.0, 1.75, 0.0, 0.0]


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, 0x3A), (torch.float32, 0x39)])
def test_pin_rotated_tail_rounded_to_input_dtype(dtype, expected):
    # re' = 1.0 * (1.1875 - 2^-20) - 0 * 0. bf16 input: T(re') = 1.1875, an e4m3 midpoint that ties to 1.25
    # (0x3A); fp32 input keeps 1.1875 - 2^-20 -> 1.125 (0x39). x450 = 448 fixes the tile-14 scale at 2^0.
    x = torch.zeros(1, 512)
    x[0, 448], x[0, 450] = 1.0, 448.0
    freqs = _rope_freqs((1.1875 - 2.0**-20, 0.0))[None]
    cache = torch.zeros(1, ref.kv_page_bytes("v41", 1), dtype=torch.uint8)
    ref.fused_store_cache(x.to(dtype), cache, torch.tensor([0]), page_size=1, layout="v41", freqs_cis=freqs)
    assert cache[0, 448:451].tolist() == [expected, 0x00, 0x7E]
    assert cache[0, 512 + 14].item() == 127


def test_fused_store_cache_argument_rules():
    cache = torch.zeros(1, ref.kv_page_bytes("v4", 1), dtype=torch.uint8)
    x = torch.zeros(1, 512)
    with pytest.raises(RuntimeError, match="freqs_cis"):
        ref.fused_store_cache(x, cache, torch.tensor([0]), page_size=1, layout="v4", freqs_cis=torch.zeros(1, 64))
    with pytest.raises(RuntimeError, match="use_fp4"):
        ref.fused_store_cache(x, cache, torch.tensor([0]), page_size=1, use_fp4=True)
    icache = torch.zeros(1, 132, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="layout"):
        ref.fused_store_cache(x[:, :128], icache, torch.tensor([0]), page_size=1, type="indexer", layout=1)
    with pytest.raises(RuntimeError, match="freqs_cis"):
        ref.fused_store_cache(x[:, :128], icache, torch.tensor([0]), page_size=1, type="indexer",
                              freqs_cis=torch.zeros(1, 64))


def test_pin_no_fma_in_rope_composed():
    """The K-writer V4 pin, composed from rms_norm_fp32 + rope_tail + the V4 quantizer."""
    x = torch.ones(512)
    w = torch.ones(512)
    w[448] = w[449] = f32(0x3F800800)  # 1 + 2^-12
    y = ref.rms_norm_fp32(x, w, 0.0)
    freqs = _rope_freqs((f32(0x3F800800), f32(0x3F800800)))
    rotated = ref.rope_tail(y, freqs)
    assert torch.equal(rotated[:448], y[:448])
    data, scale = ref.quantize_rows(rotated, "v4")
    assert data[:448].tolist() == [0x78] * 448
    assert scale[:7].tolist() == [0x77] * 7
    assert data[448:452].tolist() == hexbytes("00 00 00 40")
    assert data[452:].tolist() == [0x80, 0x3F] * 62


def test_pin_wht():
    c = 0x3DB504F3
    e5 = torch.zeros(128)
    e5[5] = 1.0
    expect = [c | (0x80000000 if bin(5 & j).count("1") % 2 else 0) for j in range(128)]
    assert i32_bits(ref.hadamard128(e5)) == expect
    v = torch.zeros(2, 128)
    v[:, :4] = torch.tensor([1.0, 1.0, 1.0, 3 * 2.0**-24])
    table = [0x3E87C3B7, 0x3DB504F1, 0x3DB504F0, 0xBDB504F1]
    assert i32_bits(ref.hadamard128(v)) == [table[j & 3] for j in range(128)] * 2


# ---------------------------------------------------------------------------------------------------------
# Round trip and page / slot consistency


def _scaled_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    tile_scale = torch.exp2(torch.randint(-20, 20, (n, 32, 1), generator=g).float())
    x = (torch.randn(n, 32, 16, generator=g) * tile_scale).reshape(n, 512)
    x[0, :64] = 0.0
    x[1, 32:48] = -0.0
    x[2, 64:80] = f32(3) * torch.randn(16, generator=g).sign()
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p", [1, 2, 64])
def test_round_trip_and_pages(layout, p):
    num_pages = 3
    x = _scaled_rows(num_pages * p, seed=p)
    k = x.reshape(num_pages, p, 512)
    pages = ref.quantize_k_cache(k, layout)
    pb = ref.kv_page_bytes(layout, p)
    assert pages.shape == (num_pages, pb) and pages.dtype == torch.uint8
    # Page padding is zero; a wider page_bytes only adds zero padding.
    used = p * BYTES_PER_TOKEN[layout]
    assert (pages[:, used:] == 0).all()
    wide = ref.quantize_k_cache(k, layout, page_bytes=pb + 64)
    assert torch.equal(wide[:, :pb], pages) and (wide[:, pb:] == 0).all()
    named = {"v4": ref.quantize_k_cache_v4, "v41": ref.quantize_k_cache_v41, "v41_fp4": ref.quantize_k_cache_v41_fp4}
    assert torch.equal(named[layout](k), pages)

    deq = ref.dequantize_k_cache(pages, p, layout)
    named_d = {"v4": ref.dequantize_k_cache_v4, "v41": ref.dequantize_k_cache_v41,
               "v41_fp4": ref.dequantize_k_cache_v41_fp4}
    assert torch.equal(named_d[layout](pages, p).view(torch.int16), deq.view(torch.int16))
    # Sanity bound on the round-trip error, per tile of 16 (fp4 steps are coarse; e4m3 keeps 3 mantissa bits).
    xt = x.reshape(-1, 32, 16)
    if layout == "v41_fp4":  # the e4m3 scale tops out at 448: magnitudes saturate at 6 * 448
        xt = xt.clamp(-2688.0, 2688.0)
    err = (deq.reshape(-1, 32, 16).float() - xt).abs()
    # Tile amax of the layout (16, 32 or 64 wide): small values in a loud tile may flush to 0.
    tile = {"v4": 64, "v41": 32, "v41_fp4": 16}[layout]
    amax = xt.reshape(-1, 512 // tile, tile).abs().amax(-1, keepdim=True).repeat_interleave(tile // 16, 1)
    # Plus the absolute step at the scale floors (V4 2^-22 * 2^-9, V41 2^-13 * 2^-9, V41_FP4 0.5 * 2^-9).
    floor_step = {"v4": 2.0**-31, "v41": 2.0**-22, "v41_fp4": 2.0**-10}[layout]
    bound = (0.3 * amax if layout == "v41_fp4" else xt.abs() / 8 + amax / 64) + floor_step
    if layout == "v4":
        bound[:, 28:] = xt[:, 28:].abs() / 128  # RoPE dims are bf16
    assert (err <= bound).all()

    # Slot store into a zero cache reproduces the pages (V4 pad byte and page padding stay 0).
    cache = torch.zeros(num_pages, pb, dtype=torch.uint8)
    slots = torch.randperm(num_pages * p, generator=torch.Generator().manual_seed(9))
    ref.store_k_cache(cache, x[slots], slots.to(torch.int32), p, layout)
    assert torch.equal(cache, pages)
    out = ref.dequantize_k_cache_paged(cache, slots, p, layout=layout)
    assert out.shape == (num_pages * p, 1, 512)
    assert torch.equal(out[:, 0].view(torch.int16), deq.reshape(-1, 512)[slots].view(torch.int16))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_pages_quantize_to_an_empty_cache(layout):
    """num_pages == 0 is a legal cache (section 2): k [0, P, 512] gives uint8 [0, page_bytes] and back."""
    for p in (1, 64):
        pb = ref.kv_page_bytes(layout, p)
        pages = ref.quantize_k_cache(torch.zeros(0, p, 512), layout)
        assert pages.shape == (0, pb) and pages.dtype == torch.uint8
        assert ref.quantize_k_cache(torch.zeros(0, p, 512), layout, page_bytes=pb + 64).shape == (0, pb + 64)
        assert ref.dequantize_k_cache(pages, p, layout).shape == (0, p, 512)


def test_indexer_round_trip_and_dequant():
    x = _scaled_rows(4, seed=11)[:, :128]
    q, s = ref.quantize_indexer_fp8(x)
    y = ref.dequantize_indexer_fp8(q, s)
    assert y.dtype == torch.float32 and (y - x).abs().le(x.abs() / 8 + s[:, None] / 64 * 448 / 64).all()
    q, b = ref.quantize_indexer_fp4(x)
    y = ref.dequantize_indexer_fp4(q, b)
    amax = x.reshape(4, 4, 32).abs().amax(-1, keepdim=True)
    assert ((y - x).reshape(4, 4, 32).abs() <= 0.5 * amax).all()
    # Hand value: tile [3.0, -1.0, 0...] -> b = 127 + ... a/6 = 0.5 -> 126; 3/0.5 = 6 (code 7), -2 (code 0xC).
    t = torch.zeros(128)
    t[0], t[1] = 3.0, -1.0
    q, b = ref.quantize_indexer_fp4(t)
    assert b[0].item() == 126 and q[0].item() == 0xC7
    assert ref.dequantize_indexer_fp4(q, b)[:2].tolist() == [3.0, -1.0]
