"""Smoke run of the benchmark code on the CPU: every family's `run` at tiny sizes, with the torch baselines run
eagerly, through a Bench that calls each op once instead of timing it. It catches what only a GPU run would
otherwise show: a wrong argument, an input built on the wrong device, a hot-tensor list that is not tensors.

The families run in a subprocess with DSV4_BENCH_DEVICE=cpu (benchmarks.harness reads it at import).
"""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Module attribute -> the tiny value the smoke run uses (sizes, calls per graph, cache bytes).
TINY = {
    "bench_cache": dict(DECODE_SIZES=(1, 5), LARGE_SIZES=(200,), CALLS_PER_GRAPH=3, DECODE_CACHE_BYTES=1 << 20),
    "bench_writers": dict(DECODE_SIZES=(1, 5), LARGE_SIZES=(200,), MID_SIZES=(100,), CALLS_PER_GRAPH=3,
                          DECODE_CACHE_BYTES=1 << 20, MAX_PREFILL_ROWS=128),
    "bench_low_ratio": dict(DECODE_SIZES=(1, 5), VERIFY_SIZES=(3,), PREFILL_TOKENS=(64,), PREFILL_REQUESTS=4,
                            CALLS_PER_GRAPH=3, DECODE_CACHE_BYTES=1 << 20),
    # 256 rows take the many-sets path; 130 tokens in plans of at most 64 the chunked prefill.
    "bench_compress": dict(DECODE_SIZES=(1, 256), PREFILL_TOKENS=(130,), MAX_PLAN_TOKENS=64, SMALL_DECODE_SETS=2,
                           CALLS_PER_GRAPH=4, WORKING_SET_BYTES=1 << 20),
    "bench_metadata": dict(CALLS_PER_GRAPH=2, DECODE_BATCHES=(1, 5), LARGE_BATCHES=(40,), SCHEDULE_BATCHES=(1, 3000)),
    "bench_pipeline": dict(BATCHES=(1, 3), STEPS_PER_GRAPH=2, MAX_TOKENS=600),
}


def _smoke_main() -> None:
    import importlib

    import torch

    from benchmarks import harness
    from benchmarks.run import compact_summary, summary

    assert harness.DEVICE == "cpu"

    class SmokeBench(harness.Bench):
        """Calls each op once; every time is 1 us. Checks what the timed paths would be given."""

        def __init__(self):
            self.device = torch.device("cpu")
            self.copy_gbps = 1000.0

        def flush_l2(self):
            pass

        def time_single(self, fn, iters=15, warmup=3, flush=True):
            fn()
            return 1.0

        def time_graph(self, calls, replays=20, hot=None):
            assert len(calls) > 0
            if hot is not None:
                assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in hot), "hot: cpu tensors"
            for fn in calls:
                fn()
            return 1.0

    bench = SmokeBench()
    rows = []
    for name, sizes in TINY.items():
        module = importlib.import_module(f"benchmarks.{name}")
        for attr, value in sizes.items():
            assert hasattr(module, attr), f"{name}.{attr}"
            setattr(module, attr, value)
        module.compiled = lambda fn: fn  # the torch baselines run eagerly: compiling them on a CPU takes minutes
        before = len(rows)
        module.run(bench, rows)
        assert len(rows) > before, f"{name} wrote no rows"
        if name != "bench_pipeline":  # every other family compares with its torch version
            assert any(r["torch_us"] for r in rows[before:]), f"{name}: no torch baseline ran"
        print(f"{name}: {len(rows) - before} rows")
    assert all(r["us"] > 0 and r["bytes"] > 0 for r in rows)
    summary(rows)
    compact_summary(rows)


def test_every_benchmark_family_runs_on_the_cpu():
    env = dict(os.environ, DSV4_BENCH_DEVICE="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DSV4_BENCH_NO_TORCH", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "torch baseline failed" not in output, output[-4000:]
    for name in TINY:
        assert f"{name}: " in output, output[-4000:]


if __name__ == "__main__":
    _smoke_main()
