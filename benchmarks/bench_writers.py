"""Norm + RoPE writer benchmarks: fused_k_norm_rope_flashmla (every main layout) and
compress_norm_rope_store (main layouts and both indexer formats, decode plans at ratio 4), at decode sizes
under CUDA-graph replay and at large N (65536, 131072 and 2^20 rows; consecutive slots against a plain copy
of the same bytes, random slots against a scatter of the same data rows), against compiled torch. Up to 65536
rows the compress writer also runs the same rows as a prefill plan (the shape of a real large-N call: a
prefill emits one compressed row per `ratio` tokens; ragged ids are 16-bit, so a plan holds <= 65536 rows).
The single-call sizes also include prefill-chunk sizes below the spec's large N (4096 to 32768 rows, no
target): the K writer switches to its pipelined kernel at 4096 rows, whose warps take 16 rows each.

    python -m benchmarks.bench_writers [--only k_writer,compress] [--no-torch]
"""
from __future__ import annotations

import argparse

import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import IndexerFormat, KVLayout

from . import torch_impls_writers as torch_impls
from .harness import (DEVICE, MAX_POS, torch_baseline_us, Bench, compiled, flat_copy_single_us, rope_table, row,
                      scatter_rows_baseline)

DECODE_SIZES = (1, 8, 64, 256, 1024)
LARGE_SIZES = (65536, 131072, 1 << 20)
MID_SIZES = (4096, 8192, 16384, 32768)  # prefill chunks: timed like the large sizes, no target
CALLS_PER_GRAPH = 64
DECODE_CACHE_BYTES = 256 << 20  # destination slots rotate over a cache > 2x L2
PAGE = 64
RATIO = 4
EPS = 1e-6
TABLE_ROW_BYTES = 256
MAX_PREFILL_ROWS = 1 << 16  # ragged ids are 16-bit

# (op, format): the K writer over the main layouts, the compress writer over main and indexer formats.
CASES = [("k_writer", layout) for layout in KVLayout] + [("compress", fmt) for fmt in (*KVLayout, *IndexerFormat)]


def _name(fmt) -> str:
    return fmt.str_name if isinstance(fmt, KVLayout) else f"indexer_{fmt.str_name}"


def _written(fmt) -> int:
    return fmt.bytes_per_token - (1 if fmt is KVLayout.V4 else 0)  # V4 scale byte 7 is never written


def _cache(fmt, tokens):
    pages = (tokens + PAGE - 1) // PAGE
    return torch.randint(0, 256, (pages, fmt.page_bytes(PAGE)), dtype=torch.uint8, device=DEVICE)


