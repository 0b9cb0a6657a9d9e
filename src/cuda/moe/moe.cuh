// The sparse MoE block on the device (docs/MODEL.md §6): routing, the routed experts for decode
// and the pieces of MoE prefill. CPU references (src/cpu/moe.cpp, cpu/forward.cpp): cpu::route_topk,
// cpu::matmul per expert + cpu::swiglu, and CpuModel::moe's weighted combine. GPU tests:
// tests/gpu/test_moe.cu.
//
//   file                     what
//   moe/route.cu             route_topk: one warp per token (route_device.cuh's route_warp)
//   matvec/matvec.cu         matvec_norm_route (router product + norm + top-k in the last block) and
//                            matvec_swiglu_experts (gate|up of the chosen experts): epilogues and a
//                            mode of the GEMV mainloop, defined there
//   moe/experts_decode.cu    moe_down_combine / moe_down_residual: down projections + combine
//   moe/route_sort.cu        moe_route_sort: the grouped GEMM's tile schedule (prefill); expert_groups:
//                            several decode tokens' slots by expert (matvec_swiglu_experts_grouped)
//   gemm/gemm.cu             gemm_grouped: the expert GEMMs of prefill (gemm/gemm.cuh)
//   moe/combine.cu           moe_combine: the weighted combine of prefill
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "cuda/gemm/gemm.cuh"
#include "cuda/matvec/matvec.cuh"

namespace tansy::cuda {

constexpr int kRouteMaxExperts = 1024;  // per-expert arrays in shared memory / registers
constexpr int kRouteMaxTopK = 16;
static_assert(dims::kExperts <= kRouteMaxExperts && dims::kExpertsPerToken <= kRouteMaxTopK);
static_assert(kRouteMaxExperts <= kGroupedMaxExperts, "every routable expert fits the grouped GEMM schedule");

// ---- routing ----

// For each token t < n: softmax (f32) over logits[t*ld .. t*ld+E), top-k (ties to the lower
// index), renormalised. idx int32 [n, k], w f32 [n, k], in descending weight order.
void route_topk(const float* logits, int64_t ld, int n, int E, int k, int* idx, float* w,
                cudaStream_t stream);

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

// Router logits (f32, W.out of them) + the routing epilogue.
void matvec_norm_route(const DevLinear& W, const NormIn& x, float* logits, const RouteEpilogue& route,
                       cudaStream_t stream, const DecodeRows* rows = nullptr);

// ---- decode: the routed experts ----

// Routed experts' gate|up for decode: W stacks n_experts interleaved gate|up matrices of
// rows_per_expert = 2*I rows. For each slot s = t*k + j: act[s, i] = swiglu of expert idx[s]
// applied to X[t]. act bf16 [n*k, I].
void matvec_swiglu_experts(const DevLinear& W, int n_experts, const int* idx, int n, int k, const bf16* X,
                           int64_t ldx, bf16* act, cudaStream_t stream);

// ---- decode, several tokens: gate|up grouped by expert (the batched decode step, bf16/batch.cu) ----

// The slots s = t*k + j of n tokens grouped by expert: each expert's slots in slot order, cut into
// items of at most tc16's 8 (the tensor-core tile's columns), so that an expert's tiles are read
// and dequantized once for up to 8 of its tokens instead of once a slot.
constexpr int kGroupCols = 8;
struct ExpertGroups {
  int* sorted = nullptr;   // [n*k] slots, expert by expert, in slot order within one
  int4* items = nullptr;   // [expert_group_items_max] {expert, first index into sorted, slots (1..8), 0}
  int* n_items = nullptr;  // [1] items written
};
// Items at most for `slots` slots over n_experts: each has a slot, and an expert's slots fill all
// its items but the last.
constexpr int expert_group_items_max(int slots, int n_experts) {
  const int used = n_experts < slots ? n_experts : slots;
  const int bound = (slots + kGroupCols - 1) / kGroupCols + used;
  return bound < slots ? bound : slots;
}
// One block: counts, a scan, then a stable scatter of the ids idx [n, k] (each in [0, n_experts)).
void expert_groups(const int* idx, int n, int k, int n_experts, const ExpertGroups& g, cudaStream_t stream);

// Whether matvec_swiglu_experts_grouped runs W (its experts have tensor-core tiles).
bool experts_grouped_ok(const DevLinear& W, int n_experts);
// matvec_swiglu_experts's act, every slot the same bits (tc16's tiles: a slot's value is its own
// mma column's), computed item by item: expert_groups, then one grid row an item. For W with
// tensor-core tiles (4-bit, 2048 columns, 2I a multiple of 16); n*k <= kMaxBatch * kRouteMaxTopK.
void matvec_swiglu_experts_grouped(const DevLinear& W, int n_experts, const int* idx, int n, int k,
                                   const bf16* X, int64_t ldx, bf16* act, const ExpertGroups& g,
                                   cudaStream_t stream);

// Routed experts' down projections fused with the weighted combine:
// out[t, r] = Σ_j wts[t, j]·(Wd_{idx[t,j]}[r]·act[t*k+j]) + sigmoid(sh_logit[t*sh_ld])·shared[t, r]
// Wd stacks n_experts matrices [H, I]; shared bf16 [n, H] (the shared expert's output, may alias out);
// out bf16 [n, H].
void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                      int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                      cudaStream_t stream);
// The same for one token, added to the residual stream instead (ResidualOut; `shared` as above);
// with `rows`, for each of rows->n tokens (idx, wts, act as for n tokens; h and ss rows->h and
// rows->ss apart).
void moe_down_residual(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                       int k, const bf16* shared, const float* sh_logit, const ResidualOut& out,
                       cudaStream_t stream, const DecodeRows* rows = nullptr);

