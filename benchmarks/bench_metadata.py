"""Metadata benchmarks: every op under CUDA-graph replay (CALLS_PER_GRAPH calls captured in one graph,
replays timed with events, median per-call microseconds) at decode batches 1..1024 and large batches,
compared with idiomatic torch compiled with torch.compile(dynamic=True).
Targets (spec/metadata.md): <= 3 us per call at batch <= 1024; the schedule at batch 65536 under 10 us.

    python -m benchmarks.run --only metadata        # through the runner (table + plot)
    python -m benchmarks.bench_metadata             # this family alone, printed
    python -m benchmarks.bench_metadata --dry-run   # anywhere: builds every case, calls it once on CPU
"""
from __future__ import annotations

import argparse

import torch

import sgl_dsv4_kernels  # noqa: F401  registers torch.ops.dsv4

from . import torch_impls_metadata as torch_impl
from .harness import torch_baseline_us, Bench, compiled, row

ops = torch.ops.dsv4

CALLS_PER_GRAPH = 100
DECODE_BATCHES = (1, 8, 64, 256, 1024)
LARGE_BATCHES = (4096,)
SCHEDULE_BATCHES = DECODE_BATCHES + (4096, 65536)
CONTEXT_TOKENS = 128 * 1024  # request capacity: 512 full pages of 256 tokens
PAGE_SIZE = 256
SWA_WINDOW = 128
TOPK = 512


def _lengths(batch, max_len, device, gen):
    return torch.randint(1, max_len + 1, (batch,), generator=gen).to(device=device, dtype=torch.int32)


def _distinct_slots(batch, device, gen):
    """Decode write slots spread over a large pool (no shared slot, no padding row)."""
    return (torch.randperm(1 << 22, generator=gen)[:batch] + 1).to(device)


