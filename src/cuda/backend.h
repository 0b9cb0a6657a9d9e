// The Hopper backend's entry point (owned by the CUDA backend; open_model() calls it).
#pragma once
#include <filesystem>
#include <memory>

#include "model/model.h"

namespace tansy {
namespace cuda {
// Which kernels the bf16 plan runs prefill (several tokens) on: the tensor-core ones, or the decode
// (GEMV) ones, a slower path that tests compare against the first.
enum class PrefillKernels { kTensorCore, kGemv };
// Which kernels a one-token decode step runs on: the persistent step (cuda/step/, where the
// checkpoint's shapes allow it: the real model's 4-bit layout), or one kernel per fused op, which
// runs every other layout and which tests compare the first against.
enum class DecodeKernels { kPersistent, kPerOp };
struct CudaPlanOptions {
  PrefillKernels prefill = PrefillKernels::kTensorCore;
  DecodeKernels decode = DecodeKernels::kPersistent;
};
}  // namespace cuda

// The fast plan (bf16 activations; src/cuda/bf16/).
std::unique_ptr<Model> make_cuda_model(const std::filesystem::path& dir,
                                       const cuda::CudaPlanOptions& opt = {});
// The f32 plan (the CPU reference's arithmetic on the device; src/cuda/f32/).
std::unique_ptr<Model> make_cuda_f32_model(const std::filesystem::path& dir);
}  // namespace tansy
