// Gated DeltaNet on the device (docs/MODEL.md §5). CPU references (src/cpu/gdn.cpp):
// cpu::conv1d_step, cpu::l2norm_heads, cpu::gdn_gates, cpu::gdn_recurrent_step, cpu::rmsnorm_gated
// (norm/norm.cuh's gated_rmsnorm). GPU tests: tests/gpu/test_gdn.cu.
//
//   file                 what
//   matvec/matvec.cu     matvec_norm_gdn: in_proj with the conv and gates as its epilogue (decode)
//   gdn/decode.cu        gdn_decode_step (decode), gdn_conv and gdn_recurrent (the GEMV prefill path)
//   gdn/prefill_tc.cu    gdn_prefill: the chunked delta rule on tensor cores (prefill)
//   gdn/prefill_norm.cu  gdn_gated_norm: the gated RMSNorm of several tokens (prefill)
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "cuda/matvec/matvec.cuh"

namespace tansy::cuda {

constexpr int kGdnDim = dims::kGdnHeadDim;  // dk = dv
constexpr int kGdnChunk = 64;               // tokens per chunk of the chunked delta rule
constexpr int kMaxConvKernel = 8;           // conv taps kept in registers
constexpr int kConvTokensPerBlock = 64;     // 4 warps of 16 tokens (gdn_conv)
static_assert(dims::kConvKernel <= kMaxConvKernel);

// ---- conv + gates (several tokens) ----

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

// ---- the delta rule (several tokens), continuing from an existing state ----

struct GdnPrefillArgs {
  // Normalised q̂ (already scaled by 1/sqrt(128)), k̂: element (t, kh, d) at q[t*q_stride + kh*128 + d].
  // (The conv output [n, 2*key_dim + value_dim] can be used in place: q at +0, k at +key_dim,
  // v at +2*key_dim, all with stride conv_dim.) Row strides multiple of 8, pointers 16-byte aligned.
  const __nv_bfloat16* q = nullptr;
  const __nv_bfloat16* k = nullptr;
  const __nv_bfloat16* v = nullptr;  // (t, h, d) at v[t*v_stride + h*128 + d]
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;
  const float* beta = nullptr;  // [n, n_v_heads]: sigmoid(b)
  const float* g = nullptr;     // [n, n_v_heads]: log-decay (<= 0)
  int n = 0;
  int n_k_heads = 0, n_v_heads = 0;  // value head h reads key head h / (n_v_heads / n_k_heads)
  float* state = nullptr;            // [n_v_heads, 128 (k), 128 (v)] f32: read as S0, overwritten with S_n
  // Output o (t, h, d) at o[t*o_stride + h*128 + d], bf16 or f32 (exactly one non-null).
  __nv_bfloat16* o_bf16 = nullptr;
  float* o_f32 = nullptr;
  int64_t o_stride = 0;
};

// The delta-rule recurrence run token by token over a.n tokens (the decode path; for prefill
// gdn_prefill does the same chunked). Writes a.o_f32.
void gdn_recurrent(const GdnPrefillArgs& a, cudaStream_t stream);

// The same chunked (chunk 64, §5.6) on tensor cores; the result equals looping the one-token update
// (§5.5) over the n tokens. Two kernels per window of up to 64 chunks (at 32 heads; the window
// bounds a 64 MiB workspace kept per (device, stream)): one block per (chunk, value head) computes
// every chunk's state-independent parts at once (the Gram and decay matrices, T = (I + A)^{-1} by
// forward substitution, Aqk); then one block per (value head, 32-column slice of the value
// dimension), 32 heads x 4 slices = 128 blocks on the real model, walks the chunks in order with
// only the state-dependent products (Q·S, K·S, T·R, Aqk·V', the state update) on the serial path.
// Every product is an mma; the f32 operands (S, R, V', T, Aqk) go in as bf16 hi + lo pairs, so
// the products keep ~16 mantissa bits, and the state stays f32 in registers across chunks
// (gdn/prefill_tc.cu says why).
// max_window_chunks > 0 caps the window below the workspace bound (tests: window boundaries at
// small sizes).
void gdn_prefill(const GdnPrefillArgs& a, cudaStream_t stream, int max_window_chunks = 0);
// Kernel launches gdn_prefill makes for n tokens at n_v_heads (for the prefill profile).
int gdn_prefill_launches(int n, int n_v_heads);

// ---- the gated RMSNorm of several tokens (gdn/prefill_norm.cu) ----

// y[t, j*128 + d] = bf16(w[d] · o[t, j*128 + d] / rms(o[t, j*128 ..]) · silu(z[t, j*128 + d])) for
// every token t < n and value head j < n_heads (cpu::rmsnorm_gated per head). o 16-byte aligned,
// z, y 8-byte aligned, strides multiples of 4.
struct GdnGatedNormArgs {
  const float* o = nullptr;
  int64_t ldo = 0;
  const bf16* z = nullptr;
  int64_t ldz = 0;
  const float* w = nullptr;  // [128]
  int n = 0, n_heads = 0;
  float eps = 0.f;
  bf16* y = nullptr;
  int64_t ldy = 0;
};
void gdn_gated_norm(const GdnGatedNormArgs& a, cudaStream_t stream);

// ---- decode (one token) ----

// GDN in_proj epilogue (rows [q|k|v conv channels | z | a | b], MODEL.md §5.2-5.4): each conv
// channel c < conv_dim gets the causal conv over its window and this token's bf16-rounded
// projection, then SiLU, into conv_out (f32; q/k not yet l2-normalised), and its window advances;
// head j gets beta[j] = sigmoid(b_j), g[j] = -exp(A_log_j)·softplus(a_j + dt_bias_j). Every row is
// also stored to Y as bf16, as matvec does (z is read from there).
struct GdnInEpilogue {
  int conv_dim = 0, value_dim = 0, n_v_heads = 0, kernel = 0;
  const float* conv_w = nullptr;  // [conv_dim, kernel], tap kernel-1 = current token
  bf16* window = nullptr;         // [kernel-1, conv_dim], oldest first
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  float* conv_out = nullptr;  // [conv_dim]
  float* beta = nullptr;      // [n_v_heads]
  float* g = nullptr;         // [n_v_heads]
};

// GDN in_proj (bf16 Y, W.out rows) + the conv/gates epilogue.
void matvec_norm_gdn(const DevLinear& W, const NormIn& x, bf16* Y, const GdnInEpilogue& gdn,
                     cudaStream_t stream, const DecodeRows* rows = nullptr);

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
// With `rows`: the step for each of rows->n tokens of different sequences (a batched decode
// step), token t's inputs and outputs at a's pointers plus t times the strides (the counters t *
// n_v_heads on) and its state rows->state[t], each computed as the one-token launch computes it.
struct GdnDecodeRows {
  int n = 1;
  int64_t conv = 0, gates = 0, z = 0, o = 0, y = 0;
  float* state[kMaxBatch] = {};
};
void gdn_decode_step(const GdnDecodeArgs& a, cudaStream_t stream, const GdnDecodeRows* rows = nullptr);

}  // namespace tansy::cuda
