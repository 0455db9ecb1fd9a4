"""Tests of the benchmark runner's compact table (benchmarks/run.py: check_target, compact_groups, compact_summary,
the JSON / markdown row readers and `python -m benchmarks.run --compact`, which scripts/gpu_check.sh prints last),
on synthetic rows and on the committed result tables; CPU only, no benchmark runs.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # benchmarks/ is a package beside sgl_dsv4_kernels, not installed
    sys.path.insert(0, REPO)

from benchmarks import run as bench_run  # noqa: E402


def _row(family, op, case, n, us, pct_copy=1.0, *, target="", speedup=None, pct_baseline=None):
    r = dict(family=family, op=op, case=case, n=n, us=us, bytes=1000 * n, gbps=round(pct_copy * 40.0),
             pct_copy=pct_copy, torch_us=None if speedup is None else round(us * speedup, 2), speedup=speedup,
             target=target)
    if pct_baseline is not None:
        r["pct_baseline"] = pct_baseline
    return r


def _rows():
    """A small run: two formats of a writer (decode sizes with a time target up to 256 and none at 1024;
    consecutive large N with a %-of-copy target; random large N without a target), a dequant with a
    %-of-gather target, a metadata op (no case kind), a compressor decode with time and bandwidth targets, and
    the pipeline's step with its sum-of-ops row."""
    rows = []
    for fmt, us in (("v4", (1.5, 1.6, 2.9, 3.2)), ("v41", (1.4, 1.5, 2.5, 3.5))):
        for n, t in zip((1, 64, 256, 1024), us):
            rows.append(_row("writers", "k_writer", f"{fmt} decode", n, t, 0.1 * n / 64,
                             target="<= 3 us" if n <= 256 else "", speedup=10.0 * t))
        rows.append(_row("writers", "k_writer", f"{fmt} consecutive", 65536, 40.0, 88.0 if fmt == "v4" else 72.5,
                         target=">= 85 %", pct_baseline=95.0))
        rows.append(_row("writers", "k_writer", f"{fmt} random", 65536, 45.0, 60.5 if fmt == "v4" else 66.0,
                         pct_baseline=101.0))
        rows.append(_row("writers", "k_writer", f"{fmt} consecutive", 1048576, 470.0, 99.5, target=">= 85 %"))
    rows.append(_row("kv_io", "dequant", "v4 random", 65536, 33.0, 76.0, target=">= 90 % of gather",
                     pct_baseline=133.0, speedup=7.2))
    rows.append(_row("kv_io", "dequant", "v41_fp4 random", 65536, 29.0, 70.0, target=">= 90 % of gather",
                     pct_baseline=89.0, speedup=48.9))
    rows.append(_row("kv_io", "dequant", "v41 random", 65536, 30.0, 79.0, target=">= 90 % of gather"))  # no base
    for n, us, target in ((1, 1.3, "<= 3 us"), (4096, 8.6, ""), (65536, 9.85, "< 10 us")):
        rows.append(_row("metadata", "get_paged_mqa_logits_metadata", "len32k", n, us, 0.5, target=target))
    for n, us, target in ((1, 1.2, "<= 2.1 us (empty + 1)"), (64, 2.4, "<= 2.1 us (empty + 1)"),
                          (1024, 8.7, ">= 85 %")):
        rows.append(_row("compress", "compress_forward", "c4 decode", n, us, 71.2 if n == 1024 else 3.0,
                         target=target, pct_baseline=130.0))
    for n in (1, 64):
        target = "<= 1.5x sum of ops (0.91x)" if n == 64 else ""
        rows.append(_row("pipeline", "decode step", "v4_c4", n, 12.0 + n / 10, 2.0, target=target,
                         pct_baseline=110.0))
        rows.append(_row("pipeline", "sum of 10 ops", "v4_c4", n, 14.0 + n / 10, 1.8))
    return rows


def _groups(rows):
    return {(g["family"], g["op"], g["kind"]): g for g in bench_run.compact_groups(rows)}


