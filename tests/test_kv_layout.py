"""T1: the KV layout mirror. The Python enums (sgl_dsv4_kernels.kv_layout), the C++ header as seen through
the introspection ops, and the lists of kv-layouts-and-quant.md sections 1 and 3 must all agree."""
import pathlib
import re

import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import IndexerFormat, KVLayout, is_valid_kv_layout_pair

REPO = pathlib.Path(__file__).resolve().parents[1]

# [bytes_per_token, data_bytes, scale_bytes, tile, num_scales, page_align], spec section 1 / 3.
SPEC_LAYOUT_TRAITS = {
    0: [584, 576, 8, 64, 7, 576],
    1: [528, 512, 16, 32, 16, 512],
    2: [288, 256, 32, 16, 32, 256],
}
SPEC_INDEXER_TRAITS = {
    0: [132, 128, 4, 128, 1, 1],
    1: [68, 64, 4, 32, 4, 1],
}
SPEC_NAMES = {0: "v4", 1: "v41", 2: "v41_fp4"}
SPEC_INDEXER_NAMES = {0: "fp8", 1: "fp4"}
GEOMETRY_FORMATS = {
    "v4": SPEC_LAYOUT_TRAITS[0],
    "v41": SPEC_LAYOUT_TRAITS[1],
    "v41_fp4": SPEC_LAYOUT_TRAITS[2],
    "indexer_fp8": SPEC_INDEXER_TRAITS[0],
    "indexer_fp4": SPEC_INDEXER_TRAITS[1],
}
# Section 1 page table: P -> page_bytes of (V4, V41, V41_FP4, IDX_FP8, IDX_FP4), and the V4/V41/FP4 pads.
SPEC_PAGE_TABLE = {
    1: ((1152, 1024, 512, 132, 68), (568, 496, 224)),
    2: ((1728, 1536, 768, 264, 136), (560, 480, 192)),
    16: ((9792, 8704, 4608, 2112, 1088), (448, 256, 0)),
    64: ((37440, 33792, 18432, 8448, 4352), (64, 0, 0)),
    128: ((74880, 67584, 36864, 16896, 8704), (128, 0, 0)),
    256: ((149760, 135168, 73728, 33792, 17408), (256, 0, 0)),
    1024: ((598464, 540672, 294912, 135168, 69632), (448, 0, 0)),
}
PAGE_SIZES = [2**k for k in range(11)]


def python_traits(fmt):
    return [fmt.bytes_per_token, fmt.data_bytes, fmt.scale_bytes, fmt.tile_size, fmt.num_scales, fmt.page_align]


