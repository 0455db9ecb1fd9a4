"""compute-sanitizer memcheck of the cache, writer and compressor kernels on hostile inputs (the metadata ops have
theirs in test_metadata): slots, positions, request slots and extend ranges at and past every bound, in int32 and
int64, and plan tensors of random bytes. Each case must report no memory error: padded and out-of-range rows are
skipped in the kernels, and nothing is read or written outside the tensors. One subprocess per case.
"""
from __future__ import annotations

import pytest

from samples import HAS_CUDA
from sanitizer import assert_memcheck_clean

# Shared by the cases: a 3-page cache per format, a RoPE table of 1024 positions, hostile index lists for a cache
# of 3 * 64 slots (positions: around the table's end), and random-byte plans.
COMMON = """
P = 64
g = torch.Generator(device=d).manual_seed(0)
table = dk.precompute_rope_table(64, 1024, 65536, 160000.0, 16.0, 32.0, 1.0).to(d)
slots64 = torch.tensor(huge64 + big + [191, 192, 193], device=d)
slots32 = torch.tensor(big + [191, 192, 193], dtype=torch.int32, device=d)
pos64 = torch.tensor(huge64 + [1023, 1024, 1025] + big, device=d)[: slots64.numel()]
pos32 = torch.tensor(big + [1023, 1024, 1025], dtype=torch.int32, device=d)
indices = [(slots64, pos64), (slots32, pos32)]

def repeat(t, n):
    return t.repeat(n // t.numel() + 1)[:n]

def random_plan(rows, width):
    return torch.randint(0, 256, (rows, width), dtype=torch.uint8, device=d, generator=g)

def extreme_plan(rows, width):
    # Words of all-ones, all-zeros, INT32_MIN / MAX and small values, cycled: nine of them, so that every word of a
    # 16- or 8-byte entry takes each value.
    words = torch.tensor([-1, 0, -(2**31), 2**31 - 1, 1, 127, 128, 65535, 65536], dtype=torch.int32, device=d)
    return repeat(words, rows * width // 4).view(torch.uint8).view(rows, width)
"""

