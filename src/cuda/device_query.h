// Which CUDA device is present, asked of the CUDA runtime without creating a context on it.
// Plain C++ (no kernels), compiled only into CUDA builds: callers guard with
// #ifdef TANSY_HAVE_CUDA_BACKEND.
#pragma once
#include <string>

namespace tansy::cuda {

struct DeviceQuery {
  int devices = 0;           // visible CUDA devices (0 when there is no driver or device)
  std::string name;          // device 0, the one the backend runs on
  int major = 0, minor = 0;  // device 0's compute capability
  std::string error;         // the runtime's error when the query failed (no driver, ...), else empty
};

// Never throws and never aborts, also without a driver (e.g. a CI machine with nvcc and no GPU).
DeviceQuery query_devices() noexcept;

}  // namespace tansy::cuda
