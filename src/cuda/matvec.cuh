// Decode-side products: y = W·x for a handful of token rows (batch-1 decode and the GEMV prefill
// path), with the MLX affine 4/8-bit dequant (docs/MODEL.md §8.3) or bf16 weights read in place.
// CPU reference: cpu::matmul (+ cpu::swiglu for the fused variant).
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"
#include "model/weights.h"

namespace tansy::cuda {

constexpr int kQuantGroup = 64;     // affine group size along `in` (MLX's only group size here)
constexpr int kMatvecMaxIn = 8192;  // up to 4 x rows are staged in shared memory as f32

// Device view of a weight matrix [out, in] in its checkpoint layout (as tansy::Linear):
// affine: q u32 [out, in*bits/32], scales/biases bf16 [out, in/64]; bf16: w [out, in].
// Expert-stacked matrices are `out` = n_experts * rows_per_expert rows, contiguous.
struct DevLinear {
  WFormat fmt = WFormat::kAffine4;
  int out = 0, in = 0;
  const uint32_t* q = nullptr;
  const bf16* scales = nullptr;
  const bf16* biases = nullptr;
  const bf16* w = nullptr;

  int bits() const { return fmt == WFormat::kAffine4 ? 4 : fmt == WFormat::kAffine8 ? 8 : 16; }
  int64_t words_per_row() const { return int64_t(in) * bits() / 32; }
  DevLinear rows(int r0, int n) const;
  // Throws unless the layout is one the kernels read (format, in % 64, 16-byte rows, in <= max).
  void check(const char* what) const;
};

// Multiprocessors of the current device (read once).
int sm_count();

struct MatvecOut {
  void* ptr = nullptr;  // row 0, column 0 (a column offset is a pointer offset)
  bool f32 = false;     // else bf16
  int64_t ld = 0;       // elements between token rows
};

// ---- decode (one token row) with the neighbouring ops fused in ----

// The residual stream h (f32, one row) carries, per norm point, kNormParts partial sums of h²
// written by the kernel that last added to h (ResidualOut, or embed), so that a consumer gets the
// RMSNorm scale without a reduction pass of its own. Unused partials stay zero (the producer of
// a point always has the same grid); summing them in a fixed order keeps decoding deterministic.
constexpr int kNormParts = 512;
constexpr int kFusedNormMaxDim = 2048;  // NormIn's row is held in registers: the model's hidden size

// The input is the RMSNorm of the residual stream, computed in every block from h and the
// partials: x = bf16(h·rsqrt(Σ ss / dim + eps)·w), the values add_rmsnorm writes. Block 0 also
// writes x to xn_out (when not null).
struct NormIn {
  const float* h = nullptr;
  const float* ss = nullptr;  // [kNormParts]
  const float* w = nullptr;
  float eps = 0.f;
  bf16* xn_out = nullptr;
};

// The product added to the residual stream in place, h[r] += y[r] (f32), with the partial sums
// of the new h² (one per block) written to ss [kNormParts] for the next NormIn.
struct ResidualOut {
  float* h = nullptr;
  float* ss = nullptr;
};

// Router epilogue: once every block has stored its logits, the last block to finish routes the
// token as route_topk does (softmax over logits[0, E), top-k, renormalised) into idx/w [k]; with
// shared_slot it appends slot k = expert E (the shared expert stacked after the routed ones) with
// weight sigmoid(logits[E]). counter: one u32 on the device, zero before the launch (left zero).
struct RouteEpilogue {
  int E = 0, k = 0;
  bool shared_slot = false;
  int* idx = nullptr;
  float* w = nullptr;
  unsigned* counter = nullptr;
};

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

// h[r] += W[r]·X for one token row (ResidualOut).
void matvec_residual(const DevLinear& W, const bf16* X, const ResidualOut& out, cudaStream_t stream);

// Y[r] = W[r]·x for the one token whose normed input `x` describes.
void matvec_norm(const DevLinear& W, const NormIn& x, const MatvecOut& Y, cudaStream_t stream);
// Router logits (f32, W.out of them) + the routing epilogue.
void matvec_norm_route(const DevLinear& W, const NormIn& x, float* logits, const RouteEpilogue& route,
                       cudaStream_t stream);
// GDN in_proj (bf16 Y, W.out rows) + the conv/gates epilogue.
void matvec_norm_gdn(const DevLinear& W, const NormIn& x, bf16* Y, const GdnInEpilogue& gdn,
                     cudaStream_t stream);

// Y[t, r] = Σ_i W[r, i]·X[t, i] for t < n (any n >= 1; rows of X `ldx` elements apart, 16-byte aligned).
void matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, const MatvecOut& Y, cudaStream_t stream);

// Fused SwiGLU pair: W's rows are interleaved (2i = gate_i, 2i+1 = up_i);
// Y[t, i] = silu(bf16(g_i))·bf16(u_i) for i < W.out/2, bf16.
void matvec_swiglu(const DevLinear& W, const bf16* X, int64_t ldx, int n, bf16* Y, int64_t ldy,
                   cudaStream_t stream);

// Routed experts' gate|up for decode: W stacks n_experts interleaved gate|up matrices of
// rows_per_expert = 2*I rows. For each slot s = t*k + j: act[s, i] = swiglu of expert idx[s]
// applied to X[t]. act bf16 [n*k, I].
void matvec_swiglu_experts(const DevLinear& W, int n_experts, const int* idx, int n, int k, const bf16* X,
                           int64_t ldx, bf16* act, cudaStream_t stream);

// Routed experts' down projections fused with the weighted combine:
// out[t, r] = Σ_j wts[t, j]·(Wd_{idx[t,j]}[r]·act[t*k+j]) + sigmoid(sh_logit[t*sh_ld])·shared[t, r]
// Wd stacks n_experts matrices [H, I]; shared bf16 [n, H] (the shared expert's output, may alias out);
// out bf16 [n, H].
void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                      int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                      cudaStream_t stream);
// The same for one token, added to the residual stream instead (ResidualOut; `shared` as above).
void moe_down_residual(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                       int k, const bf16* shared, const float* sh_logit, const ResidualOut& out,
                       cudaStream_t stream);

}  // namespace tansy::cuda
