// The PDL switch of every launch (launch.cuh): programmatic dependent launch on devices of compute capability
// >= 9.0 unless SGL_DSV4_PDL=0, read once per process.
#include "dsv4/launch.cuh"

namespace dsv4 {

namespace {
bool pdl_requested_by_environment() {
  static const bool requested = [] {
    const char* value = std::getenv("SGL_DSV4_PDL");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return requested;
}
}  // namespace

bool pdl_enabled_for_current_device() {
  if (!pdl_requested_by_environment()) return false;
  constexpr int kMaxDevices = 64;
  static int major_by_device[kMaxDevices] = {};  // 0 = not queried yet
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) return false;
  if (major_by_device[device] == 0) {
    int major = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
               "cudaDeviceGetAttribute");
    major_by_device[device] = major;
  }
  return major_by_device[device] >= 9;
}

}  // namespace dsv4
