"""Python mirror of ``include/dsv4/kv_layout.cuh``: the main-KV layouts and indexer formats.

A test (T1) keeps this mirror equal to the C++ header through the introspection ops.
"""
from __future__ import annotations

import enum
from typing import Union

# (bytes_per_token, data_bytes, scale_bytes, tile, num_scales, page_align)
_LAYOUT_TRAITS = {
    0: (584, 576, 8, 64, 7, 576),
    1: (528, 512, 16, 32, 16, 512),
    2: (288, 256, 32, 16, 32, 256),
}
_INDEXER_TRAITS = {
    0: (132, 128, 4, 128, 1, 1),
    1: (68, 64, 4, 32, 4, 1),
}


class _FormatMixin:
    _traits: dict

    @property
    def bytes_per_token(self) -> int:
        return self._traits[int(self)][0]

    @property
    def data_bytes(self) -> int:
        return self._traits[int(self)][1]

    @property
    def scale_bytes(self) -> int:
        return self._traits[int(self)][2]

    @property
    def tile_size(self) -> int:
        return self._traits[int(self)][3]

    @property
    def num_scales(self) -> int:
        return self._traits[int(self)][4]

    @property
    def page_align(self) -> int:
        return self._traits[int(self)][5]

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one page: P data rows, P scale rows, padded to a multiple of page_align."""
        align = self.page_align
        return (page_size * self.bytes_per_token + align - 1) // align * align

    def scale_offset(self, page_size: int) -> int:
        return page_size * self.data_bytes


class KVLayout(_FormatMixin, enum.IntEnum):
    V4 = 0
    V41 = 1
    V41_FP4 = 2

    @property
    def _traits(self):  # type: ignore[override]
        return _LAYOUT_TRAITS

    @property
    def str_name(self) -> str:
        return self.name.lower()

    @property
    def is_fp4(self) -> bool:
        return self is KVLayout.V41_FP4

    @classmethod
    def parse(cls, x: Union["KVLayout", int, str]) -> "KVLayout":
        """Accepts a member, an integer id or a case-insensitive name ("v4", "v41", "v41_fp4")."""
        if isinstance(x, cls):
            return x
        if isinstance(x, str):
            key = x.strip().lower()
            for member in cls:
                if member.str_name == key:
                    return member
            raise ValueError(f"unknown KVLayout {x!r}; expected one of v4, v41, v41_fp4")
        if isinstance(x, int) and not isinstance(x, bool):
            try:
                return cls(x)
            except ValueError:
                raise ValueError(f"unknown KVLayout id {x}; expected 0 (V4), 1 (V41) or 2 (V41_FP4)") from None
        raise TypeError(f"cannot interpret {x!r} as a KVLayout")


class IndexerFormat(_FormatMixin, enum.IntEnum):
    FP8 = 0
    FP4 = 1

    @property
    def _traits(self):  # type: ignore[override]
        return _INDEXER_TRAITS

    @property
    def str_name(self) -> str:
        return self.name.lower()

    @property
    def is_fp4(self) -> bool:
        return self is IndexerFormat.FP4

    @classmethod
    def parse(cls, x: Union["IndexerFormat", int, str]) -> "IndexerFormat":
        """Accepts a member, an integer id or a case-insensitive name ("fp8", "fp4", "idx_fp8", "idx_fp4")."""
        if isinstance(x, cls):
            return x
        if isinstance(x, str):
            key = x.strip().lower()
            key = key[4:] if key.startswith("idx_") else key
            for member in cls:
                if member.str_name == key:
                    return member
            raise ValueError(f"unknown IndexerFormat {x!r}; expected fp8 or fp4 (or idx_fp8 / idx_fp4)")
        if isinstance(x, int) and not isinstance(x, bool):
            try:
                return cls(x)
            except ValueError:
                raise ValueError(f"unknown IndexerFormat id {x}; expected 0 (FP8) or 1 (FP4)") from None
        raise TypeError(f"cannot interpret {x!r} as an IndexerFormat")


def layout_argument(op: str, layout, name: str = "layout") -> int:
    """The integer id of a wrapper's layout argument; a bad value raises the parse error (ValueError or
    TypeError) prefixed with the op and the argument, as every wrapper error names them."""
    try:
        return int(KVLayout.parse(layout))
    except (ValueError, TypeError) as e:
        raise type(e)(f"{op}: {name}: {e}") from None


def is_valid_kv_layout_pair(main, extra) -> bool:
    """A pool may pair a main cache with extra caches of the same layout, or V41 with V41_FP4."""
    main, extra = KVLayout.parse(main), KVLayout.parse(extra)
    return main == extra or (main == KVLayout.V41 and extra == KVLayout.V41_FP4)
