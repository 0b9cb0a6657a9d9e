// Gated attention pieces for decode and the GEMV prefill path (docs/MODEL.md §4).
// CPU references: cpu::rmsnorm + cpu::rope (qk_norm_rope), cpu::attention + sigmoid gate.
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"

namespace tansy::cuda {

constexpr int kHeadDim = 256;        // the model family's attention head_dim
constexpr int kMaxAttnSplits = 256;  // split-K partitions of the key range per (token, kv head)

// The fused q|k|v projection rows: per token, n_heads x [q (256) | gate (256)], then k (n_kv x 256),
// then v (n_kv x 256), `ld` elements apart.
struct QkvLayout {
  bf16* base = nullptr;
  int64_t ld = 0;
  int n_heads = 0, n_kv = 0;
  __host__ __device__ int64_t k_off() const { return int64_t(n_heads) * 2 * kHeadDim; }
  __host__ __device__ int64_t v_off() const { return k_off() + int64_t(n_kv) * kHeadDim; }
};

// For token t < n at position p = *pos + t: q heads RMS-normed (q_norm) and rotated in place;
// k heads normed (k_norm) and rotated into k_cache[p]; v copied into v_cache[p].
// Caches bf16 [max_pos, n_kv, 256]; NeoX rotary over the first rotary_dim dims, base theta.
void qk_norm_rope(const QkvLayout& qkv, int n, const int* pos, const float* q_norm, const float* k_norm,
                  float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, cudaStream_t stream);

// Scratch for split attention, per (token, head, split): 256 partial outputs, max, sum (+ pad to 16 bytes).
constexpr int kAttnPartStride = kHeadDim + 4;
inline size_t attn_scratch_floats(int n, int n_heads, int splits) {
  return size_t(n) * n_heads * splits * kAttnPartStride;
}

// Causal attention of the n new queries (in place in the qkv rows, already normed/rotated)
// against the cache: token t sees positions 0 .. *pos + t. The key range is split into `splits`
// parts per (token, kv head), all query heads of a kv group in one block; a second kernel merges
// the parts and applies the output gate: out[t, h*256 + d] = attn * sigmoid(gate). out bf16 rows ldo apart.
void attention_decode(const QkvLayout& qkv, int n, const int* pos, const bf16* k_cache, const bf16* v_cache,
                      int splits, float* scratch, bf16* out, int64_t ldo, cudaStream_t stream);

// One token (m == 1) in two kernels: qk_norm_rope and the split pass fused (the cached keys of
// each split are copied into shared memory before the PDL wait, while the projection before it
// still runs; the split holding the position writes the new k/v into the cache), then the merge
// with the output gate. Same results as qk_norm_rope + attention_decode for one token. Needs
// n_heads / n_kv in {1, 2, 4, 8}.
void attention_decode_fused(const QkvLayout& qkv, const int* pos, const float* q_norm, const float* k_norm,
                            float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, int splits,
                            float* scratch, bf16* out, int64_t ldo, cudaStream_t stream);

}  // namespace tansy::cuda
