"""Mutation fuzzing of every torch.ops.dsv4 op: valid calls recorded from a serving session and from KV I/O calls,
then each argument changed alone (dtype, device, shape, strides, alignment, hostile index values, NaN / inf,
extreme scalars). Every case must return or raise an error that names the op, and an op's fake must agree with it on
every case whose change is metadata only. Used by tests/test_fuzz_ops.py and scripts/asan_check.sh; as a script
(`python tests/fuzz_ops.py --device cuda --sanitizer`) it runs the cases in subprocesses, under compute-sanitizer
memcheck when asked, so that a crash or a memory error is pinned on its case.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import sgl_dsv4_kernels as dk  # noqa: E402
from sanitizer import find_sanitizer  # noqa: E402  (tests/ is on sys.path: beside this file, or pytest's rootdir)

INT_VALUES = [-1, -2, -(2**31), 2**31 - 1, 2**31, 2**40, 2**62, -(2**63), 1000, 1000000]
SCALAR_INTS = [0, -1, 1, 2, 3, 5, 63, 2**31, 2**62, -(2**63)]
SCALAR_FLOATS = [math.nan, math.inf, -1.0, 0.0, 1e30]
# Scalars the ops check against tensor values (which a fake cannot see): a change to one is not metadata only.
VALUE_CHECKED_SCALARS = {"plan_compress_prefill.default": {"num_q_tokens"}}
DATA_DEPENDENT_OUTPUTS = {"plan_compress_prefill.default"}
# The first line of each error compute-sanitizer memcheck reports.
MEMCHECK_ERROR = re.compile(r"=+ (Invalid|Misaligned|Program hit|Out-of-range|Malloc|Address)")
DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8, torch.bool]


class Call(NamedTuple):
    op: str  # overload name, e.g. "fused_store_cache.default"
    args: tuple
    kwargs: dict


class Case(NamedTuple):
    op: str
    description: str
    metadata_only: bool  # the change is to dtypes, shapes, strides or scalars: the fake sees all of it
    make: Callable[[], Optional[Call]]  # None when the change does not apply to this argument


def all_ops() -> List[str]:
    """Every registered overload of the dsv4 namespace, as "name.overload"."""
    names = [n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dsv4::")]
    return sorted(n if "." in n else n + ".default" for n in names)


def op_of(name: str):
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.dsv4, packet), overload)


# ---- recording valid calls ----


class _Recorder(TorchDispatchMode):
    """Keeps the first call of each (op, scalar arguments, dtypes) signature, its tensors cloned."""

    def __init__(self, calls: Dict[tuple, Call]):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("dsv4."):
            flat = list(args) + list(kwargs.values())
            key = (name,) + tuple(str(a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in flat)
            if key not in self.calls:
                # Written arguments are recorded as zeros: out buffers are often torch.empty, whose values would
                # make the recorded calls (and the mutations derived from their values) differ run to run.
                written = {a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
                names = [a.name for a in func._schema.arguments]
                self.calls[key] = Call(name.split(".", 1)[1],
                                       tuple(_clone(a, names[i] in written) for i, a in enumerate(args)),
                                       {k: _clone(v, k in written) for k, v in kwargs.items()})
        return func(*args, **kwargs)


def _clone(a, zero=False):
    if not isinstance(a, torch.Tensor):
        return a
    return torch.zeros_like(a) if zero else a.detach().clone()


def _kv_io_calls(device):
    gen = torch.Generator().manual_seed(0)
    page_size = 16
    for layout in dk.KVLayout:
        cache = torch.zeros(5, layout.page_bytes(page_size), dtype=torch.uint8, device=device)
        x = torch.randn(20, 512, generator=gen).to(torch.bfloat16).to(device)
        slots = torch.randperm(5 * page_size, generator=gen)[:20].to(device)
        dk.fused_store_cache(x, cache, slots, page_size=page_size, layout=layout)
        out = dk.dequantize_k_cache_paged(cache, slots, page_size, layout=layout)
        torch.ops.dsv4.dequantize_k_cache_paged.out(cache, slots, page_size, int(layout), out=out)
    for fmt in dk.IndexerFormat:
        cache = torch.zeros(5, fmt.page_bytes(page_size), dtype=torch.uint8, device=device)
        x = torch.randn(20, 128, generator=gen).to(torch.bfloat16).to(device)
        slots = torch.randperm(5 * page_size, generator=gen)[:20].to(device)
        dk.fused_store_cache(x, cache, slots, page_size=page_size, type="indexer", use_fp4=fmt.is_fp4)
    x = torch.randn(20, 512, generator=gen).to(torch.bfloat16).to(device)
    torch.ops.dsv4.fake_quant_compressed_kv(x)
    torch.ops.dsv4.fake_quant_fp4(x, block_size=32)
    for layout in dk.KVLayout:
        torch.ops.dsv4.kv_layout_traits(int(layout))
    torch.ops.dsv4.indexer_format_traits(1)
    torch.ops.dsv4.page_geometry("v41_fp4", 64)
    torch.ops.dsv4.kv_layout_pair_valid(1, 2)


def _derived_calls(calls: Dict[tuple, Call], device):
    """The overloads a serving session does not call, from the recorded calls of their siblings."""
    ops = torch.ops.dsv4
    by_op = {}
    for c in calls.values():
        by_op.setdefault(c.op, []).append(c)
    for c in by_op.get("build_page_table_positions_small_out.default", []):
        req_to_token, page_size, page_table = c.args[0], c.args[3], c.args[7]
        max_seq_len = min(page_table.size(1) * page_size, req_to_token.size(1))
        ops.build_page_table_positions_small(*c.args[:3], max_seq_len, page_size, c.args[4])
    for c in by_op.get("build_low_ratio_metadata_out.default", []):
        ops.build_low_ratio_metadata(*c.args[:3])
    for c in by_op.get("init_compression_metadata_out.default", []):
        ops.init_compression_metadata(*c.args[:5], c.args[13].size(1) > 0)
    for c in by_op.get("get_paged_mqa_logits_metadata_out.default", []):
        ops.get_paged_mqa_logits_metadata(c.args[0], c.args[1], c.args[2].size(0) - 1)
    for c in by_op.get("plan_compress_decode_out.default", []):
        ops.plan_compress_decode(*c.args[:8])
    for c in by_op.get("plan_compress_prefill_out.default", [])[:4]:
        ops.plan_compress_prefill(*c.args[:10], False)
        ops.plan_compress_prefill(*c.args[:10], True)
    for ratio, width in ((2, 512), (4, 64), (128, 8)):
        table = torch.tensor([[7, 3, 0], [1, -1, 2]], dtype=torch.int32, device=device)
        lens = torch.tensor([130, 200], dtype=torch.int32, device=device)
        pages = torch.empty((2, width), dtype=torch.int32, device=device)
        ops.fill_all_compressed_indices(table, lens, pages, ratio, 256, torch.empty_like(pages))
        ops.fill_all_compressed_indices(table.long(), lens, pages, ratio, 256, None)


def record_calls(device="cpu") -> List[Call]:
    """One valid call per (op, scalar arguments, dtypes): a 52-step session of every layer kind (no reference),
    KV I/O calls, and the sibling overloads derived from them."""
    from sgl_dsv4_kernels.pipeline import LayerKind, run_session

    torch.manual_seed(0)
    calls: Dict[tuple, Call] = {}
    with _Recorder(calls):
        run_session(list(LayerKind), device, with_reference=False)
        _kv_io_calls(device)
        _derived_calls(calls, device)
    return list(calls.values())


# ---- mutations ----


def _set_one(x, v):
    y = x.clone()
    y.view(-1)[y.numel() // 2] = v
    return y


def _misaligned(x):
    """The same values at an address one element past an aligned allocation."""
    t = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)[1:].view(x.shape)
    return t.copy_(x)


def _with_row(x, count):
    row = x[:1] if x.shape[0] else torch.zeros((1,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x] + [row] * count)


def _with_column(x):
    col = x[..., :1] if x.shape[-1] else torch.zeros(tuple(x.shape[:-1]) + (1,), dtype=x.dtype, device=x.device)
    return torch.cat([x, col], -1)


def tensor_mutations(x: torch.Tensor) -> List[Tuple[str, bool, Callable]]:
    """(description, metadata only, make) for one tensor argument."""
    out = [(f"dtype {dt}", True, lambda dt=dt: x.to(dt)) for dt in DTYPES if dt != x.dtype]
    if x.is_cuda:
        out.append(("on the CPU", True, lambda: x.cpu()))
    if x.dim() == 0:
        out.append(("as 1-D", True, lambda: x.reshape(1)))
    else:
        if x.shape[0] > 0:
            out += [("one row fewer", True, lambda: x[:-1].clone()), ("no rows", True, lambda: x[:0].clone()),
                    ("rows broadcast (stride 0)", True, lambda: x[:1].expand(x.shape))]
        out += [("one row more", True, lambda: _with_row(x, 1)), ("64 rows more", True, lambda: _with_row(x, 64))]
        if x.shape[-1] > 0:
            out += [("last dim - 1", True, lambda: x[..., :-1].clone()),
                    ("last dim halved", True, lambda: x[..., : x.shape[-1] // 2].clone())]
        out += [("last dim + 1", True, lambda: _with_column(x)),
                ("last dim strided", True, lambda: torch.stack([x, x], -1)[..., 0]),
                ("leading dim added", True, lambda: x.unsqueeze(0)),
                ("flattened", True, lambda: x.reshape(-1)),
                ("misaligned", False, lambda: _misaligned(x))]
        if x.dim() >= 2:
            out += [("transposed", True, lambda: x.transpose(0, 1)),
                    ("last dim dropped", True, lambda: x[..., 0].clone()),
                    ("columns broadcast (stride 0)", True, lambda: x[:, :1].expand(x.shape))]
    if x.numel() == 0:
        return out
    if x.dtype in (torch.int32, torch.int64):
        info = torch.iinfo(x.dtype)
        for v in INT_VALUES:
            v = max(info.min, min(info.max, v))
            out += [(f"one = {v}", False, lambda v=v: _set_one(x, v)),
                    (f"all = {v}", False, lambda v=v: torch.full_like(x, v))]
        top = int(x.max())
        for v in dict.fromkeys((top + 1, top + 2, 2 * top + 1, 16 * top + 15)):
            if info.min <= v <= info.max:
                out.append((f"one = {v} (past the max)", False, lambda v=v: _set_one(x, v)))
        out += [("reversed", False, lambda: x.flip(0)),
                ("all + 1", False, lambda: (x.long() + 1).clamp(info.min, info.max).to(x.dtype)),
                ("random", False, lambda: torch.randint(info.min // 2, min(info.max, 2**40), x.shape, dtype=x.dtype,
                                                        generator=torch.Generator().manual_seed(1)).to(x.device))]
    elif x.is_floating_point():
        for v in (math.nan, math.inf, -math.inf, 3e38):
            out.append((f"one = {v}", False, lambda v=v: _set_one(x, v)))
        out.append(("all nan", False, lambda: torch.full_like(x, math.nan)))
    elif x.dtype == torch.uint8:
        out.append(("all 0xff", False, lambda: torch.full_like(x, 255)))
    return out


def scalar_mutations(a) -> List[Tuple[str, bool, Callable]]:
    if isinstance(a, bool):
        return [(f"{not a}", True, lambda: not a)]
    if isinstance(a, int):
        values = dict.fromkeys(SCALAR_INTS + [a + 1, a - 1, 2 * a, a // 2, 64 * a])
        return [(f"{v}", True, lambda v=v: v) for v in values if v != a]
    if isinstance(a, float):
        return [(f"{v}", True, lambda v=v: v) for v in SCALAR_FLOATS]
    if isinstance(a, str):
        return [("''", True, lambda: ""), ("'bogus'", True, lambda: "bogus")]
    return []


def fuzz_cases(calls: List[Call], bases_per_op: int = 3) -> List[Case]:
    """Each of the first `bases_per_op` calls of an op (smallest first), one argument mutated per case."""
    by_op: Dict[str, List[Call]] = {}
    for c in calls:
        by_op.setdefault(c.op, []).append(c)
    cases = []
    for name in sorted(by_op):
        size = lambda c: sum(a.numel() for a in list(c.args) + list(c.kwargs.values()) if isinstance(a, torch.Tensor))
        for b, base in enumerate(sorted(by_op[name], key=size)[:bases_per_op]):
            for where, arg_name, value in arg_places(base):
                if isinstance(value, torch.Tensor):
                    mutations = tensor_mutations(value)
                elif value is None:
                    mutations = []
                else:
                    mutations = scalar_mutations(value)
                value_checked = arg_name in VALUE_CHECKED_SCALARS.get(name, ())
                for description, metadata_only, make_value in mutations:
                    cases.append(Case(name, f"call {b}, {arg_name}: {description}",
                                      metadata_only and not value_checked, _mutated_call(base, where, make_value)))
    return cases


def arg_places(call: Call) -> List[Tuple[object, str, object]]:
    """(index or keyword, schema name, value) of every argument of the call."""
    schema = op_of(call.op)._schema.arguments
    return [(i, schema[i].name, a) for i, a in enumerate(call.args)] + [(k, k, v) for k, v in call.kwargs.items()]


def replaced(call: Call, values: Dict[object, object]) -> Call:
    """The call with its other tensors cloned and the arguments at the given places (index or keyword) replaced."""
    args = [values[i] if i in values else _clone(a) for i, a in enumerate(call.args)]
    kwargs = {k: values[k] if k in values else _clone(v) for k, v in call.kwargs.items()}
    return Call(call.op, tuple(args), kwargs)


def _mutated_call(base: Call, where, make_value) -> Callable[[], Optional[Call]]:
    def make():
        try:
            value = make_value()
        except (RuntimeError, IndexError, ValueError):
            return None
        return replaced(base, {where: value})
    return make


# ---- running ----


def _outputs(result):
    """(shape, dtype) of each output tensor; a data-dependent size of a fake output is None."""
    flat = result if isinstance(result, (tuple, list)) else (result,)
    return [(tuple(d if isinstance(d, int) else None for d in t.shape), t.dtype)
            for t in flat if isinstance(t, torch.Tensor)]


def _same_outputs(real, fake) -> bool:
    """Both None (rejected), or the same dtypes and shapes (a fake's data-dependent size matches any)."""
    if real is None or fake is None:
        return real is None and fake is None
    return len(real) == len(fake) and all(
        real_dtype == fake_dtype and len(real_shape) == len(fake_shape)
        and all(f is None or r == f for r, f in zip(real_shape, fake_shape))
        for (real_shape, real_dtype), (fake_shape, fake_dtype) in zip(real, fake))


def _names_op(op: str, error: Exception) -> bool:
    packet = op.split(".")[0]
    return f"dsv4.{packet}" in str(error) or f"dsv4.{packet.removesuffix('_out')}" in str(error)


def run_case(case: Case, check_fake: bool = True) -> Tuple[str, str]:
    """("returned" | "rejected" | "skipped", "") or ("unclear" | "fake disagrees", detail)."""
    call = case.make()
    if call is None:
        return "skipped", ""
    fn = op_of(call.op)
    try:
        result = fn(*call.args, **call.kwargs)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # a kernel's fault surfaces here, on its own case
        outcome, real = "returned", _outputs(result)
    except Exception as e:  # noqa: BLE001 (every exception is classified)
        if not _names_op(call.op, e):
            return "unclear", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        outcome, real = "rejected", None
    has_tensors = any(isinstance(a, torch.Tensor) for a in list(call.args) + list(call.kwargs.values()))
    if check_fake and case.metadata_only and has_tensors:
        fake_outcome, fake = _fake_run(call)
        if fake_outcome != outcome or not _same_outputs(real, fake):
            return "fake disagrees", f"op {outcome} {real}, fake {fake_outcome} {fake}"
    return outcome, ""


def _fake_run(call: Call):
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    # Only an op with data-dependent output sizes needs a shape environment (it costs ~1 ms per input tensor).
    shape_env = ShapeEnv() if call.op in DATA_DEPENDENT_OUTPUTS else None
    with FakeTensorMode(allow_non_fake_inputs=False, shape_env=shape_env) as mode:
        conv = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
        args = tuple(conv(a) for a in call.args)
        kwargs = {k: conv(v) for k, v in call.kwargs.items()}
        try:
            result = op_of(call.op)(*args, **kwargs)
        except Exception:  # noqa: BLE001
            return "rejected", None
    return "returned", _outputs(result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bases", type=int, default=3, help="recorded calls mutated per op")
    parser.add_argument("--sanitizer", action="store_true", help="run the cases under compute-sanitizer memcheck")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: start no case after this, and report the cases that ran")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    deadline = args.deadline if args.deadline is not None else (
        time.time() + args.time_limit if args.time_limit is not None else None)
    cases = fuzz_cases(record_calls(args.device), args.bases)
    if args.worker is not None:  # one subprocess: cases from --worker on, a line per case
        for index in range(args.worker, len(cases)):
            if deadline is not None and time.time() > deadline:
                return 0
            print(f"CASE {index}", flush=True)
            outcome, detail = run_case(cases[index], check_fake=not args.sanitizer)  # the fakes: see the plain run
            print(f"DONE {index}\t{outcome}\t{detail}", flush=True)
            if outcome == "unclear" and "CUDA" in detail:
                return 3  # the context is lost: the next cases run in a fresh process
        return 0
    results: Dict[int, Tuple[str, str]] = {}
    start = 0
    while start < len(cases):
        cmd = [sys.executable, os.path.abspath(__file__), "--device", args.device, "--bases", str(args.bases),
               "--worker", str(start)]
        if deadline is not None:
            cmd += ["--deadline", str(deadline)]
        if args.sanitizer:
            cmd = [find_sanitizer() or "compute-sanitizer", "--tool", "memcheck", "--print-limit", "5"] + cmd
            cmd.append("--sanitizer")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        current = None
        for line in proc.stdout.splitlines():
            if line.startswith("CASE "):
                current = int(line.split()[1])
            elif line.startswith("DONE "):
                index, outcome, detail = line[5:].split("\t", 2)
                if results.get(int(index), ("",))[0] != "memory error":
                    results[int(index)] = (outcome, detail)
            elif current is not None and MEMCHECK_ERROR.match(line):
                results[current] = ("memory error", line.strip("= ")[:300])
        if proc.returncode == 0 or current is None:
            break
        if current not in results:
            results[current] = ("crashed", (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:300])
        start = current + 1
    return report(cases, results, timed_out=deadline is not None and time.time() > deadline)


def report(cases: List[Case], results: Dict[int, Tuple[str, str]], timed_out: bool = False) -> int:
    """A table per op, a FAIL line per failed case, then a summary line. Cases a time limit left out count as
    "not run", a failure unless the limit was reached."""
    counts: Dict[str, Counter] = {}
    bad = []
    for index, case in enumerate(cases):
        outcome, detail = results.get(index, ("not run", ""))
        counts.setdefault(case.op, Counter())[outcome] += 1
        if outcome not in ("returned", "rejected", "skipped") and not (timed_out and outcome == "not run"):
            bad.append(f"{case.op} [{case.description}]: {outcome}: {detail}")
    columns = ["returned", "rejected", "skipped", "unclear", "fake disagrees", "memory error", "crashed", "not run"]
    print(f"{'op':45s} " + " ".join(f"{c:>9s}" for c in ("cases",) + tuple(c.split()[0] for c in columns)))
    for op, c in sorted(counts.items()):
        print(f"{op:45s} {sum(c.values()):9d} " + " ".join(f"{c[k]:9d}" for k in columns))
    for line in bad:
        print("FAIL", line)
    not_run = sum(c["not run"] for c in counts.values())
    limit = f", {not_run} not run (time limit)" if timed_out else ""
    print(f"fuzz: {len(cases)} cases, {len(bad)} failed{limit}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
