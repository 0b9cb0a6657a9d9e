// Model weights as views into the mapped checkpoint, in one of two formats
// (MLX affine 4/8-bit, docs/MODEL.md §8.2-8.3; Hugging Face bf16, §8.1). Small parameters
// (norms, gates, conv) are converted to f32 at load.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace tansy {

class TensorStore;

enum class WFormat { kAffine4, kAffine8, kBF16, kF32 };
const char* wformat_name(WFormat f);

// y = W x with W [out, in] row-major (nn.Linear layout).
struct Linear {
  WFormat fmt = WFormat::kF32;
  int out = 0, in = 0;
  int group = 64;                    // affine group size along `in`
  const uint32_t* q = nullptr;       // affine: [out, in*bits/32] packed codes, low bits = low column
  const uint16_t* scales = nullptr;  // affine: [out, in/group] bf16
  const uint16_t* biases = nullptr;  // affine: [out, in/group] bf16
  const uint16_t* bf16 = nullptr;    // bf16: [out, in]
  const float* f32 = nullptr;        // f32: [out, in]

  int bits() const { return fmt == WFormat::kAffine4 ? 4 : fmt == WFormat::kAffine8 ? 8 : 0; }
  // Dequantizes row r into out[in] (f32).
  void row(int r, float* out) const;
  // Bytes this matrix occupies in its stored form.
  size_t stored_bytes() const;
  // The sub-matrix of rows [r0, r0+n) (a view).
  Linear rows(int r0, int n) const;
};

struct GdnWeights {
  Linear in_qkv;               // [conv_dim, hidden]: rows q (key_dim) | k (key_dim) | v (value_dim)
  Linear in_z;                 // [value_dim, hidden]
  Linear in_b;                 // [n_v_heads, hidden]
  Linear in_a;                 // [n_v_heads, hidden]
  Linear out;                  // [hidden, value_dim]
  std::vector<float> conv;     // [conv_dim, kernel]; tap kernel-1 multiplies the current token
  std::vector<float> A_log;    // [n_v_heads]
  std::vector<float> dt_bias;  // [n_v_heads]
  std::vector<float> norm;     // [v_head_dim] gated RMSNorm weight (plain)
};

struct AttnWeights {
  Linear q;  // [n_heads*2*head_dim, hidden]: per head [q (head_dim) | gate (head_dim)]
  Linear k, v;
  Linear o;                   // [hidden, n_heads*head_dim]
  std::vector<float> q_norm;  // [head_dim] multiplier (1 + w)
  std::vector<float> k_norm;  // [head_dim] multiplier (1 + w)
};

struct MoeWeights {
  Linear router;                 // [n_experts, hidden]
  std::vector<Linear> gate, up;  // n_experts x [moe_inter, hidden]
  std::vector<Linear> down;      // n_experts x [hidden, moe_inter]
  Linear sh_gate, sh_up;         // [shared_inter, hidden]
  Linear sh_down;                // [hidden, shared_inter]
  Linear sh_router;              // [1, hidden] scalar gate of the shared expert
};

struct LayerWeights {
  LayerKind kind = LayerKind::kLinear;
  std::vector<float> in_norm, post_norm;  // [hidden] multipliers (1 + w)
  GdnWeights gdn;                         // when kind == kLinear
  AttnWeights attn;                       // when kind == kFull
  MoeWeights moe;
};

enum class CheckpointFormat { kMlxAffine, kHfBf16 };

struct ModelWeights {
  CheckpointFormat format = CheckpointFormat::kMlxAffine;
  Linear embed;  // [vocab, hidden]; a lookup dequantizes one row
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [hidden] multiplier (1 + w)
  Linear lm_head;                 // [vocab, hidden]
  size_t stored_bytes = 0;        // text weights as stored
};

// Strict load: every tensor is consumed or explicitly skipped (vision tower, MTP head);
// a missing, extra, mis-shaped or mis-typed tensor is an Error naming it. Views point into
// `store`, which must outlive the result.
ModelWeights load_weights(const ModelConfig& cfg, const TensorStore& store);

}  // namespace tansy
