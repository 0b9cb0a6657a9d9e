#include "cuda/common/cuda_util.h"

namespace tansy::cuda {

void launch_check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("{}: launch failed: {}", what, cudaGetErrorString(e));
}

int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return sms;
}

}  // namespace tansy::cuda
