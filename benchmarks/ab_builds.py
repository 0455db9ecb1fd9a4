"""Times two or more builds of the extension against each other on the same cases, on one machine:

    python3 -m benchmarks.ab_builds --build main=A.so --build new=B.so [--rounds 3] [--iters 15] CASE[:SIZE] ...

CASE is a name of benchmarks/cases.py, SIZE its row / request count (default: the case's). Each build is a
compiled module (_C.abi3.so, e.g. `strip --strip-debug -o B.so sgl_dsv4_kernels/_C.abi3.so` after a build);
it is staged beside a copy of this checkout's Python package, and every (round, build) runs in a fresh process
that times each case: on a GPU the median of `iters` single calls with the L2 flushed before each
(harness.Bench.time_single), on the CPU (the tests' run) the median wall-clock time of a call. The builds run
in turn, in reverse order every other round, so that drift in the machine's clocks falls on all of them.
Prints a table: per case and build the min-max of the rounds' medians, and each build's median over the
first build's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "sgl_dsv4_kernels"
RESULT_PREFIX = "ab_builds result: "


def stage(build_so: str, root: str) -> str:
    """A directory holding the package's Python files with build_so as its compiled module."""
    shutil.copytree(os.path.join(REPO, PACKAGE), os.path.join(root, PACKAGE),
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(build_so, os.path.join(root, PACKAGE, "_C.abi3.so"))
    return root


def parse_case(text: str) -> Tuple[str, int]:
    name, _, size = text.partition(":")
    return name, int(size) if size else 0


def worker(case_texts: List[str], iters: int) -> None:
    """Runs in the staged process: times every case and prints the medians (us) as one JSON line."""
    import torch

    import sgl_dsv4_kernels
    from benchmarks import cases
    from benchmarks.harness import DEVICE, Bench

    print(f"module: {sgl_dsv4_kernels._C.__file__}", file=sys.stderr)
    bench = Bench() if DEVICE == "cuda" else None
    medians = {}
    for text in case_texts:
        fn = cases.build(*parse_case(text))
        if bench is not None:
            medians[text] = bench.time_single(fn, iters=iters)
        else:
            fn()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            medians[text] = statistics.median(times)
        del fn
        if bench is not None:
            torch.cuda.empty_cache()
    print(RESULT_PREFIX + json.dumps(medians))


def run_worker(module: str, staged: str, worker_args: List[str], prefix: str) -> Dict[str, float]:
    """Runs `python -m module --worker *worker_args` on the build staged in `staged` and returns the times its
    last line starting with `prefix` gives; stops when the run fails or loaded another copy of the module."""
    tool = module.rpartition(".")[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([staged, REPO]))
    proc = subprocess.run([sys.executable, "-m", module, "--worker", *worker_args], capture_output=True, text=True,
                          env=env, cwd=staged)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{tool}: the run in {staged} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    if staged not in proc.stderr:
        raise SystemExit(f"{tool}: the run in {staged} did not load its own module:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len(prefix):])


def parse_builds(parser: argparse.ArgumentParser, build_args: List[str]) -> List[Tuple[str, str]]:
    """The (name, path) of every --build NAME=PATH.so; at least two, each an existing file, names distinct."""
    builds = [b.partition("=") for b in build_args]
    if len(builds) < 2 or any(not sep or not os.path.isfile(path) for _, sep, path in builds):
        parser.error("give at least two --build NAME=PATH.so, each an existing file")
    if len({name for name, _, _ in builds}) != len(builds):
        parser.error("the builds' names must differ")
    return [(name, path) for name, _, path in builds]


Times = Dict[str, Dict[str, List[float]]]  # build name -> case -> one time (us) per round


def alternating_rounds(builds: List[Tuple[str, str]], rounds: int, run: Callable[[str], Dict[str, float]],
                       after_round: Callable[[int, Times], None] = lambda done, times: None) -> Times:
    """Stages every build, then per round calls run(staged directory) for each build in turn, in reverse order
    every other round, and collects the times it returns per case; after_round(rounds done, times so far)
    follows each round."""
    names = [name for name, _ in builds]
    times: Times = {name: {} for name in names}
    with tempfile.TemporaryDirectory(prefix="ab_") as tmp:
        staged = {name: stage(path, os.path.join(tmp, name)) for name, path in builds}
        for r in range(rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                for case, us in run(staged[name]).items():
                    times[name].setdefault(case, []).append(us)
            after_round(r + 1, times)
    return times


def table(names: List[str], case_texts: List[str], times: Times) -> str:
    """Markdown: per case, each build's min-max over the rounds, and its median over the first build's."""
    head = "| case | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:])
    lines = [head + " |", "|---" * (1 + 2 * len(names) - 1) + "|"]
    for case in case_texts:
        spans = [f"{min(times[n][case]):.2f}-{max(times[n][case]):.2f}" for n in names]
        base = statistics.median(times[names[0]][case])
        ratios = [f"{statistics.median(times[n][case]) / base:.3f}" for n in names[1:]]
        lines.append(f"| {case} | " + " | ".join(spans + ratios) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", action="append", default=[], metavar="NAME=PATH.so")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("cases", nargs="+", metavar="CASE[:SIZE]")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.cases, args.iters)
        return 0
    builds = parse_builds(parser, args.build)
    worker_args = ["--iters", str(args.iters), *args.cases]
    times = alternating_rounds(builds, args.rounds,
                               lambda staged: run_worker("benchmarks.ab_builds", staged, worker_args, RESULT_PREFIX))
    names = [name for name, _ in builds]
    print(table(names, args.cases, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
