// The router's top-k as a device function of one warp (MODEL.md §6 steps 1-2), shared by
// route_topk and the router matvec's epilogue. CPU reference: cpu::route_topk.
#pragma once
#include <cfloat>

#include "cuda/cuda_util.h"

namespace tansy::cuda {

// Order-preserving map of a float to an unsigned key (larger float, larger key; -0 as +0, so
// that equal floats give equal keys). Key 0 lies below every float's key: "taken / absent".
__device__ __forceinline__ unsigned route_key(float x) {
  const unsigned u = __float_as_uint(x == 0.f ? 0.f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float route_unkey(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Softmax (f32) over l[0, E), top-k (ties to the lower index), renormalised: idx[j], w[j] for
// j < k in descending weight order. Called by all 32 lanes of a warp; lane l holds experts
// l, l+32, ... E <= 32*PER. The top-k is taken on p = exp(l - max) (the softmax's order, with its
// ties) by one redux.sync max per pick and a redux.sync min over the tied lanes' expert indices;
// the softmax's denominator cancels in the renormalisation: w_j = p_j / (sum of the chosen p).
template <int PER>
__device__ __forceinline__ void route_warp(const float* l, int E, int k, int* idx, float* wout) {
  const int lane = threadIdx.x % 32;
  float x[PER];
  unsigned key[PER], lmax = 0u;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int e = lane + 32 * j;
    x[j] = e < E ? l[e] : 0.f;
    if (e < E) lmax = max(lmax, route_key(x[j]));
  }
  const float mx = route_unkey(__reduce_max_sync(0xffffffffu, lmax));
#pragma unroll
  for (int j = 0; j < PER; ++j) key[j] = lane + 32 * j < E ? route_key(expf(x[j] - mx)) : 0u;
  float my_v = 0.f;
  int my_i = 0;
  for (int r = 0; r < k; ++r) {
    unsigned best = 0u;
    int bj = 0;
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (key[j] > best) {  // strict: the lowest j (expert index) of a lane's equal keys
        best = key[j];
        bj = j;
      }
    const unsigned m = __reduce_max_sync(0xffffffffu, best);
    const unsigned win = __reduce_min_sync(0xffffffffu, best == m ? unsigned(lane + 32 * bj) : 0xffffffffu);
    if (lane == int(win % 32)) {
#pragma unroll
      for (int j = 0; j < PER; ++j)
        if (j == int(win / 32)) key[j] = 0u;
    }
    if (lane == r) {
      my_v = route_unkey(m);
      my_i = int(win);
    }
  }
  const float p = lane < k ? my_v : 0.f;
  float s = p;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane < k) {
    idx[lane] = my_i;
    wout[lane] = p / s;
  }
}

}  // namespace tansy::cuda
