"""The named single-call cases (benchmarks/cases.py) and the build-against-build timer (benchmarks/ab_builds.py),
run on the CPU: every case builds its inputs and calls its op, and two staged copies of this checkout's build are
timed in turn, each process loading its own copy."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = os.path.join(REPO, "sgl_dsv4_kernels", "_C.abi3.so")
sys.path.insert(0, REPO)

from benchmarks import ab_builds  # noqa: E402  (needs REPO on the path)

# A size for every case small enough for the CPU (rows, requests, or prefill tokens).
CPU_SIZES = {"kwriter": 64, "kwriter_fp4": 64, "kwriter_v4": 64, "store_v4": 64, "store_v41": 64,
             "store_v41_fp4": 64, "store_fp8": 64, "store_fp4": 64, "compress_v4": 64, "compress_v4_prefill": 64,
             "indexer_fp8": 64, "indexer_fp4": 64, "c1": 8, "c2": 8, "c2p": 64, "c4": 4, "c128": 4, "c128e": 4,
             "c4p": 130, "c4p128": 130, "c128p": 130, "plan": 4, "plan128": 4}

# Builds every case at its CPU size (with the benchmark modules' caches shrunk) and calls it once.
EVERY_CASE = """
import sys
from benchmarks import bench_compress as bc, bench_low_ratio as lr, cases
lr.DECODE_CACHE_BYTES = 1 << 20
bc.MAX_PLAN_TOKENS = 64
sizes = dict(arg.split(":") for arg in sys.argv[1:])
assert set(sizes) == set(cases.CASES), set(sizes) ^ set(cases.CASES)
for name, size in sizes.items():
    cases.build(name, int(size))()
    print("ran", name)
"""


def _cpu_env():
    return dict(os.environ, DSV4_BENCH_DEVICE="cpu", OMP_NUM_THREADS="1",
                PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_every_case_runs_on_the_cpu():
    args = [f"{name}:{size}" for name, size in CPU_SIZES.items()]
    done = subprocess.run([sys.executable, "-c", EVERY_CASE, *args], cwd=REPO, env=_cpu_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert done.stdout.count("ran ") == len(CPU_SIZES)


@pytest.mark.skipif(not os.path.isfile(BUILT), reason="the extension is not built in place")
def test_two_staged_builds_are_timed_in_turn(tmp_path):
    # The same module under two names: each process must load its own staged copy (ab_builds checks the path the
    # module came from), and every case gets one time per round and build.
    cases = ["store_v41:64", "kwriter_fp4:64", "c4:4"]
    cmd = [sys.executable, "-m", "benchmarks.ab_builds", "--build", f"a={BUILT}", "--build", f"b={BUILT}",
           "--rounds", "2", "--iters", "3", *cases]
    done = subprocess.run(cmd, cwd=str(tmp_path), env=_cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert rows[0] == "| case | a us | b us | b / a |"
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == cases
    for r in rows[1:]:
        a_span, b_span, ratio = r.strip("| ").split(" | ")[1:]
        for span in (a_span, b_span):
            low, high = map(float, span.split("-"))
            assert 0 < low <= high
        assert float(ratio) > 0


def test_the_table_gives_each_builds_median_over_the_first():
    times = {"main": {"x:1": [10.0, 12.0, 11.0]}, "new": {"x:1": [9.0, 8.0, 30.0]}}
    lines = ab_builds.table(["main", "new"], ["x:1"], times).splitlines()
    assert lines[0] == "| case | main us | new us | new / main |"
    assert lines[2] == f"| x:1 | 10.00-12.00 | 8.00-30.00 | {9.0 / 11.0:.3f} |"


def test_a_missing_build_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        ab_builds.main(["--build", f"a={BUILT}", "--build", f"b={tmp_path / 'none.so'}", "store_v41:64"])
    with pytest.raises(SystemExit):
        ab_builds.main(["--build", f"a={BUILT}", "store_v41:64"])
    with pytest.raises(SystemExit):  # two builds of one name would share a column
        ab_builds.main(["--build", f"a={BUILT}", "--build", f"a={BUILT}", "store_v41:64"])


def test_ab_decode_rejects_bad_cases_and_builds(tmp_path):
    # The decode A/B (benchmarks/ab_decode.py) times graph replays and so needs a GPU; on the CPU its argument
    # checks must still name what is wrong before anything is staged.
    def run(*args):
        return subprocess.run([sys.executable, "-m", "benchmarks.ab_decode", *args], cwd=str(tmp_path), env=_cpu_env(),
                              capture_output=True, text=True, timeout=120)

    bad_case = run("--build", f"a={BUILT}", "--build", f"b={BUILT}", "c8:64")
    assert bad_case.returncode == 2 and "c128:1,8,64" in bad_case.stderr, bad_case.stderr
    no_sizes = run("--build", f"a={BUILT}", "--build", f"b={BUILT}", "c128")
    assert no_sizes.returncode == 2 and "'c128'" in no_sizes.stderr, no_sizes.stderr
    bad_layout = run("--build", f"a={BUILT}", "--build", f"b={BUILT}", "c2.v5:64")
    assert bad_layout.returncode == 2 and "'c2.v5:64'" in bad_layout.stderr, bad_layout.stderr
    # A low-ratio case passes the case check, so the build check is what stops this one.
    one_build = run("--build", f"a={BUILT}", "c128:64", "c2v.v41_fp4:8")
    assert one_build.returncode == 2 and "at least two --build" in one_build.stderr, one_build.stderr
