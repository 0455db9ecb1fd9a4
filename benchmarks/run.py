"""Benchmark runner: measures the copy roofline and the launch floor, runs every family's benchmark
module, writes benchmarks/results/<gpu>.md (full table) and <gpu>.png (plot), and prints a summary.

    python -m benchmarks.run [--only kv_io,writers,metadata,low_ratio,compress,pipeline] [--out DIR] [--no-torch]
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import time

import torch

from .harness import Bench

# family name -> module (each defines run(bench, results))
FAMILIES = {
    "kv_io": "benchmarks.bench_cache",
    "writers": "benchmarks.bench_writers",
    "metadata": "benchmarks.bench_metadata",
    "low_ratio": "benchmarks.bench_low_ratio",
    "compress": "benchmarks.bench_compress",
    "pipeline": "benchmarks.bench_pipeline",
}


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def markdown_table(rows, bench, empty_us):
    lines = [
        f"# Benchmarks on {torch.cuda.get_device_name()}",
        "",
        f"torch {torch.__version__}; device-to-device copy bandwidth measured in this run: "
        f"**{bench.copy_gbps:.0f} GB/s** (bytes read + written); empty kernel under graph replay: "
        f"**{empty_us:.2f} us**.",
        "Decode sizes: median per-call time of many calls replayed from one CUDA graph. Large sizes: median",
        "of single calls with the L2 flushed in between (a read of 256 MB, which leaves no dirty line for the timed",
        "call to write back). `torch` = idiomatic torch compiled with",
        "torch.compile(dynamic=True). `% base` = our GB/s over a plain gather/scatter copy of the same rows and",
        "slots (torch index_select / index_copy_). For the pipeline family, `% base` = the sum of the decode step's",
        "ops timed standalone over the whole step's time (>= 67 % meets the 1.5x target). For the low_ratio family's",
        "decode and verify rows and the compressor decode rows,",
        "`% base` = our GB/s over one device copy of the same number of bytes under the same graph replay (the",
        "ceiling at that size, launch latency included). For the writers at large N (consecutive slots, prefill",
        "plans), c2 prefill and the compressor prefills, `% base` = our GB/s over one device copy of the same bytes",
        "timed the same way (single calls, the L2 flushed by a read in between): the ceiling at that size.",
        "The metadata family is timed under graph replay at every batch, the large ones included (in serving",
        "these ops run inside the step's graph).",
        "",
        "| family | op | case | N | us | MB moved | GB/s | % copy | torch us | speed-up | % base | target |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['op']} | {r['case']} | {r['n']} | {r['us']:.2f} | {r['bytes'] / 1e6:.3f} | "
            f"{r['gbps']:.0f} | {r['pct_copy']:.1f} | {_fmt(r.get('torch_us'), '.2f')} | "
            f"{_fmt(r.get('speedup'), '.1f')} | {_fmt(r.get('pct_baseline'), '.0f')} | {r.get('target', '')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in rows if "decode" in r["case"] or r["family"] in ("metadata", "pipeline")]
    large = [r for r in rows if r not in decode and r["n"] >= 65536]
    fig, axes = plt.subplots(1, 2, figsize=(18, 7))
    series = {}
    for r in decode:
        series.setdefault(f"{r['op']} {r['case']}", []).append((r["n"], r["us"]))
    for name, pts in series.items():
        pts.sort()
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    axes[0].axhline(3.0, color="red", linestyle="--", label="3 us target")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("rows per call")
    axes[0].set_ylabel("us per call (graph replay)")
    axes[0].set_title("decode sizes")
    axes[0].legend(fontsize=6, ncol=2)
    labels = [f"{r['op']} {r['case']} {r['n']}" for r in large]
    axes[1].barh(range(len(large)), [r["pct_copy"] for r in large])
    axes[1].set_yticks(range(len(large)))
    axes[1].set_yticklabels(labels, fontsize=6)
    axes[1].axvline(85, color="red", linestyle="--")
    axes[1].set_xlabel("% of measured copy bandwidth")
    axes[1].set_title("large N")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(rows):
    """A short table for the end of the log: one line per (op, case) with the decode worst case and
    the large-N results."""
    out = ["op/case                          N        us    %copy  speedup  %base"]
    for r in rows:
        if r["n"] in (1, 256) or r["n"] >= 65536 or r["family"] in ("metadata", "pipeline"):
            out.append(
                f"{(r['op'] + ' ' + r['case'])[:32]:32s} {r['n']:>7d} {r['us']:>8.2f} {r['pct_copy']:>7.1f} "
                f"{_fmt(r.get('speedup'), '>7.1f'):>8s} {_fmt(r.get('pct_baseline'), '>5.0f'):>6s}"
            )
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated families (default: all available)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--no-torch", action="store_true", help="skip the compiled torch baselines (quick runs)")
    args = parser.parse_args()
    if args.no_torch:
        os.environ["DSV4_BENCH_NO_TORCH"] = "1"
    wanted = [f for f in args.only.split(",") if f] or list(FAMILIES)
    bench = Bench()
    empty_us = bench.empty_kernel_us()
    print(f"copy bandwidth {bench.copy_gbps:.0f} GB/s, empty kernel {empty_us:.2f} us")
    rows = []
    os.makedirs(args.out, exist_ok=True)
    gpu = re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name()).strip("_").lower()
    table_path = os.path.join(args.out, f"{gpu}.md")
    for family in wanted:
        try:
            module = importlib.import_module(FAMILIES[family])
        except ModuleNotFoundError as exc:
            print(f"{family}: skipped ({exc})")
            continue
        start = time.time()
        module.run(bench, rows)
        print(f"{family}: done in {time.time() - start:.0f} s")
        with open(table_path, "w") as f:  # rewritten after every family, so a cut-off run keeps its rows
            f.write(markdown_table(rows, bench, empty_us))
    try:
        plot(rows, os.path.join(args.out, f"{gpu}.png"))
    except ImportError as exc:
        print(f"plot skipped: {exc}")
    print(summary(rows))


if __name__ == "__main__":
    main()
