// The ends of the model (docs/MODEL.md §7): the embedding lookup with dequant, and the head: lm_head
// (a plain matvec, or fused with the final norm and the greedy argmax for decode), the argmax and
// the device-side position. CPU references: cpu::embed_row, cpu::rmsnorm, cpu::matmul,
// tansy::argmax. GPU tests: tests/gpu/test_head.cu.
//
//   file             what
//   head/embed.cu    embed, argmax, advance_pos
//   head/lm_head.cu  lm_head_argmax: final norm + lm_head + argmax + position in one launch
#pragma once
#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "cuda/matvec/matvec.cuh"

namespace tansy::cuda {

// h[t, :] = E[ids[t], :] (f32: the residual stream) for t < n; ids on the device. Ids outside [0, E.out) give
// zeros (the host validates ids before they reach the device; generated ids come from argmax). ss (decode, n
// == 1): the row's Σh² goes to ss[0], the first of the NormIn partials (the rest of that point's partials are
// never written, so they stay zero). Several tokens (a batched decode step): token t's at ss[t * ss_ld].
void embed(const DevLinear& E, const int* ids, int n, float* h, cudaStream_t stream, float* ss = nullptr,
           int64_t ss_ld = 0);

// Argmax key: a larger key is a larger value, then a lower index; NaN maps below -inf.
__device__ __forceinline__ unsigned long long argmax_key(float v, int i) {
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  if (v != v) u = 0;
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - uint32_t(i));
}
// The index a key was made from.
__device__ __forceinline__ int argmax_index(unsigned long long key) {
  return int(0xffffffffu - uint32_t(key & 0xffffffffu));
}

constexpr int kArgmaxBlocks = 264;  // 2 per SM on an H200

// Index of the largest of logits[0..n) (ties to the lower index; NaN never wins).
// scratch: kArgmaxBlocks u64 on the device. The result goes to *dst, and when ring is not null
// also to ring[*counter], after which *counter is incremented (decode steps in a graph).
void argmax(const float* logits, int n, unsigned long long* scratch, int* dst, int* ring, int* counter,
            cudaStream_t stream);

// *pos += n on the device (the sequence position lives there so graphs can replay).
void advance_pos(int* pos, int n, cudaStream_t stream);

// ---- decode: the fused head (lm_head.cu) ----

// The end of a decode step in one launch: the final RMSNorm of the residual row, the lm_head
// product over the whole vocabulary, the greedy argmax and the position advance.
// CPU references: cpu::rmsnorm (+ bf16 rounding of x), cpu::matmul, tansy::argmax.
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

// lm_head_argmax for up to kLmHeadRows token rows of a batched decode step at once, the weights
// read once for all of them: the rows are the columns of the mma's B operand (each column's
// products are computed apart from the others'), every other value as lm_head_argmax computes it
// for one row, so row t's logits and token are bit for bit what lm_head_argmax gives it alone.
// Row t: a's pointers plus t times the strides (logits t * W.out, token t), its own position and
// argmax range; scratch: lm_head_scratch() * kLmHeadRows entries.
constexpr int kLmHeadRows = 8;
struct LmHeadRows {
  int n = 1;
  int64_t h = 0, ss = 0, xn = 0;  // NormIn strides
  int* pos[kLmHeadRows] = {};
  int limit[kLmHeadRows] = {};
};
void lm_head_argmax_rows(const LmHeadArgs& a, const LmHeadRows& rows, cudaStream_t stream);

}  // namespace tansy::cuda
