// Kernel launch with programmatic dependent launch (PDL) on sm_90+, and the device-side grid
// dependency controls. SGL_DSV4_PDL=0 (read once per process) turns PDL off; results are identical.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace dsv4 {

// Wait until the grids this launch depends on have completed (their writes are visible).
__device__ __forceinline__ void pdl_wait_dependencies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A read of an op input: a plain global load, never __ldg. A non-coherent load (ld.global.nc) promises that its
// data does not change while the grid lives, and under PDL a grid starts before the previous one has finished
// writing: ptxas may, and does, schedule such a load above griddepcontrol.wait (nvcc 13.0, sm_90: c2's row and
// weight loads moved there once a few instructions were added before the wait). A plain load stays after it.
template <class T>
__device__ __forceinline__ T load_input(const T* address) {
  return *address;
}

// Reads one word of every 32 bytes of the kernel's parameter block `p`, before pdl_wait_dependencies (parameters
// are not op inputs), and waits for them together. The parameters sit in a constant bank that a launch's first
// warps miss, and each line otherwise stalls a warp at its first use after the wait, one miss after another;
// here the misses overlap each other and the previous grid. (H200, c2 decode under graph replay: 0.1-0.14 us
// per call at 8 to 256 rows.) The words' XOR guards a prefetch of `any_line` (a global address the kernel
// may touch anyway) so that the loads are not optimized away. Used where an A/B run on the H200 gained: c1 /
// c2, c4 decode, the planners and the main writer kernel (notes/perf.md). Not in c128 decode (0.2 us slower
// at 64 rows with hot replays; 3-6 % slower at 1-64 rows from a cold L2 too, H100; unexplained) nor in the
// indexer writer (1.5 % slower at 65536 rows, nothing gained at decode sizes).
template <class Params>
__device__ __forceinline__ void warm_params(const Params& p, const void* any_line) {
  uint32_t x = 0;
#pragma unroll
  for (int i = 0; i < int((sizeof(Params) + 31) / 32); ++i) x ^= reinterpret_cast<const uint32_t*>(&p)[8 * i];
#if defined(__CUDA_ARCH__)
  asm volatile("{\n\t.reg .pred hit;\n\tsetp.eq.u32 hit, %0, 0x9E3779B9;\n\t@hit prefetch.global.L2 [%1];\n\t}"
               ::"r"(x), "l"(__cvta_generic_to_global(any_line)));
#endif
}

// Let the next grid on the stream start its prologue; it still waits for our completion.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Asks the L2 to fetch the 128-byte line holding `address` (a global-memory address). A prefetch returns
// no value and orders nothing, so unlike a load it may come before pdl_wait_dependencies() (§4.6 forbids
// reads there): a kernel warms the lines of inputs whose address needs no load while the previous grid
// still runs, and its loads after the wait still see the latest data (the L2 is where the GPU's writes
// meet; nothing is fetched into the L1).
__device__ __forceinline__ void prefetch_l2(const void* address) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(__cvta_generic_to_global(address)));
#endif
}

bool pdl_enabled_for_current_device();

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("dsv4: ") + what + ": " + cudaGetErrorString(err));
  }
}

// A positive value asked of the CUDA runtime once per device (an attribute, an occupancy) and read back on
// later calls: such queries cost microseconds of host time, and a launch would pay them every call. Devices
// past the first kMaxDevices ask every time.
class DeviceValueCache {
 public:
  template <typename Query>  // int64_t query(int device), > 0
  int64_t get(Query query) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    const bool cached = device >= 0 && device < kMaxDevices;
    if (cached) {
      const int64_t value = values_[device].load(std::memory_order_relaxed);
      if (value > 0) return value;
    }
    const int64_t value = query(device);
    if (cached) values_[device].store(value, std::memory_order_relaxed);
    return value;
  }

 private:
  static constexpr int kMaxDevices = 64;
  std::atomic<int64_t> values_[kMaxDevices] = {};  // 0 = not asked yet
};

// Launches `kernel` on `stream`, with programmatic stream serialization where supported.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, const char* name, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  if (pdl_enabled_for_current_device()) {
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  check_cuda(cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...), name);
}

}  // namespace dsv4
