// The Hopper backend's entry point (owned by the CUDA backend; open_model() calls it).
#pragma once
#include <filesystem>
#include <memory>

#include "model/model.h"

namespace tansy {
std::unique_ptr<Model> make_cuda_model(const std::filesystem::path& dir);
}
