"""The V41_FP4 encoder compares |x| with the exact products t*S instead of dividing (spec §10 allows
it when a test sweeps every positive e4m3 scale, every threshold and a band of ulps around each
product). This is that sweep, through fake_quant_compressed_kv on CPU and CUDA, against the
reference's IEEE division. The CUDA writers encode bf16x2 pairs (include/dsv4/e2m1_pairs.cuh): two more
sweeps, of bf16 values near every V41_FP4 threshold and of fp32 values near every indexer fp4 threshold,
go through fused_store_cache against the reference quantizers.
"""
import pytest
import torch

import sgl_dsv4_kernels as dsv4
from sgl_dsv4_kernels import reference as ref

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
ULPS = 64
BLOCK = 16


def blocks_with_head(values: torch.Tensor, head: torch.Tensor, block: int) -> torch.Tensor:
    """values [S, V] (per scale) cut into blocks of block - 1, each led by head[s] (the block's amax), zero-padded:
    [-1, block]."""
    per_block = block - 1
    values = torch.nn.functional.pad(values, (0, -values.shape[1] % per_block))
    blocks = values.view(values.shape[0], -1, per_block)
    return torch.cat([head[:, None, None].expand(-1, blocks.shape[1], 1), blocks], 2).reshape(-1, block)


def ulps_around(products: torch.Tensor, shift: int) -> torch.Tensor:
    """[P, 2 * ULPS + 1]: the values within +-ULPS ulps of each product, in fp32 (shift 0) or bf16 (shift 16) ulps."""
    offsets = torch.arange(-ULPS, ULPS + 1, dtype=torch.int32)
    bits = (products.view(torch.int32)[:, None] >> shift) + offsets[None, :]
    return (bits << shift).view(torch.float32)


def with_signs(values: torch.Tensor) -> torch.Tensor:
    """[S, V] -> [S, 2V]: each value followed by its negation."""
    return torch.stack([values, -values], 2).reshape(values.shape[0], -1)