def _inputs(op, fmt, slots, table, prefill=False):
    """One call's inputs: bf16 kv for the K writer (a column of the fused QKV output in a model), fp32 kv
    for the compress writer (the compressor emits fp32) with a decode plan whose every row emits, or
    (prefill) a prefill plan of the same rows: entry r carries ragged id r, so its slot is out_loc[r]."""
    n = slots.shape[0]
    d = 512 if isinstance(fmt, KVLayout) else 128
    inputs = dict(weight=torch.randn(d, device=DEVICE).to(torch.bfloat16), table=table)
    if op == "k_writer":
        inputs.update(kv=torch.randn(n, d, device=DEVICE, dtype=torch.bfloat16),
                      positions=torch.randint(0, MAX_POS, (n,), device=DEVICE, dtype=torch.int32),
                      out_loc=slots.int())
    else:
        seq_len = RATIO * torch.randint(1, MAX_POS // RATIO + 1, (n,), device=DEVICE, dtype=torch.int32)
        plan = torch.zeros(n, 16, dtype=torch.uint8, device=DEVICE)
        plan[:, :4] = seq_len.view(torch.uint8).view(n, 4)
        if prefill:
            plan[:, 4:8] = torch.arange(n, device=DEVICE, dtype=torch.int32).view(torch.uint8).view(n, 4)
        inputs.update(kv=torch.randn(n, d, device=DEVICE), plan=plan, out_loc=slots.long(), is_decode=not prefill)
    return inputs


def _bytes(op, fmt, inputs) -> int:
    """Each input read once (table: one 256-byte row per token), each written byte once (§6 table)."""
    n = inputs["kv"].shape[0]
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    read = size(inputs["kv"]) + size(inputs["out_loc"]) + size(inputs["weight"]) + n * TABLE_ROW_BYTES
    read += size(inputs["positions"]) if op == "k_writer" else size(inputs["plan"])
    return read + n * _written(fmt)


def _ours(op, fmt):
    if op == "k_writer":
        return lambda a, cache: dsv4.fused_k_norm_rope_flashmla(
            a["kv"], a["weight"], EPS, a["table"], a["positions"], a["out_loc"], cache, page_size=PAGE, layout=fmt)
    indexer = isinstance(fmt, IndexerFormat)
    return lambda a, cache: dsv4.compress_norm_rope_store(
        a["kv"], a["plan"], norm_weight=a["weight"], norm_eps=EPS, freq_cis=a["table"], out_loc=a["out_loc"],
        kvcache=cache, page_size=PAGE, layout=KVLayout.V4 if indexer else fmt, use_fp4=fmt is IndexerFormat.FP4,
        compress_ratio=RATIO, is_decode=a["is_decode"])


_COMPILED = {}


def _theirs(op, fmt):
    """The idiomatic torch version, compiled once per (op, format) and shared by every size."""
    key = (op, fmt)
    if key not in _COMPILED:
        _COMPILED[key] = compiled(torch_impls.k_norm_rope if op == "k_writer" else torch_impls.compress_norm_rope_store)
    fn = _COMPILED[key]
    if op == "k_writer":
        return lambda a, cache: fn(a["kv"], a["weight"], EPS, a["table"], a["positions"], a["out_loc"], cache, PAGE,
                                   int(fmt))
    indexer = isinstance(fmt, IndexerFormat)
    hadamard = torch_impls.hadamard_matrix(DEVICE) if indexer else None
    return lambda a, cache: fn(a["kv"], a["plan"], a["weight"], EPS, a["table"], a["out_loc"], cache, PAGE, RATIO,
                               0 if indexer else int(fmt), fmt is IndexerFormat.FP4, hadamard)



def _target_large(op, fmt, pattern, n):
    if pattern == "random" or n not in LARGE_SIZES:
        return ""
    alu_bound = fmt is KVLayout.V41_FP4 or (op == "compress" and isinstance(fmt, IndexerFormat))
    return ">= 70 %" if alu_bound else ">= 85 %"


def _decode(bench, results, op, fmt, table, with_torch):
    cache = _cache(fmt, DECODE_CACHE_BYTES // fmt.bytes_per_token)
    capacity = cache.shape[0] * PAGE
    ours = _ours(op, fmt)
    theirs = _theirs(op, fmt) if with_torch else None
    for n in DECODE_SIZES:
        slot_sets = torch.randperm(capacity, device=DEVICE)[: n * CALLS_PER_GRAPH].view(CALLS_PER_GRAPH, n)
        calls = [_inputs(op, fmt, slots, table) for slots in slot_sets]
        hot = [t for a in calls for t in a.values() if isinstance(t, torch.Tensor)]  # the cache comes cold
        us = bench.time_graph([lambda a=a: ours(a, cache) for a in calls], hot=hot)
        t_us = None
        if theirs:
            t_us = torch_baseline_us(lambda: bench.time_graph([lambda a=a: theirs(a, cache) for a in calls], hot=hot))
        results.append(row(bench, family="writers", op=op, case=f"{_name(fmt)} decode", n=n, us=us,
                           nbytes=_bytes(op, fmt, calls[0]), torch_us=t_us, target="<= 3 us" if n <= 256 else ""))


def _large(bench, results, op, fmt, table, with_torch):
    ours = _ours(op, fmt)
    theirs = _theirs(op, fmt) if with_torch else None
    for n in MID_SIZES + LARGE_SIZES:
        cache = _cache(fmt, n)
        patterns = ["consecutive", "random"] + (["prefill"] if op == "compress" and n <= MAX_PREFILL_ROWS else [])
        for pattern in patterns:
            slots = torch.randperm(n, device=DEVICE) if pattern == "random" else torch.arange(n, device=DEVICE)
            a = _inputs(op, fmt, slots, table, prefill=pattern == "prefill")
            us = bench.time_single(lambda: ours(a, cache))
            t_us = None  # the torch version plans decode rows only
            if theirs and pattern != "prefill":
                t_us = torch_baseline_us(lambda: bench.time_single(lambda: theirs(a, cache)))
            nbytes = _bytes(op, fmt, a)
            # Consecutive slots and prefill plans: also against a plain copy of the same bytes at this size (the
            # ceiling there); random slots against a scatter of the same data rows into the same slots.
            if pattern == "random":
                extra = scatter_rows_baseline(bench, fmt.data_bytes, slots)
            else:
                extra = dict(baseline_us=flat_copy_single_us(bench, nbytes))
            results.append(row(bench, family="writers", op=op, case=f"{_name(fmt)} {pattern}", n=n, us=us,
                               nbytes=nbytes, torch_us=t_us, target=_target_large(op, fmt, pattern, n), **extra))


def run(bench: Bench, results, ops=("k_writer", "compress"), with_torch=True) -> None:
    table = rope_table()
    for op, fmt in CASES:
        if op not in ops:
            continue
        print(f"writers: {op} {_name(fmt)}")
        _decode(bench, results, op, fmt, table, with_torch)
        _large(bench, results, op, fmt, table, with_torch)


def main():
    from .run import summary

    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="k_writer,compress", help="comma-separated: k_writer, compress")
    parser.add_argument("--no-torch", action="store_true", help="skip the compiled torch baselines")
    args = parser.parse_args()
    bench = Bench()
    print(f"copy bandwidth {bench.copy_gbps:.0f} GB/s")
    results = []
    run(bench, results, ops=tuple(args.only.split(",")), with_torch=not args.no_torch)
    print(summary(results))


if __name__ == "__main__":
    main()