def _page_table(batch, device, gen):
    return torch.randint(0, 1 << 20, (batch, CONTEXT_TOKENS // PAGE_SIZE), generator=gen,
                         dtype=torch.int32).to(device)


_COMPILED = {}


def _compiled_once(fn):
    """One torch.compile per torch implementation, shared by every batch size."""
    if fn not in _COMPILED:
        _COMPILED[fn] = compiled(fn)
    return _COMPILED[fn]


def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


# Each case builder returns (ours, theirs, bytes): `ours` calls the op once into preallocated
# buffers (the _out twins, as engines use them inside graphs), `theirs` the compiled idiomatic torch
# version; bytes counts each input read once and each output written once.


def case_page_table(batch, device, gen):
    pages = CONTEXT_TOKENS // PAGE_SIZE
    num_requests = batch + 1
    # Request r owns consecutive pages; only the first slot of each page is read.
    first_page = (torch.randperm(num_requests, generator=gen) * pages).to(device)
    req_to_token = (first_page[:, None] * PAGE_SIZE + torch.arange(CONTEXT_TOKENS, device=device)[None, :]).int()
    req = (torch.randperm(batch, generator=gen) + 1).to(device)
    lens = _lengths(batch, CONTEXT_TOKENS, device, gen)
    outs = [torch.empty(batch, dtype=torch.int32, device=device) for _ in range(3)]
    table = torch.empty((batch, pages), dtype=torch.int32, device=device)
    fn = _compiled_once(torch_impl.page_table_positions)

    def ours():
        ops.build_page_table_positions_small_out(req_to_token, req, lens, PAGE_SIZE, SWA_WINDOW,
                                                 outs[0], outs[1], table, outs[2])

    def theirs():
        return fn(req_to_token, req, lens, CONTEXT_TOKENS, PAGE_SIZE, SWA_WINDOW)

    return ours, theirs, batch * (8 + 4 + 3 * 4) + 2 * batch * pages * 4


def case_low_ratio(batch, device, gen):
    lens = _lengths(batch, 1 << 17, device, gen)
    loc = _distinct_slots(batch, device, gen)
    bufs = [t.clone() for t in ops.build_low_ratio_metadata(lens, loc, TOPK)]
    fn = _compiled_once(torch_impl.low_ratio_metadata)

    def ours():
        ops.build_low_ratio_metadata_out(lens, loc, TOPK, *bufs)

    padded = (TOPK + 63) // 64 * 64
    return ours, lambda: fn(lens, loc, TOPK), batch * (4 + 8) + 2 * batch * (8 + 4 + 4 + padded * 4)


def case_fill_all(batch, device, gen, ratio=4, width=TOPK):
    page_table = _page_table(batch, device, gen)
    lens = _lengths(batch, width, device, gen)
    page_indices = torch.empty((batch, width), dtype=torch.int32, device=device)
    raw_indices = torch.empty_like(page_indices)
    fn = _compiled_once(torch_impl.fill_all_compressed_indices)

    def ours():
        ops.fill_all_compressed_indices(page_table, lens, page_indices, ratio, PAGE_SIZE, raw_indices)

    spp = PAGE_SIZE // ratio
    nbytes = batch * 4 + batch * ((width + spp - 1) // spp) * 4 + 2 * batch * width * 4
    return ours, lambda: fn(page_table, lens, width, ratio, PAGE_SIZE), nbytes


def case_compression(batch, device, gen):
    lens = _lengths(batch, CONTEXT_TOKENS, device, gen)
    positions = lens - 1
    loc = _distinct_slots(batch, device, gen)
    page_table = _page_table(batch, device, gen)
    bufs = [t.clone() for t in ops.init_compression_metadata(lens, positions, loc, page_table, PAGE_SIZE, True)]
    fn = _compiled_once(torch_impl.compression_metadata)

    def ours():
        ops.init_compression_metadata_out(lens, positions, loc, page_table, PAGE_SIZE, *bufs)

    width = bufs[8].size(1)  # 1024 c128 page indices per row
    nbytes = batch * (4 + 4 + 8) + batch * (width // 2) * 4 + 2 * batch * (8 + 3 * 4) + batch * width * 4
    return ours, lambda: fn(lens, positions, loc, page_table, PAGE_SIZE), nbytes


def case_schedule(batch, device, gen):
    num_sms = _sm_count(device)
    lens = _lengths(batch, 32768, device, gen)
    out = torch.empty((num_sms + 1, 2), dtype=torch.int32, device=device)
    fn = _compiled_once(torch_impl.paged_mqa_schedule)

    def ours():
        ops.get_paged_mqa_logits_metadata_out(lens, 64, out)

    return ours, lambda: fn(lens, num_sms), batch * 4 + out.numel() * 4


CASES = (
    ("build_page_table_positions_small", case_page_table, DECODE_BATCHES + LARGE_BATCHES, "pages512"),
    ("build_low_ratio_metadata", case_low_ratio, DECODE_BATCHES + LARGE_BATCHES, f"topk{TOPK}"),
    ("fill_all_compressed_indices", case_fill_all, DECODE_BATCHES + LARGE_BATCHES, f"c4 w{TOPK} raw"),
    ("init_compression_metadata", case_compression, DECODE_BATCHES + LARGE_BATCHES, "pages512"),
    ("get_paged_mqa_logits_metadata", case_schedule, SCHEDULE_BATCHES, "len32k"),
)


def _target(op, batch):
    if op == "get_paged_mqa_logits_metadata" and batch == 65536:
        return "< 10 us"
    return "<= 3 us" if batch <= 1024 else ""



def run(bench, results=None):
    """Runner entry point ``run(bench, results)``; ``run(results)`` also works (it makes its own
    Bench). Appends one row per (op, batch) with family "metadata"."""
    if results is None:
        bench, results = Bench(), bench
    gen = torch.Generator().manual_seed(0)
    for op, build, batches, label in CASES:
        print(f"metadata: {op}")
        for batch in batches:
            ours, theirs, nbytes = build(batch, bench.device, gen)
            us = bench.time_graph([ours] * CALLS_PER_GRAPH)
            torch_us = torch_baseline_us(lambda: bench.time_graph([theirs] * CALLS_PER_GRAPH))
            results.append(row(bench, family="metadata", op=op, case=label, n=batch, us=us, nbytes=nbytes,
                               torch_us=torch_us, target=_target(op, batch)))
            del ours, theirs
            torch.cuda.empty_cache()
    return results


def dry_run():
    """Builds every case at small batches on CPU (the torch version included) and calls ours once."""
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    for op, build, batches, label in CASES:
        for batch in [b for b in batches if b <= 64]:
            ours, _, nbytes = build(batch, device, gen)
            ours()
            print(f"{op:34s} bs{batch:<6d} {label:14s} {nbytes:>10d} bytes  ok")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="build and call every case once on CPU")
    args = parser.parse_args()
    if args.dry_run:
        dry_run()
        return
    results = run([])
    print(f"{'op':34s} {'case':14s} {'N':>6s} {'us':>8s} {'torch us':>9s} {'GB/s':>7s}  target")
    for r in results:
        torch_us = "" if r["torch_us"] is None else f"{r['torch_us']:.2f}"
        print(f"{r['op']:34s} {r['case']:14s} {r['n']:>6d} {r['us']:8.2f} {torch_us:>9s} {r['gbps']:7.0f}  "
              f"{r['target']}")


if __name__ == "__main__":
    main()
