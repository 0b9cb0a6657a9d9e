// The Hopper backend's entry point (owned by the CUDA backend; open_model() calls it).
#pragma once
#include <filesystem>
#include <memory>

#include "model/model.h"

namespace tansy {
// The fast plan (bf16 activations; backend.cu).
std::unique_ptr<Model> make_cuda_model(const std::filesystem::path& dir);
// The f32 plan (the CPU reference's arithmetic on the device; f32_model.cu).
std::unique_ptr<Model> make_cuda_f32_model(const std::filesystem::path& dir);
}  // namespace tansy
