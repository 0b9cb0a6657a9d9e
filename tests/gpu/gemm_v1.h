// The previous prefill GEMM kernel, kept for Timing.Gemm's old-vs-new comparison only (gemm_v1.cu).
#pragma once
#include "cuda/gemm/gemm.cuh"

namespace tansy::cuda::gemm_v1 {

void gemm(const DevLinear& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
          cudaStream_t stream);
void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream);

}  // namespace tansy::cuda::gemm_v1
