// The benchmark's workload and floors (docs/BENCHMARK.md "The workload", "The limits"): the
// synthetic prompt, the digest of the generated ids, and the cost model the measured figures are
// compared against. Pure functions of the configuration, no device code.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace tansy {

struct ModelConfig;

// Prompt token i = ((i * 2654435761) mod 2^32) mod vocab_size.
std::vector<int32_t> synthetic_prompt(int n, int vocab_size);
// 64-bit FNV-1a over the ids' little-endian 4-byte encodings.
uint64_t fnv1a64_ids(std::span<const int32_t> ids);

// The benchmark's floors (BENCHMARK.md "The limits"), computed from the configuration's shapes
// and the stored format (MODEL.md §10): 4-bit/8-bit affine with bf16 scale+bias per group of 64.
struct CostModel {
  double weight_bytes_per_token = 0;      // decode, batch 1: every weight a token touches, read once
  double kv_bytes_per_context_token = 0;  // bf16 K and V of every attention layer
  double gdn_state_bytes = 0;             // f32 recurrent state of every GDN layer
  double active_params = 0;  // weights a token multiplies (mixers, router, top-k + shared experts, lm_head)
  int attn_layers = 0, attn_heads = 0, head_dim = 0;

  // Bytes one decode step moves at context `ctx`: weights + KV read + GDN state read and written.
  double decode_bytes(double ctx) const;
  // FLOPs of a prefill of `ctx` tokens: 2 x active params per token + causal attention
  // (attn_layers x 4 x heads x head_dim x ctx per token, halved for causality).
  double prefill_flops(double ctx) const;
};
CostModel cost_model(const ModelConfig& cfg);

}  // namespace tansy
