// Programmatic dependent launch for the decode kernels: a kernel launched with pdl_launch may be
// scheduled while its predecessor in the stream still runs, hiding the launch gap (decode runs
// ~500 short kernels per token). The rule that keeps it correct: every kernel launched through
// pdl_launch calls pdl_launch_dependents() only after its pdl_wait() (so at most one grid runs
// ahead, and every dependency stays transitive: when a kernel starts, every kernel before its
// predecessor has completed), and calls pdl_wait() before touching memory its predecessor may
// write (in practice: anything written in the same step). Reading before the wait what only
// earlier steps wrote (weights, a KV-cache row of an earlier position) overlaps the read with
// the predecessor's tail. Kernels launched with <<<>>> ignore both and wait as usual.
#pragma once
#include <cstdlib>
#include <cstring>
#include <utility>

#include "cuda/common/cuda_util.h"

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

// Raises the kernel's dynamic shared-memory limit when a launch needs more than granted so far
// (the backend's warm-up makes every decode shape's call before any graph capture) and fails
// loudly when the device cannot give it.
template <auto Kern>
void allow_smem(size_t smem, const char* what) {
  static size_t granted = 0;  // the 48 KiB default counts static shared memory too: always opt in
  if (smem <= granted) return;
  const cudaError_t e = cudaFuncSetAttribute(Kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it so the next launch check is not blamed
    fail("{}: {} bytes of shared memory exceed what a block can have ({})", what, smem,
         cudaGetErrorString(e));
  }
  granted = smem;
}

template <typename... Params, typename... Args>
void pdl_launch(void (*kern)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...));
}

}  // namespace tansy::cuda
