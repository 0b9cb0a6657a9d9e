// The card's measured limits, taken in the same run as the numbers they bound (docs/BENCHMARK.md
// "The limits to compare against"): copy and read bandwidth, bf16 tensor-core GEMM rate.
// Plain C++ header: the CLI (compiled by the host compiler) includes it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/model.h"

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

// Per-stage breakdown hook for `tansy bench --stages` (PERFORMANCE.md). A backend's Model that
// also derives from StageProfiler gets its stages timed and reported next to the floors; bench
// says plainly when the backend does not.
struct StageTime {
  std::string name;  // e.g. "gdn.in_proj", "moe.experts", "lm_head"; repeated layers summed
  double ms = 0;     // device time summed over the step (or prefill)
  double bytes = 0;  // minimum bytes the stage must move (0: not counted)
  double flops = 0;  // floating-point operations (0: not counted)
  int launches = 0;  // kernel launches summed into ms
};

class StageProfiler {
 public:
  virtual ~StageProfiler() = default;
  // Feeds `token` as one decode step after what `state` holds, timing each stage (advances it).
  virtual std::vector<StageTime> profile_decode_step(SequenceState& state, int32_t token) = 0;
  // Feeds `ids` after what `state` holds, timing each stage (advances it).
  virtual std::vector<StageTime> profile_prefill(SequenceState& state, std::span<const int32_t> ids) = 0;
};

}  // namespace tansy::cuda
