// The card's measured limits, taken in the same run as the numbers they bound (docs/BENCHMARK.md
// "The limits to compare against"): copy and read bandwidth, bf16 tensor-core GEMM rate.
// Plain C++ header: bench/cmd_bench.cpp (compiled by the host compiler) includes it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace tansy::cuda {

struct DeviceInfo {
  std::string gpu;           // cudaDeviceProp::name
  std::string driver;        // NVIDIA driver version ("580.159.04"), "unknown" if unreadable
  std::string cuda_runtime;  // runtime this binary was built against, "13.0"
  std::string cuda_driver;   // CUDA version the driver supports, "13.0"
  int sm_count = 0;
  double memory_gib = 0;
};

struct Ceilings {
  // Device-to-device cudaMemcpy: (bytes read + bytes written) / time.
  double copy_gbps = 0;
  size_t copy_buffer_bytes = 0;
  // Read-only reduction kernel (16-byte loads): bytes read / time.
  double read_gbps = 0;
  size_t read_buffer_bytes = 0;
  // cuBLAS bf16 GEMM (f32 accumulation), n x n x n on random data: 2 n^3 / time.
  double gemm_tflops = 0;
  int gemm_n = 0;
  int reps = 0;  // timed repetitions per figure (median reported), after warm-up
};

DeviceInfo device_info();
// Takes a few seconds and ~4.5 GiB of device memory, freed on return. Throws Error.
Ceilings measure_ceilings(int reps = 15);

}  // namespace tansy::cuda
