"""One op call per case inside an NVTX range "prof", for Nsight Compute on the GPU machine (Firecracker runtime):

    ncu --clock-control none --nvtx --nvtx-include "prof/" --section SpeedOfLight --section WarpStateStats \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
        python3 -m benchmarks.ncu_cases CASE [SIZE]

CASE: kwriter / kwriter_fp4 / kwriter_v4 (V41 / V41_FP4 / V4, 2^20 tokens), compress_v4 / indexer_fp8 / indexer_fp4
(compress writer, 2^20 decode-plan rows), compress_v4_prefill (the same as a prefill plan, 2^16 rows),
c1 / c2 (V41, 64 rows, c2 all emitting), c2p (c2 prefill, V41, 65536 tokens in 8 requests), c4 / c128 (decode,
64 requests), c128e (c128 decode, 64 requests of which the first alone closes a chunk), c4p / c4p128 / c128p
(prefill of 65536 tokens from scratch; c4p128 with head_dim 128), plan (plan_compress_prefill, c4 paged, 64
requests x 4 drafts), plan128 (the same for c128 with request rings);
SIZE replaces the row / request count.
Two warm-up calls precede the profiled one.
"""
import sys

import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import IndexerFormat, KVLayout
from benchmarks import bench_low_ratio as lr, bench_writers as wr, bench_compress as bc

table = dsv4.precompute_rope_table(64, 65536, 65536, 160000.0, 16.0, 32.0, 1.0).cuda()
case = sys.argv[1]
size = int(sys.argv[2]) if len(sys.argv) > 2 else None  # rows / batch size; each case has a default


def writer(op, fmt, n, prefill=False):
    cache = wr._cache(fmt, n)
    a = wr._inputs(op, fmt, torch.arange(n, device="cuda"), table, prefill=prefill)
    return lambda: wr._ours(op, fmt)(a, cache)


def low(op, n):
    layout = KVLayout.V41
    cache = lr._cache(layout)
    cap = cache.shape[0] * lr.PAGE
    w = torch.randn(512, device="cuda").to(torch.bfloat16)
    if op == "c1":
        a = lr._c1_calls(n, cap, w, table)[0]
        return lambda: dsv4.c1_decode_norm_rope_store(a["kv"], a["weight"], a["positions"], a["out_loc"], 1e-6,
                                                      a["table"], cache, page_size=64, layout=layout)
    a = lr._c2_calls(n, 0, cap, w, table)[0]
    a["positions"] |= 1  # every row emits
    return lambda: dsv4.c2_decode_or_verify_norm_rope_store(
        a["kv"], a["state"], a["weight"], a["positions"], a["req"], a["raw"], 1e-6, a["table"], cache,
        page_size=64, ring_size=a["ring"], draft_len=0, layout=layout)


def c2_prefill(tokens, requests=8):
    layout, ring, per = KVLayout.V41, dsv4.state_ring_size(2, 0), tokens // requests
    cache = lr._cache(layout)
    w = torch.randn(512, device="cuda").to(torch.bfloat16)
    positions = (torch.randint(0, 65536 - per, (requests, 1)) + torch.arange(per)).view(-1)
    req = torch.arange(1, requests + 1).repeat_interleave(per)
    slots = 1 + torch.randperm(cache.shape[0] * lr.PAGE - 1)[: per * requests]
    args = [t.int().cuda() for t in (positions, req, 2 * slots + (positions & 1))]
    starts = list(range(0, per * requests, per))
    extend = [torch.tensor(v, dtype=torch.int32, device="cuda") for v in (starts, [per] * requests)]
    state = torch.randn((requests + 1) * ring, 1024, device="cuda")
    kv = torch.randn(per * requests, 1024, device="cuda")
    return lambda: dsv4.c2_prefill_norm_rope_store(kv, state, w, *args, 1e-6, table, cache, *extend, page_size=64,
                                                   ring_size=ring, layout=layout)


