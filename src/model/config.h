// The model description read from config.json: Qwen3.5/3.6 MoE text architecture
// (docs/MODEL.md §1), validated field by field.
#pragma once
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace tansy {

enum class LayerKind { kLinear /* Gated DeltaNet */, kFull /* gated attention */ };

// MLX affine quantization (MODEL.md §8.3): group size and default bits, plus per-module overrides.
struct QuantConfig {
  int group_size = 64;
  int bits = 4;
  std::map<std::string, int> bits_override;  // module path -> bits (e.g. "...layers.0.mlp.gate" -> 8)
  // Bits the config declares for a module path (override or default).
  int bits_for(const std::string& module_path) const;
};

struct ModelConfig {
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  // gated attention
  int num_heads = 0, num_kv_heads = 0, head_dim = 0;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor
  double rope_theta = 0;
  // Gated DeltaNet
  int lin_num_k_heads = 0, lin_num_v_heads = 0, lin_k_head_dim = 0, lin_v_head_dim = 0;
  int conv_kernel = 0;
  // MoE
  int num_experts = 0, experts_per_tok = 0, moe_intermediate = 0, shared_intermediate = 0;
  float rms_eps = 1e-6f;
  int max_position = 0;
  std::vector<LayerKind> layers;
  std::vector<int> eos_token_ids;
  std::optional<QuantConfig> quant;  // present for MLX checkpoints
  bool is_qwen36_35b_a3b = false;    // exactly the real model's shape
  std::string name;                  // "Qwen3.6-35B-A3B" or "qwen3_5_moe (custom: ...)"

  int lin_key_dim() const { return lin_num_k_heads * lin_k_head_dim; }
  int lin_value_dim() const { return lin_num_v_heads * lin_v_head_dim; }
  int lin_conv_dim() const { return 2 * lin_key_dim() + lin_value_dim(); }
  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
  int num_full_layers() const;
  int num_linear_layers() const { return num_layers - num_full_layers(); }
};

// Parses a config.json object (vision-language wrapper with text_config, or flat text config).
// Throws Error naming the offending field.
ModelConfig parse_config(const nlohmann::json& j);
// Reads DIR/config.json (and DIR/generation_config.json for eos ids, when present).
ModelConfig load_config(const std::filesystem::path& dir);

}  // namespace tansy
