// CUDA kernels of fake_quant_compressed_kv and fake_quant_fp4: one thread per 16 consecutive
// elements; a quantization block of B elements is B/16 adjacent lanes (amax by shuffles).
#include "cache_launch.h"
#include "dsv4/launch.cuh"
#include "dsv4/quant.cuh"
#include "dsv4/vec_io.cuh"

namespace dsv4 {

namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 16;

enum class FakeQuantKind { CompressedKV, Fp4Pow2 };

template <ElemType T>
__device__ __forceinline__ void load_chunk(const void* src, float* x) {
  load_widen<kChunk, T == ElemType::FP32, T == ElemType::FP16>(src, x);
}

template <ElemType T>
__device__ __forceinline__ void store_chunk(void* dst, const float* y) {
  if constexpr (T == ElemType::FP32) {
    store_f32<kChunk>(static_cast<float*>(dst), y);
  } else {
    uint16_t h[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) h[i] = T == ElemType::FP16 ? f32_to_f16(y[i]) : f32_to_bf16(y[i]);
    store_u16<kChunk>(static_cast<uint16_t*>(dst), h);
  }
}

template <FakeQuantKind K, ElemType T>
__global__ void __launch_bounds__(kThreads) fake_quant_kernel(FakeQuantParams p) {
  constexpr int kElem = T == ElemType::FP32 ? 4 : 2;
  const int64_t chunks_per_row = p.width / kChunk;
  const int64_t chunk = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  const bool active = chunk < p.rows * chunks_per_row;
  pdl_wait_dependencies();
  float x[kChunk];
  int64_t row = 0, col = 0;
  if (active) {
    row = chunk / chunks_per_row;
    col = (chunk - row * chunks_per_row) * kChunk;
    load_chunk<T>(static_cast<const char*>(p.in) + (p.in_rows.row_offset(row) + col) * kElem, x);
  } else {
#pragma unroll
    for (int i = 0; i < kChunk; ++i) x[i] = 0.0f;
  }
  pdl_launch_dependents();
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) amax = fmax_f32(amax, fabs_f32(x[i]));
  // Blocks never straddle rows or warps: block_size / 16 divides both the row and 32.
  amax = warp_max_xor(amax, p.block_size / kChunk);
  if (!active) return;
  if constexpr (K == FakeQuantKind::CompressedKV) {
    const float scale = e4m3_decode(v41_fp4_scale_byte(amax));
    const E2m1RneThresholds encoder(scale);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) x[i] = e2m1_decode(encoder.encode(x[i])) * scale;
  } else {
    const uint8_t b = fp4_pow2_scale_byte(amax);
    const float inv = pow2f(127 - int(b));
    const float scale = pow2f(int(b) - 127);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) x[i] = e2m1_decode(e2m1_encode_rne(x[i] * inv)) * scale;
  }
  store_chunk<T>(static_cast<char*>(p.out) + (row * p.width + col) * kElem, x);
}

template <FakeQuantKind K>
void launch_fake_quant(const FakeQuantParams& p, cudaStream_t stream, const char* name) {
  const int64_t chunks = p.rows * (p.width / kChunk);
  const dim3 grid(unsigned((chunks + kThreads - 1) / kThreads));
  switch (p.type) {
    case ElemType::BF16:
      launch_kernel(fake_quant_kernel<K, ElemType::BF16>, grid, dim3(kThreads), 0, stream, name, p);
      break;
    case ElemType::FP16:
      launch_kernel(fake_quant_kernel<K, ElemType::FP16>, grid, dim3(kThreads), 0, stream, name, p);
      break;
    case ElemType::FP32:
      launch_kernel(fake_quant_kernel<K, ElemType::FP32>, grid, dim3(kThreads), 0, stream, name, p);
      break;
  }
}

}  // namespace

void fake_quant_compressed_kv_cuda(const FakeQuantParams& p, cudaStream_t stream) {
  launch_fake_quant<FakeQuantKind::CompressedKV>(p, stream, "fake_quant_compressed_kv");
}

void fake_quant_fp4_cuda(const FakeQuantParams& p, cudaStream_t stream) {
  launch_fake_quant<FakeQuantKind::Fp4Pow2>(p, stream, "fake_quant_fp4");
}

}  // namespace dsv4
