// Router: one block per token. k rounds of a block-wide argmax pick the experts; k and E are
// small (8 of 256), so this is a few microseconds and keeps the ids on the device.
#include <cfloat>

#include "cuda/moe.cuh"

namespace tansy::cuda {
namespace {

constexpr int kThreads = 256;

struct ArgMax {
  float v;
  int i;
};

__device__ __forceinline__ ArgMax better(ArgMax a, ArgMax b) {
  return (b.v > a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}

__device__ ArgMax block_argmax(ArgMax m, ArgMax* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ArgMax other{__shfl_xor_sync(0xffffffffu, m.v, o), __shfl_xor_sync(0xffffffffu, m.i, o)};
    m = better(m, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) red[warp] = m;
  __syncthreads();
  ArgMax r = red[0];
  for (int w = 1; w < kThreads / 32; ++w) r = better(r, red[w]);
  return r;
}

__device__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) r += red[w];
  return r;
}

__global__ void __launch_bounds__(kThreads) route_kernel(const float* __restrict__ logits, int64_t ld, int E, int k,
                                                         int* __restrict__ idx, float* __restrict__ wout) {
  __shared__ float p[kRouteMaxExperts];
  __shared__ ArgMax red[kThreads / 32];
  __shared__ float fred[kThreads / 32];
  const int t = blockIdx.x;
  const float* l = logits + int64_t(t) * ld;
  ArgMax m{-FLT_MAX, 0x7fffffff};
  for (int e = threadIdx.x; e < E; e += kThreads) {
    p[e] = l[e];
    m = better(m, ArgMax{l[e], e});
  }
  const float mx = block_argmax(m, red).v;
  float s = 0.f;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    p[e] = expf(p[e] - mx);
    s += p[e];
  }
  const float inv = 1.f / block_sum(s, fred);
  // Top-k on the probabilities (same order as on the logits; exp is monotone, ties stay ties).
  float chosen_sum = 0.f, my_w = 0.f;
  int my_i = 0;
  for (int j = 0; j < k; ++j) {
    ArgMax c{-FLT_MAX, 0x7fffffff};
    for (int e = threadIdx.x; e < E; e += kThreads) c = better(c, ArgMax{p[e], e});
    const ArgMax best = block_argmax(c, red);
    const float pw = best.v * inv;
    chosen_sum += pw;
    if (threadIdx.x == j) {
      my_w = pw;
      my_i = best.i;
    }
    __syncthreads();
    if (threadIdx.x == 0) p[best.i] = -FLT_MAX;
    __syncthreads();
  }
  if (threadIdx.x < k) {
    idx[t * k + threadIdx.x] = my_i;
    wout[t * k + threadIdx.x] = my_w / chosen_sum;
  }
}

}  // namespace

void route_topk(const float* logits, int64_t ld, int n, int E, int k, int* idx, float* w, cudaStream_t stream) {
  TANSY_CHECK(E >= 1 && E <= kRouteMaxExperts, "route_topk: {} experts outside 1..{}", E, kRouteMaxExperts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && k <= E, "route_topk: top-{} of {} experts unsupported", k, E);
  TANSY_CHECK(n >= 1 && ld >= E && logits && idx && w, "route_topk: bad arguments (n {}, ld {})", n, ld);
  route_kernel<<<n, kThreads, 0, stream>>>(logits, ld, E, k, idx, w);
  CUDA_LAUNCH_CHECK();
}

}  // namespace tansy::cuda
