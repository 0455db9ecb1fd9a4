"""§4.6 of compressors.md (and cache-writers.md's PDL rule) in the machine code of the built module: every kernel
waits on its grid dependency (griddepcontrol.wait, SASS ACQBULK) before any global memory access, and no kernel
reads through the non-coherent path (LDG ... .CONSTANT, from __ldg or ld.global.nc). Under PDL a grid starts
before the previous one has finished writing, so a non-coherent load, which assumes its data fixed for the
grid's life, may be scheduled above the wait, and ptxas does so (nvcc 13.0, sm_90, c2's row and weight loads).
Runs on the CPU machine too: cuobjdump reads the cubins out of the module file."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import sgl_dsv4_kernels

# CI (.ci/run) sets DSV4_REQUIRE_CUDA=1: there a module without CUDA code, or without one of the default
# architectures, fails these checks instead of skipping them.
REQUIRE_CUDA = os.environ.get("DSV4_REQUIRE_CUDA", "0") == "1"

# Global memory accesses (prefetches, CCTL, are not reads: they return nothing).
GLOBAL_ACCESS = re.compile(r"^(LDG|STG|LD|ST|ATOM|ATOMG|RED|REDG|LDGSTS|UBLKCP|UTMALDG|UTMASTG|UBLKRED)(\.|$)")


def _cuobjdump() -> str | None:
    """cuobjdump from PATH, the CUDA toolkit, or the copy that Triton (a torch dependency) ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "cuobjdump"), os.X_OK):
            return os.path.join(home, "bin", "cuobjdump")
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if os.access(bundled, os.X_OK) else None


def _kernels():
    """(arch, name, [instruction]) of every function in the module's cubins; skips when there are none."""
    module = Path(sgl_dsv4_kernels.__file__).parent / "_C.abi3.so"
    tool = _cuobjdump()
    if tool is None or not module.exists():
        _skip_unless_required("needs cuobjdump and the built module")
    out = subprocess.run([tool, "-sass", str(module)], capture_output=True, text=True).stdout
    kernels, arch = [], None
    for line in out.splitlines():
        if m := re.search(r"arch = (sm_\d+)", line):
            arch = m.group(1)
        elif m := re.search(r"Function : (\S+)", line):
            kernels.append((arch, m.group(1), []))
        elif kernels and (m := re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)):
            kernels[-1][2].append(re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(1)))
    if not kernels:
        _skip_unless_required("the module has no CUDA code (a CPU-only build)")
    return kernels


def _skip_unless_required(why: str) -> None:
    if REQUIRE_CUDA:
        pytest.fail(f"{why}, but DSV4_REQUIRE_CUDA=1")
    pytest.skip(why)


@pytest.fixture(scope="module")
def kernels():
    return _kernels()


def test_every_kernel_waits_before_touching_global_memory(kernels):
    early = {}
    for arch, name, code in kernels:
        waits = [i for i, ins in enumerate(code) if ins.startswith("ACQBULK")]
        assert waits, f"{arch} {name}: no griddepcontrol.wait"
        accesses = [ins for ins in code[: waits[0]] if GLOBAL_ACCESS.match(ins)]
        if accesses:
            early[f"{arch} {name}"] = accesses[:4]
    assert not early, f"global accesses before griddepcontrol.wait: {early}"


def test_no_non_coherent_loads(kernels):
    nc = {}
    for arch, name, code in kernels:
        loads = [ins for ins in code if ins.startswith("LDG") and ".CONSTANT" in ins]
        if loads:
            nc[f"{arch} {name}"] = loads[:4]
    assert not nc, f"non-coherent loads (use load_input, launch.cuh): {nc}"


def test_the_checks_see_the_kernels(kernels):
    """The parse found the module's kernels and their waits (a parse that found nothing would pass the rest)."""
    names = {name for _, name, _ in kernels}
    assert len(kernels) >= 100
    assert any("c2_rows_kernel" in n for n in names) and any("prefill_plan_fused" in n for n in names)
    assert sum(len(code) for _, _, code in kernels) > 100_000


def test_default_architectures_are_built(kernels):
    """setup.py's default targets, sm_90 and sm_100, both have cubins. Checked where DSV4_REQUIRE_CUDA=1 (CI); a
    local build may narrow them with DSV4_CUDA_ARCHS."""
    if not REQUIRE_CUDA:
        pytest.skip("only under DSV4_REQUIRE_CUDA=1: a local build may narrow DSV4_CUDA_ARCHS")
    assert {arch for arch, _, _ in kernels} >= {"sm_90", "sm_100"}