def spec_page_bytes(traits, p):
    bpt, _, _, _, _, align = traits
    return -(-p * bpt // align) * align


@pytest.mark.parametrize("layout_id", [0, 1, 2])
def test_layout_traits_mirror(layout_id):
    member = KVLayout(layout_id)
    assert int(member) == layout_id
    assert member.str_name == SPEC_NAMES[layout_id]
    assert member.is_fp4 == (layout_id == 2)
    assert list(torch.ops.dsv4.kv_layout_traits(layout_id)) == SPEC_LAYOUT_TRAITS[layout_id]
    assert python_traits(member) == SPEC_LAYOUT_TRAITS[layout_id]


@pytest.mark.parametrize("fmt_id", [0, 1])
def test_indexer_traits_mirror(fmt_id):
    member = IndexerFormat(fmt_id)
    assert int(member) == fmt_id
    assert member.str_name == SPEC_INDEXER_NAMES[fmt_id]
    assert member.is_fp4 == (fmt_id == 1)
    assert list(torch.ops.dsv4.indexer_format_traits(fmt_id)) == SPEC_INDEXER_TRAITS[fmt_id]
    assert python_traits(member) == SPEC_INDEXER_TRAITS[fmt_id]


def test_enum_members_are_exactly_the_spec_ids():
    assert [(m.name, int(m)) for m in KVLayout] == [("V4", 0), ("V41", 1), ("V41_FP4", 2)]
    assert [(m.name, int(m)) for m in IndexerFormat] == [("FP8", 0), ("FP4", 1)]


@pytest.mark.parametrize("fmt_name", list(GEOMETRY_FORMATS))
def test_page_geometry_all_page_sizes(fmt_name):
    traits = GEOMETRY_FORMATS[fmt_name]
    if fmt_name.startswith("indexer"):
        mirror = IndexerFormat.parse(fmt_name[len("indexer_"):])
    else:
        mirror = KVLayout.parse(fmt_name)
    for p in PAGE_SIZES:
        expected = [spec_page_bytes(traits, p), p * traits[1]]
        assert list(torch.ops.dsv4.page_geometry(fmt_name, p)) == expected, (fmt_name, p)
        assert [mirror.page_bytes(p), mirror.scale_offset(p)] == expected, (fmt_name, p)
        # a page holds P data rows and P scale rows, and the padding is less than one alignment unit
        assert expected[0] >= p * traits[0] and expected[0] - p * traits[0] < traits[5]
        assert expected[0] % traits[5] == 0


@pytest.mark.parametrize("p", sorted(SPEC_PAGE_TABLE))
def test_page_table_of_the_spec(p):
    page_bytes, pads = SPEC_PAGE_TABLE[p]
    names = ["v4", "v41", "v41_fp4", "indexer_fp8", "indexer_fp4"]
    for name, pb in zip(names, page_bytes):
        assert torch.ops.dsv4.page_geometry(name, p)[0] == pb, (name, p)
    for layout_id, pad in enumerate(pads):
        assert KVLayout(layout_id).page_bytes(p) - p * SPEC_LAYOUT_TRAITS[layout_id][0] == pad


def test_worked_scale_offsets():
    # kv-layouts-and-quant.md section 3 examples (P = 64).
    assert list(torch.ops.dsv4.page_geometry("indexer_fp8", 64)) == [8448, 8192]
    assert list(torch.ops.dsv4.page_geometry("indexer_fp4", 64)) == [4352, 4096]
    assert list(torch.ops.dsv4.page_geometry("v4", 64)) == [37440, 36864]
    assert list(torch.ops.dsv4.page_geometry("v41", 64)) == [33792, 32768]
    assert list(torch.ops.dsv4.page_geometry("v41_fp4", 64)) == [18432, 16384]


# ---------------------------------------------------------------------------------------------------
# parse


@pytest.mark.parametrize("layout_id", [0, 1, 2])
def test_layout_parse_round_trips(layout_id):
    member = KVLayout(layout_id)
    name = SPEC_NAMES[layout_id]
    for x in (member, layout_id, name, name.upper(), name.capitalize(), f" {name} "):
        assert KVLayout.parse(x) is member, x
    assert KVLayout.parse(member.str_name) is member
    assert KVLayout.parse(int(member)) is member


@pytest.mark.parametrize("fmt_id", [0, 1])
def test_indexer_parse_round_trips(fmt_id):
    member = IndexerFormat(fmt_id)
    name = SPEC_INDEXER_NAMES[fmt_id]
    for x in (member, fmt_id, name, name.upper(), "idx_" + name, ("IDX_" + name).upper()):
        assert IndexerFormat.parse(x) is member, x
    assert IndexerFormat.parse(member.str_name) is member


@pytest.mark.parametrize("bad", [3, -1, 100, "v5", "", "fp8", "v4.1", "V41-FP4"])
def test_layout_parse_unknown_raises(bad):
    with pytest.raises((ValueError, TypeError)):
        KVLayout.parse(bad)


@pytest.mark.parametrize("bad", [2, -1, "fp16", "v4", "idx_", "idx_fp2"])
def test_indexer_parse_unknown_raises(bad):
    with pytest.raises((ValueError, TypeError)):
        IndexerFormat.parse(bad)


@pytest.mark.parametrize("bad", [None, 1.0, [0]])
def test_parse_rejects_non_ids(bad):
    with pytest.raises((ValueError, TypeError)):
        KVLayout.parse(bad)
    with pytest.raises((ValueError, TypeError)):
        IndexerFormat.parse(bad)


# ---------------------------------------------------------------------------------------------------
# pair matrix


PAIR_MATRIX = {  # (main, extra) -> valid, section 1
    (0, 0): True, (0, 1): False, (0, 2): False,
    (1, 0): False, (1, 1): True, (1, 2): True,
    (2, 0): False, (2, 1): False, (2, 2): True,
}


@pytest.mark.parametrize("pair", sorted(PAIR_MATRIX))
def test_pair_matrix(pair):
    main, extra = pair
    expected = PAIR_MATRIX[pair]
    assert is_valid_kv_layout_pair(KVLayout(main), KVLayout(extra)) is expected
    assert is_valid_kv_layout_pair(main, extra) is expected
    assert is_valid_kv_layout_pair(SPEC_NAMES[main], SPEC_NAMES[extra].upper()) is expected
    assert torch.ops.dsv4.kv_layout_pair_valid(main, extra) is expected  # the C++ function


def test_pair_with_unknown_layout_raises():
    with pytest.raises((ValueError, TypeError)):
        is_valid_kv_layout_pair(1, 3)
    with pytest.raises((ValueError, TypeError)):
        is_valid_kv_layout_pair("v5", "v4")
    for main, extra, name in ((1, 3, "extra"), (-1, 0, "main"), (2**32, 0, "main"), (0, 2**32 + 1, "extra")):
        with pytest.raises(RuntimeError, match=rf"dsv4\.kv_layout_pair_valid: {name} must be a KVLayout id"):
            torch.ops.dsv4.kv_layout_pair_valid(main, extra)


# ---------------------------------------------------------------------------------------------------
# introspection ops: unknown ids


@pytest.mark.parametrize("bad", [3, -1, 2**32, 2**32 + 1, -(2**32)])
def test_kv_layout_traits_unknown_raises(bad):
    with pytest.raises(RuntimeError, match=r"dsv4\.kv_layout_traits.*\blayout\b"):
        torch.ops.dsv4.kv_layout_traits(bad)


@pytest.mark.parametrize("bad", [2, -1, 2**32, 2**32 + 1])
def test_indexer_format_traits_unknown_raises(bad):
    with pytest.raises(RuntimeError, match=r"dsv4\.indexer_format_traits.*\bfmt\b"):
        torch.ops.dsv4.indexer_format_traits(bad)


@pytest.mark.parametrize("bad", ["v5", "", "V4", "indexer", "fp8", "idx_fp8", "v4 "])
def test_page_geometry_unknown_format_raises(bad):
    with pytest.raises(RuntimeError, match=r"dsv4\.page_geometry.*\bformat\b"):
        torch.ops.dsv4.page_geometry(bad, 64)


@pytest.mark.parametrize("bad", [0, -1, 3, 48, 2048, 2**31, 2**32 + 64])
def test_page_geometry_bad_page_size_raises(bad):
    with pytest.raises(RuntimeError, match=r"dsv4\.page_geometry.*\bpage_size\b"):
        torch.ops.dsv4.page_geometry("v4", bad)


# ---------------------------------------------------------------------------------------------------
# single definition


SIZE_LITERAL = re.compile(r"\b(584|528|288|132|68)\b")


def test_size_literals_only_in_kv_layout_header():
    header = REPO / "include" / "dsv4" / "kv_layout.cuh"
    assert header.is_file()
    assert SIZE_LITERAL.search(header.read_text())  # the grep itself works
    offenders = []
    roots = [REPO / "csrc", REPO / "include"]
    files = [f for root in roots for f in sorted(root.rglob("*")) if f.is_file()]
    assert files
    for f in files:
        if f.resolve() == header.resolve():
            continue
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if SIZE_LITERAL.search(line):
                offenders.append(f"{f.relative_to(REPO)}:{lineno}: {line.strip()}")
    assert not offenders, "size literals outside include/dsv4/kv_layout.cuh:\n" + "\n".join(offenders)


def test_package_exports():
    for name in ("KVLayout", "IndexerFormat", "is_valid_kv_layout_pair", "fused_store_cache",
                 "dequantize_k_cache_paged", "fake_quant_compressed_kv", "fake_quant_fp4"):
        assert hasattr(dsv4, name), name
