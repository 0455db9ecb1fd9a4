"""Tests of the command line sgl_dsv4_kernels/__main__.py (`python -m sgl_dsv4_kernels info | selftest | bench`),
run in a fresh process as a user runs it: the layouts' sizes from `info`, the selftest's table (every cache
format, and with --pipeline every layer kind and check), its exit status when a check fails, and usage errors.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_dsv4_kernels import IndexerFormat, KVLayout

from samples import cuda_only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE = "usage: python -m sgl_dsv4_kernels"
# One row of the selftest's table: "store+dequant v41_fp4      PASS    2820.9  cache bytes == reference, ..."
SELFTEST_ROW = re.compile(r"^(store\+dequant \S+|store indexer_\S+)\s+(PASS|FAIL)\s+(\d+\.\d)\s+(.*)$")
# One row of the pipeline selftest's final table: "v41_c2     dequantized SWA rows           PASS   52"
PIPELINE_ROW = re.compile(r"^(v4_c4|v4_c128|v41_c1|v41_c2)\s+(.+?)\s+(PASS|FAIL)\s+(\d+)(.*)$")


def _env(**extra):
    # One CPU thread: the reference model runs many small ops, which a thread pool slows down ten-fold
    # on a loaded machine.
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(*args, timeout=300, **env):
    """Runs `python -m sgl_dsv4_kernels ARGS` from the repository root; returns the finished process."""
    return subprocess.run([sys.executable, "-m", "sgl_dsv4_kernels", *args], cwd=REPO, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def _selftest_rows(stdout):
    """{check name: (passed, detail)} from the selftest's table; every table line must parse."""
    rows = {}
    for line in stdout.splitlines():
        m = SELFTEST_ROW.match(line)
        if m:
            assert m.group(1) not in rows, line
            rows[m.group(1)] = (m.group(2) == "PASS", m.group(4))
    return rows


def _info_ops(stdout):
    return re.search(r"^ops: (.*)$", stdout, re.M).group(1).split(", ")


def _registered_ops():
    """Every op registered under torch.ops.dsv4 (overload names dropped)."""
    return {s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("dsv4::")}


def _expected_checks():
    return ([f"store+dequant {layout.str_name}" for layout in KVLayout]
            + [f"store indexer_{fmt.str_name}" for fmt in IndexerFormat])


def _check_all_formats_pass(stdout, device, rows, page_size):
    lines = stdout.splitlines()
    assert lines[0].startswith(f"selftest on {device} "), lines[0]
    assert f"{rows} rows, page size {page_size}" in lines[0]
    table = _selftest_rows(stdout)
    assert list(table) == _expected_checks(), stdout
    for name, (ok, detail) in table.items():
        assert ok, (name, detail)
        # Both comparisons the check makes are reported equal (a KV layout also compares its dequantized rows).
        assert detail.count("== reference") == (2 if name.startswith("store+dequant") else 1), (name, detail)
        assert "!=" not in detail
    assert "selftest: all passed" in lines


def _check_pipeline_passes(stdout, decode_mode):
    from sgl_dsv4_kernels.pipeline import LayerKind
    from sgl_dsv4_kernels.pipeline.scenario import default_schedule

    steps = sum(action.mode != "finish" for action in default_schedule())  # the session's steps (52)
    assert f"one layer per kind, decode steps {decode_mode}" in stdout
    # One line of per-step times per step, in the order of the schedule.
    step_lines = [line for line in stdout.splitlines() if re.match(r"^\s*\d+ (prefill|extend|decode|verify)\s", line)]
    assert len(step_lines) == steps
    assert all(line.count("PASS") == len(LayerKind) and "FAIL" not in line for line in step_lines)
    final = {}
    for line in stdout.splitlines():
        m = PIPELINE_ROW.match(line)
        if m:
            final[(m.group(1), m.group(2))] = (m.group(3), int(m.group(4)), m.group(5))
    assert {kind for kind, _ in final} == {k.value for k in LayerKind}
    checks = ["metadata", "compressor output", "cache and state bytes", "dequantized SWA rows",
              "dequantized compressed rows"]
    if decode_mode != "eager":  # every step is also compared with the eager twin, tallied apart
        checks += ["twin: metadata and outputs", "twin: cache and state bytes"]
    for check in checks:
        assert all((k.value, check) in final for k in LayerKind), check
    for key, (result, n, failed) in final.items():
        assert (result, n, failed.strip()) == ("PASS", steps, ""), key
    assert stdout.rstrip().splitlines()[-1] == "pipeline selftest: all passed"