// ---- prefill ----

// Routing sort: top-k expert ids [n, k] (int32, each in [0, n_experts)) -> tokens grouped by
// expert. A "slot" is t*k + j (token t's j-th choice); a "sorted row" is its position in the
// expert-grouped order. Order within one expert is unspecified (each row's result is independent
// of its position, so outputs are deterministic anyway). Two launches over the ids (count, then
// scatter), counting in r.work (zero before, left zero); graph-capturable. One sort at a time per
// r.work. r.tile_offsets counts tiles of r.tile_rows rows (kGroupedBM or kGroupedSmallBM).
void moe_route_sort(const int* topk_ids, int n, int k, int n_experts, const MoeRouting& r,
                    cudaStream_t stream);

// Weighted combine (no atomics, deterministic):
// out[t, :] = residual[t, :] + Σ_j weight[t, j]·Yd[slot_row[t*k+j], :] + sigmoid(sh_logit[t*sh_ld])·shared[t,
// :] Yd bf16 [n*k, d] sorted rows (down_proj output), weight f32 [n, k]. residual, shared/sh_logit may be
// null (then those terms are 0). out bf16 [n, d] may alias residual. d % 8 == 0.
void moe_combine(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k, int d,
                 const __nv_bfloat16* residual, const __nv_bfloat16* shared, const float* sh_logit,
                 int64_t sh_ld, __nv_bfloat16* out, cudaStream_t stream);

// moe_combine (residual null) fused with the add_rmsnorm after it, bit for bit their results:
// r = Σ_j weight[t, j]·Yd[slot_row[t*k+j], :] + sigmoid(sh_logit[t*sh_ld])·shared[t, :] rounded to
// bf16 (never stored), h[t, :] += r (f32), xn[t, :] = bf16(h·rsqrt(mean(h²) + eps)·norm_w).
// d % 8 == 0, d <= kCombineNormMaxDim (the row stays in one block's shared memory).
constexpr int kCombineNormMaxDim = 2048;
void moe_combine_add_rmsnorm(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k,
                             int d, const __nv_bfloat16* shared, const float* sh_logit, int64_t sh_ld,
                             float* h, const float* norm_w, float eps, __nv_bfloat16* xn,
                             cudaStream_t stream);

// MoE prefill with these pieces (what the backend does per layer; xn = normed hidden [n, H]):
//   router logits (gemm, f32) -> route_topk -> moe_route_sort
//   -> gemm_grouped(gate|up interleaved [E, 2I, H], gather=true, kSwiGlu) -> act [n*k, I]
//   -> gemm_grouped(down [E, H, I], gather=false) -> Yd [n*k, H] bf16
//   -> shared expert: gemm(gate|up interleaved, kSwiGlu) -> gemm(down) ; gemm(shared_expert_gate, f32)
//   -> moe_combine(..., residual null, out = r) -> add_rmsnorm (h += r, the next norm), or the two as
//      one launch: moe_combine_add_rmsnorm.

}  // namespace tansy::cuda