def compress(ratio, bs, one_emitting=False):
    """Decode of bs requests at random positions, or (one_emitting) with only the first closing a chunk."""
    hd, ring = 512, (16 if ratio == 4 else 256)
    gen = torch.Generator().manual_seed(1)
    state, x, plan, _ = bc._decode_set(ratio, hd, ring, bs, gen)
    if one_emitting:
        seq = torch.full((bs,), 8 * ratio + 1, device="cuda")
        seq[0] = 8 * ratio
        plan = dsv4.plan_compress_decode(torch.arange(1, bs + 1, device="cuda"), seq, compress_ratio=ratio,
                                         ring_size=ring, use_req_ring=True)
    ape = torch.randn(8 if ratio == 4 else 128, hd, device="cuda")
    return lambda: dsv4.compress_forward(state, x, ape, plan, head_dim=hd)


def compress_prefill(ratio, tokens, hd=512):
    """The first chunk (at most 2^16 tokens) of a single-request prefill from scratch."""
    ring = 16 if ratio == 4 else 256
    plan = bc._prefill_plans(ratio, ring, tokens)[0]
    rows = min(tokens, bc.MAX_PLAN_TOKENS)
    state = dsv4.alloc_compress_state(ratio, hd, 2, ring, device="cuda")
    x = torch.randn(rows, (4 if ratio == 4 else 2) * hd, device="cuda")
    ape = torch.randn(8 if ratio == 4 else 128, hd, device="cuda")
    return lambda: dsv4.compress_forward(state, x, ape, plan, head_dim=hd)


def planner(bs, ratio=4):
    """plan_compress_prefill of a verify step (4 drafts per request): c4 paged, or c128 with request rings."""
    rids = (torch.randperm(bs) + 1).cuda()
    seq = torch.randint(256, 4096, (bs,)).cuda()
    r2t = torch.randint(0, 1 << 20, (bs + 1, 4096), dtype=torch.int32).cuda()
    f2s = torch.randint(0, 1 << 20, (1 << 20,), dtype=torch.int32).cuda()
    ext = torch.full((bs,), 4, device="cuda")
    seq_total = seq + ext
    out_c = torch.empty(bs * 4, 16, dtype=torch.uint8, device="cuda")
    out_w = torch.empty(bs * 4, 8, dtype=torch.uint8, device="cuda")
    if ratio == 128:
        return lambda: dsv4.plan_compress_prefill(rids, seq_total, ext, num_q_tokens=bs * 4, out=(out_c, out_w),
                                                  compress_ratio=128, ring_size=256, use_req_ring=True)
    return lambda: dsv4.plan_compress_prefill(rids, seq_total, ext, r2t, f2s, num_q_tokens=bs * 4, out=(out_c, out_w),
                                              compress_ratio=4, ring_size=16, swa_page_size=256)


fn = {
    "kwriter": lambda: writer("k_writer", KVLayout.V41, size or 1 << 20),
    "kwriter_fp4": lambda: writer("k_writer", KVLayout.V41_FP4, size or 1 << 20),
    "kwriter_v4": lambda: writer("k_writer", KVLayout.V4, size or 1 << 20),
    "compress_v4": lambda: writer("compress", KVLayout.V4, size or 1 << 20),
    "compress_v4_prefill": lambda: writer("compress", KVLayout.V4, size or 1 << 16, prefill=True),
    "indexer_fp8": lambda: writer("compress", IndexerFormat.FP8, size or 1 << 20),
    "indexer_fp4": lambda: writer("compress", IndexerFormat.FP4, size or 1 << 20),
    "c1": lambda: low("c1", size or 64),
    "c2": lambda: low("c2", size or 64),
    "c2p": lambda: c2_prefill(size or 65536),
    "c4": lambda: compress(4, size or 64),
    "c128": lambda: compress(128, size or 64),
    "c128e": lambda: compress(128, size or 64, one_emitting=True),
    "c4p": lambda: compress_prefill(4, size or 65536),
    "c4p128": lambda: compress_prefill(4, size or 65536, hd=128),
    "c128p": lambda: compress_prefill(128, size or 65536),
    "plan": lambda: planner(size or 64),
    "plan128": lambda: planner(size or 64, ratio=128),
}[case]()
for _ in range(2):
    fn()
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("prof")
fn()
torch.cuda.nvtx.range_pop()
torch.cuda.synchronize()
