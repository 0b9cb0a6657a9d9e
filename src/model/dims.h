// The fixed dimensions of Qwen3.6-35B-A3B (docs/MODEL.md §1), in one place.
//
// Two kinds of constant live here. The per-head dimensions and the quantization group are what
// the kernels are built for: they are compile-time constants of the CUDA backend, and a checkpoint
// whose config differs is refused at load (tiny test models keep them, so they run the real
// kernels). The other figures describe the one model this engine serves: configuration checks and
// cost models compare against them, and kernels size their limits from them (static_asserts below),
// but a smaller test model may have fewer layers, experts or a smaller hidden size.
#pragma once

namespace tansy::dims {

// ---- built into the kernels ----
constexpr int kAttnHeadDim = 256;  // full attention head_dim (q, k, v and the gate)
constexpr int kGdnHeadDim = 128;   // Gated DeltaNet dk = dv
constexpr int kQuantGroup = 64;    // MLX affine group size along a row

// ---- the served model (config.json of Qwen3.6-35B-A3B) ----
constexpr int kHidden = 2048;
constexpr int kLayers = 40;
constexpr int kFullAttnLayers = 10;  // every 4th layer; the other 30 are Gated DeltaNet
constexpr int kVocab = 248320;
constexpr int kAttnHeads = 16;
constexpr int kAttnKvHeads = 2;
constexpr int kRotaryDim = 64;  // partial RoPE: a quarter of the head
constexpr int kGdnKeyHeads = 16;
constexpr int kGdnValueHeads = 32;
constexpr int kConvKernel = 4;
constexpr int kExperts = 256;
constexpr int kExpertsPerToken = 8;
constexpr int kMoeIntermediate = 512;
constexpr int kSharedIntermediate = 512;

static_assert(kHidden % kQuantGroup == 0, "rows of the hidden size split into whole quant groups");
static_assert(kMoeIntermediate % kQuantGroup == 0 && kSharedIntermediate % kQuantGroup == 0);
static_assert(kAttnHeads % kAttnKvHeads == 0, "GQA: whole query groups per KV head");
static_assert(kGdnValueHeads % kGdnKeyHeads == 0, "GDN: whole value groups per key head");
static_assert(kRotaryDim <= kAttnHeadDim && kRotaryDim % 2 == 0);
static_assert(kExpertsPerToken <= kExperts);

}  // namespace tansy::dims