@pytest.mark.parametrize("case,kind", [
    ("v41_fp4 decode", "decode"), ("indexer_fp8 consecutive", "consecutive"), ("v4 random", "random"),
    ("v41 prefill", "prefill"), ("v4 verify d=4", "verify"), ("c4 verify4 decode", "decode"),
    ("c4 D128 prefill", "prefill"), ("pages512", "pages512"), ("v4_c4", "v4_c4"), ("c4 w512 raw", "c4 w512 raw"),
])
def test_case_kind(case, kind):
    assert bench_run.case_kind(case) == kind


@pytest.mark.parametrize("fields,met,value,text", [
    (dict(us=3.0, target="<= 3 us"), True, 3.0, "<= 3 us"),  # the limit itself meets a <= target
    (dict(us=3.01, target="<= 3 us"), False, 3.01, "<= 3 us"),
    (dict(us=10.0, target="< 10 us"), False, 10.0, "< 10 us"),  # ... not a < one
    (dict(us=9.9, target="< 10 us"), True, 9.9, "< 10 us"),
    (dict(us=2.2, target="<= 2.1 us (empty + 1)"), False, 2.2, "<= 2.1 us"),
    # A bare % is of the copy bandwidth, whatever % base says.
    (dict(pct_copy=84.9, pct_baseline=99.0, target=">= 85 %"), False, 84.9, ">= 85 %"),
    (dict(pct_copy=85.0, target=">= 85 %"), True, 85.0, ">= 85 %"),
    # "% of scatter / gather" is of the row's baseline.
    (dict(pct_copy=40.0, pct_baseline=95.0, target=">= 90 % of scatter"), True, 95.0, ">= 90 % of scatter"),
    (dict(pct_copy=95.0, pct_baseline=57.0, target=">= 90 % of gather"), False, 57.0, ">= 90 % of gather"),
    (dict(pct_copy=95.0, target=">= 90 % of gather"), None, None, ">= 90 % of gather"),  # no baseline: unjudged
    # The pipeline: its own ratio note, else the step's % base (the sum of ops over the step).
    (dict(pct_baseline=110.0, target="<= 1.5x sum of ops (0.91x)"), True, 0.91, "<= 1.5x sum of ops"),
    (dict(pct_baseline=50.0, target="<= 1.5x sum of ops"), False, 2.0, "<= 1.5x sum of ops"),
    (dict(us=1.0, target="fast enough"), None, None, "fast enough"),  # unreadable: unjudged
])
def test_check_target(fields, met, value, text):
    r = dict(dict(us=5.0, pct_copy=50.0), **fields)
    c = bench_run.check_target(r)
    assert c["met"] is met and c["text"] == text
    assert c["value"] == pytest.approx(value) if value is not None else c["value"] is None
    if met is not None:
        assert (c["margin"] >= 0) == met or (c["margin"] == 0 and text.startswith("<") and not met)


def test_check_target_without_target():
    assert bench_run.check_target(dict(us=1.0, pct_copy=1.0, target="")) is None
    assert bench_run.check_target(dict(us=1.0, pct_copy=1.0)) is None


