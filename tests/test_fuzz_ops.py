"""Every op fed hostile arguments (tests/fuzz_ops.py): one argument of a valid call changed at a time. Each case must
return or raise an error naming the op, and the op's fake must agree with it wherever the change is metadata
only. Under scripts/asan_check.sh the CPU cases also run with AddressSanitizer; the CUDA cases run in subprocesses,
once under compute-sanitizer memcheck.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fuzz_ops
from samples import cuda_only
from sanitizer import find_sanitizer

OPS = fuzz_ops.all_ops()


@pytest.fixture(scope="module")
def cpu_cases():
    cases = {}
    for case in fuzz_ops.fuzz_cases(fuzz_ops.record_calls("cpu"), bases_per_op=3):
        cases.setdefault(case.op, []).append(case)
    return cases


def test_recorded_calls_cover_every_op(cpu_cases):
    assert len(OPS) >= 28 and set(cpu_cases) == set(OPS)


def test_the_fuzzer_reaches_both_outcomes(cpu_cases):
    # A fuzzer whose changes all fail (or all pass) the checks would test nothing: the seeds must be valid calls
    # (most value changes are accepted: padded and out-of-range rows are skipped) and the shape changes rejected.
    outcomes = {}
    for case in (c for cases in cpu_cases.values() for c in cases):
        kind = case.description.split(": ", 1)[1].split(" = ")[0]
        outcomes.setdefault(kind, set()).add(fuzz_ops.run_case(case, check_fake=False)[0])
    assert {"returned", "rejected"} <= outcomes["one row fewer"] and {"returned", "rejected"} <= outcomes["one"]
    assert outcomes["dtype torch.int8"] == outcomes["transposed"] == {"rejected"}


@pytest.mark.parametrize("op", OPS)
def test_hostile_arguments_cpu(cpu_cases, op):
    failures = []
    for case in cpu_cases[op]:
        outcome, detail = fuzz_ops.run_case(case)
        if outcome not in ("returned", "rejected", "skipped"):
            failures.append(f"[{case.description}] {outcome}: {detail}")
    assert not failures, f"{len(failures)} of {len(cpu_cases[op])} cases:\n" + "\n".join(failures[:20])


def _fuzz_subprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, fuzz_ops.__file__, "--device", "cuda", *args], capture_output=True,
                          text=True, timeout=1500, env=dict(os.environ, PYTHONPATH=fuzz_ops.REPO))


@cuda_only
def test_hostile_arguments_cuda():
    proc = _fuzz_subprocess("--bases", "3")
    assert proc.returncode == 0 and ", 0 failed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-2000:]


@cuda_only
def test_hostile_arguments_cuda_memcheck():
    if find_sanitizer() is None:
        pytest.skip("compute-sanitizer not found")
    proc = _fuzz_subprocess("--bases", "1", "--sanitizer")
    assert proc.returncode == 0 and ", 0 failed" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_a_time_limit_reports_the_cases_that_ran(capsys):
    # The device runs bound the fuzz in time: past the limit no case starts, and the report counts the rest as
    # not run without failing (a limit of 0 s runs none).
    assert fuzz_ops.main(["--device", "cpu", "--bases", "1", "--time-limit", "0"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    total = int(last.split()[1])
    assert total > 1000 and last.endswith(f"0 failed, {total} not run (time limit)")