CASES = {
    "kv_io": """
for layout in dk.KVLayout:
    cache = torch.zeros(3, layout.page_bytes(P), dtype=torch.uint8, device=d)
    for slots, _ in indices:
        x = torch.randn(slots.numel(), 512, device=d).to(torch.bfloat16)
        dk.fused_store_cache(x, cache, slots, page_size=P, layout=layout)
        dk.dequantize_k_cache_paged(cache, slots, P, layout=layout)
for fmt in dk.IndexerFormat:
    cache = torch.zeros(3, fmt.page_bytes(P), dtype=torch.uint8, device=d)
    for slots, _ in indices:
        x = torch.randn(slots.numel(), 128, device=d).to(torch.bfloat16)
        dk.fused_store_cache(x, cache, slots, page_size=P, type="indexer", use_fp4=fmt.is_fp4)
""",
    "writers": """
for layout in dk.KVLayout:
    cache = torch.zeros(3, layout.page_bytes(P), dtype=torch.uint8, device=d)
    w = torch.randn(512, device=d).to(torch.bfloat16)
    for slots, pos in indices:
        for n in (slots.numel(), 4099):  # the one-row kernel, and the pipelined one (n >= 4096)
            wide = torch.randn(n, 700, device=d).to(torch.bfloat16)
            for kv in (wide[:, :512].contiguous(), wide[:, 5:517]):  # contiguous, then a strided column slice
                dk.fused_k_norm_rope_flashmla(kv, w, 1e-6, table, repeat(pos, n), repeat(slots, n), cache,
                                              page_size=P, layout=layout)
formats = [(layout, False, 512) for layout in dk.KVLayout] + [(dk.KVLayout.V4, fp4, 128) for fp4 in (False, True)]
for layout, fp4, dim in formats:
    page_bytes = (dk.IndexerFormat(int(fp4)) if dim == 128 else layout).page_bytes(P)
    cache = torch.zeros(3, page_bytes, dtype=torch.uint8, device=d)
    w = torch.randn(dim, device=d).to(torch.bfloat16)
    for slots, _ in indices:
        n = slots.numel()
        for plan in (random_plan(n, 16), extreme_plan(n, 16)):
            for is_decode in (True, False):
                for ratio in (4, 128):
                    dk.compress_norm_rope_store(torch.randn(n, dim, device=d), plan, norm_weight=w, norm_eps=1e-6,
                                                freq_cis=table, out_loc=slots, kvcache=cache, page_size=P,
                                                layout=layout, use_fp4=fp4, compress_ratio=ratio,
                                                is_decode=is_decode)
""",
    "low_ratio": """
w = torch.randn(512, device=d).to(torch.bfloat16)
ring, owners = 8, 4
for layout in dk.KVLayout:
    cache = torch.zeros(3, layout.page_bytes(P), dtype=torch.uint8, device=d)
    state = torch.zeros(owners * ring, 1024, device=d)
    for slots, pos in indices:
        n = slots.numel() - slots.numel() % 2  # verify blocks of 2
        kv = torch.randn(n, 512, device=d).to(torch.bfloat16)
        dk.c1_decode_norm_rope_store(kv, w, pos[:n], slots[:n], 1e-6, table, cache, page_size=P, layout=layout)
        req = repeat(torch.tensor([-(2**31), -1, 0, owners - 1, owners, 2**31 - 1], device=d, dtype=slots.dtype), n)
        x = torch.randn(n, 1024, device=d)
        for draft in (0, 2):
            dk.c2_decode_or_verify_norm_rope_store(x, state, w, pos[:n], req, slots[:n], 1e-6, table, cache,
                                                   page_size=P, ring_size=ring, draft_len=draft, layout=layout)
        # Requests at, across and past the rows' ends, negative and empty.
        starts = torch.tensor([-5, 0, 3, n - 1, n, 2**31 - 1, 2], dtype=torch.int32, device=d)
        lens = torch.tensor([3, n + 1, 2, 5, 1, 2, -(2**31)], dtype=torch.int32, device=d)
        dk.c2_prefill_norm_rope_store(x, state, w, pos[:n], req, slots[:n], 1e-6, table, cache, starts, lens,
                                      page_size=P, ring_size=ring, layout=layout)
""",
    "compressors": """
for ratio, dim, ring in ((4, 512, 16), (4, 128, 16), (128, 512, 256)):
    width = (4 if ratio == 4 else 2) * dim
    ape = torch.randn(8 if ratio == 4 else 128, dim, device=d)
    for dtype in (torch.float32, torch.bfloat16):
        state = dk.alloc_compress_state(ratio, dim, 3, ring, dtype=dtype, device=d)
        for rows in (37, 300):
            x = torch.randn(rows, width, device=d).to(dtype)
            for make in (random_plan, extreme_plan):
                dk.compress_forward(state, x, ape, make(rows, 16), head_dim=dim, compress_ratio=ratio,
                                    is_decode=True)
                dk.compress_forward(state, x, ape, make(rows, 16), make(rows, 8), head_dim=dim,
                                    compress_ratio=ratio, is_decode=False)
# Planners: request slots, lengths and page tables at and past their bounds (paged c4 and request rings).
for slots, _ in indices:
    n = slots.numel()
    lens = repeat(torch.tensor([0, 1, 3, 4, 5, 255, 256, 4095, 5000], device=d, dtype=slots.dtype), n)
    rids = repeat(torch.tensor([-1, 0, 1, 2, 3, 2**31 - 1], device=d, dtype=slots.dtype), n)
    r2t = repeat(slots, 4 * 4096).view(4, 4096)
    f2s = repeat(slots, 1024)
    for ratio, kw in ((4, dict(req_to_token=r2t, full_to_swa=f2s, swa_page_size=64)),
                      (4, dict(use_req_ring=True)), (128, dict(use_req_ring=True))):
        ring = 16 if ratio == 4 else 256
        dk.plan_compress_decode(rids, lens, compress_ratio=ratio, ring_size=ring, **kw)
        ext = torch.ones_like(lens)
        dk.plan_compress_prefill(rids, lens, ext, num_q_tokens=n, compress_ratio=ratio, ring_size=ring,
                                 use_cuda_graph=True, **kw)
""",
}


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_compute_sanitizer_memcheck(case):
    assert_memcheck_clean(COMMON + CASES[case])
