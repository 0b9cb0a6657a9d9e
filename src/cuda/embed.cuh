// Embedding lookup with dequant (docs/MODEL.md §7, §8.3) and the greedy argmax over logits.
// CPU references: cpu::embed_row, tansy::argmax.
#pragma once
#include <cstdint>

#include "cuda/cuda_util.h"
#include "cuda/matvec.cuh"

namespace tansy::cuda {

// h[t, :] = E[ids[t], :] (f32: the residual stream) for t < n; ids on the device. Ids outside [0, E.out) give
// zeros (the host validates ids before they reach the device; generated ids come from argmax). ss (decode, n
// == 1): the row's Σh² goes to ss[0], the first of the NormIn partials (the rest of that point's partials are
// never written, so they stay zero).
void embed(const DevLinear& E, const int* ids, int n, float* h, cudaStream_t stream, float* ss = nullptr);

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

}  // namespace tansy::cuda
