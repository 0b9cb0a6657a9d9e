#include "bench/workload.h"

#include <string>

#include "core/error.h"
#include "model/config.h"

namespace tansy {
namespace {

constexpr const char* kPrefix = "language_model.model.";

}  // namespace

std::vector<int32_t> synthetic_prompt(int n, int vocab_size) {
  TANSY_CHECK(n >= 0 && vocab_size > 0, "synthetic_prompt: bad size {} / vocab {}", n, vocab_size);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) ids[size_t(i)] = int32_t((uint32_t(i) * 2654435761u) % uint32_t(vocab_size));
  return ids;
}

uint64_t fnv1a64_ids(std::span<const int32_t> ids) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (int32_t id : ids)
    for (int b = 0; b < 4; ++b) h = (h ^ ((uint32_t(id) >> (8 * b)) & 0xffu)) * 0x100000001b3ULL;
  return h;
}

CostModel cost_model(const ModelConfig& c) {
  auto bits_of = [&](const std::string& module) { return c.quant ? c.quant->bits_for(module) : 16; };
  auto group = c.quant ? c.quant->group_size : 64;
  // Stored bytes of an [out, in] matrix: codes plus a bf16 scale and bias per group (or bf16 dense).
  auto mat = [&](double out, double in, int bits) {
    return bits == 16 ? out * in * 2 : out * in * (bits / 8.0 + 4.0 / group);
  };
  CostModel m;
  const double H = c.hidden_size;
  const std::string P = kPrefix;
  double bytes =
      mat(1, H, bits_of(P + "embed_tokens")) + mat(c.vocab_size, H, bits_of("language_model.lm_head"));
  double params = double(c.vocab_size) * H;
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string L = P + "layers." + std::to_string(i) + ".";
    bytes += 2 * H * 2;  // input and post-attention norms (bf16)
    if (c.layers[size_t(i)] == LayerKind::kLinear) {
      const double rows = c.lin_conv_dim() + c.lin_value_dim() + 2.0 * c.lin_num_v_heads;
      bytes += mat(rows, H, 4) + mat(H, c.lin_value_dim(), 4) + double(c.lin_conv_dim()) * c.conv_kernel * 2;
      params += rows * H + H * c.lin_value_dim() + double(c.lin_conv_dim()) * c.conv_kernel;
    } else {
      const double rows = 2.0 * c.q_dim() + 2.0 * c.kv_dim();
      bytes += mat(rows, H, 4) + mat(H, c.q_dim(), 4);
      params += rows * H + H * c.q_dim();
    }
    const double expert = 3.0 * c.moe_intermediate * H, shared = 3.0 * c.shared_intermediate * H;
    bytes += mat(c.num_experts, H, bits_of(L + "mlp.gate")) +
             mat(1, H, bits_of(L + "mlp.shared_expert_gate")) +
             mat(1, (c.experts_per_tok * expert + shared), 4);
    params += (c.num_experts + 1.0) * H + c.experts_per_tok * expert + shared;
  }
  m.weight_bytes_per_token = bytes;
  m.active_params = params;
  m.attn_layers = c.num_full_layers();
  m.attn_heads = c.num_heads;
  m.head_dim = c.head_dim;
  m.kv_bytes_per_context_token = double(m.attn_layers) * 2 * c.kv_dim() * 2;
  m.gdn_state_bytes =
      double(c.num_linear_layers()) * c.lin_num_v_heads * c.lin_k_head_dim * c.lin_v_head_dim * 4;
  return m;
}

double CostModel::decode_bytes(double ctx) const {
  return weight_bytes_per_token + kv_bytes_per_context_token * ctx + 2 * gdn_state_bytes;
}

double CostModel::prefill_flops(double ctx) const {
  return ctx * (2 * active_params + double(attn_layers) * 4 * attn_heads * head_dim * ctx / 2);
}

}  // namespace tansy
