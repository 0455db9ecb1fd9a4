"""Command line: ``python -m sgl_dsv4_kernels {info,selftest,bench}``.

selftest writes random KV rows into every cache format on the GPU (the CPU when there is none),
reads them back, compares with the pure-torch reference and prints a pass/fail table. With
``--pipeline`` it then drives one layer of each kind through a 52-step serving session beside the
reference model (sgl_dsv4_kernels.pipeline), printing per-step times and a pass/fail table.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def info() -> int:
    import sgl_dsv4_kernels as dsv4

    print(f"sgl_dsv4_kernels from {dsv4.__file__}")
    print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}")
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}")
    # Every registered schema (dir(torch.ops.dsv4) lists only the ops resolved so far).
    ops = sorted({s.name.split("::", 1)[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("dsv4::")})
    print("ops: " + ", ".join(ops))
    formats = [(layout.str_name, layout) for layout in dsv4.KVLayout]
    formats += [(f"indexer_{fmt.str_name}", fmt) for fmt in dsv4.IndexerFormat]
    for name, fmt in formats:
        print(f"  {name:11s} {fmt.bytes_per_token} B/token, page(64) = {fmt.page_bytes(64)} B")
    return 0


def _kv_io_checks(device: torch.device, rows: int, page_size: int):
    """Yields (name, passed, detail, microseconds) for each cache format."""
    import sgl_dsv4_kernels as dsv4
    from sgl_dsv4_kernels import reference as ref

    gen = torch.Generator().manual_seed(0)
    for layout in dsv4.KVLayout:
        pages = 2 * rows // page_size + 1
        cache = torch.randint(0, 256, (pages, layout.page_bytes(page_size)), dtype=torch.uint8, generator=gen)
        x = (torch.randn(rows, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (rows, 1), generator=gen).float()))
        x = x.to(torch.bfloat16)
        slots = torch.randperm(pages * page_size, generator=gen)[:rows]
        slots[::7] = -1  # padded rows write nothing
        expected = cache.clone()
        ref.store_k_cache(expected, x, slots, page_size, layout)
        cache, x, slots = cache.to(device), x.to(device), slots.to(device)
        start = time.perf_counter()
        dsv4.fused_store_cache(x, cache, slots, page_size=page_size, layout=layout)
        out = dsv4.dequantize_k_cache_paged(cache, slots, page_size, layout=layout)
        if device.type == "cuda":
            torch.cuda.synchronize()
        us = (time.perf_counter() - start) * 1e6
        same_bytes = torch.equal(cache.cpu(), expected)
        ref_rows = ref.dequantize_k_cache_paged(expected, slots.cpu(), page_size, layout=layout)
        same_rows = torch.equal(out.cpu().view(torch.int16), ref_rows.view(torch.int16))
        detail = f"cache bytes {'==' if same_bytes else '!='} reference, rows {'==' if same_rows else '!='} reference"
        yield f"store+dequant {layout.str_name}", same_bytes and same_rows, detail, us
    for fmt in dsv4.IndexerFormat:
        pages = 2 * rows // page_size + 1
        cache = torch.randint(0, 256, (pages, fmt.page_bytes(page_size)), dtype=torch.uint8, generator=gen)
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16)
        slots = torch.randperm(pages * page_size, generator=gen)[:rows]
        expected = cache.clone()
        ref.store_indexer_cache(expected, x, slots, page_size, int(fmt))
        cache_d = cache.to(device)
        start = time.perf_counter()
        dsv4.fused_store_cache(x.to(device), cache_d, slots.to(device), page_size=page_size, type="indexer",
                               use_fp4=fmt.is_fp4)
        if device.type == "cuda":
            torch.cuda.synchronize()
        us = (time.perf_counter() - start) * 1e6
        ok = torch.equal(cache_d.cpu(), expected)
        yield f"store indexer_{fmt.str_name}", ok, f"cache bytes {'==' if ok else '!='} reference", us


def selftest(device: torch.device, rows: int, page_size: int) -> int:
    print(f"selftest on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"{rows} rows, page size {page_size}")
    print(f"{'check':28s} {'result':6s} {'us':>9s}  detail")
    failures = 0
    for name, ok, detail, us in _kv_io_checks(device, rows, page_size):
        failures += not ok
        print(f"{name:28s} {'PASS' if ok else 'FAIL':6s} {us:9.1f}  {detail}")
    print("selftest: " + ("all passed" if failures == 0 else f"{failures} FAILED"))
    return 1 if failures else 0


def pipeline_selftest(device: torch.device, decode_mode: str) -> int:
    """The serving session of sgl_dsv4_kernels.pipeline for every layer kind, checked after every step."""
    from sgl_dsv4_kernels.pipeline import LayerKind, run_session

    kinds = list(LayerKind)
    if decode_mode == "auto":
        decode_mode = "graph" if device.type == "cuda" else "eager"
    print(f"\npipeline selftest on {device}: one layer per kind, decode steps {decode_mode}"
          + (" (beside an eager twin)" if decode_mode != "eager" else "") + ", checked against the reference model")
    print(f"{'step':>4s} {'mode':8s} {'reqs':>4s} {'tokens':>6s}  " + "  ".join(f"{k.value:>16s}" for k in kinds))
    row = {}
    outcomes = {}  # (kind, check) -> [passed steps, failed steps]

    def on_step(report):
        row[report.kind] = f"{report.seconds * 1e6:9.0f} us {'PASS' if report.ok else 'FAIL'}"
        for check in report.checks:
            outcomes.setdefault((report.kind, check.name), [0, 0])[0 if check.ok else 1] += 1
            if not check.ok:
                print(f"     FAIL {report.kind.value} {check.name}: {check.detail}")
        if len(row) == len(kinds):
            b = report.batch
            print(f"{report.index:4d} {b.mode:8s} {len(b.rids):4d} {b.num_tokens:6d}  "
                  + "  ".join(f"{row[k]:>16s}" for k in kinds))
            row.clear()

    run_session(kinds, device, decode_mode=decode_mode, on_step=on_step)
    print(f"\n{'layer':10s} {'check':30s} {'result':6s} steps")
    failed = 0
    for (kind, name), (passed, bad) in outcomes.items():
        failed += bad > 0
        print(f"{kind.value:10s} {name:30s} {'PASS' if not bad else 'FAIL':6s} {passed + bad}"
              + (f" ({bad} failed)" if bad else ""))
    print("pipeline selftest: " + ("all passed" if not failed else f"{failed} checks FAILED"))
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_dsv4_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="build and op summary")
    st = sub.add_parser("selftest", help="write, read back and check every cache format")
    st.add_argument("--device", default="auto", help="auto (GPU if present), cpu or cuda")
    st.add_argument("--rows", type=int, default=333)
    st.add_argument("--page-size", type=int, default=64)
    st.add_argument("--pipeline", action="store_true",
                    help="also drive one layer of each kind through a serving session beside the reference model")
    st.add_argument("--decode-mode", default="auto", choices=["auto", "eager", "graph", "compiled"],
                    help="how --pipeline runs decode steps (auto: CUDA graph on a GPU, eager on the CPU)")
    bench = sub.add_parser("bench", help="run the benchmarks (GPU only); the pipeline family reports the whole "
                                         "decode step per layer kind beside the sum of its ops")
    bench.add_argument("--only", default="", help="comma-separated families of benchmarks/run.py, e.g. pipeline")
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "selftest":
        device = _device(args.device)
        status = selftest(device, args.rows, args.page_size)
        if args.pipeline:
            status |= pipeline_selftest(device, args.decode_mode)
        return status
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU")
        return 1
    from benchmarks import run as bench_run  # the benchmarks live beside the package in the repo

    sys.argv = ["benchmarks.run"] + (["--only", args.only] if args.only else [])
    bench_run.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
