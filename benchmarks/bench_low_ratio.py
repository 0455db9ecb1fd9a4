"""Ratio-1 and ratio-2 compressor benchmarks: c1_decode_norm_rope_store and c2_decode_or_verify_norm_rope_store
(decode, and verify with 4 drafts) for every main layout, at decode sizes under CUDA-graph replay, with bytes
counted per compressors.md §9, against compiled torch; c2_prefill_norm_rope_store at prefill sizes (single calls,
the L2 flushed in between) against one device copy of the same bytes.

    python -m benchmarks.bench_low_ratio [--no-torch]
"""
from __future__ import annotations

import argparse

import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import KVLayout

from . import torch_impls_low_ratio as torch_impls
from .harness import (DEVICE, MAX_POS, torch_baseline_us, Bench, compiled, flat_copy_single_us, flat_copy_us,
                      rope_table, row)

DECODE_SIZES = (1, 8, 64, 256, 1024)
VERIFY_SIZES = (8, 64, 256)  # requests; 4 draft rows each
VERIFY_DRAFT = 4
PREFILL_TOKENS = (4096, 32768, 65536)
PREFILL_REQUESTS = 8
CALLS_PER_GRAPH = 64  # disjoint (input, state, slot) sets: bs 1024 replays > 2x L2 for both ops
DECODE_CACHE_BYTES = 256 << 20  # destination slots rotate over a cache > 2x L2
PAGE = 64
EPS = 1e-6
LATENT_BYTES = 512 * 2
PAIR_ROW_BYTES = 1024 * 4
INDEX_BYTES = 4  # int32 positions / out_loc / req_pool_indices


def _written(layout) -> int:
    return layout.bytes_per_token - (1 if layout is KVLayout.V4 else 0)  # V4 scale byte 7 is never written


def _cache(layout):
    pages = DECODE_CACHE_BYTES // layout.page_bytes(PAGE)
    return torch.randint(0, 256, (pages, layout.page_bytes(PAGE)), dtype=torch.uint8, device=DEVICE)


def c1_bytes(layout, n) -> int:
    """§9: input 1 KiB + latent 1 KiB + the cache row, plus two indices, per row (every row stores)."""
    return n * (LATENT_BYTES + LATENT_BYTES + _written(layout) + 2 * INDEX_BYTES)


def c2_bytes(layout, positions, from_ring) -> int:
    """§9: every row reads its input (4 KiB) and writes its latent row (1 KiB, zeros for even rows); an even row
    writes its ring row (4 KiB); an odd row reads its partner from the ring (4 KiB) when it is a block's first
    row (inside a verify block the partner is the previous input row, already counted) and writes its cache row."""
    odd = int((positions & 1).sum())
    even = positions.numel() - odd
    per_row = PAIR_ROW_BYTES + LATENT_BYTES + 3 * INDEX_BYTES
    return positions.numel() * per_row + even * PAIR_ROW_BYTES + from_ring * PAIR_ROW_BYTES + odd * _written(layout)


def _c1_calls(n, capacity, weight, table):
    slots = 1 + torch.randperm(capacity - 1, device=DEVICE)[: n * CALLS_PER_GRAPH].int().view(CALLS_PER_GRAPH, n)
    return [dict(kv=torch.randn(n, 512, device=DEVICE).to(torch.bfloat16), weight=weight, table=table,
                 positions=torch.randint(0, MAX_POS, (n,), device=DEVICE, dtype=torch.int32), out_loc=s)
            for s in slots]


