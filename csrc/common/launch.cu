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
  static DeviceValueCache major_by_device;
  const int64_t major = major_by_device.get([](int device) {
    int value = 0;
    check_cuda(cudaDeviceGetAttribute(&value, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
    return int64_t(value);
  });
  return major >= 9;
}

}  // namespace dsv4
