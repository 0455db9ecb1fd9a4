"""Seeded sample inputs shared by the KV I/O tests (correctness, opcheck, compile, graphs).

Everything numeric here comes from the specs (kv-layouts-and-quant.md sections 1-4), never from the
compiled ops: the format table, hand-built boundary tiles, row/slot/cache generators and the byte
addressing of section 2. Generators run on the CPU with a torch.Generator and move the result.
"""
from __future__ import annotations

import math
import struct
from typing import Iterator, List, NamedTuple, Optional, Tuple

import pytest
import torch

torch.set_flush_denormal(False)

# ----------------------------------------------------------------------------------------------------
# Devices

HAS_CUDA = torch.cuda.is_available()
CUDA_MARKS = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_MARKS, id="cuda")]


def devices():
    """Parametrize values: "cpu", plus "cuda" marked `cuda` and skipped without a GPU."""
    return list(DEVICES)


def run_with_pdl_off_and_on(script: str, tmp_path, *args: str):
    """Runs `script` (python -c; it must torch.save its results to sys.argv[1], followed by `args`) in a fresh
    process with SGL_DSV4_PDL=0, then =1 (the switch is read once per process), and returns both results."""
    import os
    import subprocess
    import sys

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    results = []
    for pdl in ("0", "1"):
        path = tmp_path / f"pdl{pdl}.pt"
        env = dict(os.environ, SGL_DSV4_PDL=pdl)
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run([sys.executable, "-c", script, str(path), *args], env=env, check=True, timeout=600)
        results.append(torch.load(path))
    return results


def cuda_only(fn):
    """Marks a test as needing a GPU (selected by `-m cuda`, skipped without one)."""
    for mark in CUDA_MARKS:
        fn = mark(fn)
    return fn


# ----------------------------------------------------------------------------------------------------
# Formats, written from the spec tables (independent of sgl_dsv4_kernels.kv_layout)


class Fmt(NamedTuple):
    name: str  # also the page_geometry() format string
    indexer: bool
    id: int  # KVLayout id, or IndexerFormat id for the indexer formats
    bytes_per_token: int
    data_bytes: int
    scale_bytes: int
    tile: int
    num_scales: int
    page_align: int

    @property
    def width(self) -> int:
        return 128 if self.indexer else 512

    @property
    def align(self) -> int:
        """Base-pointer / page-stride alignment A of section 2."""
        return 4 if self.indexer else 16

    @property
    def scale_used(self) -> int:
        """Scale bytes a writer stores per row (V4 leaves its pad byte 7 alone)."""
        return 4 if self.indexer else self.num_scales

    def page_bytes(self, page_size: int) -> int:
        return -(-page_size * self.bytes_per_token // self.page_align) * self.page_align

    def scale_offset(self, page_size: int) -> int:
        return page_size * self.data_bytes

    def __repr__(self) -> str:
        return self.name


V4 = Fmt("v4", False, 0, 584, 576, 8, 64, 7, 576)
V41 = Fmt("v41", False, 1, 528, 512, 16, 32, 16, 512)
V41_FP4 = Fmt("v41_fp4", False, 2, 288, 256, 32, 16, 32, 256)
IDX_FP8 = Fmt("indexer_fp8", True, 0, 132, 128, 4, 128, 1, 1)
IDX_FP4 = Fmt("indexer_fp4", True, 1, 68, 64, 4, 32, 4, 1)
MAIN_FORMATS = [V4, V41, V41_FP4]
INDEXER_FORMATS = [IDX_FP8, IDX_FP4]
ALL_FORMATS = MAIN_FORMATS + INDEXER_FORMATS


def fmt_id(fmt: Fmt) -> str:
    return fmt.name


# ----------------------------------------------------------------------------------------------------
# Ops (public wrappers) and the matching reference calls


def op_store(fmt: Fmt, x, cache, slots, page_size, **kwargs):
    import sgl_dsv4_kernels as dsv4

    if fmt.indexer:
        dsv4.fused_store_cache(x, cache, slots, page_size=page_size, type="indexer",
                               use_fp4=fmt.id == 1, **kwargs)
    else:
        dsv4.fused_store_cache(x, cache, slots, page_size=page_size, layout=fmt.id, **kwargs)


def ref_store(ref, fmt: Fmt, x, cache, slots, page_size):
    if fmt.indexer:
        ref.store_indexer_cache(cache, x, slots, page_size, fmt.id)
    else:
        ref.store_k_cache(cache, x, slots, page_size, fmt.id)


def ref_quantize(ref, fmt: Fmt, x) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data [N, data_bytes], used scale bytes [N, scale_used]) of the reference quantizer."""
    if not fmt.indexer:
        data, scale = ref.quantize_rows(x, fmt.id)
        return data, scale[..., : fmt.scale_used]
    if fmt.id == 0:
        data, s = ref.quantize_indexer_fp8(x)
        return data, s.to(torch.float32).unsqueeze(-1).contiguous().view(torch.uint8)
    return ref.quantize_indexer_fp4(x)


# ----------------------------------------------------------------------------------------------------
# Scalar helpers


def f32_from_bits(bits) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def bits_from_f32(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def tensor_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64/int32 bit patterns -> fp32 tensor."""
    return bits.to(torch.int64).to(torch.int32).view(torch.float32)


def generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def seed_of(*parts) -> int:
    """A stable seed from test parameters (hash() of str is salted per process)."""
    h = 1469598103934665603
    for ch in repr(parts).encode():
        h = ((h ^ ch) * 1099511628211) & 0xFFFFFFFFFFFF
    return h


# ----------------------------------------------------------------------------------------------------
# Boundary tiles of kv-layouts-and-quant.md 4.7 (fp32 values)

# Magnitudes of the uniform tiles (+m at even, -m at odd positions), plus the 4.4 indexer-fp8 cases.
BOUNDARY_M = [0.0, 2.0**-12, 6 * 2.0**-9, 0.01, 6 * 1.0625, 6 * 1.1875, 8.25, 448.0, 449.0, 2688.0, 1e6]
IDX_FP8_CLIP_M = [f32_from_bits(0x3C030000), 1000.0]

V41_SPECIAL_TILE = [448, 17, 19, 2.0**-10, 3 * 2.0**-10, -(2.0**-10), -0.0, 248, 432, 2.0**-12, 200, -1e-30]
FP4_TIE_TILE = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5, -6, 0.1, -0.0, 0, 5.5, 4.5]
FP4_TIE_BLOCK = [8.25, 4.125, 3.4375, -4.8125, 0, -0.0, 2.5, -3.5] * 2
FP4_DIV_TILE = [f32_from_bits(0x40E3FFFF), -3, 1]
# fake_quant_fp4 subnormal block of section 6 (block_size 16).
FP4_SUBNORMAL_BLOCK = [3 * 2.0**-127, -(2.0**-128), 2.0**-129, -(2.0**-130)]


def uniform_tile(m: float, n: int) -> torch.Tensor:
    t = torch.full((n,), m, dtype=torch.float32)
    t[1::2] = -t[1::2]
    if m == 0.0:
        t[1::2] = -0.0
    return t


def padded_tile(values, n: int) -> torch.Tensor:
    t = torch.zeros(n, dtype=torch.float32)
    v = torch.tensor([float(a) for a in values], dtype=torch.float32)
    t[: min(n, v.numel())] = v[:n]
    return t


def special_tiles(n: int) -> List[torch.Tensor]:
    """Every 4.7 tile (and the 4.4 clip tiles) as fp32 tiles of n elements."""
    tiles = [uniform_tile(m, n) for m in BOUNDARY_M + IDX_FP8_CLIP_M]
    tiles += [padded_tile(v, n) for v in (V41_SPECIAL_TILE, FP4_TIE_TILE, FP4_TIE_BLOCK, FP4_DIV_TILE)]
    return tiles


# ----------------------------------------------------------------------------------------------------
# Row generators


