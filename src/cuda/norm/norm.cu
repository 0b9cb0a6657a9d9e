#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/norm/norm.cuh"

namespace tansy::cuda {
namespace {

constexpr int kThreads = kNormThreads;

// The row is held in registers (PER values per thread), so every load is issued before the
// first store and the block pays one memory latency instead of one per loop trip.
template <int PER>
__global__ void __launch_bounds__(kThreads)
    add_rmsnorm_kernel(float* h, const bf16* r, const float* __restrict__ w, int dim, float eps,
                       bf16* __restrict__ xn) {
  __shared__ float red[kThreads / 32];
  pdl_wait();
  pdl_launch_dependents();
  float* hr = h + int64_t(blockIdx.x) * dim;
  const bf16* rr = r ? r + int64_t(blockIdx.x) * dim : nullptr;
  float v[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = threadIdx.x + j * kThreads;
    float x = 0.f;
    if (i < dim) {
      x = hr[i];
      if (rr) x += __bfloat162float(rr[i]);
    }
    v[j] = x;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (rr && i < dim) hr[i] = v[j];
    ss += v[j] * v[j];
  }
  const float scale = rsqrtf(block_sum<kThreads>(ss, red) / float(dim) + eps);
  bf16* xr = xn + int64_t(blockIdx.x) * dim;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = threadIdx.x + j * kThreads;
    if (i < dim) xr[i] = __float2bfloat16(v[j] * scale * w[i]);
  }
}

// One block per (head, token); blockDim = head_dim.
__global__ void gated_rmsnorm_kernel(const float* __restrict__ o, int64_t ldo, const bf16* __restrict__ z,
                                     int64_t ldz, const float* __restrict__ w, int head_dim, float eps,
                                     bf16* __restrict__ y, int64_t ldy) {
  __shared__ float red[32];
  pdl_wait();
  pdl_launch_dependents();
  const int j = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
  const float v = o[int64_t(t) * ldo + int64_t(j) * head_dim + d];
  float s = v * v;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (d % 32 == 0) red[d / 32] = s;
  __syncthreads();
  float tot = 0.f;
  for (int i = 0; i < head_dim / 32; ++i) tot += red[i];
  const float zz = __bfloat162float(z[int64_t(t) * ldz + int64_t(j) * head_dim + d]);
  const float g = zz / (1.f + __expf(-zz));
  y[int64_t(t) * ldy + int64_t(j) * head_dim + d] =
      __float2bfloat16(w[d] * v * rsqrtf(tot / float(head_dim) + eps) * g);
}

}  // namespace

void add_rmsnorm(float* h, const bf16* r, const float* w, int n, int dim, float eps, bf16* xn,
                 cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && dim >= 1 && dim <= kNormMaxDim, "add_rmsnorm: n {} dim {} outside limits", n, dim);
  TANSY_CHECK(h && w && xn, "add_rmsnorm: missing buffers");
  // One register per value for the model's hidden sizes; wider rows take the 64-per-thread variant.
  constexpr int kSmall = 8;
  static_assert(kNormMaxDim <= 64 * kThreads);
  if (dim <= kSmall * kThreads)
    pdl_launch(add_rmsnorm_kernel<kSmall>, dim3(n), dim3(kThreads), 0, stream, h, r, w, dim, eps, xn);
  else
    pdl_launch(add_rmsnorm_kernel<64>, dim3(n), dim3(kThreads), 0, stream, h, r, w, dim, eps, xn);
}

void gated_rmsnorm(const float* o, int64_t ldo, const bf16* z, int64_t ldz, const float* w, int n,
                   int n_heads, int head_dim, float eps, bf16* y, int64_t ldy, cudaStream_t stream) {
  TANSY_CHECK(head_dim % 32 == 0 && head_dim <= 1024,
              "gated_rmsnorm: head_dim {} must be a multiple of 32, <= 1024", head_dim);
  TANSY_CHECK(n >= 1 && n <= 65535 && n_heads >= 1, "gated_rmsnorm: n {} heads {} outside limits", n,
              n_heads);
  TANSY_CHECK(o && z && w && y, "gated_rmsnorm: missing buffers");
  pdl_launch(gated_rmsnorm_kernel, dim3(n_heads, n), dim3(head_dim), 0, stream, o, ldo, z, ldz, w, head_dim,
             eps, y, ldy);
}

}  // namespace tansy::cuda
