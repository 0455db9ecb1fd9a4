"""An op rejects a written tensor that shares memory with another of its tensor arguments
(csrc/common/overlap_checks.cpp), and accepts every disjoint placement, however interleaved.

1. Every written argument of every op (one recorded valid call each, tests/fuzz_ops.py), placed in one buffer with
   each other tensor argument: overlapping by all bytes, by one element at either end (rejected, the message
   naming both), or adjacent (accepted).
2. Random row-strided placements of two tensors in one buffer against a byte-set reference: the check's answer is
   exactly whether a byte is shared (dequantize's `out` against its `cache`; the store's `cache` against its
   `input`, whose rows may repeat or overlap).
"""
from __future__ import annotations

import random
from typing import Dict, List

import numpy as np
import pytest
import torch

import fuzz_ops
import sgl_dsv4_kernels as dk
from samples import devices

ALIGN = 16  # the strictest alignment any op asks of a tensor's address


def _written_names(op: str) -> List[str]:
    return [a.name for a in fuzz_ops.op_of(op)._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _tensors(call: fuzz_ops.Call) -> Dict[str, tuple]:
    """Argument name -> (index or keyword, value), for the call's non-empty tensors."""
    return {name: (where, value) for where, name, value in fuzz_ops.arg_places(call)
            if isinstance(value, torch.Tensor) and value.numel()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _in_buffer(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor shaped like `like`, holding its values, at byte `offset` of `buffer`."""
    view = buffer[offset: offset + _nbytes(like)].view(like.dtype).view(like.shape)
    return view.copy_(like)


def _placed_call(call: fuzz_ops.Call, written: str, other: str, placement: str) -> fuzz_ops.Call:
    tensors = _tensors(call)
    (w_at, w), (o_at, o) = tensors[written], tensors[other]
    bw, bo = _nbytes(w), _nbytes(o)
    offsets = {  # (written's offset, other's offset)
        "same start": (0, 0),
        "other's last element on written's first": ((bo - 1) // ALIGN * ALIGN, 0),
        "written's last element on other's first": (0, (bw - 1) // ALIGN * ALIGN),
        "adjacent": (0, -(-bw // ALIGN) * ALIGN),
    }[placement]
    buffer = torch.zeros(max(offsets[0] + bw, offsets[1] + bo), dtype=torch.uint8, device=w.device)
    # The other argument is copied last: an input keeps its values where the two share bytes.
    placed_written = _in_buffer(buffer, offsets[0], w)
    return fuzz_ops.replaced(call, {w_at: placed_written, o_at: _in_buffer(buffer, offsets[1], o)})


def _alias_cases(calls: List[fuzz_ops.Call]):
    """(call, written, other) for every written argument and every other non-empty tensor on its device, from
    the smallest recorded call of each op."""
    smallest = {}
    for c in sorted(calls, key=lambda c: sum(_nbytes(a) for a in c.args + tuple(c.kwargs.values())
                                             if isinstance(a, torch.Tensor))):
        smallest.setdefault(c.op, c)
    for op, call in sorted(smallest.items()):
        tensors = _tensors(call)
        for written in (n for n in _written_names(op) if n in tensors):
            for other, (_, value) in tensors.items():
                if other != written and value.device == tensors[written][1].device:
                    yield call, written, other


@pytest.fixture(scope="module", params=devices())
def alias_cases(request):
    return list(_alias_cases(fuzz_ops.record_calls(request.param)))


def test_every_op_with_a_written_tensor_is_covered(alias_cases):
    ops = {c.op for c, _, _ in alias_cases}
    with_written = {op for op in fuzz_ops.all_ops() if _written_names(op)}
    assert ops == with_written and len(alias_cases) >= 60


@pytest.mark.parametrize("placement", ["same start", "other's last element on written's first",
                                       "written's last element on other's first"])
def test_shared_bytes_are_rejected(alias_cases, placement):
    failures = []
    for call, written, other in alias_cases:
        placed = _placed_call(call, written, other, placement)
        try:
            fuzz_ops.op_of(placed.op)(*placed.args, **placed.kwargs)
            failures.append(f"{call.op} {written} / {other}: accepted")
        except RuntimeError as e:
            packet = call.op.split(".")[0]
            message = str(e)
            if not (f"dsv4.{packet}" in message and "shares memory" in message and written in message
                    and other in message):
                failures.append(f"{call.op} {written} / {other}: {message.splitlines()[0][:200]}")
    assert not failures, f"{len(failures)} of {len(alias_cases)}:\n" + "\n".join(failures[:20])


def test_adjacent_placements_are_accepted(alias_cases):
    failures = []
    for call, written, other in alias_cases:
        placed = _placed_call(call, written, other, "adjacent")
        try:
            fuzz_ops.op_of(placed.op)(*placed.args, **placed.kwargs)
        except RuntimeError as e:
            failures.append(f"{call.op} {written} / {other}: {str(e).splitlines()[0][:200]}")
    assert not failures, f"{len(failures)} of {len(alias_cases)}:\n" + "\n".join(failures[:20])


# ---- exactness against a byte-set reference ----


def _bytes_of(t: torch.Tensor, base: int) -> np.ndarray:
    """The byte offsets (from `base`) of every element of `t`."""
    index = np.zeros(1, dtype=np.int64)
    for size, stride in zip(t.shape, t.stride()):
        index = (index[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    first = t.data_ptr() - base
    return np.unique((first + index[:, None] * t.element_size() + np.arange(t.element_size())).reshape(-1))


def _shares_bytes(a: torch.Tensor, b: torch.Tensor, base: int) -> bool:
    return np.intersect1d(_bytes_of(a, base), _bytes_of(b, base)).size > 0


def _rejected(fn) -> bool:
    try:
        fn()
        return False
    except RuntimeError as e:
        assert "shares memory" in str(e), str(e)
        return True


PAGE = 2  # tokens per page: small pages keep the byte sets small
WIDTH = dk.KVLayout.V4.page_bytes(PAGE)
CACHE_STRIDES = [WIDTH, WIDTH + 16, 2 * WIDTH, 2048]


def _random_cache(rng, buffer: torch.Tensor) -> torch.Tensor:
    """A V4 cache of 1-5 pages at a random 16-byte aligned place, its pages spaced by a random stride."""
    return buffer.as_strided((rng.choice([1, 2, 3, 5]), WIDTH), (rng.choice(CACHE_STRIDES), 1),
                             rng.randrange(0, 12000, 16))


def _bf16_rows(rng, buffer: torch.Tensor, shape, strides) -> torch.Tensor:
    return buffer.view(torch.bfloat16).as_strided(shape, strides, rng.randrange(0, 6000))


def _agrees_with_byte_sets(device, draw):
    """300 random placements from draw(rng, buffer) -> (written, other, call): the call is rejected exactly when
    the two tensors share a byte; both answers occur often."""
    rng = random.Random(0)
    buffer = torch.zeros(1 << 15, dtype=torch.uint8, device=device)
    seen = {True: 0, False: 0}
    for _ in range(300):
        written, other, call = draw(rng, buffer)
        expected = _shares_bytes(written, other, buffer.data_ptr())
        where = [(t.shape, t.stride(), t.data_ptr() - buffer.data_ptr()) for t in (written, other)]
        assert _rejected(call) == expected, where
        seen[expected] += 1
    assert min(seen.values()) >= 30, seen


@pytest.mark.parametrize("device", devices())
def test_dequantize_out_against_cache_exactly(device):
    def draw(rng, buffer):
        cache = _random_cache(rng, buffer)
        rows = rng.choice([1, 2, 3, 4])
        out_stride = rng.choice([512, 512 + 8, 1024, cache.stride(0) // 2])
        out = _bf16_rows(rng, buffer, (rows, 1, 512), (out_stride, 512, 1))
        slots = torch.full((rows,), -1, dtype=torch.int64, device=device)  # skipped rows: nothing is written
        return out, cache, lambda: torch.ops.dsv4.dequantize_k_cache_paged.out(cache, slots, PAGE, 0, out=out)

    _agrees_with_byte_sets(device, draw)


@pytest.mark.parametrize("device", devices())
def test_store_cache_against_input_rows_exactly(device):
    def draw(rng, buffer):
        cache = _random_cache(rng, buffer)
        rows = rng.choice([1, 2, 3, 6])
        # Repeated (0), overlapping (< 512) and spaced row strides of a bf16 input.
        x = _bf16_rows(rng, buffer, (rows, 512), (rng.choice([0, 100, 512, 600, cache.stride(0) // 2, 1024]), 1))
        slots = torch.full((rows,), -1, dtype=torch.int64, device=device)
        return cache, x, lambda: dk.fused_store_cache(x, cache, slots, page_size=PAGE, layout=dk.KVLayout.V4)

    _agrees_with_byte_sets(device, draw)

@pytest.mark.parametrize("device", devices())
def test_a_rejected_call_writes_nothing(device):
    buffer = torch.arange(4 * WIDTH, device=device).to(torch.uint8)
    before = buffer.clone()
    cache = buffer.view(4, WIDTH)
    x = buffer[: 4 * 1024].view(torch.bfloat16).view(4, 512)
    slots = torch.arange(4, device=device)
    with pytest.raises(RuntimeError, match="dsv4.fused_store_cache: cache shares memory with input"):
        dk.fused_store_cache(x, cache, slots, page_size=PAGE, layout=dk.KVLayout.V4)
    if device == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(buffer, before)
