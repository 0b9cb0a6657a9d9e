// Gated DeltaNet pieces for decode and the GEMV prefill path (docs/MODEL.md §5).
// CPU references: cpu::conv1d_step, cpu::l2norm_heads, cpu::gdn_gates, cpu::gdn_recurrent_step.
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/gdn_prefill.cuh"

namespace tansy::cuda {

constexpr int kGdnDim = 128;       // dk = dv (the model family's)
constexpr int kMaxConvKernel = 8;  // conv taps kept in registers
constexpr int kConvTokensPerBlock = 16;

struct GdnConvArgs {
  // Pre-conv q|k|v channels of token t at x[t*ldx + c], c < conv_dim = 2*n_k_heads*128 + n_v_heads*128.
  const bf16* x = nullptr;
  int64_t ldx = 0;
  // The per-head gate inputs, bf16, token t at a[t*ld_ab + h], b[t*ld_ab + h].
  const bf16* a = nullptr;
  const bf16* b = nullptr;
  int64_t ld_ab = 0;
  int n = 0;
  int n_k_heads = 0, n_v_heads = 0, kernel = 0;
  const float* conv_w = nullptr;   // [conv_dim, kernel], tap kernel-1 = current token
  bf16* window = nullptr;          // [kernel-1, conv_dim] previous inputs, oldest first; updated
  const float* A_log = nullptr;    // [n_v_heads]
  const float* dt_bias = nullptr;  // [n_v_heads]
  // Outputs: y bf16 [n, conv_dim] = silu(conv), with the q heads l2-normalised and scaled by
  // 1/sqrt(128) and the k heads l2-normalised; beta, g f32 [n, n_v_heads].
  bf16* y = nullptr;
  float* beta = nullptr;
  float* g = nullptr;
};

// Causal conv1d + SiLU + q/k l2norm + gates for n tokens, conv window advanced by n.
void gdn_conv(const GdnConvArgs& a, cudaStream_t stream);

// The delta-rule recurrence run token by token over a.n tokens (the decode path; for prefill
// gdn_prefill does the same chunked). Writes a.o_f32.
void gdn_recurrent(const GdnPrefillArgs& a, cudaStream_t stream);

// One decode token through the rest of a GDN layer after matvec_norm_gdn: q/k l2-normalisation
// (q scaled by 1/sqrt(128)), the delta-rule update of the f32 state, and the gated RMSNorm per
// value head (§5.5-5.7), in one launch: block (head, 32 state columns); the last of a head's four
// blocks to finish normalises the head's 128 outputs.
struct GdnDecodeArgs {
  const float* conv = nullptr;  // [conv_dim]: SiLU(conv) of q heads | k heads | v heads
  const float* beta = nullptr;  // [n_v_heads]
  const float* g = nullptr;     // [n_v_heads]
  int n_k_heads = 0, n_v_heads = 0;
  float* state = nullptr;         // [n_v_heads, 128, 128], updated
  const bf16* z = nullptr;        // [n_v_heads * 128] gate input
  const float* norm_w = nullptr;  // [128]
  float eps = 0.f;
  float* o = nullptr;            // [n_v_heads * 128] f32 scratch: outputs before the norm
  unsigned* counters = nullptr;  // [n_v_heads], zero before the launch (left zero)
  bf16* y = nullptr;             // [n_v_heads * 128]
};
void gdn_decode_step(const GdnDecodeArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