def make_rows(n: int, width: int = 512, *, tile: int = 16, seed: int = 0, dtype=torch.float32,
              device="cpu", special: bool = True, exp_range=(-20, 20)) -> torch.Tensor:
    """Rows [n, width] built tile by tile (tiles of `tile` elements): randn scaled by 2^U(-20, 20) per tile,
    plus zero tiles, -0.0 half tiles, subnormal tiles, tiles holding a tiny negative, and every 4.7 tile
    (placed first, so the first rows always hold them). Rounded RNE to `dtype`."""
    g = generator(seed)
    assert width % tile == 0
    per_row = width // tile
    x = torch.randn(n, per_row, tile, generator=g)
    lo, hi = exp_range
    x *= torch.exp2(torch.rand(n, per_row, 1, generator=g) * (hi - lo) + lo)
    kind = torch.rand(n, per_row, generator=g)
    flat = x.view(-1, tile)
    kind = kind.view(-1)
    flat[kind < 0.04] = 0.0
    half = (kind >= 0.04) & (kind < 0.08)
    flat[half, : tile // 2] = -0.0
    sub = ((kind >= 0.08) & (kind < 0.12)).nonzero().squeeze(-1)
    if sub.numel():
        bits = torch.randint(1, 0x800000, (sub.numel(), tile), generator=g)
        sign = torch.randint(0, 2, (sub.numel(), tile), generator=g) << 31
        flat[sub] = tensor_from_bits(bits | sign)
    tiny = ((kind >= 0.12) & (kind < 0.14)).nonzero().squeeze(-1)
    if tiny.numel():
        flat[tiny, 0] = -1e-30
        flat[tiny, 1] = -1e-10
    if special:
        tiles = special_tiles(tile)
        count = min(len(tiles), flat.shape[0])
        flat[:count] = torch.stack(tiles[:count])
        # ... and again at random places further on
        extra = ((kind >= 0.14) & (kind < 0.18)).nonzero().squeeze(-1)
        if extra.numel():
            pick = torch.randint(0, len(tiles), (extra.numel(),), generator=g)
            flat[extra] = torch.stack(tiles)[pick]
    return x.view(n, width).to(dtype).to(device)


def strided_rows(x: torch.Tensor, extra: int = 3) -> torch.Tensor:
    """The same rows as a column slice of a wider tensor (row stride width + extra elements)."""
    n, w = x.shape
    wide = torch.full((n, w + extra), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, :w] = x
    return wide[:, :w]


def overlapping_rows(x: torch.Tensor, stride: int) -> torch.Tensor:
    """x.shape rows taken `stride` elements apart from x's values laid end to end: repeated rows (stride 0) or
    rows that overlap (stride < width)."""
    n, width = x.shape
    return x.reshape(-1)[: (n - 1) * stride + width].as_strided((n, width), (stride, 1))


# ----------------------------------------------------------------------------------------------------
# Slots


def invalid_slots(capacity: int, dtype) -> List[int]:
    big = 2**40 if dtype == torch.int64 else 2**31 - 1
    out = [-1, -capacity if capacity > 0 else -7, capacity, capacity + 5, big]
    if dtype == torch.int32:
        out.append(-(2**31))
    return out


def make_slots(n_valid: int, capacity: int, *, seed: int = 0, dtype=torch.int64, device="cpu",
               invalid: bool = True) -> torch.Tensor:
    """n_valid distinct valid slots in [0, capacity) plus the invalid ones, shuffled."""
    g = generator(seed)
    valid = torch.randperm(capacity, generator=g)[:n_valid]
    parts = [valid]
    if invalid:
        parts.append(torch.tensor(invalid_slots(capacity, dtype), dtype=torch.int64))
    s = torch.cat(parts)
    s = s[torch.randperm(s.numel(), generator=g)]
    return s.to(dtype).to(device)


# ----------------------------------------------------------------------------------------------------
# Caches

CACHE_KINDS = ["contiguous", "wide", "stride_plus64", "stride_2x", "column_slice", "pool_slice"]


def random_bytes(shape, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=generator(seed), dtype=torch.uint8).to(device)


def make_cache(fmt: Fmt, page_size: int, num_pages: int, *, kind: str = "contiguous", device="cpu",
               seed: int = 0, fill: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cache view, backing buffer). The buffer is poisoned with seeded random bytes (or `fill`).

    kinds: contiguous [n, page_bytes]; wide (W = page_bytes + 32); stride_plus64 / stride_2x (column
    slice [:, :page_bytes] of a buffer of page_bytes + 64 / 2 * page_bytes columns); column_slice
    ([:, 32:32 + page_bytes] of a wider buffer); pool_slice (dim-0 slice [2:2 + n] of a larger pool).
    """
    pb = fmt.page_bytes(page_size)
    if kind == "contiguous":
        shape, sl = (num_pages, pb), (slice(None), slice(None))
    elif kind == "wide":
        shape, sl = (num_pages, pb + 32), (slice(None), slice(None))
    elif kind == "stride_plus64":
        shape, sl = (num_pages, pb + 64), (slice(None), slice(0, pb))
    elif kind == "stride_2x":
        shape, sl = (num_pages, 2 * pb), (slice(None), slice(0, pb))
    elif kind == "column_slice":
        shape, sl = (num_pages, pb + 96), (slice(None), slice(32, 32 + pb))
    elif kind == "pool_slice":
        shape, sl = (num_pages + 5, pb), (slice(2, 2 + num_pages), slice(None))
    else:
        raise ValueError(kind)
    if fill is None:
        buf = random_bytes(shape, seed, device)
    else:
        buf = torch.full(shape, fill, dtype=torch.uint8, device=device)
    return buf[sl], buf


def clone_view(view: torch.Tensor, buf: torch.Tensor, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """A copy of `buf` (optionally on another device) and the same view into it."""
    assert buf.storage_offset() == 0
    b2 = buf.detach().to(buf.device if device is None else device, copy=True)
    return b2.as_strided(view.shape, view.stride(), view.storage_offset()), b2


def slot_offsets(fmt: Fmt, page_size: int, page_stride: int, slot: int) -> Tuple[int, int]:
    """(data offset, scale offset) of a slot in bytes from the cache base (section 2 arithmetic)."""
    page, row = slot // page_size, slot % page_size
    base = page * page_stride
    return base + row * fmt.data_bytes, base + page_size * fmt.data_bytes + row * fmt.scale_bytes


def read_rows(fmt: Fmt, cache: torch.Tensor, page_size: int, slots) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data rows, used scale bytes) stored at the given valid slots, read with the section 2 arithmetic."""
    flat = flat_bytes(cache).cpu()
    data, scale = [], []
    for s in [int(v) for v in slots]:
        d, c = slot_offsets(fmt, page_size, cache.stride(0), s)
        data.append(flat[d: d + fmt.data_bytes])
        scale.append(flat[c: c + fmt.scale_used])
    return torch.stack(data), torch.stack(scale)


def contiguous_rows(fmt: Fmt, cache: torch.Tensor, page_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(data, used scale) of every slot of a contiguous [num_pages, page_bytes] cache, in slot order."""
    p = page_size
    data = cache[:, : p * fmt.data_bytes].reshape(-1, fmt.data_bytes)
    scale = cache[:, p * fmt.data_bytes: p * (fmt.data_bytes + fmt.scale_bytes)].reshape(-1, fmt.scale_bytes)
    return data, scale[:, : fmt.scale_used]


def describe_byte(fmt: Fmt, page_size: int, page_stride: int, offset: int) -> str:
    page, off = divmod(offset, page_stride) if page_stride else (0, offset)
    so = fmt.scale_offset(page_size)
    if off < so:
        return f"page {page} data row {off // fmt.data_bytes} byte {off % fmt.data_bytes}"
    if off < so + page_size * fmt.scale_bytes:
        r = off - so
        return f"page {page} scale row {r // fmt.scale_bytes} byte {r % fmt.scale_bytes}"
    if off < fmt.page_bytes(page_size):
        return f"page {page} padding byte {off}"
    return f"page {page} byte {off} (past page_bytes)"


def assert_bytes_equal(got: torch.Tensor, expected: torch.Tensor, fmt: Optional[Fmt] = None,
                       page_size: int = 1, page_stride: int = 0, what: str = "cache"):
    """Whole-buffer byte comparison with a readable report of the first differences."""
    got, expected = got.cpu(), expected.cpu()
    assert got.shape == expected.shape, (got.shape, expected.shape)
    diff = (got != expected).reshape(-1).nonzero().squeeze(-1)
    if diff.numel() == 0:
        return
    g, e = got.reshape(-1), expected.reshape(-1)
    lines = []
    for off in diff[:12].tolist():
        where = describe_byte(fmt, page_size, page_stride, off) if fmt is not None else f"byte {off}"
        lines.append(f"  offset {off} ({where}): got 0x{int(g[off]):02X}, expected 0x{int(e[off]):02X}")
    raise AssertionError(f"{what}: {diff.numel()} bytes differ\n" + "\n".join(lines))


def assert_bits_equal(got: torch.Tensor, expected: torch.Tensor, what: str = "output"):
    """Bitwise comparison of two floating tensors of the same dtype (signs of zero and NaN bits included)."""
    assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    ibits = {2: torch.int16, 4: torch.int32}[got.element_size()]
    g = got.detach().cpu().contiguous().view(ibits)
    e = expected.detach().cpu().contiguous().view(ibits)
    diff = (g != e).nonzero()
    if diff.numel() == 0:
        return
    mask = (1 << (8 * got.element_size())) - 1
    lines = []
    for idx in diff[:12].tolist():
        gi, ei = int(g[tuple(idx)]) & mask, int(e[tuple(idx)]) & mask
        lines.append(f"  at {tuple(idx)}: got 0x{gi:X} ({got.cpu()[tuple(idx)].item()!r}), "
                     f"expected 0x{ei:X} ({expected.cpu()[tuple(idx)].item()!r})")
    raise AssertionError(f"{what}: {diff.shape[0]} elements differ\n" + "\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# Per-op sample inputs for opcheck / compile tests: (args, kwargs) with small deterministic tensors.


class Sample(NamedTuple):
    name: str
    op: object  # an OpOverload / OpOverloadPacket of torch.ops.dsv4
    args: tuple
    kwargs: dict


def store_samples(device="cpu") -> Iterator[Sample]:
    ops = torch.ops.dsv4
    for fmt in ALL_FORMATS:
        for dtype in (torch.bfloat16, torch.float32):
            p = 2
            cache, _ = make_cache(fmt, p, 4, device=device, seed=seed_of("opcheck", fmt.name))
            x = make_rows(7, fmt.width, tile=fmt.tile, seed=3, dtype=dtype, device=device)
            slots = torch.tensor([5, -1, 0, 7, 8, 3, 2**40], dtype=torch.int64, device=device)
            kw = dict(page_size=p)
            if fmt.indexer:
                kw.update(type="indexer", use_fp4=fmt.id == 1)
            else:
                kw.update(layout=fmt.id)
            yield Sample(f"store-{fmt.name}-{str(dtype)[6:]}", ops.fused_store_cache.default, (x, cache, slots), kw)
    for fmt in (V41, V41_FP4):
        cache, _ = make_cache(fmt, 2, 4, device=device, seed=1)
        x = make_rows(5, 512, tile=fmt.tile, seed=4, dtype=torch.bfloat16, device=device)
        slots = torch.tensor([1, 6, -1, 0, 3], dtype=torch.int32, device=device)
        freqs = rope_rows(5, seed=5).to(device)
        yield Sample(f"store-{fmt.name}-freqs", ops.fused_store_cache.default, (x, cache, slots),
                     dict(page_size=2, layout=fmt.id, freqs_cis=freqs))


def dequant_samples(device="cpu") -> Iterator[Sample]:
    ops = torch.ops.dsv4
    for fmt in MAIN_FORMATS:
        # a cache written by the store op (random bytes would decode to NaNs, which opcheck's
        # output comparison treats as mismatches)
        cache, _ = make_cache(fmt, 4, 3, device=device, fill=0)
        x = make_rows(12, 512, tile=fmt.tile, seed=seed_of("deq", fmt.name), dtype=torch.bfloat16, device=device)
        op_store(fmt, x, cache, torch.arange(12, device=device), 4)
        slots = torch.tensor([0, 11, -1, 5, 12, 3], dtype=torch.int32, device=device)
        yield Sample(f"dequant-{fmt.name}", ops.dequantize_k_cache_paged.default, (cache, slots, 4, fmt.id), {})
        out = torch.zeros(6, 1, 512, dtype=torch.bfloat16, device=device)
        yield Sample(f"dequant_out-{fmt.name}", ops.dequantize_k_cache_paged.out, (cache, slots, 4, fmt.id),
                     dict(out=out))


def fake_quant_samples(device="cpu") -> Iterator[Sample]:
    ops = torch.ops.dsv4
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = make_rows(6, 256, tile=16, seed=7, dtype=torch.float32).clamp(-6e4, 6e4).to(dtype).to(device)
        yield Sample(f"fq_kv-{str(dtype)[6:]}", ops.fake_quant_compressed_kv.default, (x,), {})
        for bs in (16, 128):
            yield Sample(f"fq_fp4-{str(dtype)[6:]}-{bs}", ops.fake_quant_fp4.default, (x,), dict(block_size=bs))
    x3 = make_rows(12, 64, tile=16, seed=8, dtype=torch.float32).view(3, 4, 64).to(device)
    yield Sample("fq_kv-3d", ops.fake_quant_compressed_kv.default, (x3,), {})
    yield Sample("fq_fp4-3d", ops.fake_quant_fp4.default, (x3,), dict(block_size=32))
    # Rank 12 whose 11 leading dims are laid out in reverse order, so none merges with another.
    x12 = make_rows(2**11, 32, tile=16, seed=9, dtype=torch.float32).view([2] * 11 + [32]).to(device)
    x12 = x12.permute(*range(10, -1, -1), 11).contiguous().permute(*range(10, -1, -1), 11)
    yield Sample("fq_kv-rank12", ops.fake_quant_compressed_kv.default, (x12,), {})
    yield Sample("fq_fp4-rank12", ops.fake_quant_fp4.default, (x12,), dict(block_size=16))


def all_samples(device="cpu") -> List[Sample]:
    return [*store_samples(device), *dequant_samples(device), *fake_quant_samples(device)]


# ----------------------------------------------------------------------------------------------------
# RoPE rows


def rope_rows(n: int, seed: int = 0) -> torch.Tensor:
    """Per-row rotation tables fp32 [n, 64] = (cos, sin) pairs of random angles, built on the CPU."""
    g = generator(seed)
    theta = (torch.rand(n, 32, generator=g, dtype=torch.float64) * 2 - 1) * math.pi
    f = torch.stack([torch.cos(theta), torch.sin(theta)], dim=-1).reshape(n, 64).to(torch.float32)
    return f.contiguous()


def flat_bytes(cache: torch.Tensor) -> torch.Tensor:
    """1-D byte view from the cache base to the end of its last page (works for column slices)."""
    n = (cache.size(0) - 1) * cache.stride(0) + cache.size(1) if cache.size(0) else 0
    return cache.as_strided((n,), (1,), cache.storage_offset())


def write_row_bytes(fmt: Fmt, cache: torch.Tensor, page_size: int, slot: int, data=None, scale=None):
    """Writes raw data / scale bytes (lists or uint8 tensors) of one slot, section 2 addressing."""
    d, s = slot_offsets(fmt, page_size, cache.stride(0), slot)
    flat = flat_bytes(cache)
    if data is not None:
        t = torch.as_tensor(data, dtype=torch.uint8).to(cache.device)
        flat[d: d + t.numel()] = t
    if scale is not None:
        t = torch.as_tensor(scale, dtype=torch.uint8).to(cache.device)
        flat[s: s + t.numel()] = t


def huge_cpu_tensor(nbytes, tmp_dir):
    """nbytes of CPU memory of which only the touched pages become resident: an ordinary allocation
    (virtual memory), or else a shared mapping of a sparse file (not counted by strict overcommit)."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError):
        pass
    path = tmp_dir / "huge_cache.bin"
    with open(path, "wb") as f:
        f.truncate(nbytes)
    try:
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError, OSError) as e:
        pytest.skip(f"cannot map a {nbytes / 2**30:.1f} GiB cache here: {e}")
