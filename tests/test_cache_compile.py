"""T11 and opcheck for the KV I/O ops: fake impls under FakeTensorMode, torch.library.opcheck on CPU/CUDA
inputs, torch.compile(fullgraph=True) (also dynamic over N) with no clone of the cache, CUDA-graph
capture + replay with padded rows under sync-debug "error", a non-default stream, and PDL on/off."""
import contextlib
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import sgl_dsv4_kernels as dsv4
from samples import (
    ALL_FORMATS,
    IDX_FP8,
    MAIN_FORMATS,
    V4,
    V41,
    V41_FP4,
    all_samples,
    assert_bits_equal,
    assert_bytes_equal,
    clone_view,
    cuda_only,
    fmt_id,
    invalid_slots,
    make_cache,
    make_rows,
    make_slots,
    op_store,
    ref_store,
    seed_of,
)

pytestmark = pytest.mark.usefixtures("single_thread")

BF16 = torch.bfloat16
REPO = pathlib.Path(__file__).resolve().parents[1]
SAMPLE_NAMES = [s.name for s in all_samples("cpu")]


def _sample(name, device):
    return {s.name: s for s in all_samples(device)}[name]


# ====================================================================================================
# fake impls and opcheck


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_fake_impl_shapes(device, name):
    s = _sample(name, device)
    mode = FakeTensorMode()
    args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in s.args]
    kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in s.kwargs.items()}
    with mode:
        result = s.op(*args, **kwargs)
    real = s.op(*s.args, **s.kwargs)
    if real is None:
        assert result is None
        return
    assert result.shape == real.shape and result.dtype == real.dtype
    assert result.device == real.device and result.stride() == real.stride()
    if name.startswith("dequant"):
        assert result.shape == (s.args[1].shape[0], 1, 512) and result.dtype == BF16
    else:
        x = s.args[0]
        assert result.shape == x.shape and result.dtype == x.dtype and result.is_contiguous()


@pytest.mark.parametrize("name", SAMPLE_NAMES)
def test_opcheck(device, name):
    s = _sample(name, device)
    torch.library.opcheck(s.op, s.args, s.kwargs)  # schema, autograd registration, faketensor, aot dynamic


# ====================================================================================================
# torch.compile


def _no_cache_copy(code: str):
    """The generated wrapper's call() runs the op on the graph input itself: no allocation, no copy."""
    assert "def call(" in code, code
    body = code[code.index("def call("):]
    body = body[: body.index("\nrunner = ")] if "\nrunner = " in body else body
    assert "dsv4.fused_store_cache" in body, body
    for bad in ("clone(", "copy_(", "empty_strided", "as_strided_scatter", "aten.copy", "aten.clone"):
        assert bad not in body, f"generated code contains {bad!r}:\n{body}"


def _store_fn(fmt, p):
    kw = dict(page_size=p)
    if fmt.indexer:
        kw.update(type="indexer", use_fp4=fmt.id == 1)
    else:
        kw.update(layout=fmt.id)

    def store(x, cache, slots):
        torch.ops.dsv4.fused_store_cache(x, cache, slots, **kw)

    return store


