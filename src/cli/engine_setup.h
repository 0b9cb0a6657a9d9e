// What `tansy serve` and `tansy chat` share: finding the model directory and loading the model,
// tokenizer and engine from command-line flags.
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "engine/engine.h"

namespace tansy::cli {

// Flags every engine-backed command takes (values) in addition to its own.
const std::vector<std::string>& engine_flags();

// --model DIR, or models/tansy-demo found from the current directory or the repository the
// executable was built in.
std::filesystem::path resolve_model_dir(const Flags& flags);

struct LoadedEngine {
  std::filesystem::path dir;
  std::unique_ptr<Engine> engine;
  GenerationDefaults defaults;
};
LoadedEngine load_engine(const Flags& flags);

}  // namespace tansy::cli
