"""Shared benchmark machinery: CUDA-graph replay timing, the device-to-device copy roofline,
a plain gather/scatter-copy baseline and result rows.

Decode-size cases are timed as the median per-call time of many calls captured in one CUDA graph, each call
with its own destination lines, and the L2 flushed before every replay with only the calls' inputs read back into
it (`hot`): the lines the calls write, and the state rows they read, come cold as in serving. Large cases are
timed as the median of single calls timed with events, with the L2 flushed in between.
"""
from __future__ import annotations

import functools
import os
import statistics
from typing import Callable, Dict, List, Optional, Sequence

import torch

import sgl_dsv4_kernels as dsv4

L2_FLUSH_BYTES = 256 << 20  # several times the H200's 50-60 MB L2
# Where the benchmarks put their tensors: a GPU for every real run; "cpu" only for the smoke run of the
# benchmark code itself (tests/test_bench_smoke.py), whose times mean nothing.
DEVICE = os.environ.get("DSV4_BENCH_DEVICE", "cuda")
MAX_POS = 65536  # the positions the writer benchmarks draw lie below this: the RoPE table's length


@functools.lru_cache(maxsize=1)
def rope_table() -> torch.Tensor:
    """The RoPE table every writer benchmark uses (DeepSeek-V4's rope dim 64 and YaRN parameters), on DEVICE;
    built once per process."""
    return dsv4.precompute_rope_table(64, MAX_POS, 65536, 160000.0, 16.0, 32.0, 1.0).to(DEVICE)