# ----------------------------------------------------------------------------------------------------
# info


def test_info_prints_layout_sizes_and_ops():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # The package the process loaded is this repository's.
    assert out.splitlines()[0] == f"sgl_dsv4_kernels from {os.path.join(REPO, 'sgl_dsv4_kernels', '__init__.py')}"
    assert f"CUDA available: {torch.cuda.is_available()}" in out
    # Every main-KV layout with its bytes per token and its 64-token page, from the Python traits (584 / 528 / 288).
    for layout in KVLayout:
        line = re.search(rf"^\s+{layout.str_name}\s+(\d+) B/token, page\(64\) = (\d+) B$", out, re.M)
        assert line, (layout, out)
        assert (int(line.group(1)), int(line.group(2))) == (layout.bytes_per_token, layout.page_bytes(64))
        assert int(line.group(1)) == torch.ops.dsv4.kv_layout_traits(int(layout))[0]  # the C++ header agrees
    # And both indexer formats (132 / 68).
    for fmt in IndexerFormat:
        line = re.search(rf"^\s+indexer_{fmt.str_name}\s+(\d+) B/token, page\(64\) = (\d+) B$", out, re.M)
        assert line, (fmt, out)
        assert (int(line.group(1)), int(line.group(2))) == (fmt.bytes_per_token, fmt.page_bytes(64))
        assert int(line.group(1)) == torch.ops.dsv4.indexer_format_traits(int(fmt))[0]
    # The op list names registered ops, the README's main ones among them.
    ops = _info_ops(out)
    assert ops == sorted(ops) and len(set(ops)) == len(ops)
    assert set(ops) <= _registered_ops()
    for name in ("fused_store_cache", "dequantize_k_cache_paged", "fused_k_norm_rope_flashmla",
                 "compress_norm_rope_store", "c1_decode_norm_rope_store", "c2_decode_or_verify_norm_rope_store",
                 "c2_prefill_norm_rope_store", "compress_forward", "plan_compress_decode", "plan_compress_prefill",
                 "build_page_table_positions_small", "get_paged_mqa_logits_metadata"):
        assert name in ops, name


def test_info_lists_every_registered_op():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    assert set(_info_ops(proc.stdout)) == _registered_ops()


# ----------------------------------------------------------------------------------------------------
# selftest on the CPU (--device cpu: the CPU ops even where a GPU is present)


