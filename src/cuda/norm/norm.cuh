// RMSNorm variants (docs/MODEL.md §3) as separate launches (prefill and the GEMV prefill path;
// decode fuses its norms into the products, matvec/matvec.cuh NormIn). CPU references
// (src/cpu/norm.cpp): cpu::rmsnorm, cpu::rmsnorm_gated. GPU tests: tests/gpu/test_norm.cu.
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"

namespace tansy::cuda {

constexpr int kNormMaxDim = 16384;
constexpr int kNormThreads = 256;  // a row's block; element i of a row is thread i % 256's

// Residual add fused with the next RMSNorm, per token row t < n (rows `dim` apart); the residual
// stream h is f32: h += r (skipped when r is null), xn = bf16(h * rsqrt(mean(h^2) + eps) * w).
void add_rmsnorm(float* h, const bf16* r, const float* w, int n, int dim, float eps, bf16* xn,
                 cudaStream_t stream);

// Gated RMSNorm per value head (GDN output, §5.7): for t < n and head j < n_heads,
// y = w ⊙ (o·rsqrt(mean(o^2)+eps)) ⊙ silu(z) over head_dim values.
// o f32 (row stride ldo), z bf16 (row stride ldz), y bf16 (row stride ldy).
void gated_rmsnorm(const float* o, int64_t ldo, const bf16* z, int64_t ldz, const float* w, int n,
                   int n_heads, int head_dim, float eps, bf16* y, int64_t ldy, cudaStream_t stream);

}  // namespace tansy::cuda