def sweep_blocks() -> torch.Tensor:
    """Blocks of 16 whose element 0 is 6*S (so the block scale is exactly the e4m3 value S) and
    whose other 15 elements walk +-64 ulps around t*S for every threshold t, both signs."""
    scales = ref.e4m3_decode(torch.arange(1, 0x7F, dtype=torch.uint8))  # every positive finite e4m3
    products = (scales[:, None] * torch.tensor(THRESHOLDS)[None, :]).reshape(-1)  # exact in fp32
    values = with_signs(ulps_around(products, 0).reshape(len(scales), -1))
    return blocks_with_head(values, 6.0 * scales, BLOCK)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_threshold_products_equal_ieee_division(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = sweep_blocks()
    assert x.shape[0] > 7000  # 126 scales x 7 thresholds x 129 ulps x 2 signs, 15 per block
    expected = ref.fake_quant_compressed_kv(x)
    got = dsv4.fake_quant_compressed_kv(x.to(device)).cpu()
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    # The same tiles through the cache writer: codes and scales byte-equal to the reference rows.
    rows = x.reshape(-1)[: x.numel() // 512 * 512].reshape(-1, 512)
    cache = torch.zeros(rows.shape[0], dsv4.KVLayout.V41_FP4.page_bytes(1), dtype=torch.uint8, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    dsv4.fused_store_cache(rows.to(device), cache, slots, page_size=1, layout="v41_fp4")
    data, scale = ref.quantize_rows(rows, dsv4.KVLayout.V41_FP4)
    assert torch.equal(cache[:, :256].cpu(), data)
    assert torch.equal(cache[:, 256:288].cpu(), scale)


def assert_bf16_store_equals_reference(rows: torch.Tensor, device: str) -> None:
    """bf16 rows stored as V41_FP4 through fused_store_cache (page size 1) equal the reference quantizer's rows."""
    cache = torch.zeros(rows.shape[0], dsv4.KVLayout.V41_FP4.page_bytes(1), dtype=torch.uint8, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    dsv4.fused_store_cache(rows.to(device), cache, slots, page_size=1, layout="v41_fp4")
    data, scale = ref.quantize_rows(rows.float(), dsv4.KVLayout.V41_FP4)
    assert torch.equal(cache[:, :256].cpu(), data)
    assert torch.equal(cache[:, 256:288].cpu(), scale)


def bf16_sweep_rows() -> torch.Tensor:
    """bf16 rows of 16-value blocks: element 0 is 6*S (the block scale is exactly the e4m3 value S), the
    others walk every bf16 value within +-64 bf16 ulps of each t*S (clamped to 6*S), both signs."""
    scales = ref.e4m3_decode(torch.arange(1, 0x7F, dtype=torch.uint8))
    products = (scales[:, None] * torch.tensor(THRESHOLDS)[None, :]).reshape(-1)  # bf16 values
    values = torch.minimum(ulps_around(products, 16).reshape(len(scales), -1), 6.0 * scales[:, None])
    x = blocks_with_head(with_signs(values), 6.0 * scales, BLOCK).reshape(-1)
    return torch.nn.functional.pad(x, (0, -x.numel() % 512)).view(-1, 512).to(torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_pair_encoder_equals_reference(device):
    """bf16 input takes the packed bf16x2 encoder on CUDA (e2m1_pairs.cuh): every bf16 value near every
    threshold of every scale, stored through fused_store_cache, equals the reference rows."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = bf16_sweep_rows()
    assert rows.shape[0] > 200
    assert_bf16_store_equals_reference(rows, device)


def test_v41_fp4_scale_of_bf16_amax_by_multiply():
    """quant.cuh v41_fp4_scale_byte_of_bf16: for every non-negative finite bf16 amax, amax * fl(1/6) gives the
    same clamped e4m3 scale byte as the IEEE quotient amax / 6 (the products differ from the quotients in
    their last bit for some amax, so the property is the byte's, not the value's)."""
    amax = (torch.arange(0, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    quotient, product = amax / 6.0, amax * torch.tensor(1.0 / 6.0, dtype=torch.float32)
    assert not torch.equal(quotient, product)  # the premise is not trivial

    def byte(r):
        return ref.e4m3_encode(r.clamp(2.0**-9, 448.0))

    assert torch.equal(byte(product), byte(quotient))


def bf16_amax_sweep_rows() -> torch.Tensor:
    """bf16 rows of 16-value tiles whose amax walks every positive finite bf16 value; the other 15 values of
    a tile are fixed fractions of it (both signs)."""
    amax = (torch.arange(1, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    fractions = torch.tensor([0.9, -0.8, 0.7, -0.55, 0.45, -0.4, 0.3, -0.26, 0.2, -0.13, 0.1, -0.05, 0.04, -0.01, 0.0])
    x = torch.cat([amax[:, None], amax[:, None] * fractions[None, :]], 1).reshape(-1)
    return torch.nn.functional.pad(x, (0, -x.numel() % 512)).view(-1, 512).to(torch.bfloat16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_bf16_amax_sweep_equals_reference(device):
    """Every bf16 tile amax through the bf16-input store (scale byte by v41_fp4_scale_byte_of_bf16 on CUDA)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = bf16_amax_sweep_rows()
    assert rows.shape[0] * 32 >= 0x7F7F
    assert_bf16_store_equals_reference(rows, device)


def indexer_sweep_rows() -> torch.Tensor:
    """fp32 rows of 32-value tiles for the indexer fp4 quantizer: element 0 is 6 * 2^k (the tile multiplier is
    exactly 2^-k) and the others walk +-64 fp32 ulps around t * 2^k for every threshold t, both signs, for
    k in [-20, 20]."""
    scales = torch.pow(2.0, torch.arange(-20, 21, dtype=torch.float32))
    products = (scales[:, None] * torch.tensor(THRESHOLDS)[None, :]).reshape(-1)
    values = with_signs(ulps_around(products, 0).reshape(len(scales), -1))
    x = blocks_with_head(values, 6.0 * scales, 32).reshape(-1)
    return torch.nn.functional.pad(x, (0, -x.numel() % 128)).view(-1, 128)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_indexer_pair_encoder_equals_reference(device):
    """The indexer fp4 store encodes pairs on CUDA (E2m1ThresholdPairEncoder, which rounds magnitudes up to
    bf16): exact thresholds (ties toward zero) and one ulp above them, against the reference quantizer."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows = indexer_sweep_rows()
    assert rows.shape[0] > 100
    fmt = dsv4.IndexerFormat.FP4
    cache = torch.zeros(rows.shape[0], fmt.page_bytes(1), dtype=torch.uint8, device=device)
    slots = torch.arange(rows.shape[0], device=device)
    dsv4.fused_store_cache(rows.to(device), cache, slots, page_size=1, type="indexer", use_fp4=True)
    data, scale = ref.quantize_indexer_fp4(rows)
    assert torch.equal(cache[:, :64].cpu(), data)
    assert torch.equal(cache[:, 64:68].cpu(), scale)
