"""compute-sanitizer memcheck of a Python snippet in a subprocess: the shared runner of the hostile-input tests
(test_metadata's and test_memcheck's). Every case runs the ops on out-of-range and extreme inputs and must end
with no memory error reported."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import torch
import sgl_dsv4_kernels as dk
ops = torch.ops.dsv4
d = "cuda"
big = [-(2**31), -(2**31) + 1, -257, -256, -1, 0, 1, 255, 256, 2**31 - 1]
huge64 = [-(2**62), -(2**33), -1, 0, 2**33, 2**40, 2**62]
"""


def find_sanitizer():
    for candidate in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def assert_memcheck_clean(case_source: str) -> None:
    """Runs PRELUDE + case_source under memcheck (skips when compute-sanitizer is not installed) and asserts
    that it exits cleanly with no error reported."""
    sanitizer = find_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer not found")
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(case_source) + "\ntorch.cuda.synchronize()\n"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Without torch's caching allocator every tensor is its own allocation, so that memcheck also sees an access
    # just past a tensor (inside a cached segment it would be a valid address).
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    proc = subprocess.run(
        [sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", script],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr
