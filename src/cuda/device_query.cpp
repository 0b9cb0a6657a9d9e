#include "cuda/device_query.h"

#include <cuda_runtime_api.h>

namespace tansy::cuda {

DeviceQuery query_devices() noexcept {
  DeviceQuery q;
  try {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      q.error = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(e);
      cudaGetLastError();  // clear it, so that later runtime calls do not report it again
      return q;
    }
    if (n <= 0) return q;
    cudaDeviceProp p{};
    e = cudaGetDeviceProperties(&p, 0);
    if (e != cudaSuccess) {
      q.error = std::string("cudaGetDeviceProperties failed: ") + cudaGetErrorString(e);
      cudaGetLastError();
      return q;
    }
    q.devices = n;
    q.name = p.name;
    q.major = p.major;
    q.minor = p.minor;
  } catch (...) {  // std::string allocation; nothing else here throws
    q = DeviceQuery{};
    q.error = "device query failed";
  }
  return q;
}

}  // namespace tansy::cuda
