// Synthetic checkpoints: the exact tensor names, shapes, dtypes and quantization layout of
// mlx-community/Qwen3.6-35B-A3B-4bit (MODEL.md §8.2-8.3), filled with deterministic random
// values at scales that keep hidden states of order 1, so that benchmarks and full-size tests
// run the real code paths without the real weights (BENCHMARK.md "The weights").
#pragma once
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>

namespace tansy {

// config.json of the real checkpoint as MODEL.md §1 and §8.3 describe it (VLM wrapper,
// text_config, quantization with 8-bit router and shared-expert-gate overrides).
nlohmann::json real_model_config_json();

// Completes a user-supplied config into the MLX wrapper form synth writes: a flat text config
// is wrapped under text_config; a missing `quantization` block gets the real model's
// (4-bit, group 64, 8-bit mlp.gate and mlp.shared_expert_gate for every layer), mirrored in
// quantization_config.
nlohmann::json complete_synth_config(nlohmann::json config);

struct SynthOptions {
  uint64_t seed = 0;
  int threads = 0;                              // 0: hardware concurrency
  size_t shard_bytes = size_t(5) << 30;         // start a new shard past this many data bytes
  size_t chunk_bytes = size_t(32) << 20;        // unit of work per thread and per write
};

struct SynthResult {
  size_t data_bytes = 0;  // tensor bytes over all shards
  int tensors = 0;
  int shards = 0;
};

// Writes DIR/config.json, DIR/model-0000k-of-0000N.safetensors and
// DIR/model.safetensors.index.json. DIR must be absent or empty. Output depends only on
// (config, seed), never on the thread count. Throws Error.
SynthResult write_synthetic_checkpoint(const nlohmann::json& config, const std::filesystem::path& dir,
                                       const SynthOptions& opt);

}  // namespace tansy
