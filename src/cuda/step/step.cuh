// The persistent decode step: the GDN layers and every MoE block of a one-token decode step in
// one launch per run of layers between two attention mixers (11 launches for the real model's
// 40 layers instead of 240), one block per multiprocessor for the whole run.
//
// Why: a decode step is ~250 dependent products of 5-14 MB, each paying a launch, a wait on its
// predecessor and a cold start of its weight stream (docs/PERFORMANCE.md). Here the weights of
// every product stream without a break through a ring of shared-memory slots: a producer warp
// walks the block's tiles of all products in order and copies each into a free slot (bulk
// copies), never waiting on activations (weights do not depend on them) except for the routed
// experts, whose rows it copies as soon as the router's logits are complete. Eight consumer warps
// take the tiles in the same order; between two products they wait on a grid-wide counter (one
// arrive and one spin per block), not on a kernel boundary.
//
// Each value is computed with the same arithmetic in the same order as the per-op kernels
// (matvec.cu, gdn/decode.cu, moe/experts_decode.cu share the device functions), so the step's
// results equal theirs bit for bit on a 132-multiprocessor card, where the residual products'
// partial sums fall into the same row blocks. GPU test: tests/gpu/test_step.cu (against the
// per-op kernels, whose CPU references are cpu::matmul, cpu::gdn_*, cpu::route_topk).
//
// Supported shapes (checked by step_supported; the model otherwise runs the per-op kernels):
// 4-bit GDN and expert matrices, an 8-bit router, the shared expert folded as expert E, hidden
// size <= 2048 with in_proj rows a multiple of 16, moe_intermediate 512.
#pragma once
#include "cuda/gdn/gdn.cuh"
#include "cuda/matvec/matvec.cuh"

namespace tansy::cuda {

constexpr int kStepMaxLayers = 4;  // layers per launch (kernel parameter space)

struct StepLayer {
  int gdn = 0;    // 1: the GDN mixer and the MoE; 0: the MoE only (an attention layer's mixer ran before)
  int index = 0;  // layer index in the model: norm points 2*index (mixer input), 2*index+1, 2*index+2
  // GDN mixer
  DevLinear gdn_in;   // [conv_dim + value_dim + 2 n_v_heads, H] 4-bit: [qkv | z | a | b]
  DevLinear gdn_out;  // [H, value_dim] 4-bit
  const float* in_norm = nullptr;
  const float* conv_w = nullptr;  // [conv_dim, kernel]
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  const float* gnorm = nullptr;  // [128]
  bf16* window = nullptr;        // [kernel-1, conv_dim], the sequence's
  float* state = nullptr;        // [n_v_heads, 128, 128], the sequence's
  // MoE
  const float* post_norm = nullptr;
  DevLinear router;  // [E + 1 (+ pad), H] 8-bit: the experts, then the shared expert's gate
  DevLinear gu;      // [(E+1) * 2I, H] 4-bit, gate/up rows interleaved, the shared expert last
  DevLinear down;    // [(E+1) * H, I] 4-bit
};

struct StepArgs {
  int n_layers = 0;
  StepLayer layer[kStepMaxLayers];
  int H = 0, conv_dim = 0, value_dim = 0, n_k_heads = 0, n_v_heads = 0, conv_kernel = 0;
  int E = 0, K = 0, I = 0;
  float eps = 0.f;
  // scratch of the plan (CudaModel)
  float* h = nullptr;                // [H] residual stream
  float* ss = nullptr;               // [2 * layers + 1, kNormParts] partial sums of h² per norm point
  bf16* proj = nullptr;              // [gdn_in.out] in_proj outputs (z read by the gated norm)
  float* conv_out = nullptr;         // [conv_dim]
  float* beta = nullptr;             // [n_v_heads]
  float* g = nullptr;                // [n_v_heads]
  float* o = nullptr;                // [value_dim]
  unsigned* gdn_counters = nullptr;  // [n_v_heads], zero (left zero)
  bf16* mix = nullptr;               // [value_dim] gated-norm output, out_proj's input
  float* logits = nullptr;           // [router.out]
  int* topk_idx = nullptr;           // [K + 1]
  float* topk_w = nullptr;           // [K + 1]
  bf16* xn = nullptr;                // [H] the MoE input
  bf16* act = nullptr;               // [(K + 1) * I]
  int* route_log = nullptr;          // [layers, K + 1] each layer's choices (may be null)
  unsigned* barrier = nullptr;       // grid barrier counter of this launch, zero before it
  // Profiling (null otherwise): %globaltimer (ns) at points of each product in each block,
  // [product p of this launch][kStepStamps][block]: 0 start (its inputs ready), 1 end, 2 x staged,
  // 3 first weight tile landed, 4 last tile landed (2-4: products with tiles, in blocks with tiles).
  // Products in order, 6 per GDN layer (in_proj, recurrence, out_proj, router, experts gate|up,
  // experts down), 3 per MoE-only layer.
  unsigned long long* prof = nullptr;
};

constexpr int kStepStamps = 5;
constexpr int kStepKinds = 6;  // the products above, in that order
constexpr int kStepMaxProducts = kStepMaxLayers * kStepKinds;

// Whether the persistent step runs these shapes (else the reason, for the plan's log line).
bool step_supported(const StepLayer& L, const StepArgs& a, std::string* why);

// Enqueues the run of layers; a.barrier must be zero when it starts (the caller clears it).
void decode_step_layers(const StepArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
