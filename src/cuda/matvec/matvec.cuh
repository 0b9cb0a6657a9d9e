// Decode-side products: y = W·x for a handful of token rows (batch-1 decode and the GEMV prefill
// path), with the MLX affine 4/8-bit dequant (docs/MODEL.md §8.3) or bf16 weights read in place.
// CPU reference: cpu::matmul (+ cpu::swiglu for the fused variant). GPU tests: tests/gpu/test_matvec.cu.
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "model/dims.h"
#include "model/weights.h"

namespace tansy::cuda {

constexpr int kQuantGroup = dims::kQuantGroup;  // affine group size along `in`
constexpr int kMatvecMaxIn = 8192;              // up to 4 x rows are staged in shared memory as f32

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

// ---- decode (one token row) with the neighbouring ops fused in ----

// A batched decode launch (continuous batching): n sequences' token rows, row t in grid row
// blockIdx.y = t, each computed by the same blocks in the same order as the one-row launch, so a
// sequence's values do not depend on what else is in the batch. Row t reads and writes at the
// one-row launch's pointers plus t times these strides (elements); the conv windows, which
// belong to the sequences' states, come as pointers (every row's, row 0's included).
struct DecodeRows {
  int n = 1;
  int64_t h = 0;                 // NormIn::h, ResidualOut::h (f32 residual rows)
  int64_t ss = 0;                // NormIn::ss, ResidualOut::ss (kNormParts partials per norm point)
  int64_t xn = 0;                // NormIn::xn_out
  int64_t y = 0;                 // the product's output rows
  int64_t conv = 0;              // GdnInEpilogue::conv_out
  int64_t gates = 0;             // GdnInEpilogue::beta and ::g
  int64_t route = 0;             // RouteEpilogue::idx and ::w (the counter of row t is counter + t)
  bf16* window[kMaxBatch] = {};  // GdnInEpilogue::window of each row's sequence
};

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

// h[r] += W[r]·X for one token row (ResidualOut); with `rows`, for each of rows->n rows (X rows
// rows->y apart).
void matvec_residual(const DevLinear& W, const bf16* X, const ResidualOut& out, cudaStream_t stream,
                     const DecodeRows* rows = nullptr);

// Y[r] = W[r]·x for the one token whose normed input `x` describes (with `rows`: each row's).
void matvec_norm(const DevLinear& W, const NormIn& x, const MatvecOut& Y, cudaStream_t stream,
                 const DecodeRows* rows = nullptr);
// Y[t, r] = Σ_i W[r, i]·X[t, i] for t < n (any n >= 1; rows of X `ldx` elements apart, 16-byte aligned).
void matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, const MatvecOut& Y, cudaStream_t stream);

// Fused SwiGLU pair: W's rows are interleaved (2i = gate_i, 2i+1 = up_i);
// Y[t, i] = silu(bf16(g_i))·bf16(u_i) for i < W.out/2, bf16.
void matvec_swiglu(const DevLinear& W, const bf16* X, int64_t ldx, int n, bf16* Y, int64_t ldy,
                   cudaStream_t stream);

}  // namespace tansy::cuda
