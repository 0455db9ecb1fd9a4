"""The reference module must give bit-identical results on CPU and CUDA tensors (kv-layouts-and-quant.md
§7): otherwise a CUDA-vs-reference test on the GPU would compare against a different oracle."""
import pytest
import torch

from sgl_dsv4_kernels import reference as ref

pytestmark = pytest.mark.cuda

ROWS = 4096


def _bytes(t):
    return t.detach().cpu().contiguous().view(torch.uint8)


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(torch.equal(_bytes(u), _bytes(v)) for u, v in zip(a, b))


@pytest.fixture(scope="module")
def rows():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.randint(-40, 40, (ROWS, 32, 1), generator=gen).float())
    x = (torch.randn(ROWS, 32, 16, generator=gen) * scale).reshape(ROWS, 512)
    x[0] = 0
    x[1, :100] = -0.0
    x[2] = torch.randn(512, generator=gen) * 1e-39  # subnormal inputs
    x[3, :32] = 7.1249995  # the division-vs-reciprocal case of §4.3
    bits = torch.randint(-(2**31), 2**31 - 1, (512,), dtype=torch.int32, generator=gen)
    x[4] = bits.view(torch.float32).nan_to_num(0.0, 0.0, 0.0)  # arbitrary finite bit patterns
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizers_equal_on_cpu_and_cuda(rows, dtype):
    x = rows.to(dtype)
    xc = x.cuda()
    for layout in (0, 1, 2):
        assert _same(ref.quantize_rows(x, layout), ref.quantize_rows(xc, layout)), layout
    assert _same(ref.quantize_indexer_fp8(x[:, :128]), ref.quantize_indexer_fp8(xc[:, :128]))
    assert _same(ref.quantize_indexer_fp4(x[:, :128]), ref.quantize_indexer_fp4(xc[:, :128]))
    assert _same(ref.fake_quant_compressed_kv(x), ref.fake_quant_compressed_kv(xc))
    for block in (16, 32, 64, 128):
        assert _same(ref.fake_quant_fp4(x, block), ref.fake_quant_fp4(xc, block)), block
    w = torch.randn(512).to(dtype)
    assert _same(ref.rms_norm_fp32(x, w, 1e-6), ref.rms_norm_fp32(xc, w.cuda(), 1e-6))


def test_rope_and_hadamard_equal_on_cpu_and_cuda(rows):
    freqs = torch.randn(ROWS, 64)
    assert _same(ref.rope_tail(rows, freqs), ref.rope_tail(rows.cuda(), freqs.cuda()))
    assert _same(ref.hadamard128(rows[:, :128]), ref.hadamard128(rows[:, :128].cuda()))


@pytest.mark.parametrize("layout", [0, 1, 2])
def test_pages_equal_on_cpu_and_cuda(rows, layout):
    gen = torch.Generator().manual_seed(layout)
    geometry = ref.layout_geometry(layout)
    data = torch.randint(0, 256, (ROWS, geometry.data_bytes), dtype=torch.uint8, generator=gen)
    scale = torch.randint(0, 256, (ROWS, geometry.scale_bytes), dtype=torch.uint8, generator=gen)
    assert _same(ref.dequantize_rows(data, scale, layout), ref.dequantize_rows(data.cuda(), scale.cuda(), layout))
    page, pages = 64, 70
    width = ref.kv_page_bytes(layout, page)
    cache = torch.randint(0, 256, (pages, width + 64), dtype=torch.uint8, generator=gen)[:, :width]
    slots = torch.cat([torch.randperm(pages * page, generator=gen)[: ROWS - 3],
                       torch.tensor([-1, pages * page, 2**40])])
    cache_cuda = cache.cuda()
    ref.store_k_cache(cache, rows, slots, page, layout)
    ref.store_k_cache(cache_cuda, rows.cuda(), slots.cuda(), page, layout)
    assert _same(cache, cache_cuda)
    assert _same(
        ref.dequantize_k_cache_paged(cache, slots, page, layout=layout),
        ref.dequantize_k_cache_paged(cache_cuda, slots.cuda(), page, layout=layout),
    )
