"""Named single-call cases: one op call on inputs built like the benchmark families' (same helpers), for
Nsight Compute (benchmarks/ncu_cases.py) and for timing two builds of the extension against each other
(benchmarks/ab_builds.py).

CASES maps a name to (builder, default size); build(name, size) returns a no-argument callable that makes the
call. kwriter / kwriter_fp4 / kwriter_v4: the K writer (V41 / V41_FP4 / V4, consecutive slots); store_v4 /
store_v41 / store_v41_fp4 / store_fp8 / store_fp4: fused_store_cache (bf16 rows, consecutive slots);
compress_v4 / indexer_fp8 / indexer_fp4: the compress writer (decode-plan rows), compress_v4_prefill: the same
as a prefill plan; c1 / c2: V41 decode (c2 all emitting), c2p: c2 prefill (V41, 8 requests); c4 / c128:
compress_forward decode of SIZE requests, c128e: c128 decode where only the first request closes a chunk;
c4p / c4p128 / c128p: the first chunk of a prefill from scratch (c4p128 with head_dim 128); plan / plan128:
plan_compress_prefill of a verify step (4 drafts per request; c4 paged, c128 with request rings).
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import IndexerFormat, KVLayout

from . import bench_cache as kv, bench_compress as bc, bench_low_ratio as lr, bench_writers as wr
from .harness import DEVICE, rope_table


def writer(op, fmt, n, prefill=False):
    cache = wr._cache(fmt, n)
    a = wr._inputs(op, fmt, torch.arange(n, device=DEVICE), rope_table(), prefill=prefill)
    call = wr._ours(op, fmt)
    return lambda: call(a, cache)


def store(fmt, n):
    x = torch.randn(n, 512 if isinstance(fmt, KVLayout) else 128, device=DEVICE, dtype=torch.bfloat16)
    cache, slots, call = kv._cache(fmt, n), torch.arange(n, device=DEVICE).int(), kv._our_store(fmt)
    return lambda: call(x, cache, slots)


def low(op, n):
    layout = KVLayout.V41
    cache = lr._cache(layout)
    cap = cache.shape[0] * lr.PAGE
    w = torch.randn(512, device=DEVICE).to(torch.bfloat16)
    table = rope_table()
    if op == "c1":
        a = lr._c1_calls(n, cap, w, table)[0]
        return lambda: dsv4.c1_decode_norm_rope_store(a["kv"], a["weight"], a["positions"], a["out_loc"], 1e-6,
                                                      a["table"], cache, page_size=lr.PAGE, layout=layout)
    a = lr._c2_calls(n, 0, cap, w, table)[0]
    a["positions"] |= 1  # every row emits
    return lambda: dsv4.c2_decode_or_verify_norm_rope_store(
        a["kv"], a["state"], a["weight"], a["positions"], a["req"], a["raw"], 1e-6, a["table"], cache,
        page_size=lr.PAGE, ring_size=a["ring"], draft_len=0, layout=layout)


def c2_prefill(tokens, requests=8):
    layout, ring, per = KVLayout.V41, dsv4.state_ring_size(2, 0), tokens // requests
    cache = lr._cache(layout)
    w = torch.randn(512, device=DEVICE).to(torch.bfloat16)
    positions = (torch.randint(0, 65536 - per, (requests, 1)) + torch.arange(per)).view(-1)
    req = torch.arange(1, requests + 1).repeat_interleave(per)
    slots = 1 + torch.randperm(cache.shape[0] * lr.PAGE - 1)[: per * requests]
    args = [t.int().to(DEVICE) for t in (positions, req, 2 * slots + (positions & 1))]
    starts = list(range(0, per * requests, per))
    extend = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (starts, [per] * requests)]
    state = torch.randn((requests + 1) * ring, 1024, device=DEVICE)
    kv_rows = torch.randn(per * requests, 1024, device=DEVICE)
    table = rope_table()
    return lambda: dsv4.c2_prefill_norm_rope_store(kv_rows, state, w, *args, 1e-6, table, cache, *extend,
                                                   page_size=lr.PAGE, ring_size=ring, layout=layout)


def compress(ratio, bs, one_emitting=False):
    """Decode of bs requests at random positions, or (one_emitting) with only the first closing a chunk."""
    hd, ring = 512, (16 if ratio == 4 else 256)
    gen = torch.Generator().manual_seed(1)
    state, x, plan, _ = bc._decode_set(ratio, hd, ring, bs, gen)
    if one_emitting:
        seq = torch.full((bs,), 8 * ratio + 1, device=DEVICE)
        seq[0] = 8 * ratio
        plan = dsv4.plan_compress_decode(torch.arange(1, bs + 1, device=DEVICE), seq, compress_ratio=ratio,
                                         ring_size=ring, use_req_ring=True)
    ape = torch.randn(8 if ratio == 4 else 128, hd, device=DEVICE)
    return lambda: dsv4.compress_forward(state, x, ape, plan, head_dim=hd)


def compress_prefill(ratio, tokens, hd=512):
    """The first chunk (at most bc.MAX_PLAN_TOKENS tokens) of a single-request prefill from scratch."""
    ring = 16 if ratio == 4 else 256
    plan = bc._prefill_plans(ratio, ring, tokens)[0]
    rows = min(tokens, bc.MAX_PLAN_TOKENS)
    state = dsv4.alloc_compress_state(ratio, hd, 2, ring, device=DEVICE)
    x = torch.randn(rows, (4 if ratio == 4 else 2) * hd, device=DEVICE)
    ape = torch.randn(8 if ratio == 4 else 128, hd, device=DEVICE)
    return lambda: dsv4.compress_forward(state, x, ape, plan, head_dim=hd)


def planner(bs, ratio=4):
    """plan_compress_prefill of a verify step (4 drafts per request): c4 paged, or c128 with request rings."""
    rids = (torch.randperm(bs) + 1).to(DEVICE)
    seq = torch.randint(256, 4096, (bs,)).to(DEVICE)
    r2t = torch.randint(0, 1 << 20, (bs + 1, 4096), dtype=torch.int32).to(DEVICE)
    f2s = torch.randint(0, 1 << 20, (1 << 20,), dtype=torch.int32).to(DEVICE)
    ext = torch.full((bs,), 4, device=DEVICE)
    seq_total = seq + ext
    out_c = torch.empty(bs * 4, 16, dtype=torch.uint8, device=DEVICE)
    out_w = torch.empty(bs * 4, 8, dtype=torch.uint8, device=DEVICE)
    if ratio == 128:
        return lambda: dsv4.plan_compress_prefill(rids, seq_total, ext, num_q_tokens=bs * 4, out=(out_c, out_w),
                                                  compress_ratio=128, ring_size=256, use_req_ring=True)
    return lambda: dsv4.plan_compress_prefill(rids, seq_total, ext, r2t, f2s, num_q_tokens=bs * 4, out=(out_c, out_w),
                                              compress_ratio=4, ring_size=16, swa_page_size=256)


CASES: Dict[str, Tuple[Callable[[int], Callable[[], object]], int]] = {
    "kwriter": (lambda n: writer("k_writer", KVLayout.V41, n), 1 << 20),
    "kwriter_fp4": (lambda n: writer("k_writer", KVLayout.V41_FP4, n), 1 << 20),
    "kwriter_v4": (lambda n: writer("k_writer", KVLayout.V4, n), 1 << 20),
    "store_v4": (lambda n: store(KVLayout.V4, n), 1 << 16),
    "store_v41": (lambda n: store(KVLayout.V41, n), 1 << 16),
    "store_v41_fp4": (lambda n: store(KVLayout.V41_FP4, n), 1 << 16),
    "store_fp8": (lambda n: store(IndexerFormat.FP8, n), 1 << 16),
    "store_fp4": (lambda n: store(IndexerFormat.FP4, n), 1 << 16),
    "compress_v4": (lambda n: writer("compress", KVLayout.V4, n), 1 << 20),
    "compress_v4_prefill": (lambda n: writer("compress", KVLayout.V4, n, prefill=True), 1 << 16),
    "indexer_fp8": (lambda n: writer("compress", IndexerFormat.FP8, n), 1 << 20),
    "indexer_fp4": (lambda n: writer("compress", IndexerFormat.FP4, n), 1 << 20),
    "c1": (lambda n: low("c1", n), 64),
    "c2": (lambda n: low("c2", n), 64),
    "c2p": (c2_prefill, 65536),
    "c4": (lambda n: compress(4, n), 64),
    "c128": (lambda n: compress(128, n), 64),
    "c128e": (lambda n: compress(128, n, one_emitting=True), 64),
    "c4p": (lambda n: compress_prefill(4, n), 65536),
    "c4p128": (lambda n: compress_prefill(4, n, hd=128), 65536),
    "c128p": (lambda n: compress_prefill(128, n), 65536),
    "plan": (planner, 64),
    "plan128": (lambda n: planner(n, ratio=128), 64),
}


def build(name: str, size: int = 0) -> Callable[[], object]:
    """The case's call on freshly built inputs; size 0 takes the case's default size."""
    if name not in CASES:
        raise SystemExit(f"unknown case {name!r}; known: {', '.join(CASES)}")
    builder, default = CASES[name]
    return builder(size or default)
