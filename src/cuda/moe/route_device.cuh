// The router's top-k as a device function of one warp (docs/MODEL.md §6 steps 1-2), shared by
// route_topk and the router matvec's epilogue. CPU reference: cpu::route_topk.
#pragma once
#include <cfloat>

#include "cuda/common/cuda_util.h"

namespace tansy::cuda {

// A probability's rank key for the warp's unsigned max (redux.sync): a non-negative float's bits
// order as it does, and the top bit puts every probability (0 included) above a removed or
// absent expert (-FLT_MAX), which gets 0.
__device__ __forceinline__ unsigned route_key(float p) {
  return p >= 0.f ? (__float_as_uint(p) | 0x80000000u) : 0u;
}

// Softmax (f32) over l[0, E), top-k (ties to the lower index), renormalised: idx[j], w[j] for
// j < k in descending weight order. Called by all 32 lanes of a warp; lane l holds experts
// l, l+32, ... (ascending in j, so a strict > keeps the lower index on ties). E <= 32*PER.
template <int PER>
__device__ __forceinline__ void route_warp(const float* l, int E, int k, int* idx, float* wout) {
  const int lane = threadIdx.x % 32;
  float p[PER];
  float mx = -FLT_MAX;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    p[j] = e < E ? l[e] : -FLT_MAX;
    mx = fmaxf(mx, p[j]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    if (lane + 32 * j < E) {
      p[j] = expf(p[j] - mx);
      s += p[j];
    }  // else p[j] stays -FLT_MAX, below every probability
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float inv = 1.f / s;
  // Top-k on the probabilities (same order as on the logits; exp is monotone, ties stay ties).
  float chosen_sum = 0.f, my_w = 0.f;
  int my_i = 0;
  // Each round: the lane's best (the lower index on ties), the warp's largest key, then the lowest
  // index holding it; two warp reductions, no shuffles. Rolled: each round needs the last one's removal.
#pragma unroll 1
  for (int r = 0; r < k; ++r) {
    float cv = -FLT_MAX;
    int ci = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (p[j] > cv) cv = p[j], ci = lane + 32 * j;
    const unsigned key = route_key(cv), top = __reduce_max_sync(0xffffffffu, key);
    const int wi = int(__reduce_min_sync(0xffffffffu, key == top ? unsigned(ci) : 0xffffffffu));
    const float pw = __uint_as_float(top & 0x7fffffffu) * inv;
    chosen_sum += pw;
    if (lane == r) {
      my_w = pw;
      my_i = wi;
    }
    if (lane == wi % 32) {
#pragma unroll
      for (int j = 0; j < PER; ++j)
        if (j == wi / 32) p[j] = -FLT_MAX;
    }
  }
  if (lane < k) {
    idx[lane] = my_i;
    wout[lane] = my_w / chosen_sum;
  }
}

}  // namespace tansy::cuda
