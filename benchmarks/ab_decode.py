"""Times two or more builds of the extension against each other on the compressor decode benchmarks:

    python3 -m benchmarks.ab_decode --build main=A.so --build new=B.so [--rounds 3] c128:1,8,64 c4:64 c2.v41:256 ...

Each CASE is a `compress_forward` decode configuration of benchmarks/bench_compress.py (c4, c4_d128, c128), or
a ratio-1 / ratio-2 one of benchmarks/bench_low_ratio.py for a main layout (c1.v4, c2.v41, c2v.v41_fp4, ...; c2v
is verify with 4 drafts, its sizes in requests), with the batch sizes to time, which are timed as those
benchmarks time them: 64 calls over rotating input sets, replayed from one CUDA graph that starts from a cold L2
(the rings cold, the inputs hot). benchmarks.ab_builds times single calls, in which launch latency and the PDL
overlap between calls that decode sizes turn on do not show. Builds run in alternating order, each (round,
build) in a fresh process, as in ab_builds; prints ab_builds' table, after every round.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

from .ab_builds import Times, alternating_rounds, parse_builds, run_worker, table

RESULT_PREFIX = "ab_decode result: "
CONFIGS = {"c4": (4, 512, 16), "c4_d128": (4, 128, 16), "c128": (128, 512, 256)}  # as bench_compress.CASES
LOW_RATIO = ("c1", "c2", "c2v")  # c2v: c2 verify with bench_low_ratio.VERIFY_DRAFT drafts
LAYOUTS = ("v4", "v41", "v41_fp4")  # KVLayout.str_name, spelled out so that parsing needs no torch


def known_names() -> List[str]:
    return sorted(CONFIGS) + [f"{op}.{layout}" for op in LOW_RATIO for layout in LAYOUTS]


def parse_case(text: str):
    name, _, sizes = text.partition(":")
    if name not in known_names() or not sizes:
        raise ValueError(f"ab_decode: a case is one of {known_names()} with sizes, e.g. c128:1,8,64; got {text!r}")
    return name, tuple(int(s) for s in sizes.split(","))


def time_low_ratio(bench, name: str, sizes) -> List[float]:
    """Per-call times (us) of a c1 / c2 case at each size, as benchmarks.bench_low_ratio times them."""
    import sgl_dsv4_kernels as dsv4
    from benchmarks import bench_low_ratio as br

    op, _, layout_name = name.partition(".")
    layout = next(layout for layout in dsv4.KVLayout if layout.str_name == layout_name)
    table, weight = br.table_and_weight()
    rows: List[Dict] = []
    if op == "c1":
        br.DECODE_SIZES = sizes
        br._bench_c1(bench, rows, layout, weight, table, False)
    else:
        br.DECODE_SIZES = br.VERIFY_SIZES = sizes
        br._bench_c2(bench, rows, layout, weight, table, False, draft_len=br.VERIFY_DRAFT if op == "c2v" else 0)
    return [r["us"] for r in rows]


def worker(case_texts: List[str]) -> None:
    """Runs in the staged process: times every (case, size) and prints the per-call times (us) as one JSON line."""
    import sgl_dsv4_kernels
    from benchmarks import bench_compress as bc
    from benchmarks import bench_low_ratio as br
    from benchmarks.harness import Bench

    print(f"module: {sgl_dsv4_kernels._C.__file__}", file=sys.stderr)
    bc.flat_copy_us = br.flat_copy_us = lambda *args, **kwargs: 1.0  # the rows' copy baseline: not needed here
    bench = Bench()
    out = {}
    for text in case_texts:
        name, sizes = parse_case(text)
        if name in CONFIGS:
            bc.DECODE_SIZES = sizes
            rows: List[Dict] = []
            bc._decode(bench, rows, *CONFIGS[name], False)
            times = [r["us"] for r in rows]
        else:
            times = time_low_ratio(bench, name, sizes)
        out.update({f"{name}@{n}": us for n, us in zip(sizes, times)})
    print(RESULT_PREFIX + json.dumps(out))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=PATH.so")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("cases", nargs="+", metavar="CASE:SIZES")
    args = parser.parse_args(argv)
    try:
        for text in args.cases:
            parse_case(text)
    except ValueError as err:
        parser.error(str(err))
    if args.worker:
        worker(args.cases)
        return 0
    builds = parse_builds(parser, args.build)
    names = [name for name, _ in builds]

    def progress(done: int, times: Times) -> None:
        print(f"after round {done}:\n" + table(names, list(times[names[0]]), times), flush=True)

    alternating_rounds(builds, args.rounds,
                       lambda staged: run_worker("benchmarks.ab_decode", staged, args.cases, RESULT_PREFIX), progress)
    return 0


if __name__ == "__main__":
    sys.exit(main())
