// --backend auto|cpu|cuda: which backend a command runs on. auto picks the CUDA backend when this
// build has it and device 0 is a Hopper GPU (compute capability 9.x, what the kernels are built
// for), else the CPU backend.
#pragma once
#include <string>

namespace tansy {

// What the choice looks at.
struct DeviceProbe {
  bool cuda_built = false;   // this build has the CUDA backend
  int devices = 0;           // visible CUDA devices
  std::string name;          // device 0
  int major = 0, minor = 0;  // device 0's compute capability
  std::string error;         // the runtime's error when the query failed (no driver, ...)
};

// The real probe: asks the CUDA runtime in CUDA builds (never throws, also without a driver);
// in CPU-only builds reports cuda_built = false without asking anything.
DeviceProbe probe_devices();

struct BackendChoice {
  std::string backend;  // "cpu" or "cuda"
  std::string reason;   // e.g. "NVIDIA H200, sm_90" or "no CUDA device"
};

// `requested` is "auto", "cpu" or "cuda". "cuda" on a build without the backend, without a
// device or on a device that is not Hopper throws Error saying which; anything else throws too.
BackendChoice choose_backend(const std::string& requested, const DeviceProbe& probe);

// --cuda-precision auto|bf16|f32: which plan the CUDA backend runs (ModelOptions::cuda_precision).
// bf16 is the fast plan (bf16 activations, f32 residual stream and state); f32 runs the CPU
// reference's arithmetic on the device (every activation f32: the CPU backend's logits to float
// rounding, ~1e-6, so its greedy answers short of closer ties), with simple kernels. auto picks f32 for a
// checkpoint of at most kF32AutoBytes (its safetensors files together: a small model, whose decode
// is bound by launches either way) and bf16 otherwise. Anything else throws Error.
inline constexpr unsigned long long kF32AutoBytes = 1ull << 30;
struct PrecisionChoice {
  std::string precision;  // "bf16" or "f32"
  std::string reason;
};
PrecisionChoice choose_cuda_precision(const std::string& requested, unsigned long long checkpoint_bytes);
// Bytes of DIR's *.safetensors files (what auto looks at).
unsigned long long checkpoint_bytes(const std::string& dir);

}  // namespace tansy