@pytest.mark.parametrize("kind", ["contiguous", "pool_slice"])
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_compile_store_in_place(device, fmt, kind):
    torch._dynamo.reset()
    p, num_pages = 2, 40
    compiled = torch.compile(_store_fn(fmt, p), fullgraph=True)
    for it in range(2):
        seed = seed_of("compile-store", fmt.name, kind, it)
        cache, buf = make_cache(fmt, p, num_pages, kind=kind, device=device, seed=seed)
        exp_cache, exp_buf = clone_view(cache, buf)
        x = make_rows(37, fmt.width, tile=fmt.tile, seed=seed + 1, dtype=BF16).to(device)
        slots = make_slots(32, p * num_pages, seed=seed + 2, device=device)
        op_store(fmt, x, exp_cache, slots, p)
        if it == 0:
            _, codes = run_and_get_code(compiled, x, cache, slots)
            _no_cache_copy("\n".join(codes))
        else:
            compiled(x, cache, slots)
        assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_compile_store_dynamic_n(device, fmt):
    torch._dynamo.reset()
    p, num_pages = 64, 4
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(_store_fn(fmt, p), backend=counter, fullgraph=True, dynamic=True)
    for n in (7, 17, 64, 200):
        seed = seed_of("compile-dyn", fmt.name, n)
        cache, buf = make_cache(fmt, p, num_pages, device=device, seed=seed)
        exp_cache, exp_buf = clone_view(cache, buf)
        x = make_rows(n, fmt.width, tile=fmt.tile, seed=seed + 1).to(device)
        n_valid = n - len(invalid_slots(p * num_pages, torch.int32))
        slots = make_slots(n_valid, p * num_pages, seed=seed + 2, dtype=torch.int32, device=device)
        op_store(fmt, x, exp_cache, slots, p)
        compiled(x, cache, slots)
        assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0))
    assert counter.frame_count == 1


def test_compile_store_misaligned_cache_raises_at_run_time():
    """The fake has no data pointer, so a misaligned cache traces and raises when the kernel runs."""
    torch._dynamo.reset()
    fmt, p = V41, 2
    pb = fmt.page_bytes(p)
    flat = torch.zeros(3 * pb + 16, dtype=torch.uint8)
    cache = flat[8: 8 + 3 * pb].view(3, pb)
    x = torch.zeros(2, 512)
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"dsv4\.fused_store_cache.*\bcache\b"):
        torch.compile(_store_fn(fmt, p), fullgraph=True)(x, cache, slots)


@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_compile_store_then_read(device, fmt):
    """A graph that writes the cache and then reads it: the mutation must stay ordered before the read."""
    torch._dynamo.reset()
    p, num_pages = 2, 30
    store = _store_fn(fmt, p)

    def fn(x, cache, slots, read_slots):
        before = dsv4.dequantize_k_cache_paged(cache, read_slots, p, layout=fmt.id)
        store(x, cache, slots)
        after = dsv4.dequantize_k_cache_paged(cache, read_slots, p, layout=fmt.id)
        return before, after, dsv4.fake_quant_compressed_kv(after[:, 0])

    seed = seed_of("compile-rw", fmt.name)
    cache, buf = make_cache(fmt, p, num_pages, device=device, fill=0)
    exp_cache, exp_buf = clone_view(cache, buf)
    x = make_rows(25, 512, tile=fmt.tile, seed=seed, dtype=BF16).to(device)
    slots = make_slots(20, p * num_pages, seed=seed + 1, device=device)
    read_slots = torch.cat([slots, slots.flip(0)])
    expected = fn(x, exp_cache, slots, read_slots)
    got = torch.compile(fn, fullgraph=True)(x, cache, slots, read_slots)
    assert torch.equal(buf, exp_buf)
    for g, e in zip(got, expected):
        assert_bits_equal(g, e)
    assert bool((got[0].view(torch.int16) == 0).all())  # read before the store: zero bytes decode to +0


@pytest.mark.parametrize("overload", ["functional", "out"])
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_compile_dequant(device, fmt, overload):
    torch._dynamo.reset()
    p, num_pages = 64, 4
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    if overload == "functional":
        def fn(cache, slots):
            return dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
    else:
        def fn(cache, slots, out):
            dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id, out=out)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for n in (8, 40, 129):
        seed = seed_of("compile-deq", fmt.name, overload, n)
        cache, _ = make_cache(fmt, p, num_pages, kind="pool_slice", device=device, seed=seed)
        slots = make_slots(n - 5, p * num_pages, seed=seed + 1, device=device)
        expected = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
        if overload == "functional":
            got = compiled(cache, slots)
        else:
            ws = torch.zeros(n + 5, 1, 512, dtype=BF16, device=device)
            got = ws[5:]
            compiled(cache, slots, got)
            assert bool((ws[:5].view(torch.int16) == 0).all())
        assert_bits_equal(got, expected)
    assert counter.frame_count == 1


