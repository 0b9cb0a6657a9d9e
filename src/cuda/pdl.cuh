// Programmatic dependent launch for the decode kernels: a kernel launched with pdl_launch may be
// scheduled while its predecessor in the stream still runs, hiding the launch gap (decode runs
// ~500 short kernels per token). The rule that keeps it correct: every kernel launched through
// pdl_launch calls pdl_launch_dependents() only after its pdl_wait() (so at most one grid runs
// ahead, and every dependency stays transitive: when a kernel starts, every kernel before its
// predecessor has completed), and calls pdl_wait() before touching memory its predecessor may
// write (in practice: anything written in the same step). Reading before the wait what only
// earlier steps wrote (weights, a KV-cache row of an earlier position) overlaps the read with
// the predecessor's tail. Kernels launched with <<<>>> ignore both and wait as usual.
// TANSY_CUDA_PDL=0 launches without the attribute (to compare the two).
#pragma once
#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/cuda_util.h"

namespace tansy::cuda {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool pdl_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TANSY_CUDA_PDL");
    if (!v || std::strcmp(v, "1") == 0) return true;
    if (std::strcmp(v, "0") == 0) return false;
    fail("TANSY_CUDA_PDL must be 0 or 1, not '{}'", v);
  }();
  return on;
}

template <typename... Params, typename... Args>
void pdl_launch(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...));
  CUDA_LAUNCH_CHECK();
}

}  // namespace tansy::cuda
