// Gated full attention on the device (docs/MODEL.md §4). CPU references (src/cpu/attention.cpp):
// cpu::rmsnorm + cpu::rope (qk_norm_rope), cpu::attention + the sigmoid output gate. GPU tests:
// tests/gpu/test_attention.cu.
//
//   file                  what
//   attention/decode.cu   qk_norm_rope, split-K decode attention (+ fused decode kernel), merge
//   attention/prefill.cu  causal flash attention on tensor cores (prefill)
//   attention/prefill_wgmma.cu  the same on Hopper's warpgroup tensor cores (wgmma, TMA)
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "model/dims.h"

namespace tansy::cuda {

constexpr int kHeadDim = dims::kAttnHeadDim;
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
//
// With `rows`: one new token of each of rows->n sequences (a batched decode step): token t's qkv
// row t of qkv, its position rows->pos[t] and its caches; scratch holds n tokens' partials. Each
// token is computed as the one-token launch computes it (pos, k_cache and v_cache unused).
//
// With `merge_counters` (one token only: n_kv unsigned counters, zero before the call, left
// nonzero): one kernel. Each split counts itself done, and the first splits wait for the others
// and merge (head, 64 dims) each, with the merge kernel's sums in the same order: the same bits,
// without the second launch and its wait for the whole first grid.
struct AttnDecodeRows {
  int n = 1;
  const int* pos[kMaxBatch] = {};
  bf16* k_cache[kMaxBatch] = {};
  bf16* v_cache[kMaxBatch] = {};
};
void attention_decode_fused(const QkvLayout& qkv, const int* pos, const float* q_norm, const float* k_norm,
                            float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, int splits,
                            float* scratch, bf16* out, int64_t ldo, cudaStream_t stream,
                            const AttnDecodeRows* rows = nullptr, unsigned* merge_counters = nullptr);

// ---- prefill: causal flash attention on tensor cores (prefill.cu) ----

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

// Throws unless `a` is a valid attention_prefill call (the checks both kernels share).
void attention_prefill_check(const AttnPrefillArgs& a);

// The warpgroup kernel (prefill_wgmma.cu: wgmma, tensor copies, producer/consumer warps), same
// arguments and results. Supports n_heads / n_kv dividing 128 (1, 2, 4, 8, 16).
bool attention_prefill_wgmma_supports(const AttnPrefillArgs& a);
void attention_prefill_wgmma(const AttnPrefillArgs& a, cudaStream_t stream);
// Keys per K/V tile of the warpgroup kernel, 64 or 80 (default 80); a measurement hook.
void attention_prefill_wgmma_set_tile(int keys);
int attention_prefill_wgmma_tile();
// Whether its two consumer warpgroups take turns issuing their products (FlashAttention-3's
// ping-pong; default off, measured slower here); a measurement hook.
void attention_prefill_wgmma_set_pingpong(bool on);
bool attention_prefill_wgmma_pingpong();
// Test probe of the warpgroup kernel's parts: the first 128 flattened query rows of kv head 0 and
// keys 0 .. BN-1 (BN = the tile above) through its tensor maps, shared layout and wgmma calls;
// writes S = Q·Kᵀ (unscaled, f32 [128][BN]) and O = P·V (f32 [128][256]) for P given as bf16
// [128][BN]. Rows are flattened as in the kernel (row r: position r / G, head r % G).
void attention_prefill_wgmma_probe(const AttnPrefillArgs& a, const __nv_bfloat16* p, float* s_out,
                                   float* o_out, cudaStream_t stream);

// Which kernel attention_prefill runs (a test/measurement hook; the default is kWgmma). kWgmma
// runs the mma.sync kernel for the groups attention_prefill_wgmma does not support.
enum class AttnPrefillKernel { kMmaSync, kWgmma };
void attention_prefill_set_kernel(AttnPrefillKernel k);
AttnPrefillKernel attention_prefill_current_kernel();

}  // namespace tansy::cuda
