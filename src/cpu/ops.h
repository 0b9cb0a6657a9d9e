// The CPU reference backend's operations, plain f32, one family per file (matmul.cpp, norm.cpp,
// attention.cpp, gdn.cpp, moe.cpp). These are the oracle every CUDA kernel is tested against:
// the CUDA launchers in src/cuda/ take the same arguments with device pointers.
// Formulas: docs/MODEL.md (section numbers in each comment).
#pragma once
#include <cstdint>
#include <span>

#include "core/threadpool.h"
#include "model/weights.h"

namespace tansy::cpu {

// ---- matmul.cpp: products with the affine dequant fused in (MODEL.md §8.3); CUDA: matvec/, gemm/ ----
// Y[t, o] = sum_i W[o, i] * X[t, i] for t < n; X [n, W.in], Y [n, W.out]. Threads of `pool` over
// rows of W (the CPU model passes its own, sized by --threads); the result does not depend on it.
void matmul(const Linear& W, const float* X, int n, float* Y, ThreadPool& pool = ThreadPool::global());
// Dequantizes row `row` of an embedding-like matrix.
void embed_row(const Linear& E, int row, float* out);

// ---- norm.cpp (MODEL.md §3) ----
// y = x * rsqrt(mean(x^2) + eps) * w over `dim` values; in-place allowed. w is the multiplier (1 + w_hf).
void rmsnorm(const float* x, const float* w, int dim, float eps, float* y);
// Gated RMSNorm of one GDN value head: y = w * (o * rsqrt(mean(o^2)+eps)) * silu(z).
void rmsnorm_gated(const float* o, const float* z, const float* w, int dim, float eps, float* y);

// ---- attention.cpp (MODEL.md §4) ----
// NeoX rotary on the first rotary_dim dims of a head vector at position pos (theta base).
void rope(float* x, int rotary_dim, int pos, double theta);
// One query position against cached keys/values: q [n_heads, hd], K/V [n_ctx, n_kv, hd] (row per
// position), causal over the n_ctx cached positions, GQA (head h uses kv head h / (n_heads/n_kv)),
// scale 1/sqrt(hd). out [n_heads, hd].
void attention(const float* q, const float* K, const float* V, int n_ctx, int n_heads, int n_kv, int hd,
               float* out);

// ---- gdn.cpp (MODEL.md §5) ----
// Causal depthwise conv1d + SiLU for one token: window [kernel-1, C] holds the previous inputs
// (oldest first) and is shifted to append x. w [C, kernel], tap kernel-1 = current token.
void conv1d_step(const float* x, float* window, const float* w, int C, int kernel, float* y);
// Gates per value head: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias).
void gdn_gates(const float* a, const float* b, const float* A_log, const float* dt_bias, int n_v_heads,
               float* beta, float* g);
// L2-normalise each head of x [n_heads, dim] in place: x / sqrt(sum x^2 + 1e-6), times `scale`.
void l2norm_heads(float* x, int n_heads, int dim, float scale);
// One delta-rule step for all value heads. q,k [n_k_heads, dk] (normalised, q scaled),
// v [n_v_heads, dv]; S [n_v_heads, dk, dv] f32 updated in place; o [n_v_heads, dv].
void gdn_recurrent_step(const float* q, const float* k, const float* v, const float* beta, const float* g,
                        int n_k_heads, int n_v_heads, int dk, int dv, float* S, float* o);

// ---- moe.cpp (MODEL.md §6) ----
// softmax over n_experts logits (f32), top-k, renormalised. Ties break to the lower index.
void route_topk(const float* logits, int n_experts, int k, int* idx, float* weight);
// silu(g) * u elementwise.
void swiglu(const float* g, const float* u, int n, float* y);

}  // namespace tansy::cpu
