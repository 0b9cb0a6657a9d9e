// Decode-side products: y = W·x for a handful of token rows (batch-1 decode and the GEMV prefill
// path), with the MLX affine 4/8-bit dequant (MODEL.md §8.3) or bf16 weights read in place.
// CPU reference: cpu::matmul (+ cpu::swiglu for the fused variant).
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"
#include "model/weights.h"

namespace tansy::cuda {

constexpr int kQuantGroup = 64;      // affine group size along `in` (MLX's only group size here)
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

struct MatvecOut {
  void* ptr = nullptr;  // row 0, column 0 (a column offset is a pointer offset)
  bool f32 = false;     // else bf16
  int64_t ld = 0;       // elements between token rows
};

// Y[t, r] = Σ_i W[r, i]·X[t, i] for t < n (any n >= 1; rows of X `ldx` elements apart, 16-byte aligned).
void matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, const MatvecOut& Y, cudaStream_t stream);

// Fused SwiGLU pair: W's rows are interleaved (2i = gate_i, 2i+1 = up_i);
// Y[t, i] = silu(bf16(g_i))·bf16(u_i) for i < W.out/2, bf16.
void matvec_swiglu(const DevLinear& W, const bf16* X, int64_t ldx, int n, bf16* Y, int64_t ldy, cudaStream_t stream);

// Routed experts' gate|up for decode: W stacks n_experts interleaved gate|up matrices of
// rows_per_expert = 2*I rows. For each slot s = t*k + j: act[s, i] = swiglu of expert idx[s]
// applied to X[t]. act bf16 [n*k, I].
void matvec_swiglu_experts(const DevLinear& W, int n_experts, const int* idx, int n, int k, const bf16* X,
                           int64_t ldx, bf16* act, cudaStream_t stream);

// Routed experts' down projections fused with the weighted combine:
// out[t, r] = Σ_j wts[t, j]·(Wd_{idx[t,j]}[r]·act[t*k+j]) + sigmoid(sh_logit[t*sh_ld])·shared[t, r]
// Wd stacks n_experts matrices [H, I]; shared bf16 [n, H] (the shared expert's output, may alias out);
// out bf16 [n, H].
void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act, int n,
                      int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out, cudaStream_t stream);

}  // namespace tansy::cuda
