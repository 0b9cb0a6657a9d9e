// Gated DeltaNet prefill, chunked (chunk 64, docs/MODEL.md §5.6), continuing from an existing state.
// The result equals looping the one-token update (§5.5, cpu::gdn_recurrent_step) over the n tokens.
//
// Work split: one block per (value head, 32-column slice of the value dimension): columns of S are
// independent, so 32 heads x 4 slices = 128 blocks on the real model. Each block walks the chunks
// in order; the value-independent per-chunk parts (K·Kᵀ, Q·Kᵀ, the triangular solve for W) are
// recomputed by each slice of a head, which is cheaper than a second pass through device memory
// at these sizes. All arithmetic f32.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tansy::cuda {

constexpr int kGdnHeadDim = 128;  // dk = dv = 128 (fixed by the model family)
constexpr int kGdnChunk = 64;

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

void gdn_prefill(const GdnPrefillArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
