"""Reference KV formats: scalar codecs (e4m3, e2m1, ue8m0), the five row quantizers, pages, slot stores and
fake quant, written from kv-layouts-and-quant.md. Pure torch; CPU and CUDA give identical bits because every
division by a non-power-of-two uses a divisor tensor and ue8m0 / e2m1 / bf16 rounding are done on integer bits.
"""
from __future__ import annotations

from typing import NamedTuple, Tuple

import torch

__all__ = [
    # constants and geometry
    "FLOOR",
    "LayoutGeometry",
    "layout_geometry",
    "indexer_geometry",
    "kv_page_bytes",
    "indexer_page_bytes",
    "slot_offsets",
    # scalars
    "ceil2byte",
    "pow2",
    "bf16_rne_bits",
    "cast_scale_inv_to_ue8m0",
    "ue8m0_encode",
    "ue8m0_to_fp32",
    "e4m3_encode",
    "e4m3_decode",
    "e2m1_encode_rne",
    "e2m1_encode_threshold",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "v4_scale_byte_closed_form",
    "v41_scale_byte_closed_form",
    "indexer_fp4_scale_byte_closed_form",
    # rows
    "quantize_rows",
    "dequantize_rows",
    # pages
    "quantize_k_cache",
    "dequantize_k_cache",
    "quantize_k_cache_v4",
    "quantize_k_cache_v41",
    "quantize_k_cache_v41_fp4",
    "dequantize_k_cache_v4",
    "dequantize_k_cache_v41",
    "dequantize_k_cache_v41_fp4",
    # slots
    "store_k_cache",
    "dequantize_k_cache_paged",
    # indexer
    "quantize_indexer_fp8",
    "quantize_indexer_fp4",
    "dequantize_indexer_fp8",
    "dequantize_indexer_fp4",
    "store_indexer_cache",
    # fake quant
    "fake_quant_compressed_kv",
    "fake_quant_fp4",
]

# ----------------------------------------------------------------------------------------------------------
# Geometry (spec sections 1 and 3), defined here independently of the compiled code and of kv_layout.py.


class LayoutGeometry(NamedTuple):
    bytes_per_token: int
    data_bytes: int
    scale_bytes: int
    tile: int
    num_scales: int
    page_align: int


_KV_GEOMETRY = {
    0: LayoutGeometry(584, 576, 8, 64, 7, 576),  # V4: 448 e4m3 + 64 bf16, 7 ue8m0 + 1 pad
    1: LayoutGeometry(528, 512, 16, 32, 16, 512),  # V41: 512 e4m3, 16 ue8m0
    2: LayoutGeometry(288, 256, 32, 16, 32, 256),  # V41_FP4: 512 e2m1, 32 e4m3 scales
}
_KV_NAMES = {"v4": 0, "v41": 1, "v41_fp4": 2}
_IDX_GEOMETRY = {
    0: LayoutGeometry(132, 128, 4, 128, 1, 1),  # IDX_FP8: 128 e4m3 + fp32 scale
    1: LayoutGeometry(68, 64, 4, 32, 4, 1),  # IDX_FP4: 128 e2m1 + 4 ue8m0
}
_IDX_NAMES = {"fp8": 0, "fp4": 1, "idx_fp8": 0, "idx_fp4": 1}

V4, V41, V41_FP4 = 0, 1, 2
_ROPE_START = 448  # V4 stores dims 448..511 as bf16
D_MAIN, D_INDEXER = 512, 128


def _parse(x, names: dict, table: dict, what: str) -> int:
    # int ids, strings and any IntEnum (an IntEnum is an int) are accepted.
    if isinstance(x, str):
        key = x.strip().lower()
        if key not in names:
            raise ValueError(f"unknown {what} {x!r}")
        return names[key]
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"cannot interpret {x!r} as a {what}")
    if int(x) not in table:
        raise ValueError(f"unknown {what} id {int(x)}")
    return int(x)


def _layout_id(layout) -> int:
    return _parse(layout, _KV_NAMES, _KV_GEOMETRY, "KV layout")