def _c2_calls(n, draft_len, capacity, weight, table):
    """CALLS_PER_GRAPH disjoint sets: distinct requests (own ring rows), distinct cache slots, random parity."""
    rows = n * max(draft_len, 1)
    ring = dsv4.state_ring_size(2, draft_len)
    requests = n * CALLS_PER_GRAPH
    state = torch.randn(requests * ring + ring, 1024, device=DEVICE)  # owner 0 is the dummy request
    req_sets = (1 + torch.randperm(requests, device=DEVICE)).int().view(CALLS_PER_GRAPH, n)
    slot_sets = 1 + torch.randperm(capacity - 1, device=DEVICE)[: rows * CALLS_PER_GRAPH].view(CALLS_PER_GRAPH, rows)
    calls = []
    for req, slots in zip(req_sets, slot_sets):
        start = torch.randint(1, MAX_POS - draft_len - 1, (n, 1), device=DEVICE)
        positions = (start + torch.arange(max(draft_len, 1), device=DEVICE)).view(-1)
        calls.append(dict(kv=torch.randn(rows, 1024, device=DEVICE), state=state, weight=weight, table=table,
                          positions=positions.int(), req=req.repeat_interleave(max(draft_len, 1)),
                          raw=(2 * slots + (positions & 1)).int(), ring=ring, draft_len=draft_len))
    return calls


def _c2_from_ring(a) -> int:
    """Odd rows that read their partner from the ring: every odd row in decode, block-first odd rows in verify."""
    odd = (a["positions"] & 1) == 1
    if a["draft_len"]:
        first = torch.arange(a["positions"].numel(), device=DEVICE) % a["draft_len"] == 0
        odd = odd & first
    return int(odd.sum())



def _hot_inputs(calls):
    """The calls' inputs, which serving has just written: every tensor but the ring state (a layer's ring rows
    come cold by its next step, as the cache does)."""
    return [t for a in calls for name, t in a.items() if isinstance(t, torch.Tensor) and name != "state"]


def _target(n) -> str:
    return "<= 3 us" if n <= 256 else ">= 85 %"


def _bench_c1(bench, results, layout, weight, table, with_torch):
    cache = _cache(layout)
    capacity = cache.shape[0] * PAGE
    theirs = compiled(torch_impls.c1_decode) if with_torch else None
    for n in DECODE_SIZES:
        calls = _c1_calls(n, capacity, weight, table)
        hot = _hot_inputs(calls)
        us = bench.time_graph([lambda a=a: dsv4.c1_decode_norm_rope_store(
            a["kv"], a["weight"], a["positions"], a["out_loc"], EPS, a["table"], cache, page_size=PAGE,
            layout=layout) for a in calls], hot=hot)
        t_us = torch_baseline_us(lambda: bench.time_graph([lambda a=a: theirs(
            a["kv"], a["weight"], EPS, a["table"], a["positions"], a["out_loc"], cache, PAGE, int(layout))
            for a in calls], hot=hot)) if theirs else None
        nbytes = c1_bytes(layout, n)
        results.append(row(bench, family="low_ratio", op="c1", case=f"{layout.str_name} decode", n=n, us=us,
                           nbytes=nbytes, torch_us=t_us, baseline_us=flat_copy_us(bench, nbytes, CALLS_PER_GRAPH),
                           target=_target(n)))
        del calls


def _bench_c2(bench, results, layout, weight, table, with_torch, draft_len):
    cache = _cache(layout)
    capacity = cache.shape[0] * PAGE
    theirs = compiled(torch_impls.c2_decode_or_verify) if with_torch else None
    mode = f"verify d={draft_len}" if draft_len else "decode"
    for n in (VERIFY_SIZES if draft_len else DECODE_SIZES):
        calls = _c2_calls(n, draft_len, capacity, weight, table)
        hot = _hot_inputs(calls)
        us = bench.time_graph([lambda a=a: dsv4.c2_decode_or_verify_norm_rope_store(
            a["kv"], a["state"], a["weight"], a["positions"], a["req"], a["raw"], EPS, a["table"], cache,
            page_size=PAGE, ring_size=a["ring"], draft_len=a["draft_len"], layout=layout) for a in calls], hot=hot)
        t_us = torch_baseline_us(lambda: bench.time_graph([lambda a=a: theirs(
            a["kv"], a["state"], a["weight"], EPS, a["table"], a["positions"], a["req"], a["raw"], cache, PAGE,
            a["ring"], a["draft_len"], int(layout)) for a in calls], hot=hot)) if theirs else None
        nbytes = c2_bytes(layout, calls[0]["positions"].cpu(), _c2_from_ring(calls[0]))
        results.append(row(bench, family="low_ratio", op="c2", case=f"{layout.str_name} {mode}",
                           n=calls[0]["kv"].shape[0], us=us, nbytes=nbytes, torch_us=t_us,
                           baseline_us=flat_copy_us(bench, nbytes, CALLS_PER_GRAPH),
                           target=_target(calls[0]["kv"].shape[0])))
        del calls


