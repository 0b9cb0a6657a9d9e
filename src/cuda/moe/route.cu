// Router: one warp per token, the E logits in registers (PER per lane). k rounds of a warp-wide
// argmax (warp reductions only, no block barriers) pick the experts; the ids stay on the device. Eight
// tokens a block. 11 µs a layer at 4,096 tokens with one-warp blocks and with eight-warp ones alike
// (H200, docs/PERFORMANCE.md): the time is the k dependent argmax rounds of each warp.
#include "cuda/common/launch.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/moe/route_device.cuh"

namespace tansy::cuda {
namespace {

constexpr int kTokensPerBlock = 8;  // one warp each

// Lane l holds experts l, l+32, ... (route_warp).
template <int PER>
__global__ void __launch_bounds__(32 * kTokensPerBlock)
    route_kernel(const float* __restrict__ logits, int64_t ld, int n, int E, int k, int* __restrict__ idx,
                 float* __restrict__ wout) {
  pdl_wait();
  pdl_launch_dependents();
  const int t = blockIdx.x * kTokensPerBlock + threadIdx.x / 32;
  if (t >= n) return;
  route_warp<PER>(logits + int64_t(t) * ld, E, k, idx + t * k, wout + t * k);
}

}  // namespace

void route_topk(const float* logits, int64_t ld, int n, int E, int k, int* idx, float* w,
                cudaStream_t stream) {
  TANSY_CHECK(E >= 1 && E <= kRouteMaxExperts, "route_topk: {} experts outside 1..{}", E, kRouteMaxExperts);
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && k <= E, "route_topk: top-{} of {} experts unsupported", k, E);
  TANSY_CHECK(n >= 1 && ld >= E && logits && idx && w, "route_topk: bad arguments (n {}, ld {})", n, ld);
  static_assert(kRouteMaxExperts <= 32 * 32 && kRouteMaxTopK <= 32);
  const dim3 grid((n + kTokensPerBlock - 1) / kTokensPerBlock), block(32 * kTokensPerBlock);
  if (E <= 8 * 32)
    pdl_launch(route_kernel<8>, grid, block, 0, stream, logits, ld, n, E, k, idx, w);
  else
    pdl_launch(route_kernel<32>, grid, block, 0, stream, logits, ld, n, E, k, idx, w);
}

}  // namespace tansy::cuda