@pytest.mark.parametrize("rows,page_size", [(None, None), (37, 2)], ids=["default", "rows37-page2"])
def test_selftest_cpu_every_format_passes(rows, page_size):
    args = ["selftest", "--device", "cpu"]
    if rows is not None:
        args += ["--rows", str(rows), "--page-size", str(page_size)]
    proc = _cli(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _check_all_formats_pass(proc.stdout, "cpu", rows or 333, page_size or 64)
    assert "pipeline selftest" not in proc.stdout  # only with --pipeline


def test_selftest_pipeline_cpu():
    """The README's `selftest --pipeline`: every layer kind through the 52-step session, eager on the CPU (~6 s)."""
    proc = _cli("selftest", "--device", "cpu", "--pipeline")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    _check_all_formats_pass(proc.stdout, "cpu", 333, 64)
    _check_pipeline_passes(proc.stdout, "eager")


def test_selftest_pipeline_cpu_compiled_beside_a_twin():
    """Decode steps compiled on the CPU run beside an eager twin; its comparisons are tallied apart from the
    reference checks (they shared a name, so the GPU's graph mode counted 104 of 52 steps), each once per step."""
    proc = _cli("selftest", "--device", "cpu", "--rows", "16", "--pipeline", "--decode-mode", "compiled")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "decode steps compiled (beside an eager twin)" in proc.stdout
    _check_pipeline_passes(proc.stdout, "compiled")


_CORRUPTED_REFERENCE = textwrap.dedent(
    """
    import sys
    from sgl_dsv4_kernels import reference as ref
    from sgl_dsv4_kernels.__main__ import main

    store = ref.store_indexer_cache

    def store_then_flip(cache, *args, **kwargs):  # the expected indexer cache, one byte off
        out = store(cache, *args, **kwargs)
        cache.view(-1)[:1].bitwise_xor_(0xFF)
        return out

    ref.store_indexer_cache = store_then_flip
    sys.exit(main(["selftest", "--device", "cpu"]))
    """
)


def test_selftest_reports_a_mismatch_and_fails():
    """A selftest that cannot fail checks nothing: one byte off in the reference's indexer caches is reported
    for both indexer formats, and the exit status is 1."""
    proc = subprocess.run([sys.executable, "-c", _CORRUPTED_REFERENCE], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    table = _selftest_rows(proc.stdout)
    assert list(table) == _expected_checks()
    for name, (ok, detail) in table.items():
        if name.startswith("store indexer_"):
            assert not ok and detail == "cache bytes != reference", (name, detail)
        else:
            assert ok, (name, detail)
    assert "selftest: 2 FAILED" in proc.stdout.splitlines()


# ----------------------------------------------------------------------------------------------------
# Usage errors and the GPU-only command


@pytest.mark.parametrize("args,message", [
    ([], "the following arguments are required: command"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["selftest", "--bogus"], "unrecognized arguments: --bogus"),
    (["selftest", "--decode-mode", "fast"], "argument --decode-mode: invalid choice: 'fast'"),
    # A selftest of no rows checked nothing and printed "all passed"; the others ended in a traceback.
    (["selftest", "--rows", "0"], "argument --rows: must be >= 1, got 0"),
    (["selftest", "--rows", "-5"], "argument --rows: must be >= 1, got -5"),
    (["selftest", "--page-size", "0"], "argument --page-size: must be a power of two in [1, 1024], got 0"),
    (["selftest", "--page-size", "3"], "argument --page-size: must be a power of two in [1, 1024], got 3"),
    (["selftest", "--device", "bogus"], "argument --device: invalid device 'bogus' (auto, cpu or cuda)"),
    (["selftest", "--device", "meta"], "argument --device: invalid device 'meta' (auto, cpu or cuda)"),
    (["selftest", "--device", "cpu", "--pipeline", "--decode-mode", "graph"],
     "argument --decode-mode: graph replays a CUDA graph, which needs a CUDA device"),
    # Without --pipeline no decode step runs, so the mode was silently ignored.
    (["selftest", "--device", "cpu", "--decode-mode", "eager"], "argument --decode-mode: only --pipeline runs"),
], ids=["none", "bad-command", "bad-option", "bad-choice", "rows0", "rows-negative", "page-size0", "page-size3",
        "bad-device", "meta-device", "graph-on-cpu", "mode-without-pipeline"])
def test_bad_usage_exits_nonzero_with_usage(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert USAGE in proc.stderr and message in proc.stderr, proc.stderr
    if args == ["bogus"]:  # the choices are named
        assert all(command in proc.stderr.splitlines()[-1] for command in ("info", "selftest", "bench"))
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing ran


def test_selftest_on_cuda_without_a_gpu_is_a_usage_error():
    proc = _cli("selftest", "--device", "cuda", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert USAGE in proc.stderr and "argument --device: cuda asked for, but there is no such CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bench_without_a_gpu_exits_1():
    proc = _cli("bench", CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "bench needs a CUDA GPU"


# ----------------------------------------------------------------------------------------------------
# On a GPU: `selftest` picks the GPU by default, and --pipeline replays the decode steps from a CUDA graph
# beside an eager twin.


@cuda_only
def test_info_names_the_gpu():
    proc = _cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "CUDA available: True" in proc.stdout
    assert f"device: {torch.cuda.get_device_name()}" in proc.stdout.splitlines()


@cuda_only
def test_selftest_gpu_default_device_with_pipeline():
    proc = _cli("selftest", "--pipeline", timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert f"({torch.cuda.get_device_name()})" in proc.stdout.splitlines()[0]
    _check_all_formats_pass(proc.stdout, "cuda", 333, 64)
    assert "decode steps graph (beside an eager twin)" in proc.stdout
    _check_pipeline_passes(proc.stdout, "graph")