@pytest.mark.parametrize("op", ["compressed_kv", "fp4"])
def test_compile_fake_quant(device, op):
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")

    def fn(x):
        if op == "compressed_kv":
            return dsv4.fake_quant_compressed_kv(x)
        return dsv4.fake_quant_fp4(x, block_size=64)

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for n in (3, 17, 100):
        x = make_rows(n, 512, tile=16, seed=seed_of("compile-fq", op, n), dtype=BF16).to(device)
        before = x.clone()
        assert_bits_equal(compiled(x), fn(x))
        assert_bits_equal(x, before)
    assert counter.frame_count == 1


@cuda_only
@pytest.mark.parametrize("kind", ["contiguous", "pool_slice"])
def test_compile_store_peak_memory_cuda(kind):
    """No cache clone: a compiled store into a >= 64 MiB cache allocates far less than the cache."""
    torch._dynamo.reset()
    fmt, p = V4, 64
    num_pages = (64 << 20) // fmt.page_bytes(p) + 2
    cache, buf = make_cache(fmt, p, num_pages, kind=kind, device="cuda", fill=0x5A)
    cache_bytes = num_pages * fmt.page_bytes(p)
    assert cache_bytes >= 64 << 20
    x = make_rows(256, 512, tile=64, seed=1, dtype=BF16).cuda()
    slots = make_slots(251, p * num_pages, seed=2, device="cuda")
    compiled = torch.compile(_store_fn(fmt, p), fullgraph=True)
    compiled(x, cache, slots)  # compile outside the measurement
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        compiled(x, cache, slots)
        torch.cuda.synchronize()
        increase = torch.cuda.max_memory_allocated() - base
        assert increase < cache_bytes // 2, f"peak memory rose by {increase} bytes for a {cache_bytes}-byte cache"
    exp_cache, exp_buf = clone_view(cache, torch.full_like(buf, 0x5A))
    op_store(fmt, x, exp_cache, slots, p)
    assert torch.equal(buf, exp_buf)


# ====================================================================================================
# CUDA graphs, streams, PDL


