"""Which kernel a size takes (cuda). Several tests aim at one CUDA path by size alone: the pipelined K writer
from 4096 aligned rows (test_writers), the two-launch prefill planner above 1024 requests (test_compress_plan,
test_compress_forward), the schedule's tile-scan path above 2048 requests (test_metadata). These check, with the
profiler, that those sizes launch those kernels and one size less does not, so that a changed threshold shows
here instead of leaving those tests on the other path.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import KVLayout

HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]

K_WRITER_PIPELINE_MIN_ROWS = 4096  # test_writers.py
TWO_LAUNCH_PLANNER_MIN_BATCH = 1025  # test_compress_plan.py, test_compress_forward.py
SCHEDULE_TILE_SCAN_MIN_BATCH = 2049  # test_metadata.py


def _kernels(fn) -> str:
    """The names of the CUDA kernels fn launches, one per line."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return "\n".join(e.key for e in prof.key_averages())


def _k_writer(n):
    page = 64
    kv = torch.randn(n, 512, device="cuda", dtype=torch.bfloat16)
    table = dsv4.precompute_rope_table(64, 4096, 4096, 10000.0, 1.0, 32.0, 1.0).cuda()
    cache = torch.zeros(-(-n // page), KVLayout.V4.page_bytes(page), dtype=torch.uint8, device="cuda")
    positions = torch.randint(0, 4096, (n,), device="cuda", dtype=torch.int32)
    weight = torch.ones(512, device="cuda", dtype=torch.bfloat16)
    out_loc = torch.arange(n, device="cuda", dtype=torch.int32)
    return lambda: dsv4.fused_k_norm_rope_flashmla(kv, weight, 1e-6, table, positions, out_loc, cache,
                                                   page_size=page, layout=KVLayout.V4)


def _prefill_planner(batch):
    rids = torch.arange(1, batch + 1, device="cuda")
    extend = torch.full((batch,), 3, device="cuda")
    seq = torch.randint(3, 600, (batch,), device="cuda")
    return lambda: dsv4.plan_compress_prefill(rids, seq, extend, num_q_tokens=3 * batch, compress_ratio=128,
                                              ring_size=256, use_req_ring=True)


def _schedule(batch):
    lens = torch.randint(0, 3000, (batch,), device="cuda", dtype=torch.int32)
    return lambda: dsv4.get_paged_mqa_logits_metadata(lens, 64, 132)


@pytest.mark.parametrize("make,size,kernel", [
    (_k_writer, K_WRITER_PIPELINE_MIN_ROWS, "k_writer_pipelined_kernel"),
    (_prefill_planner, TWO_LAUNCH_PLANNER_MIN_BATCH, "prefill_scan_kernel"),
    (_schedule, SCHEDULE_TILE_SCAN_MIN_BATCH, "schedule_tile_scan_kernel"),
], ids=["k_writer", "prefill_planner", "schedule"])
def test_size_takes_the_path_its_tests_aim_at(make, size, kernel):
    assert kernel in _kernels(make(size)), f"{size} does not launch {kernel}"
    assert kernel not in _kernels(make(size - 1)), f"{size - 1} launches {kernel} too"