class Bench:
    """Per-run state: the measured copy bandwidth and a buffer used to flush the L2."""

    def __init__(self, device: str = DEVICE):
        self.device = torch.device(device)
        self._flush = torch.ones(L2_FLUSH_BYTES // 4, dtype=torch.int32, device=self.device)
        self.copy_gbps = self.measure_copy_bandwidth()

    def flush_l2(self) -> None:
        """Evicts the L2 and leaves it clean: a read of a buffer several times its size. The lines that the
        previous call left dirty are written back during this read, not during the next timed call. (A write of
        the buffer, used before, left the L2 full of its own dirty lines: an H200 then timed a single 122 MB
        copy at 81 % of the copy bandwidth against 89 % after this read, and a 190 MB one at 87 against 92 %.)"""
        self._flush.sum()

    def measure_copy_bandwidth(self, nbytes: int = 2 << 30) -> float:
        """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_()
        dst = torch.empty_like(src)
        us = self.time_single(lambda: dst.copy_(src), flush=False)
        del src, dst
        return 2 * nbytes / (us * 1e3)

    def time_single(self, fn: Callable[[], object], iters: int = 15, warmup: int = 3, flush: bool = True) -> float:
        """Median microseconds of one call of fn, each call timed alone with events."""
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            if flush:
                self.flush_l2()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    def warm_l2(self, hot: Sequence[torch.Tensor]) -> None:
        """Flushes the L2, then reads `hot` back into it (each tensor once, however often it is listed)."""
        self.flush_l2()
        seen = set()
        for t in hot:
            key = (t.data_ptr(), t.shape, t.stride())
            if key not in seen:
                seen.add(key)
                t.sum()

    def time_graph(self, calls: Sequence[Callable[[], object]], replays: int = 20,
                   hot: Optional[Sequence[torch.Tensor]] = None) -> float:
        """Median microseconds per call of `calls` captured back to back in one CUDA graph.

        Each entry of `calls` typically uses its own inputs and destination slots. With `hot` (the calls'
        inputs: what serving's previous kernels have just written), every replay starts from an L2 that holds
        those tensors and nothing else the calls touch: the cache lines they write and the state rows they
        read come from DRAM, as a layer's do at its next decode step (ARCHITECTURE §5). Without `hot`, a replay
        finds whatever the previous one left in the L2: every line a call touches is hot from the second
        replay on, so a few calls per graph would write L2-resident lines only.
        """
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in calls:  # warm up (and trigger any lazy initialisation) outside capture
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for fn in calls:
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            if hot is not None:
                self.warm_l2(hot)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return statistics.median(times)

    def empty_kernel_us(self) -> float:
        """Per-call time of a trivial kernel under graph replay: the launch floor."""
        t = torch.zeros(1, device=self.device)
        return self.time_graph([lambda: t.add_(1)] * 100)


def gather_copy_us(bench: Bench, src_rows: torch.Tensor, slots: torch.Tensor) -> float:
    """Plain gather of whole rows (index_select) over the same slots: the random-slot baseline."""
    return bench.time_single(lambda: torch.index_select(src_rows, 0, slots))


def scatter_copy_us(bench: Bench, dst_rows: torch.Tensor, slots: torch.Tensor, src_rows: torch.Tensor) -> float:
    """Plain scatter of whole rows (index_copy_) into the same slots: the random-slot baseline."""
    return bench.time_single(lambda: dst_rows.index_copy_(0, slots, src_rows))


def scatter_rows_baseline(bench: Bench, row_bytes: int, slots: torch.Tensor) -> Dict:
    """The random-slot baseline of a cache writer, as `row` arguments: a scatter (index_copy_) of rows of
    row_bytes from a contiguous source into the same slots, in the widest words that divide a row."""
    words = as_words(row_bytes)
    word_bytes = torch.empty((), dtype=words).element_size()
    dst = torch.zeros(slots.numel(), row_bytes // word_bytes, dtype=words, device=bench.device)
    src = torch.ones_like(dst)
    return dict(baseline_us=scatter_copy_us(bench, dst, slots.long(), src),
                baseline_bytes=2 * slots.numel() * row_bytes)


def flat_copy_us(bench: Bench, nbytes: int, calls: int) -> float:
    """One device copy moving nbytes (nbytes / 2 read, nbytes / 2 written) per call, timed like a decode op:
    `calls` disjoint buffer pairs replayed from one CUDA graph, the sources hot and the destinations cold.
    What moving the same bytes costs at that size in one launch, launch latency included: the ceiling of a
    decode-size op."""
    half = max(nbytes // 2, 1)
    pairs = [(torch.empty(half, dtype=torch.uint8, device=bench.device).random_(),
              torch.empty(half, dtype=torch.uint8, device=bench.device)) for _ in range(calls)]
    return bench.time_graph([lambda s=s, d=d: d.copy_(s) for s, d in pairs], hot=[s for s, _ in pairs])


def flat_copy_single_us(bench: Bench, nbytes: int) -> float:
    """One device copy moving nbytes (nbytes / 2 read, nbytes / 2 written), timed like a large-N op: single
    calls with the L2 flushed in between. What moving the same bytes costs at that size, the launch included:
    the ceiling of a large-N op of that size."""
    half = max(nbytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device=bench.device).random_()
    dst = torch.empty_like(src)
    return bench.time_single(lambda: dst.copy_(src))


def as_words(rows_bytes: int) -> torch.dtype:
    """Widest integer dtype dividing a row, so the baseline copies rows in wide words."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if rows_bytes % size == 0:
            return dtype
    return torch.uint8


def row(
    bench: Bench,
    *,
    family: str,
    op: str,
    case: str,
    n: int,
    us: float,
    nbytes: int,
    torch_us: Optional[float] = None,
    baseline_us: Optional[float] = None,
    baseline_bytes: Optional[int] = None,
    target: str = "",
) -> Dict:
    """One result row: time, bytes moved, achieved GB/s and its fraction of the copy bandwidth."""
    gbps = nbytes / (us * 1e3)
    out = dict(
        family=family, op=op, case=case, n=n, us=us, bytes=nbytes, gbps=gbps,
        pct_copy=100.0 * gbps / bench.copy_gbps, torch_us=torch_us,
        speedup=(torch_us / us) if torch_us else None, target=target,
    )
    if baseline_us is not None:
        base_gbps = (baseline_bytes if baseline_bytes is not None else nbytes) / (baseline_us * 1e3)
        out["pct_baseline"] = 100.0 * gbps / base_gbps
    return out


def torch_baseline_us(fn: Callable[[], float]) -> Optional[float]:
    """Times a torch baseline; a failure (e.g. a compile error) is reported, not fatal. Skipped (None)
    when DSV4_BENCH_NO_TORCH=1: compiling the baselines dominates a run, and a quick check of our own
    kernels' times does not need them."""
    if os.environ.get("DSV4_BENCH_NO_TORCH") == "1":
        return None
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        print(f"  torch baseline failed: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def compiled(fn: Callable) -> Callable:
    """The idiomatic torch implementation compiled once, as a user would (dynamic shapes)."""
    return torch.compile(fn, dynamic=True)


Results = List[Dict]
