// Prefill GEMMs on tensor cores: Y[n, out] = X[n, in] · Wᵀ with the affine dequant fused into the
// B-tile load (docs/MODEL.md §8.3), and the grouped (per-expert) variant for MoE prefill (§6).
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

#include "cuda/matvec.cuh"  // DevLinear: the device view of a weight matrix, shared with decode

namespace tansy::cuda {

// Limits the launchers enforce.
constexpr int kGemmInAlign = kQuantGroup;  // `in` must be a multiple: one k-tile = one quant group
constexpr int kGroupedBM = 64;     // rows per tile in the grouped GEMM (moe_route_sort's tile schedule)
constexpr int kMaxExperts = 1024;  // moe_route_sort keeps per-expert counters in shared memory

enum class GemmEpilogue {
  kStore,       // Y = X·Wᵀ
  kAccumulate,  // Y += X·Wᵀ (residual add; the add happens in f32, then Y's type)
  // W's rows are interleaved gate/up pairs (row 2i = gate_i, row 2i+1 = up_i); writes
  // Y[:, i] = silu(g_i)·u_i, so Y has out/2 columns. Interleave rows at load (packed rows move as is).
  kSwiGlu,
};

enum class GemmOutType { kBF16, kF32 };

struct GemmOutput {
  void* ptr = nullptr;  // first element of row 0 (a column offset is just a pointer offset)
  GemmOutType type = GemmOutType::kBF16;
  int64_t ld = 0;  // elements between rows; must be even (paired stores)
  GemmEpilogue epilogue = GemmEpilogue::kStore;
};

// Y[r, :] for r < n. X: bf16 [n, in] rows `ldx` elements apart (ldx % 8 == 0, 16-byte aligned).
// Any n >= 1 works (tiles are masked); small n is correct but runs at tile granularity.
void gemm(const DevLinear& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
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
// W stacks n_experts matrices (W.out = n_experts * rows per expert, DevLinear's convention). X_row(r) =
// X[sorted_slot[r] / k] when `gather` (the first expert projection reads the token rows in place, no gather
// copy), else X[r] (already sorted, e.g. the SwiGLU activations feeding down_proj). Y has n*k rows in sorted
// order.
void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream);

// Weighted combine (no atomics, deterministic):
// out[t, :] = residual[t, :] + Σ_j weight[t, j]·Yd[slot_row[t*k+j], :] + sigmoid(sh_logit[t*sh_ld])·shared[t,
// :] Yd bf16 [n*k, d] sorted rows (down_proj output), weight f32 [n, k]. residual, shared/sh_logit may be
// null (then those terms are 0). out bf16 [n, d] may alias residual. d % 8 == 0.
void moe_combine(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k, int d,
                 const __nv_bfloat16* residual, const __nv_bfloat16* shared, const float* sh_logit,
                 int64_t sh_ld, __nv_bfloat16* out, cudaStream_t stream);

// MoE prefill with these pieces (what the backend does per layer; xn = normed hidden [n, H]):
//   router logits (gemm, f32) -> top-k (lead's kernel) -> moe_route_sort
//   -> gemm_grouped(gate|up interleaved [E, 2I, H], gather=true, kSwiGlu) -> act [n*k, I]
//   -> gemm_grouped(down [E, H, I], gather=false) -> Yd [n*k, H] bf16
//   -> shared expert: gemm(gate|up interleaved, kSwiGlu) -> gemm(down) ; gemm(shared_expert_gate, f32)
//   -> moe_combine(..., residual = h, out = h).

}  // namespace tansy::cuda

// ---- Tensor-core primitives shared by the prefill kernels (gemm, attention_prefill) ----
// mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async. Fragment layouts follow the PTX ISA
// ("Matrix fragments for mma.m16n8k16"): lane = 4*g + c; A rows g/g+8, cols 2c/2c+1 (+8);
// B (k x n) col n = g, rows 2c/2c+1 (+8); C rows g/g+8, cols 2c/2c+1.
namespace tansy::cuda::tc {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; when !valid the destination is zero-filled and `src` is not read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += a·b
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of (row, col) in a shared tile whose rows hold `kChunks` 16-byte chunks (8 bf16
// each). The chunk index is XORed with row%8 so the 8 row addresses of one ldmatrix matrix fall
// in 8 different bank groups.
template <int kChunks>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kChunks >= 8 && kChunks % 8 == 0);
  return row * kChunks * 8 + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

}  // namespace tansy::cuda::tc
