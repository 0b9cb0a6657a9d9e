// Prefill GEMMs on tensor cores: Y[n, out] = X[n, in] · Wᵀ with the affine dequant fused into the
// B-tile load (MODEL.md §8.3), and the grouped (per-expert) variant for MoE prefill (§6).
//
// Weights stay in the checkpoint's own packed layout (no repack needed, no dequantized copies):
//   affine 4/8-bit: q u32 [out, in*bits/32] (low bits = low column), scales/biases bf16 [out, in/64];
//   bf16 dense:     w [out, in].
// Expert-stacked weights (grouped GEMM) are the same arrays with a leading [n_experts] dimension,
// contiguous, exactly as MLX stores switch_mlp.* ([256, 512, 256] u32 etc.).
//
// Numerics: bf16 operands, f32 accumulation (mma.sync m16n8k16), dequant w = s·q + b in f32 then
// rounded to bf16 (the same rounding a bf16 matmul on dequantized weights would see).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "model/weights.h"

namespace tansy::cuda {

// Device view of one weight matrix [out, in] (or n_experts stacked ones), as in tansy::Linear.
struct GemmWeight {
  WFormat fmt = WFormat::kAffine4;  // kAffine4, kAffine8 or kBF16 (kF32 is rejected)
  int out = 0, in = 0;               // per expert for stacked weights
  const uint32_t* q = nullptr;              // affine codes
  const __nv_bfloat16* scales = nullptr;    // affine
  const __nv_bfloat16* biases = nullptr;    // affine
  const __nv_bfloat16* w = nullptr;         // bf16 dense
};

// Limits the launchers enforce.
constexpr int kGemmGroup = 64;         // affine group size (the only one MLX uses here)
constexpr int kGemmInAlign = 64;       // `in` must be a multiple: one k-tile = one quant group
constexpr int kGroupedBM = 64;         // rows per tile in the grouped GEMM (moe_route_sort's tile schedule)
constexpr int kMaxExperts = 1024;      // moe_route_sort keeps per-expert counters in shared memory

enum class GemmEpilogue {
  kStore,       // Y = X·Wᵀ
  kAccumulate,  // Y += X·Wᵀ (residual add; the add happens in f32, then Y's type)
  // W's rows are interleaved gate/up pairs (row 2i = gate_i, row 2i+1 = up_i); writes
  // Y[:, i] = silu(g_i)·u_i, so Y has out/2 columns. Interleave rows at load (packed rows move as is).
  kSwiGlu,
};

enum class GemmOutType { kBF16, kF32 };

struct GemmOutput {
  void* ptr = nullptr;         // first element of row 0 (a column offset is just a pointer offset)
  GemmOutType type = GemmOutType::kBF16;
  int64_t ld = 0;              // elements between rows; must be even (paired stores)
  GemmEpilogue epilogue = GemmEpilogue::kStore;
};

// Y[r, :] for r < n. X: bf16 [n, in] rows `ldx` elements apart (ldx % 8 == 0, 16-byte aligned).
// Any n >= 1 works (tiles are masked); small n is correct but runs at tile granularity.
void gemm(const GemmWeight& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
          cudaStream_t stream);

// ---- MoE prefill ----
// Routing sort: top-k expert ids [n, k] (int32, each in [0, n_experts)) -> tokens grouped by
// expert. A "slot" is t*k + j (token t's j-th choice); a "sorted row" is its position in the
// expert-grouped order. Order within one expert is unspecified (each row's result is independent
// of its position, so outputs are deterministic anyway). One block, one launch; graph-capturable.
struct MoeRouting {
  int* expert_offsets = nullptr;  // [n_experts + 1]: expert e owns sorted rows [off[e], off[e+1])
  int* tile_offsets = nullptr;    // [n_experts + 1]: prefix sum of ceil(count_e / kGroupedBM)
  int* sorted_slot = nullptr;     // [n*k]: slot held by each sorted row
  int* slot_row = nullptr;        // [n*k]: sorted row of each slot (inverse of sorted_slot)
};
void moe_route_sort(const int* topk_ids, int n, int k, int n_experts, const MoeRouting& r,
                    cudaStream_t stream);

// Grouped GEMM over the n*k sorted rows: Y[r, :] = X_row(r) · W_eᵀ for r in expert e's range,
// W = n_experts stacked matrices. X_row(r) = X[sorted_slot[r] / k] when `gather` (the first expert
// projection reads the token rows in place, no gather copy), else X[r] (already sorted, e.g. the
// SwiGLU activations feeding down_proj). Y has n*k rows in sorted order.
void gemm_grouped(const GemmWeight& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather,
                  int n, int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream);

// Weighted combine (no atomics, deterministic):
// out[t, :] = residual[t, :] + Σ_j weight[t, j]·Yd[slot_row[t*k+j], :] + sigmoid(sh_logit[t])·shared[t, :]
// Yd bf16 [n*k, d] sorted rows (down_proj output), weight f32 [n, k]. residual, shared/sh_logit may
// be null (then those terms are 0). out bf16 [n, d] may alias residual. d % 8 == 0.
void moe_combine(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k, int d,
                 const __nv_bfloat16* residual, const __nv_bfloat16* shared, const float* sh_logit,
                 __nv_bfloat16* out, cudaStream_t stream);

// MoE prefill with these pieces (what the backend does per layer; xn = normed hidden [n, H]):
//   router logits (gemm, f32) -> top-k (lead's kernel) -> moe_route_sort
//   -> gemm_grouped(gate|up interleaved [E, 2I, H], gather=true, kSwiGlu) -> act [n*k, I]
//   -> gemm_grouped(down [E, H, I], gather=false) -> Yd [n*k, H] bf16
//   -> shared expert: gemm(gate|up interleaved, kSwiGlu) -> gemm(down) ; gemm(shared_expert_gate, f32)
//   -> moe_combine(..., residual = h, out = h).

}  // namespace tansy::cuda