def test_compact_groups():
    rows = _rows()
    groups = bench_run.compact_groups(rows)
    # One group per (family, op, case kind), in the order the rows ran; formats fold together; the pipeline's
    # sum-of-ops rows are left out.
    assert [(g["family"], g["op"], g["kind"]) for g in groups] == [
        ("writers", "k_writer", "decode"), ("writers", "k_writer", "consecutive"), ("writers", "k_writer", "random"),
        ("kv_io", "dequant", "random"), ("metadata", "get_paged_mqa_logits_metadata", "len32k"),
        ("compress", "compress_forward", "decode"), ("pipeline", "decode step", "v4_c4")]
    assert sum(g["rows"] for g in groups) == len([r for r in rows if not r["op"].startswith("sum of")])
    g = _groups(rows)

    dec = g["writers", "k_writer", "decode"]
    assert (dec["rows"], dec["n_min"], dec["n_max"]) == (8, 1, 1024)
    assert (dec["targets"], dec["met"], dec["unjudged"]) == (6, 6, 0)  # the 1024 rows carry no target
    c, r = dec["worst_time"]
    assert (r["case"], r["n"], c["value"]) == ("v4 decode", 256, 2.9)  # 2.9 of 3 us: the least margin
    assert dec["max_time"]["us"] == 2.9  # N <= 256 only: the 1024 rows' 3.2 / 3.5 us are not decode-size
    assert dec["worst_bw"] is None and dec["min_pct_copy"] is None
    assert dec["speedup"] == pytest.approx((14.0, 35.0))

    con = g["writers", "k_writer", "consecutive"]
    assert (con["targets"], con["met"]) == (4, 3)
    c, r = con["worst_bw"]
    assert (r["case"], r["n"], c["value"], c["met"]) == ("v41 consecutive", 65536, 72.5, False)
    assert con["min_pct_copy"]["pct_copy"] == 72.5 and con["speedup"] is None

    ran = g["writers", "k_writer", "random"]
    assert (ran["targets"], ran["met"], ran["worst_bw"]) == (0, 0, None)
    assert (ran["min_pct_copy"]["case"], ran["min_pct_copy"]["pct_copy"]) == ("v4 random", 60.5)

    deq = g["kv_io", "dequant", "random"]
    assert (deq["targets"], deq["met"], deq["unjudged"]) == (3, 1, 1)
    c, r = deq["worst_bw"]
    assert (r["case"], c["value"]) == ("v41_fp4 random", 89.0)  # % of gather, not the 70 % of copy
    assert deq["speedup"] == pytest.approx((7.2, 48.9))

    meta = g["metadata", "get_paged_mqa_logits_metadata", "len32k"]
    assert (meta["targets"], meta["met"]) == (2, 2)
    c, r = meta["worst_time"]
    assert (r["n"], c["text"]) == (65536, "< 10 us")  # 9.85 of 10 us is closer than 1.3 of 3

    comp = g["compress", "compress_forward", "decode"]
    assert (comp["targets"], comp["met"]) == (3, 1)
    assert comp["worst_time"][1]["n"] == 64 and comp["worst_bw"][0]["value"] == 71.2  # % of copy, not the 130

    pipe = g["pipeline", "decode step", "v4_c4"]
    assert (pipe["rows"], pipe["targets"], pipe["met"]) == (2, 1, 1)
    assert pipe["worst_bw"][0]["value"] == pytest.approx(0.91) and pipe["worst_time"] is None


def test_compact_summary_lines():
    rows = _rows()
    text = bench_run.compact_summary(rows)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["family", "op", "kind", "N"] and lines[0].rstrip().endswith("met")
    assert set(lines[1]) == {"-"}
    body, footer = lines[2:-1], lines[-1]
    assert len(body) == len(bench_run.compact_groups(rows)) == 7  # one line per group, printed whole
    by_key = {tuple(line.split()[:3]): line for line in body}

    line = by_key["writers", "k_writer", "decode"]
    assert "2.90 <= 3 us (v4 @256)" in line and "14.0-35.0" in line and line.endswith("6/6 met")
    line = by_key["writers", "k_writer", "consecutive"]
    assert "72.5 % >= 85 % (v41 @65536)" in line and line.endswith("3/4 NOT MET")
    line = by_key["writers", "k_writer", "random"]
    assert "60.5 %, no target (v4 @65536)" in line and line.endswith("- (no target)")
    line = by_key["kv_io", "dequant", "random"]
    assert "89.0 % >= 90 % of gather (v41_fp4 @65536)" in line and line.endswith("1/2 NOT MET, 1 unjudged")
    line = next(v for k, v in by_key.items() if k[0] == "metadata")
    assert "9.85 < 10 us (@65536)" in line and line.endswith("2/2 met")
    line = by_key["compress", "compress_forward", "decode"]
    assert "2.40 <= 2.1 us (c4 @64)" in line and "71.2 % >= 85 % (c4 @1024)" in line and line.endswith("1/3 NOT MET")
    line = by_key["pipeline", "decode", "step"]
    assert "18.40 us, no target (@64)" in line and "0.91x <= 1.5x sum of ops (@64)" in line
    assert line.endswith("1/1 met") and "sum of 10 ops" not in text

    # Columns line up: every line's met column starts where the header's does.
    col = lines[0].index("met", lines[0].index("torch x"))
    assert all(len(line) > col and line[col - 2:col] == "  " and line[col] != " " for line in body)
    assert footer == "targets met: 14/18 rows (1 unjudged); lines with a target not met: 3 of 7"


