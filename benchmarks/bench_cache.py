"""KV I/O benchmarks: fused_store_cache (every main layout and both indexer formats) and
dequantize_k_cache_paged (every layout), at decode sizes under CUDA-graph replay and at large N
with consecutive and random slots; compared with compiled torch and a plain gather/scatter copy.
"""
from __future__ import annotations

import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import KVLayout, IndexerFormat

from . import torch_impls_cache as ref_torch
from .harness import torch_baseline_us, Bench, as_words, compiled, gather_copy_us, row, scatter_rows_baseline

DECODE_SIZES = (1, 8, 64, 256, 1024)
LARGE_SIZES = (65536, 131072, 1 << 20)
CALLS_PER_GRAPH = 64
DECODE_CACHE_BYTES = 256 << 20  # destination slots rotate over a cache > 2x L2
PAGE = 64
INDEX_BYTES = 4  # int32 slots


def _cache(fmt, tokens, device="cuda"):
    pages = (tokens + PAGE - 1) // PAGE
    return torch.randint(0, 256, (pages, fmt.page_bytes(PAGE)), dtype=torch.uint8, device=device)


def _store_bytes(fmt, n):
    read = 1024 if isinstance(fmt, KVLayout) else 256
    written = fmt.bytes_per_token - (1 if fmt == KVLayout.V4 else 0)  # V4 scale byte 7 is never written
    return n * (read + INDEX_BYTES + written)


def _dequant_bytes(layout, n):
    stored = layout.bytes_per_token - (1 if layout == KVLayout.V4 else 0)
    return n * (stored + INDEX_BYTES + 1024)


def _our_store(fmt):
    if isinstance(fmt, KVLayout):
        return lambda x, cache, slots: dsv4.fused_store_cache(x, cache, slots, page_size=PAGE, layout=fmt)
    return lambda x, cache, slots: dsv4.fused_store_cache(
        x, cache, slots, page_size=PAGE, type="indexer", use_fp4=fmt == IndexerFormat.FP4)


_COMPILED = {}


def _compiled_once(key, fn):
    """One torch.compile per (op, format), shared by the decode and the large cases."""
    if key not in _COMPILED:
        _COMPILED[key] = compiled(fn)
    return _COMPILED[key]


def _torch_store(fmt):
    if isinstance(fmt, KVLayout):
        fn = _compiled_once(("store", fmt), ref_torch.store_main)
        return lambda x, cache, slots: fn(x, cache, slots, PAGE, int(fmt))
    fn = _compiled_once(("store_indexer", fmt), ref_torch.store_indexer)
    return lambda x, cache, slots: fn(x, cache, slots, PAGE, int(fmt))


def _torch_dequant(layout):
    fn = _compiled_once(("dequant", layout), ref_torch.dequantize)
    return lambda cache, slots: fn(cache, slots, PAGE, int(layout))