@contextlib.contextmanager
def no_host_sync():
    """Any synchronizing CUDA call inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    torch.cuda.synchronize()
    return graph, result


def _padded_slots(n_real, n_pad, capacity, seed):
    """n_real distinct valid slots, then padding rows with slot -1 (and one other invalid slot)."""
    s = make_slots(n_real, capacity, seed=seed, invalid=False)
    pad = torch.full((n_pad - n_real,), -1, dtype=torch.int64)
    if pad.numel() > 1:
        pad[-1] = capacity + 3
    return torch.cat([s, pad])


@cuda_only
@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=fmt_id)
def test_cuda_graph_store(ref, fmt):
    p, num_pages, n_pad = 64, 4, 48
    capacity = p * num_pages
    cache, buf = make_cache(fmt, p, num_pages, device="cuda", seed=seed_of("graph", fmt.name))
    x_static = torch.zeros(n_pad, fmt.width, dtype=BF16, device="cuda")
    slots_static = torch.full((n_pad,), -1, dtype=torch.int64, device="cuda")
    graph, _ = _capture(lambda: op_store(fmt, x_static, cache, slots_static, p))
    for it, n_real in enumerate([48, 20, 0, 33]):
        seed = seed_of("graph-step", fmt.name, it)
        x_new = make_rows(n_pad, fmt.width, tile=fmt.tile, seed=seed, dtype=BF16)
        slots_new = _padded_slots(n_real, n_pad, capacity, seed + 1)
        x_static.copy_(x_new.cuda())
        slots_static.copy_(slots_new.cuda())
        exp_cache, exp_buf = clone_view(cache, buf)
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        with no_host_sync():
            op_store(fmt, x_static, exp_cache, slots_static, p)  # eager, on a cloned cache
            graph.replay()
        assert torch.cuda.memory_allocated() == allocated
        torch.cuda.synchronize()
        assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0), what=f"replay {it}")
    # one more replay, checked against the reference
    ref_cache, ref_buf_cpu = clone_view(cache, buf, device="cpu")
    x_last = make_rows(8, fmt.width, tile=fmt.tile, seed=99, dtype=BF16)
    s_last = _padded_slots(5, 8, capacity, 98)
    x_static[:8].copy_(x_last.cuda())
    slots_static.fill_(-1)
    slots_static[:8].copy_(s_last.cuda())
    graph.replay()
    torch.cuda.synchronize()
    ref_store(ref, fmt, x_last, ref_cache, s_last, p)
    assert_bytes_equal(buf, ref_buf_cpu, fmt, p, cache.stride(0), what="replay vs reference")


@cuda_only
@pytest.mark.parametrize("overload", ["functional", "out"])
@pytest.mark.parametrize("fmt", MAIN_FORMATS, ids=fmt_id)
def test_cuda_graph_dequant(fmt, overload):
    p, num_pages, n_pad = 64, 4, 40
    capacity = p * num_pages
    cache, buf = make_cache(fmt, p, num_pages, device="cuda", seed=seed_of("graph-deq", fmt.name))
    slots_static = torch.full((n_pad,), -1, dtype=torch.int32, device="cuda")
    out_static = torch.zeros(n_pad, 1, 512, dtype=BF16, device="cuda")

    def run():
        if overload == "functional":
            return dsv4.dequantize_k_cache_paged(cache, slots_static, p, layout=fmt.id)
        dsv4.dequantize_k_cache_paged(cache, slots_static, p, layout=fmt.id, out=out_static)
        return out_static

    graph, out = _capture(run)
    for it, n_real in enumerate([40, 7, 0, 25]):
        seed = seed_of("graph-deq-step", fmt.name, it)
        buf.copy_(make_cache(fmt, p, num_pages, device="cpu", seed=seed)[1].cuda())  # new cache bytes
        slots_static.copy_(_padded_slots(n_real, n_pad, capacity, seed + 1).to(torch.int32).cuda())
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        with no_host_sync():
            graph.replay()
            expected = dsv4.dequantize_k_cache_paged(cache, slots_static, p, layout=fmt.id)
        torch.cuda.synchronize()
        assert_bits_equal(out, expected, f"replay {it}")
        del expected
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= allocated


@cuda_only
@pytest.mark.parametrize("op", ["compressed_kv", "fp4"])
def test_cuda_graph_fake_quant(op):
    x_static = torch.zeros(24, 512, dtype=BF16, device="cuda")

    def run():
        if op == "compressed_kv":
            return dsv4.fake_quant_compressed_kv(x_static)
        return dsv4.fake_quant_fp4(x_static, block_size=32)

    graph, y = _capture(run)
    for it in range(3):
        x_static.copy_(make_rows(24, 512, tile=16, seed=seed_of("graph-fq", op, it), dtype=BF16).cuda())
        with no_host_sync():
            graph.replay()
            expected = run()
        torch.cuda.synchronize()
        assert_bits_equal(y, expected, f"replay {it}")


@cuda_only
@pytest.mark.parametrize("fmt", [V4, V41_FP4, IDX_FP8], ids=fmt_id)
def test_runs_on_current_non_default_stream(fmt):
    """Work queued on a side stream (a long sleep, then the input copy) must precede the ops: they run
    on the current stream, not on the default one."""
    p, num_pages, n = 64, 4, 200
    capacity = p * num_pages
    cache, buf = make_cache(fmt, p, num_pages, device="cuda", seed=5)
    exp_cache, exp_buf = clone_view(cache, buf)
    x_final = make_rows(n, fmt.width, tile=fmt.tile, seed=6, dtype=BF16).cuda()
    slots_final = make_slots(n - 5, capacity, seed=7, device="cuda")
    x = torch.zeros_like(x_final)
    slots = torch.full_like(slots_final, -1)
    # Load every kernel first: a lazily loaded CUDA module may synchronize the device on its first
    # launch, which would hide a launch on the wrong stream.
    warm_cache, _ = make_cache(fmt, p, 1, device="cuda", seed=1)
    op_store(fmt, x_final[:8], warm_cache, slots_final[:8] % p, p)
    if not fmt.indexer:
        dsv4.dequantize_k_cache_paged(warm_cache, slots_final[:8] % p, p, layout=fmt.id)
        dsv4.fake_quant_compressed_kv(x_final[:8])
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        x.copy_(x_final)
        slots.copy_(slots_final)
        op_store(fmt, x, cache, slots, p)
        if not fmt.indexer:
            out = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
            fq = dsv4.fake_quant_compressed_kv(x)
    torch.cuda.synchronize()
    op_store(fmt, x_final, exp_cache, slots_final, p)
    assert_bytes_equal(buf, exp_buf, fmt, p, cache.stride(0))
    if not fmt.indexer:
        assert_bits_equal(out, dsv4.dequantize_k_cache_paged(exp_cache, slots_final, p, layout=fmt.id))
        assert_bits_equal(fq, dsv4.fake_quant_compressed_kv(x_final))


PDL_WORKER = textwrap.dedent("""
    import sys
    import torch
    sys.path[:0] = [{repo!r}, {tests!r}]
    torch.set_flush_denormal(False)
    import sgl_dsv4_kernels as dsv4
    from samples import ALL_FORMATS, make_cache, make_rows, make_slots, op_store, seed_of
    results = {{}}
    for fmt in ALL_FORMATS:
        for p, num_pages in ((1, 6000), (64, 100)):
            seed = seed_of("pdl", fmt.name, p)
            cache, buf = make_cache(fmt, p, num_pages, device="cuda", seed=seed)
            n = min(5000, p * num_pages)
            x = make_rows(n, fmt.width, tile=fmt.tile, seed=seed + 1, dtype=torch.bfloat16).cuda()
            slots = make_slots(n - 5, p * num_pages, seed=seed + 2, device="cuda")
            # back-to-back dependent kernels on one stream: store -> dequant -> fake quant -> store -> ...
            op_store(fmt, x, cache, slots, p)
            if not fmt.indexer:
                out = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
                y = dsv4.fake_quant_compressed_kv(out[:, 0])
                z = dsv4.fake_quant_fp4(y, block_size=32)
                op_store(fmt, z, cache, slots.flip(0), p)
                out2 = dsv4.dequantize_k_cache_paged(cache, slots, p, layout=fmt.id)
                results[fmt.name, p, "out"] = out.cpu()
                results[fmt.name, p, "out2"] = out2.cpu()
            else:
                op_store(fmt, x.flip(0), cache, slots, p)
            results[fmt.name, p, "cache"] = buf.cpu()
    torch.cuda.synchronize()
    torch.save(results, sys.argv[1])
""")


@cuda_only
def test_pdl_on_and_off_give_identical_bytes(tmp_path):
    script = tmp_path / "pdl_worker.py"
    script.write_text(PDL_WORKER.format(repo=str(REPO), tests=str(REPO / "tests")))
    saved = {}
    for flag in ("0", "1"):
        env = dict(os.environ, SGL_DSV4_PDL=flag)
        path = tmp_path / f"pdl_{flag}.pt"
        proc = subprocess.run([sys.executable, str(script), str(path)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        saved[flag] = torch.load(path)
    assert saved["0"].keys() == saved["1"].keys() and len(saved["0"]) > 0
    for key in saved["0"]:
        a, b = saved["0"][key], saved["1"][key]
        if a.dtype == torch.uint8:
            assert torch.equal(a, b), key
        else:
            assert_bits_equal(b, a, str(key))
