// The end of a decode step in one launch: the final RMSNorm of the residual row, the lm_head
// product over the whole vocabulary, the greedy argmax and the position advance.
// CPU references: cpu::rmsnorm (+ bf16 rounding of x), cpu::matmul, tansy::argmax.
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/matvec.cuh"

namespace tansy::cuda {

struct LmHeadArgs {
  DevLinear W;  // [vocab, hidden], MLX affine 4-bit (the only format this kernel reads)
  NormIn x;     // the residual row, its Σh² partials and the final norm's weight; xn_out optional
  float* logits = nullptr;                // [W.out] f32
  int limit = 0;                          // the argmax covers ids [0, limit), 1 <= limit <= W.out
  int* token = nullptr;                   // the argmax (ties to the lower id; NaN never wins)
  int* pos = nullptr;                     // *pos += 1 once everything else is done (may be null)
  unsigned long long* scratch = nullptr;  // lm_head_scratch() entries
  unsigned* counter = nullptr;            // one u32, zero before the launch (left zero)
};

// Whether lm_head_argmax reads this weight: 4-bit, in a multiple of 256 and at most 2048.
bool lm_head_argmax_supports(const DevLinear& W);

// Scratch entries (one per block) lm_head_argmax needs.
int lm_head_scratch();

// x = bf16(rmsnorm(h)·w); logits[r] = Σ_i W[r, i]·x[i] for every row r; *token = argmax over
// [0, limit); *pos += 1. Weights stream through a multi-stage pipeline of tensor copies (TMA)
// into shared memory in a grid of one block per multiprocessor; the products run on tensor cores
// (mma.sync m16n8k16, the 4-bit codes widened to bf16 128+q exactly, f32 accumulation per quant
// group, then scale and bias in f32). Throws unless W is 4-bit with in % 256 == 0 and in <= 2048.
void lm_head_argmax(const LmHeadArgs& a, cudaStream_t stream);

}  // namespace tansy::cuda
