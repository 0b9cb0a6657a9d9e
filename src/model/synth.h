// Synthetic checkpoints: the exact tensor names, shapes, dtypes and quantization layout of
// mlx-community/Qwen3.6-35B-A3B-4bit (MODEL.md §8.2-8.3), filled with deterministic random
// values at scales that keep hidden states of order 1, so that benchmarks and full-size tests
// run the real code paths without the real weights (BENCHMARK.md "The weights").
#pragma once
#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

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

// Synthetic benchmark workload (BENCHMARK.md "The workload").

// Prompt token i = ((i * 2654435761) mod 2^32) mod vocab_size.
std::vector<int32_t> synthetic_prompt(int n, int vocab_size);
// 64-bit FNV-1a over the ids' little-endian 4-byte encodings.
uint64_t fnv1a64_ids(std::span<const int32_t> ids);

struct ModelConfig;

// The benchmark's floors (BENCHMARK.md "The limits"), computed from the configuration's shapes
// and the stored format (MODEL.md §10): 4-bit/8-bit affine with bf16 scale+bias per group of 64.
struct CostModel {
  double weight_bytes_per_token = 0;  // decode, batch 1: every weight a token touches, read once
  double kv_bytes_per_context_token = 0;  // bf16 K and V of every attention layer
  double gdn_state_bytes = 0;             // f32 recurrent state of every GDN layer
  double active_params = 0;               // weights a token multiplies (mixers, router, top-k + shared experts, lm_head)
  int attn_layers = 0, attn_heads = 0, head_dim = 0;

  // Bytes one decode step moves at context `ctx`: weights + KV read + GDN state read and written.
  double decode_bytes(double ctx) const;
  // FLOPs of a prefill of `ctx` tokens: 2 x active params per token + causal attention
  // (attn_layers x 4 x heads x head_dim x ctx per token, halved for causality).
  double prefill_flops(double ctx) const;
};
CostModel cost_model(const ModelConfig& cfg);

}  // namespace tansy
