// Causal flash attention for prefill (docs/MODEL.md §4 steps 6-7): GQA, head_dim 256, tensor cores.
//
// KV cache layout (chosen here; the backend allocates it this way): K and V are separate bf16
// arrays [max_pos, n_kv_heads, 256], one row of n_kv_heads*256 values per position. The new
// positions' keys/values (p0 .. p0+n-1) must already be written (post-norm, post-RoPE k; raw v).
//
// Query rows are the new positions p0+i (i < n); each attends to keys 0 .. p0+i. The 8 (in
// general n_heads/n_kv) query heads of one KV group are processed together so every K/V tile
// loaded to shared memory serves all of them. Scores scaled by 1/sqrt(256) = 1/16, softmax in f32,
// P rounded to bf16 for the P·V product, f32 accumulation.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace tansy::cuda {

constexpr int kAttnHeadDim = 256;
constexpr int kAttnMaxGroup = 16;  // n_heads / n_kv_heads (8 on the real model)

struct AttnPrefillArgs {
  // Queries, normed and rotated: element (i, h, d) at q[i*q_stride_t + h*q_stride_h + d].
  // (The q_proj output [n, n_heads*512] with per-head [q | gate] is used in place: stride_t
  // n_heads*512, stride_h 512.) Rows and heads 16-byte aligned.
  const __nv_bfloat16* q = nullptr;
  int64_t q_stride_t = 0, q_stride_h = 0;
  const __nv_bfloat16* k_cache = nullptr;  // [>= p0+n, n_kv, 256]
  const __nv_bfloat16* v_cache = nullptr;  // [>= p0+n, n_kv, 256]
  int p0 = 0;                              // absolute position of the first query
  int n = 0;                               // number of query positions
  int n_heads = 0, n_kv = 0;
  // Optional output gate (fused §4.7): out *= sigmoid(gate), same indexing as q. Null = no gate.
  const __nv_bfloat16* gate = nullptr;
  int64_t gate_stride_t = 0, gate_stride_h = 0;
  // Output: element (i, h, d) at out[i*out_stride_t + h*out_stride_h + d] (even strides).
  __nv_bfloat16* out = nullptr;
  int64_t out_stride_t = 0, out_stride_h = 0;
};

void attention_prefill(const AttnPrefillArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