def test_compact_summary_empty():
    lines = bench_run.compact_summary([]).splitlines()
    assert len(lines) == 3 and lines[-1] == "targets met: 0/0 rows; lines with a target not met: 0 of 0"


def test_rows_round_trip_json_and_markdown(tmp_path, monkeypatch):
    rows = _rows()
    path = tmp_path / "rows.json"
    bench_run.save_rows(rows, str(path))
    assert bench_run.load_rows(str(path)) == rows
    assert len(path.read_text().splitlines()) == len(rows) + 2  # one row per line
    bench_run.save_rows([], str(path))
    assert bench_run.load_rows(str(path)) == []

    # The markdown table the runner writes reads back to the same compact table (values at its precision).
    monkeypatch.setattr(bench_run.torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    md = bench_run.markdown_table(rows, SimpleNamespace(copy_gbps=4000.0), 1.1)
    back = bench_run.rows_from_markdown(md)
    assert len(back) == len(rows)
    assert [(r["family"], r["op"], r["case"], r["n"], r["target"]) for r in back] == \
        [(r["family"], r["op"], r["case"], r["n"], r["target"]) for r in rows]
    assert bench_run.compact_summary(back) == bench_run.compact_summary(rows)


def _runner(*args):
    """`python -m benchmarks.run ARGS` from the repository root with no GPU visible; the finished process."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_compact_cli(tmp_path):
    """What scripts/gpu_check.sh runs: `python -m benchmarks.run --compact ROWS.json` prints the table, no GPU."""
    path = tmp_path / "bench_rows.json"
    bench_run.save_rows(_rows(), str(path))
    proc = _runner("--compact", str(path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == bench_run.compact_summary(_rows()) + "\n"


def test_unknown_family_is_a_usage_error():
    """`--only` with a misspelt family stops before any measuring (it used to end in a KeyError after the copy
    roofline), naming the argument, the unknown name and the choices."""
    proc = _runner("--only", "writers,writer")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "argument --only: unknown families ['writer']" in proc.stderr
    assert all(family in proc.stderr for family in bench_run.FAMILIES)
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "benchmarks", "results", "*.md"))),
                         ids=os.path.basename)
def test_committed_tables(path):
    """Every committed results table reads back whole, and every row with a target is judged."""
    with open(path) as f:
        text = f.read()
    rows = bench_run.load_rows(path)
    assert len(rows) == sum(line.startswith("| ") and not line.startswith("| family") for line in text.splitlines())
    groups = bench_run.compact_groups(rows)
    assert sum(g["rows"] for g in groups) == sum(not r["op"].startswith("sum of ") for r in rows)
    assert sum(g["targets"] for g in groups) == sum(bool(r["target"]) for r in rows)
    # Targets are all readable; only a `% of ...` target on a row without a baseline stays unjudged.
    for r in rows:
        c = bench_run.check_target(r)
        if c is not None:
            assert c["unit"] != "?", r["target"]
            assert c["met"] is not None or (c["unit"] == "%" and r.get("pct_baseline") is None), r
    lines = bench_run.compact_summary(rows).splitlines()
    assert len(lines) == len(groups) + 3