def _decode_store(bench, results, fmt, name):
    width = 512 if isinstance(fmt, KVLayout) else 128
    cache = _cache(fmt, DECODE_CACHE_BYTES // fmt.bytes_per_token)
    capacity = cache.shape[0] * PAGE
    ours, theirs = _our_store(fmt), _torch_store(fmt)
    for n in DECODE_SIZES:
        xs = [torch.randn(n, width, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS_PER_GRAPH)]
        slot_sets = torch.randperm(capacity, device="cuda")[: n * CALLS_PER_GRAPH].int().view(CALLS_PER_GRAPH, n)
        hot = xs + list(slot_sets)  # the cache comes cold
        us = bench.time_graph([lambda x=x, s=s: ours(x, cache, s) for x, s in zip(xs, slot_sets)], hot=hot)
        t_us = torch_baseline_us(
            lambda: bench.time_graph([lambda x=x, s=s: theirs(x, cache, s) for x, s in zip(xs, slot_sets)], hot=hot))
        results.append(row(bench, family="kv_io", op="store", case=f"{name} decode", n=n, us=us,
                           nbytes=_store_bytes(fmt, n), torch_us=t_us, target="<= 3 us" if n <= 256 else ""))


def _large_store(bench, results, fmt, name):
    width = 512 if isinstance(fmt, KVLayout) else 128
    ours, theirs = _our_store(fmt), _torch_store(fmt)
    for n in LARGE_SIZES:
        x = torch.randn(n, width, device="cuda", dtype=torch.bfloat16)
        cache = _cache(fmt, n)
        for pattern in ("consecutive", "random"):
            slots = (torch.arange(n, device="cuda") if pattern == "consecutive"
                     else torch.randperm(n, device="cuda")).int()
            us = bench.time_single(lambda: ours(x, cache, slots))
            t_us = torch_baseline_us(lambda: bench.time_single(lambda: theirs(x, cache, slots)))
            extra = {}
            if pattern == "random":  # a scatter of the same data rows into the same slots
                extra = scatter_rows_baseline(bench, fmt.data_bytes, slots)
            if pattern == "consecutive":
                target = ">= 70 %" if fmt == KVLayout.V41_FP4 else (">= 85 %" if isinstance(fmt, KVLayout) else "")
            else:
                target = ">= 90 % of scatter" if isinstance(fmt, KVLayout) else ""
            results.append(row(bench, family="kv_io", op="store", case=f"{name} {pattern}", n=n, us=us,
                               nbytes=_store_bytes(fmt, n), torch_us=t_us, target=target, **extra))
        del x, cache


def _decode_dequant(bench, results, layout):
    cache = _cache(layout, DECODE_CACHE_BYTES // layout.bytes_per_token)
    capacity = cache.shape[0] * PAGE
    theirs = _torch_dequant(layout)
    for n in DECODE_SIZES:
        slot_sets = torch.randperm(capacity, device="cuda")[: n * CALLS_PER_GRAPH].int().view(CALLS_PER_GRAPH, n)
        outs = [torch.empty(n, 1, 512, dtype=torch.bfloat16, device="cuda") for _ in range(CALLS_PER_GRAPH)]
        hot = list(slot_sets)  # the cache rows read come cold, as attention finds them
        us = bench.time_graph([lambda s=s, o=o: dsv4.dequantize_k_cache_paged(cache, s, PAGE, layout=layout, out=o)
                               for s, o in zip(slot_sets, outs)], hot=hot)
        t_us = torch_baseline_us(lambda: bench.time_graph([lambda s=s: theirs(cache, s) for s in slot_sets], hot=hot))
        results.append(row(bench, family="kv_io", op="dequant", case=f"{layout.str_name} decode", n=n, us=us,
                           nbytes=_dequant_bytes(layout, n), torch_us=t_us, target="<= 3 us" if n <= 256 else ""))


def _large_dequant(bench, results, layout):
    theirs = _torch_dequant(layout)
    for n in LARGE_SIZES:
        cache = _cache(layout, n)
        out = torch.empty(n, 1, 512, dtype=torch.bfloat16, device="cuda")
        for pattern in ("consecutive", "random"):
            slots = (torch.arange(n, device="cuda") if pattern == "consecutive"
                     else torch.randperm(n, device="cuda")).int()
            us = bench.time_single(lambda: dsv4.dequantize_k_cache_paged(cache, slots, PAGE, layout=layout, out=out))
            t_us = torch_baseline_us(lambda: bench.time_single(lambda: theirs(cache, slots)))
            extra = {}
            if pattern == "random":
                # Gather of whole stored token rows (data + scale bytes) by the same slots.
                token = layout.data_bytes + layout.scale_bytes
                words = as_words(token)
                src = torch.ones(n, token // torch.empty((), dtype=words).element_size(), dtype=words, device="cuda")
                extra = dict(baseline_us=gather_copy_us(bench, src, slots.long()), baseline_bytes=2 * n * token)
            target = (">= 85 %" if pattern == "consecutive" else ">= 90 % of gather")
            results.append(row(bench, family="kv_io", op="dequant", case=f"{layout.str_name} {pattern}", n=n, us=us,
                               nbytes=_dequant_bytes(layout, n), torch_us=t_us, target=target, **extra))
        del cache, out


def run(bench: Bench, results) -> None:
    for layout in KVLayout:
        print(f"kv_io: {layout.str_name}")
        _decode_store(bench, results, layout, layout.str_name)
        _large_store(bench, results, layout, layout.str_name)
        _decode_dequant(bench, results, layout)
        _large_dequant(bench, results, layout)
    for fmt in IndexerFormat:
        name = f"indexer_{fmt.str_name}"
        print(f"kv_io: {name}")
        _decode_store(bench, results, fmt, name)
        _large_store(bench, results, fmt, name)