def c2_prefill_bytes(layout, positions, starts, lens, ring) -> int:
    """Every row reads its input and writes its latent row; odd rows write their cache row, and a request whose
    first position is odd reads its partner from the ring; the even rows among each request's last ring rows
    (ring even) park theirs."""
    odd = int((positions & 1).sum())
    first_odd = int((positions[starts] & 1).sum())
    parked = sum(int(((positions[s + max(0, n - ring):s + n] & 1) == 0).sum()) for s, n in zip(starts, lens))
    per_row = PAIR_ROW_BYTES + LATENT_BYTES + 3 * INDEX_BYTES
    return positions.numel() * per_row + odd * _written(layout) + (first_odd + parked) * PAIR_ROW_BYTES


def _bench_c2_prefill(bench, results, layout, weight, table, with_torch):
    """A chunk of PREFILL_REQUESTS requests of equal length at random start positions (mixed parity)."""
    cache = _cache(layout)
    capacity = cache.shape[0] * PAGE
    ring = dsv4.state_ring_size(2, 0)
    theirs = compiled(torch_impls.c2_prefill) if with_torch else None
    for tokens in PREFILL_TOKENS:
        per = tokens // PREFILL_REQUESTS
        lens = [per] * PREFILL_REQUESTS
        starts = [r * per for r in range(PREFILL_REQUESTS)]
        first = torch.randint(0, MAX_POS - per, (PREFILL_REQUESTS, 1))
        positions = (first + torch.arange(per)).view(-1)
        req = torch.arange(1, PREFILL_REQUESTS + 1).repeat_interleave(per)
        slots = 1 + torch.randperm(capacity - 1)[:tokens]
        state = torch.randn((PREFILL_REQUESTS + 1) * ring, 1024, device=DEVICE)
        kv = torch.randn(tokens, 1024, device=DEVICE)
        args = [t.int().to(DEVICE) for t in (positions, req, 2 * slots + (positions & 1))]
        extend = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (starts, lens)]
        us = bench.time_single(lambda: dsv4.c2_prefill_norm_rope_store(
            kv, state, weight, *args, EPS, table, cache, *extend, page_size=PAGE, ring_size=ring, layout=layout))
        t_us = torch_baseline_us(lambda: bench.time_single(lambda: theirs(
            kv, state, weight, EPS, table, *args, cache, PAGE, ring, int(layout)))) if theirs else None
        nbytes = c2_prefill_bytes(layout, positions, starts, lens, ring)
        results.append(row(bench, family="low_ratio", op="c2 prefill", case=f"{layout.str_name} prefill", n=tokens,
                           us=us, nbytes=nbytes, torch_us=t_us, baseline_us=flat_copy_single_us(bench, nbytes)))
        del kv, state


def table_and_weight():
    """The RoPE table and the bf16 norm weight that every case uses."""
    return rope_table(), torch.randn(512, device=DEVICE).to(torch.bfloat16)


def run(bench: Bench, results, with_torch=True) -> None:
    table, weight = table_and_weight()
    for layout in KVLayout:
        print(f"low_ratio: {layout.str_name}")
        _bench_c1(bench, results, layout, weight, table, with_torch)
        _bench_c2(bench, results, layout, weight, table, with_torch, draft_len=0)
        _bench_c2(bench, results, layout, weight, table, with_torch, draft_len=VERIFY_DRAFT)
        _bench_c2_prefill(bench, results, layout, weight, table, with_torch)


def main():
    from .run import summary

    parser = argparse.ArgumentParser()
    parser.add_argument("--no-torch", action="store_true", help="skip the compiled torch baselines")
    args = parser.parse_args()
    bench = Bench()
    print(f"copy bandwidth {bench.copy_gbps:.0f} GB/s")
    results = []
    run(bench, results, with_torch=not args.no_torch)
    print(summary(results))


if __name__ == "__main__":
    main()