def _indexer_id(fmt) -> int:
    return _parse(fmt, _IDX_NAMES, _IDX_GEOMETRY, "indexer format")


def layout_geometry(layout) -> LayoutGeometry:
    return _KV_GEOMETRY[_layout_id(layout)]


def indexer_geometry(fmt) -> LayoutGeometry:
    return _IDX_GEOMETRY[_indexer_id(fmt)]


def _page_bytes(g: LayoutGeometry, page_size: int) -> int:
    return -(-page_size * g.bytes_per_token // g.page_align) * g.page_align


def kv_page_bytes(layout, page_size: int) -> int:
    """ceil(P * bytes_per_token / page_align) * page_align."""
    return _page_bytes(layout_geometry(layout), page_size)


def indexer_page_bytes(fmt, page_size: int) -> int:
    return _page_bytes(indexer_geometry(fmt), page_size)


# ----------------------------------------------------------------------------------------------------------
# Bit helpers


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


def _f32_const(bits: int, like: torch.Tensor) -> torch.Tensor:
    """An fp32 tensor shaped like `like` holding the value with the given bit pattern."""
    return _from_bits(torch.full(like.shape, bits, dtype=torch.int32, device=like.device))


FLOOR_BITS = 0x38D1B717  # fl32(1e-4)
FLOOR = torch.tensor([FLOOR_BITS], dtype=torch.int32).view(torch.float32)[0].item()


def _floor_like(x: torch.Tensor) -> torch.Tensor:
    return _f32_const(FLOOR_BITS, x)


def _div(a: torch.Tensor, divisor: float) -> torch.Tensor:
    # A Python number (or CPU scalar) as divisor makes torch compute a * (1/b) on CUDA: always divide by a
    # tensor on the dividend's device (spec section 7).
    return a / torch.full_like(a, divisor)


def ceil2byte(s: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte of the smallest power of two >= s (finite s >= 2^-126): E(s) + (M(s) != 0), as int32."""
    b = _bits(s)
    return (b >> 23) + ((b & 0x7FFFFF) != 0).to(torch.int32)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """fp32 2^k for integer k in [-126, 127], built from its exponent bits."""
    return _from_bits((k.to(torch.int32) + 127) << 23)


def bf16_rne_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 bits (int16) with round-to-nearest-even on the integer bits; NaN -> canonical 0x7FC0.

    Done on bits so that subnormals and NaN come out identically on every device.
    """
    nan = torch.isnan(x.to(torch.float32))
    b = _bits(x)
    b = torch.where(nan, torch.zeros_like(b), b)  # keeps the rounding add below from overflowing int32
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # arithmetic shift keeps the int16 range
    rounded = torch.where(nan, torch.full_like(rounded, 0x7FC0), rounded)
    return rounded.to(torch.int16)


def _bf16_from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int16).contiguous().view(torch.bfloat16)


# ----------------------------------------------------------------------------------------------------------
# Scalar codecs (spec section 0)


def ue8m0_to_fp32(b: torch.Tensor) -> torch.Tensor:
    """byte -> 2^(b-127); byte 0 -> 2^-127 (subnormal bits 0x00400000), 255 -> NaN. `b << 23` is wrong at both ends."""
    b = b.to(torch.int32)
    bits = b << 23
    bits = torch.where(b == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(b == 255, torch.full_like(bits, 0x7FC00000), bits)
    return _from_bits(bits)


def _ceil_log2_subnormal_byte(b: torch.Tensor) -> torch.Tensor:
    """For a subnormal fp32 with mantissa M (value M*2^-149): ceil(log2(M)) - 149 + 127, via the exactly
    converted float(M) (M < 2^23 converts exactly)."""
    mf = (b & 0x7FFFFF).to(torch.float32)
    return ceil2byte(mf) - 127 - 149 + 127


def ue8m0_encode(s: torch.Tensor) -> torch.Tensor:
    """uint8 byte of the smallest power of two >= s, for s >= 0: saturates to 254 above 2^127, subnormals and
    zero give byte 0 (2^-127) when s <= 2^-127; NaN and inf give 255 (NaN)."""
    s = s.to(torch.float32)
    b = _bits(s) & 0x7FFFFFFF
    byte = ceil2byte(_from_bits(b))
    sub = (b >> 23) == 0
    byte = torch.where(sub, _ceil_log2_subnormal_byte(b).clamp(min=0), byte)
    byte = byte.clamp(0, 254)
    byte = torch.where(torch.isnan(s) | torch.isinf(s), torch.full_like(byte, 255), byte)
    return byte.to(torch.uint8)


def cast_scale_inv_to_ue8m0(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s (fp32) for finite s >= 2^-126; 2^-126 for 0 < s < 2^-126."""
    s = s.to(torch.float32)
    return pow2(ceil2byte(s).clamp(min=1) - 127)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> OCP e4m3fn byte: RNE, |v| > 448 saturates, the sign bit is kept for zero results."""
    v = v.to(torch.float32)
    mag = torch.clamp(v.abs(), max=448.0)  # clip first: torch's cast is RNE but gives NaN from 464 up
    code = mag.to(torch.float8_e4m3fn).view(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 7)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn byte -> fp32 (exact); 0x7F / 0xFF -> NaN. Built from bits: subnormals are m * 2^-9."""
    b = b.to(torch.int32)
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = _from_bits(((e - 7 + 127) << 23) | (m << 20))
    subnormal = m.to(torch.float32) * (2.0**-9)  # product by a power of two: exact
    mag = torch.where(e == 0, subnormal, normal)
    val = torch.where((b & 0x80) != 0, -mag, mag)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(val, float("nan")), val)


_E2M1_RNE_UP = (0.25, 1.25, 2.5, 5.0)  # midpoints that go down (to the even index): counted with >
_E2M1_RNE_EVEN = (0.75, 1.75, 3.5)  # midpoints that go up (to the even index): counted with >=
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode_rne(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 code (uint8 0..15): nearest magnitude, ties to the even index, saturating at 6;
    bit 3 = sign bit of v (so -0.0 and tiny negatives give 0x8)."""
    v = v.to(torch.float32)
    a = v.abs()
    idx = torch.zeros_like(a, dtype=torch.int32)
    for t in _E2M1_RNE_UP:
        idx += (a > t).to(torch.int32)
    for t in _E2M1_RNE_EVEN:
        idx += (a >= t).to(torch.int32)
    return (idx | (torch.signbit(v).to(torch.int32) << 3)).to(torch.uint8)


def e2m1_encode_threshold(v: torch.Tensor) -> torch.Tensor:
    """Indexer rule: index = number of thresholds strictly exceeded by |v| (ties toward zero);
    sign only when v < 0 and index != 0 (never a negative zero)."""
    v = v.to(torch.float32)
    a = v.abs()
    idx = torch.zeros_like(a, dtype=torch.int32)
    for t in _E2M1_THRESHOLDS:
        idx += (a > t).to(torch.int32)
    neg = (v < 0) & (idx != 0)
    return (idx | (neg.to(torch.int32) << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 code -> fp32; code 0x8 gives -0.0."""
    c = codes.to(torch.int64)
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = table[c & 7]
    return torch.where((c & 8) != 0, -mag, mag)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """codes[..., 2k] -> bytes[..., k]; the even element goes to the low nibble."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """bytes[..., k] -> codes[..., 2k] (low nibble first)."""
    d = data.to(torch.uint8)
    return torch.stack([d & 0xF, d >> 4], dim=-1).flatten(-2)


# Closed forms of the power-of-two scale bytes (4.1, 4.2, 4.5); T5 checks them against the definitions.


def _exp_mant(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    b = _bits(a)
    return b >> 23, b & 0x7FFFFF


def v4_scale_byte_closed_form(amax: torch.Tensor) -> torch.Tensor:
    """4.1: a = max(amax, FLOOR); b = E(a) - 8 + [M(a) > 0x600000]."""
    a = torch.maximum(amax.to(torch.float32), _floor_like(amax))
    e, m = _exp_mant(a)
    return (e - 8 + (m > 0x600000).to(torch.int32)).to(torch.uint8)


def v41_scale_byte_closed_form(amax: torch.Tensor) -> torch.Tensor:
    """4.2: b = max(E(amax) - 8 + [M(amax) > 0x600000], 114)."""
    e, m = _exp_mant(amax.to(torch.float32))
    return torch.clamp(e - 8 + (m > 0x600000).to(torch.int32), min=114).to(torch.uint8)


def indexer_fp4_scale_byte_closed_form(amax: torch.Tensor) -> torch.Tensor:
    """4.5: a = max(amax, FLOOR); b = E(a) - 2 + [M(a) > 0x400000]."""
    a = torch.maximum(amax.to(torch.float32), _floor_like(amax))
    e, m = _exp_mant(a)
    return (e - 2 + (m > 0x400000).to(torch.int32)).to(torch.uint8)


# Scale bytes by their definitions (what the quantizers use).


def _v4_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    a = torch.maximum(amax.to(torch.float32), _floor_like(amax))  # floor on amax
    return ceil2byte(_div(a, 448.0))


def _v41_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    s = _div(amax.to(torch.float32), 448.0)
    return ceil2byte(torch.maximum(s, _floor_like(s)))  # floor on the quotient


def _indexer_fp4_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    a = torch.maximum(amax.to(torch.float32), _floor_like(amax))
    return ceil2byte(_div(a, 6.0))


def _fp4_e4m3_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    """4.3: S = e4m3(min(max(fl(amax / 6), 2^-9), 448)), a byte in [0x01, 0x7E] for finite amax."""
    r = _div(amax.to(torch.float32), 6.0)
    return e4m3_encode(torch.clamp(r, min=2.0**-9, max=448.0))


# ----------------------------------------------------------------------------------------------------------
# Tile quantizers on fp32 values


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // tile, tile)


def _amax(tiles: torch.Tensor) -> torch.Tensor:
    return tiles.abs().amax(dim=-1)  # max is exact and order-free


def _quant_e4m3_pow2(x: torch.Tensor, tile: int, scale_byte_fn) -> Tuple[torch.Tensor, torch.Tensor]:
    """e4m3 payload with a ue8m0 scale per tile: q = e4m3(clip(x * 2^(127 - b), +-448))."""
    t = _tiles(x, tile)
    b = scale_byte_fn(_amax(t))
    inv = pow2(127 - b).unsqueeze(-1)
    q = e4m3_encode(torch.clamp(t * inv, -448.0, 448.0))
    return q.flatten(-2), b.to(torch.uint8)


def _quant_fp4_e4m3_scale(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """V41_FP4 tiles of 16: (codes[..., n], scale bytes[..., n/16]); codes = e2m1_rne(fl(x / S))."""
    t = _tiles(x, 16)
    s_byte = _fp4_e4m3_scale_byte(_amax(t))
    s = e4m3_decode(s_byte).unsqueeze(-1)
    codes = e2m1_encode_rne(t / s.expand_as(t))  # IEEE division by the decoded scale
    return codes.flatten(-2), s_byte


def quantize_rows(x: torch.Tensor, layout) -> Tuple[torch.Tensor, torch.Tensor]:
    """x[..., 512] -> (data uint8[..., data_bytes], scale uint8[..., scale_bytes]) of one main layout.

    V4's scale pad byte (byte 7) is 0 here; writers never store it.
    """
    lid = _layout_id(layout)
    if x.shape[-1] != D_MAIN:
        raise ValueError(f"quantize_rows: expected last dim 512, got {x.shape[-1]}")
    x = x.to(torch.float32)
    if lid == V4:
        q, b = _quant_e4m3_pow2(x[..., :_ROPE_START], 64, _v4_scale_byte)
        rope = bf16_rne_bits(x[..., _ROPE_START:]).contiguous().view(torch.uint8)  # little-endian
        pad = torch.zeros(*b.shape[:-1], 1, dtype=torch.uint8, device=x.device)
        return torch.cat([q, rope], dim=-1), torch.cat([b, pad], dim=-1)
    if lid == V41:
        return _quant_e4m3_pow2(x, 32, _v41_scale_byte)
    codes, s_byte = _quant_fp4_e4m3_scale(x)
    return pack_e2m1(codes), s_byte


def _canonical_bf16(p: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (RNE) with every NaN written as 0x7FC0."""
    return _bf16_from_bits(bf16_rne_bits(p))


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, layout) -> torch.Tensor:
    """(data, scale) rows of a main layout -> bf16[..., 512]; products in fp32, one RNE rounding to bf16."""
    lid = _layout_id(layout)
    g = _KV_GEOMETRY[lid]
    data = data.to(torch.uint8)
    scale = scale.to(torch.uint8)
    if lid == V4:
        s = ue8m0_to_fp32(scale[..., :7]).repeat_interleave(64, dim=-1)  # pad byte 7 never used
        nope = _canonical_bf16(e4m3_decode(data[..., :_ROPE_START]) * s)
        rope = data[..., _ROPE_START:].contiguous().view(torch.bfloat16)  # copied verbatim, NaN included
        return torch.cat([nope, rope], dim=-1)
    if lid == V41:
        s = ue8m0_to_fp32(scale).repeat_interleave(g.tile, dim=-1)
        return _canonical_bf16(e4m3_decode(data) * s)
    s = e4m3_decode(scale).repeat_interleave(16, dim=-1)
    return _canonical_bf16(e2m1_decode(unpack_e2m1(data)) * s)


# ----------------------------------------------------------------------------------------------------------
# Whole pages: [P data rows][P scale rows][zero padding]


def quantize_k_cache(k: torch.Tensor, layout, page_bytes: int | None = None) -> torch.Tensor:
    """k[num_pages, P, 512] -> uint8[num_pages, page_bytes] (padding and V4 pad bytes zero)."""
    g = layout_geometry(layout)
    num_pages, p, _ = k.shape
    pb = _page_bytes(g, p) if page_bytes is None else int(page_bytes)
    if pb < _page_bytes(g, p):
        raise ValueError(f"quantize_k_cache: page_bytes {pb} < {_page_bytes(g, p)}")
    data, scale = quantize_rows(k, layout)
    pages = torch.zeros(num_pages, pb, dtype=torch.uint8, device=k.device)
    # Explicit widths: reshape(num_pages, -1) cannot infer one when num_pages == 0.
    pages[:, : p * g.data_bytes] = data.reshape(num_pages, p * g.data_bytes)
    pages[:, p * g.data_bytes : p * (g.data_bytes + g.scale_bytes)] = scale.reshape(num_pages, p * g.scale_bytes)
    return pages


def dequantize_k_cache(pages: torch.Tensor, page_size: int, layout) -> torch.Tensor:
    """uint8[num_pages, >= page_bytes] -> bf16[num_pages, P, 512]."""
    g = layout_geometry(layout)
    p = page_size
    data = pages[:, : p * g.data_bytes].reshape(-1, p, g.data_bytes)
    scale = pages[:, p * g.data_bytes : p * (g.data_bytes + g.scale_bytes)].reshape(-1, p, g.scale_bytes)
    return dequantize_rows(data, scale, layout)


def quantize_k_cache_v4(k, page_bytes=None):
    return quantize_k_cache(k, V4, page_bytes)


def quantize_k_cache_v41(k, page_bytes=None):
    return quantize_k_cache(k, V41, page_bytes)


def quantize_k_cache_v41_fp4(k, page_bytes=None):
    return quantize_k_cache(k, V41_FP4, page_bytes)


def dequantize_k_cache_v4(pages, page_size):
    return dequantize_k_cache(pages, page_size, V4)


def dequantize_k_cache_v41(pages, page_size):
    return dequantize_k_cache(pages, page_size, V41)


def dequantize_k_cache_v41_fp4(pages, page_size):
    return dequantize_k_cache(pages, page_size, V41_FP4)


# ----------------------------------------------------------------------------------------------------------
# Slot addressing (section 2) and in-place slot stores / reads


def _check_cache(cache: torch.Tensor, page_size: int, page_bytes: int, what: str) -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 2 or (cache.size(0) > 0 and cache.stride(1) != 1):
        raise ValueError(f"{what}: cache must be a 2-D uint8 tensor with stride(1) == 1")
    if page_size < 1 or page_size > 1024 or page_size & (page_size - 1):
        raise ValueError(f"{what}: page_size must be a power of two in [1, 1024], got {page_size}")
    if cache.size(1) < page_bytes:
        raise ValueError(f"{what}: cache width {cache.size(1)} < page_bytes {page_bytes}")
    if cache.size(0) >= 2 and cache.stride(0) < cache.size(1):
        raise ValueError(f"{what}: cache stride(0) {cache.stride(0)} < width {cache.size(1)}")


def slot_offsets(
    slots: torch.Tensor, page_size: int, num_pages: int, page_stride: int, data_bytes: int, scale_bytes: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid, data_off, scale_off) in int64 bytes from the cache base; offsets of invalid slots are 0."""
    s = slots.to(torch.int64)  # widen before any product: page * page_stride passes 2^31
    valid = (s >= 0) & (s < num_pages * page_size)
    s = torch.where(valid, s, torch.zeros_like(s))
    shift = page_size.bit_length() - 1
    page, row = s >> shift, s & (page_size - 1)
    base = page * page_stride
    return valid, base + row * data_bytes, base + page_size * data_bytes + row * scale_bytes


def _flat_view(cache: torch.Tensor) -> torch.Tensor:
    """1-D byte view from the cache base to the end of its last page (the cache may be a column slice)."""
    n = 0 if cache.size(0) == 0 else (cache.size(0) - 1) * cache.stride(0) + cache.size(1)
    return cache.as_strided((n,), (1,), cache.storage_offset())


def _store_rows(cache, data, scale, slots, page_size, g: LayoutGeometry, scale_used: int, what: str):
    _check_cache(cache, page_size, _page_bytes(g, page_size), what)
    valid, data_off, scale_off = slot_offsets(
        slots, page_size, cache.size(0), cache.stride(0), g.data_bytes, g.scale_bytes
    )
    keep = valid.nonzero().squeeze(-1)  # invalid slots write nothing
    if keep.numel() == 0:
        return
    flat = _flat_view(cache)
    d_idx = data_off[keep].unsqueeze(-1) + torch.arange(g.data_bytes, device=cache.device)
    s_idx = scale_off[keep].unsqueeze(-1) + torch.arange(scale_used, device=cache.device)
    flat[d_idx] = data[keep].to(cache.device)
    flat[s_idx] = scale[keep][:, :scale_used].to(cache.device)


def store_k_cache(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, page_size: int, layout) -> None:
    """In place: row i of x[N, 512] -> slot slots[i]; writes its data row and used scale bytes (V4: 7)."""
    lid = _layout_id(layout)
    g = _KV_GEOMETRY[lid]
    data, scale = quantize_rows(x, lid)
    _store_rows(cache, data, scale, slots, page_size, g, g.num_scales, "store_k_cache")


def dequantize_k_cache_paged(cache: torch.Tensor, slots: torch.Tensor, page_size: int, *, layout=V4) -> torch.Tensor:
    """bf16[N, 1, 512] decoded from the rows at `slots`; an invalid slot gives 512 x +0.0."""
    g = layout_geometry(layout)
    _check_cache(cache, page_size, _page_bytes(g, page_size), "dequantize_k_cache_paged")
    valid, data_off, scale_off = slot_offsets(
        slots, page_size, cache.size(0), cache.stride(0), g.data_bytes, g.scale_bytes
    )
    n = slots.shape[0]
    out = torch.zeros(n, 1, D_MAIN, dtype=torch.bfloat16, device=cache.device)
    keep = valid.nonzero().squeeze(-1)
    if keep.numel() == 0:
        return out
    flat = _flat_view(cache)
    data = flat[data_off[keep].unsqueeze(-1) + torch.arange(g.data_bytes, device=cache.device)]
    scale = flat[scale_off[keep].unsqueeze(-1) + torch.arange(g.scale_bytes, device=cache.device)]
    out[keep, 0] = dequantize_rows(data, scale, layout)
    return out


# ----------------------------------------------------------------------------------------------------------
# Indexer formats (section 3, quantizers 4.4 and 4.5)


def quantize_indexer_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x[..., 128] -> (e4m3 uint8[..., 128], fp32 scale[...]): s = fl(max(amax, FLOOR) / 448), inv = fl(1 / s)."""
    x = x.to(torch.float32)
    amax = _amax(x)
    a = torch.maximum(amax, _floor_like(amax))
    s = _div(a, 448.0)
    inv = torch.full_like(s, 1.0) / s
    q = e4m3_encode(torch.clamp(x * inv.unsqueeze(-1), -448.0, 448.0))
    return q, s


def quantize_indexer_fp4(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """x[..., 128] -> (packed e2m1 uint8[..., 64], ue8m0 uint8[..., 4]); ties toward zero, no negative zero."""
    t = _tiles(x.to(torch.float32), 32)
    b = _indexer_fp4_scale_byte(_amax(t))
    codes = e2m1_encode_threshold(t * pow2(127 - b).unsqueeze(-1))
    return pack_e2m1(codes.flatten(-2)), b.to(torch.uint8)


def dequantize_indexer_fp8(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32[..., 128] = e4m3val(data) * s."""
    return e4m3_decode(data) * scale.to(torch.float32).unsqueeze(-1)


def dequantize_indexer_fp4(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32[..., 128] = e2m1val(code) * 2^(byte - 127) per tile of 32."""
    return e2m1_decode(unpack_e2m1(data)) * ue8m0_to_fp32(scale).repeat_interleave(32, dim=-1)


def store_indexer_cache(cache: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, page_size: int, fmt) -> None:
    """In place: row i of x[N, 128] -> slot slots[i] of an indexer cache (fmt 0 = FP8 132 B, 1 = FP4 68 B)."""
    fid = _indexer_id(fmt)
    g = _IDX_GEOMETRY[fid]
    if fid == 0:
        data, s = quantize_indexer_fp8(x)
        scale = s.unsqueeze(-1).contiguous().view(torch.uint8)  # fp32 little-endian
    else:
        data, scale = quantize_indexer_fp4(x)
    _store_rows(cache, data, scale, slots, page_size, g, g.scale_bytes, "store_indexer_cache")


# ----------------------------------------------------------------------------------------------------------
# Fake quantization (section 6)


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """V41_FP4 quantize + dequantize per block of 16 along the last dim, in fp32, cast to x.dtype (exact)."""
    if x.dim() == 0 or x.shape[-1] % 16:
        raise ValueError("fake_quant_compressed_kv: x must have rank >= 1 and size(-1) % 16 == 0")
    codes, s_byte = _quant_fp4_e4m3_scale(x.to(torch.float32))
    y = e2m1_decode(codes) * e4m3_decode(s_byte).repeat_interleave(16, dim=-1)
    return y.to(x.dtype).contiguous()


def fake_quant_fp4(x: torch.Tensor, block_size: int = 32) -> torch.Tensor:
    """e2m1 with a power-of-two scale per block: a = max(amax, 6 * 2^-126), S = 2^(ceil2byte(fl(a/6)) - 127),
    y = e2m1val(e2m1_rne(fl(x / S))) * S in fp32, cast RNE to x.dtype (may overflow to inf for fp16)."""
    if block_size not in (16, 32, 64, 128) or x.dim() == 0 or x.shape[-1] % block_size:
        raise ValueError("fake_quant_fp4: block_size must be 16, 32, 64 or 128 and divide x.size(-1)")
    t = _tiles(x.to(torch.float32), block_size)
    amax = _amax(t)
    a = torch.maximum(amax, torch.full_like(amax, 6.0 * 2.0**-126))  # exact fp32 constant
    s = pow2(ceil2byte(_div(a, 6.0)) - 127).unsqueeze(-1).expand_as(t)
    y = e2m1_decode(e2m1_encode_rne(t / s)) * s
    return y.flatten(-2).to(x.dtype).contiguous()
