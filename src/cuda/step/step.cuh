// The persistent decode step: every product of a one-token decode step but the attention itself
// and the head (the GDN layers, the attention layers' in_proj and o_proj, every MoE block) in one
// launch per run of layers between two attention cores (11 launches for the real model's 40
// layers instead of 250), one block per multiprocessor for the whole run.
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
// (matvec.cu, gdn/decode.cu, moe/experts_decode.cu share the device functions; the 2048-column
// 4-bit products, in_proj of both mixers and experts gate|up, run on tensor cores through
// matvec/tc_tile.cuh in both), so the step's
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

// A launch's entries: 3 GDN layers between two attention layers, the o_proj + MoE of the
// attention layer before them and the in_proj of the one after (kernel parameter space).
constexpr int kStepMaxLayers = 5;

// What an entry of a launch computes.
enum StepMixer : int {
  kStepGdn = 0,      // a GDN layer: its mixer, then its MoE
  kStepAttnOut = 1,  // an attention layer after its attention core: o_proj + residual, then its MoE
  kStepAttnIn = 2,   // an attention layer's input norm + in_proj [q+gate | k | v] (the core runs next)
};

// The products, in the order a launch runs them.
enum StepKind : int {
  kGdnIn = 0,
  kGdnRec,
  kGdnOut,
  kRouter,
  kExpertsGu,
  kExpertsDown,
  kAttnOut,
  kAttnIn,
  kStepKinds
};

struct StepLayer {
  int mixer = kStepGdn;
  int index = 0;  // layer index in the model: norm points 2*index (mixer input), 2*index+1, 2*index+2
  // attention projections (kStepAttnIn: attn_in; kStepAttnOut: attn_o)
  DevLinear attn_in;  // [q_dim * 2 + 2 kv_dim, H] 4-bit
  DevLinear attn_o;   // [H, q_dim] 4-bit
  // GDN mixer
  DevLinear gdn_in;                // [conv_dim + value_dim + 2 n_v_heads, H] 4-bit: [qkv | z | a | b]
  DevLinear gdn_out;               // [H, value_dim] 4-bit
  const float* in_norm = nullptr;  // the GDN's or the attention's input norm
  const float* conv_w = nullptr;   // [conv_dim, kernel]
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
  bf16* proj = nullptr;              // [gdn_in.out | attn_in.out] in_proj outputs (z read by the gated norm)
  float* conv_out = nullptr;         // [conv_dim]
  float* beta = nullptr;             // [n_v_heads]
  float* g = nullptr;                // [n_v_heads]
  float* o = nullptr;                // [value_dim]
  unsigned* gdn_counters = nullptr;  // [n_v_heads], zero (left zero)
  bf16* mix = nullptr;               // [value_dim | q_dim] gated-norm / attention output, out_proj's input
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
  // Products in launch order (step_product).
  unsigned long long* prof = nullptr;
};

constexpr int kStepStamps = 5;
constexpr int kStepMaxProducts = kStepMaxLayers * 6;

// The products of an entry: 6 for a GDN layer, 4 after an attention core, 1 before it.
__host__ __device__ inline int step_n_products(const StepLayer& L) {
  return L.mixer == kStepGdn ? 6 : L.mixer == kStepAttnOut ? 4 : 1;
}
__host__ __device__ inline int step_product(const StepLayer& L, int j) {
  if (L.mixer == kStepGdn) return kGdnIn + j;
  if (L.mixer == kStepAttnIn) return kAttnIn;
  return j == 0 ? kAttnOut : kRouter + (j - 1);
}

// Whether the persistent step runs these shapes (else the reason, for the plan's log line).
bool step_supported(const StepLayer& L, const StepArgs& a, std::string* why);

// Enqueues the run of layers; a.barrier must be zero when it starts (the caller clears it).
void decode_step_layers(const StepArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
