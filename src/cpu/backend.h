#pragma once
#include <filesystem>
#include <memory>

#include "model/model.h"

namespace tansy {
std::unique_ptr<Model> make_cpu_model(const std::filesystem::path& dir, const ModelOptions& opt);
}
