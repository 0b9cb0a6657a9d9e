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
// CPU reference: cpu::matmul. GPU tests: tests/gpu/test_gemm.cu (the grouped GEMM: tests/gpu/test_moe.cu
// and Gemm.GroupedWgmma).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/matvec/matvec.cuh"  // DevLinear: the device view of a weight matrix, shared with decode

namespace tansy::cuda {

// Limits the launchers enforce.
constexpr int kGemmInAlign = kQuantGroup;  // `in` must be a multiple: one k-tile = one quant group
constexpr int kGroupedBM = 64;  // rows per tile in the grouped GEMM (moe_route_sort's tile schedule)
// The short tile: with up to 16 rows an expert on average (prompts of up to 512 tokens over 256
// experts, top-8) a 64-row tile is mostly empty rows, whose accumulators and shared memory still
// size the block. 16-row tiles make small blocks, five a multiprocessor (gemm.cu): about +10% prefill
// at 256 and 384 tokens on an H100 (docs/PERFORMANCE.md, 2026-12-07). 4-bit experts with staged
// scales on the mma.sync kernel only (grouped_tile_rows).
constexpr int kGroupedSmallBM = 16;
constexpr int kGroupedMaxExperts = 1024;  // experts a grouped GEMM schedule can hold

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

// Which kernel runs the 4-bit and bf16 products (8-bit ones always take mma.sync; bf16 weights take
// gemm_bf16_wgmma.cu's kernel unless kMma is forced). kAuto, the product's
// choice: the Hopper warpgroup kernel (gemm_wgmma.cu) for the dense products, where it measured
// 1.6x the mma.sync kernel (Timing.Gemm, H200, 2026-12-01: in_proj 0.456 vs 0.782 ms at 4,096
// tokens), and for the grouped expert products the kernels grouped_auto names (gemm.cu). kMma /
// kWgmma force one kernel for both; kWgmmaGrouped runs the grouped products on the persistent
// warpgroup kernel with per-expert tiles (gemm_grouped_wgmma.cu) and the dense ones as kAuto does.
// The tests and Timing.Gemm use them to check and time each.
enum class GemmKernel { kAuto, kMma, kWgmma, kWgmmaGrouped };
void gemm_set_kernel(GemmKernel k);
GemmKernel gemm_kernel();

// Y[r, :] for r < n. X: bf16 [n, in] rows `ldx` elements apart (ldx % 8 == 0, 16-byte aligned).
// Any n >= 1 works (tiles are masked); small n is correct but runs at tile granularity.
void gemm(const DevLinear& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
          cudaStream_t stream);

// ---- grouped (per-expert) GEMM, for MoE prefill ----
// The tile schedule moe_route_sort (moe/moe.cuh) builds from the top-k choices: tokens grouped by
// expert. A "slot" is t*k + j (token t's j-th choice); a "sorted row" is its position in the
// expert-grouped order.
struct MoeRouting {
  int* expert_offsets = nullptr;  // [n_experts + 1]: expert e owns sorted rows [off[e], off[e+1])
  int* tile_offsets = nullptr;    // [n_experts + 1]: prefix sum of ceil(count_e / tile_rows)
  int* sorted_slot = nullptr;     // [n*k]: slot held by each sorted row
  int* slot_row = nullptr;        // [n*k]: sorted row of each slot (inverse of sorted_slot)
  int* work = nullptr;            // [2*n_experts + 1]: moe_route_sort's counters; zero before the
                                  // first sort, and each sort leaves it zero
  int tile_rows = kGroupedBM;     // rows a tile: kGroupedBM, or kGroupedSmallBM where grouped_tile_rows
                                  // says so; the sort and both grouped products read the same value
};

// The tile rows (MoeRouting::tile_rows) for a MoE block's two grouped products over `rows` routed
// rows: kGroupedSmallBM where both expert matrices are 4-bit with whole runs of staged scales, the
// mma.sync kernel runs both (the current kernel choice) and there are at most kGroupedSmallBM rows an
// expert on average; else kGroupedBM.
int grouped_tile_rows(const DevLinear& gate_up, const DevLinear& down, long rows, int n_experts);

// Grouped GEMM over the n*k sorted rows: Y[r, :] = X_row(r) · W_eᵀ for r in expert e's range,
// W stacks n_experts matrices (W.out = n_experts * rows per expert, DevLinear's convention). X_row(r) =
// X[sorted_slot[r] / k] when `gather` (the first expert projection reads the token rows in place, no gather
// copy), else X[r] (already sorted, e.g. the SwiGLU activations feeding down_proj). Y has n*k rows in sorted
// order.
void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream);

}  // namespace tansy::cuda
