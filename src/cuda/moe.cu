// Router: one warp per token, the E logits in registers (PER per lane). k rounds of a warp-wide
// argmax (shuffles only, no block barriers) pick the experts; the ids stay on the device.
#include <cfloat>

#include "cuda/moe.cuh"

#include "cuda/pdl.cuh"

namespace tansy::cuda {
namespace {

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ __forceinline__ ArgMax warp_argmax(ArgMax m) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = better(m, ArgMax{__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)});
  return m;
}

// Lane l holds experts l, l+32, ... (ascending in j, so a strict > keeps the lower index on ties).
template <int PER>
__global__ void __launch_bounds__(32) route_kernel(const float* __restrict__ logits, int64_t ld, int E, int k,
                                                   int* __restrict__ idx, float* __restrict__ wout) {
  pdl_wait();
  pdl_launch_dependents();
  const int t = blockIdx.x, lane = threadIdx.x;
  const float* l = logits + int64_t(t) * ld;
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
  for (int r = 0; r < k; ++r) {
    ArgMax c{-FLT_MAX, 0x7fffffff};
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if (p[j] > c.v) c = ArgMax{p[j], lane + 32 * j};
    const ArgMax best = warp_argmax(c);
    const float pw = best.v * inv;
    chosen_sum += pw;
    if (lane == r) {
      my_w = pw;
      my_i = best.i;
    }
    if (lane == best.i % 32) {
#pragma unroll
      for (int j = 0; j < PER; ++j)
        if (j == best.i / 32) p[j] = -FLT_MAX;
    }
  }
  if (lane < k) {
    idx[t * k + lane] = my_i;
    wout[t * k + lane] = my_w / chosen_sum;
  }
}

}  // namespace

void route_topk(const float* logits, int64_t ld, int n, int E, int k, int* idx, float* w, cudaStream_t stream) {
  TANSY_CHECK(E >= 1 && E <= kRouteMaxExperts, "route_topk: {} experts outside 1..{}", E, kRouteMaxExperts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && k <= E, "route_topk: top-{} of {} experts unsupported", k, E);
  TANSY_CHECK(n >= 1 && ld >= E && logits && idx && w, "route_topk: bad arguments (n {}, ld {})", n, ld);
  static_assert(kRouteMaxExperts <= 32 * 32 && kRouteMaxTopK <= 32);
  if (E <= 8 * 32) pdl_launch(route_kernel<8>, dim3(n), dim3(32), 0, stream, logits, ld, E, k, idx, w);
  else pdl_launch(route_kernel<32>, dim3(n), dim3(32), 0, stream, logits, ld, E, k, idx, w);
}

}  // namespace tansy::cuda
