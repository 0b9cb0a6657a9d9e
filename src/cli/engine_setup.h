// What `tansy serve` and `tansy chat` share: finding the model directory and loading the model,
// tokenizer and engine from command-line flags (and the --backend choice, also used by logits and
// generate).
#pragma once
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "cli/command.h"
#include "engine/engine.h"
#include "text/chat_template.h"

namespace tansy::cli {

// Flags every engine-backed command takes (values) in addition to its own.
const std::vector<std::string>& engine_flags();

// --model DIR, or models/tansy-demo found from the current directory or the repository the
// executable was built in.
std::filesystem::path resolve_model_dir(const Flags& flags);

// --backend auto|cpu|cuda (default auto: cuda on a Hopper GPU of a CUDA build, else cpu; the
// choice and its reason go to stderr). Throws Error for cuda without a usable device.
std::string backend_from_flags(const Flags& flags);

// --cuda-precision auto|bf16|f32 (default auto) for a model in `dir` on `backend`: the CUDA plan
// (model/backend_choice.h); auto's choice and reason go to stderr when the backend is cuda.
// Throws Error for another value.
std::string cuda_precision_from_flags(const Flags& flags, const std::string& backend,
                                      const std::filesystem::path& dir);

struct LoadedEngine {
  std::filesystem::path dir;
  std::unique_ptr<Engine> engine;
  GenerationDefaults defaults;
  std::shared_ptr<const text::ChatTemplate> chat_template;  // the checkpoint's own
};
LoadedEngine load_engine(const Flags& flags);

}  // namespace tansy::cli
