"""Times two or more builds of the extension against each other on the compressor decode benchmark:

    python3 -m benchmarks.ab_decode --build main=A.so --build new=B.so [--rounds 3] c128:1,8,64 c4:64 ...

Each CASE is a `compress_forward` decode configuration of benchmarks/bench_compress.py (c4, c4_d128, c128) with
the batch sizes to time, which are timed as that benchmark times them: 64 calls over rotating input sets,
replayed from one CUDA graph that starts from a cold L2 (the rings cold, the inputs hot). benchmarks.ab_builds
times single calls, in which launch latency and the PDL overlap between calls that decode sizes turn on do
not show. Builds run in alternating order, each (round, build) in a fresh process, as in ab_builds; prints
ab_builds' table, after every round.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List

from .ab_builds import REPO, stage, table

RESULT_PREFIX = "ab_decode result: "
CONFIGS = {"c4": (4, 512, 16), "c4_d128": (4, 128, 16), "c128": (128, 512, 256)}  # as bench_compress.CASES


def parse_case(text: str):
    name, _, sizes = text.partition(":")
    if name not in CONFIGS or not sizes:
        raise ValueError(f"ab_decode: a case is one of {sorted(CONFIGS)} with sizes, e.g. c128:1,8,64; got {text!r}")
    return name, tuple(int(s) for s in sizes.split(","))


def worker(case_texts: List[str]) -> None:
    """Runs in the staged process: times every (case, size) and prints the per-call times (us) as one JSON line."""
    import sgl_dsv4_kernels
    from benchmarks import bench_compress as bc
    from benchmarks.harness import Bench

    print(f"module: {sgl_dsv4_kernels._C.__file__}", file=sys.stderr)
    bc.flat_copy_us = lambda *args, **kwargs: 1.0  # the rows' copy baseline: not needed here
    bench = Bench()
    out = {}
    for text in case_texts:
        name, sizes = parse_case(text)
        bc.DECODE_SIZES = sizes
        rows: List[Dict] = []
        bc._decode(bench, rows, *CONFIGS[name], False)
        out.update({f"{name}@{r['n']}": r["us"] for r in rows})
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
    builds = [b.partition("=") for b in args.build]
    if len(builds) < 2 or any(not sep or not os.path.isfile(path) for _, sep, path in builds):
        parser.error("give at least two --build NAME=PATH.so, each an existing file")
    names = [name for name, _, _ in builds]
    times: Dict[str, Dict[str, List[float]]] = {n: {} for n in names}
    with tempfile.TemporaryDirectory(prefix="ab_decode_") as tmp:
        staged = {name: stage(path, os.path.join(tmp, name)) for name, _, path in builds}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([staged[name], REPO]))
                proc = subprocess.run([sys.executable, "-m", "benchmarks.ab_decode", "--worker", *args.cases],
                                      capture_output=True, text=True, env=env, cwd=staged[name])
                lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
                if proc.returncode != 0 or not lines or staged[name] not in proc.stderr:
                    raise SystemExit(f"ab_decode: the run of {name} failed (exit {proc.returncode}):\n"
                                     f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
                for case, us in json.loads(lines[-1][len(RESULT_PREFIX):]).items():
                    times[name].setdefault(case, []).append(us)
            print(f"after round {r + 1}:\n" + table(names, list(times[names[0]]), times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
