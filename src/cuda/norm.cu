#include "cuda/norm.cuh"

namespace tansy::cuda {
namespace {

constexpr int kThreads = 256;

template <int THREADS>
__device__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) r += red[w];
  return r;
}

__global__ void __launch_bounds__(kThreads) add_rmsnorm_kernel(bf16* h, const bf16* __restrict__ r,
                                                               const float* __restrict__ w, int dim, float eps,
                                                               bf16* __restrict__ xn) {
  __shared__ float red[kThreads / 32];
  bf16* hr = h + int64_t(blockIdx.x) * dim;
  const bf16* rr = r ? r + int64_t(blockIdx.x) * dim : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < dim; i += kThreads) {
    float v = __bfloat162float(hr[i]);
    if (rr) {
      const bf16 s = __float2bfloat16(v + __bfloat162float(rr[i]));
      hr[i] = s;
      v = __bfloat162float(s);
    }
    ss += v * v;
  }
  const float scale = rsqrtf(block_sum<kThreads>(ss, red) / float(dim) + eps);
  bf16* xr = xn + int64_t(blockIdx.x) * dim;
  for (int i = threadIdx.x; i < dim; i += kThreads) xr[i] = __float2bfloat16(__bfloat162float(hr[i]) * scale * w[i]);
}

// One block per (head, token); blockDim = head_dim.
__global__ void gated_rmsnorm_kernel(const float* __restrict__ o, int64_t ldo, const bf16* __restrict__ z, int64_t ldz,
                                     const float* __restrict__ w, int head_dim, float eps, bf16* __restrict__ y,
                                     int64_t ldy) {
  __shared__ float red[32];
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
  y[int64_t(t) * ldy + int64_t(j) * head_dim + d] = __float2bfloat16(w[d] * v * rsqrtf(tot / float(head_dim) + eps) * g);
}

}  // namespace

void add_rmsnorm(bf16* h, const bf16* r, const float* w, int n, int dim, float eps, bf16* xn, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && dim >= 1 && dim <= kNormMaxDim, "add_rmsnorm: n {} dim {} outside limits", n, dim);
  TANSY_CHECK(h && w && xn, "add_rmsnorm: missing buffers");
  add_rmsnorm_kernel<<<n, kThreads, 0, stream>>>(h, r, w, dim, eps, xn);
  CUDA_LAUNCH_CHECK();
}

void gated_rmsnorm(const float* o, int64_t ldo, const bf16* z, int64_t ldz, const float* w, int n, int n_heads,
                   int head_dim, float eps, bf16* y, int64_t ldy, cudaStream_t stream) {
  TANSY_CHECK(head_dim % 32 == 0 && head_dim <= 1024, "gated_rmsnorm: head_dim {} must be a multiple of 32, <= 1024",
              head_dim);
  TANSY_CHECK(n >= 1 && n <= 65535 && n_heads >= 1, "gated_rmsnorm: n {} heads {} outside limits", n, n_heads);
  TANSY_CHECK(o && z && w && y, "gated_rmsnorm: missing buffers");
  gated_rmsnorm_kernel<<<dim3(n_heads, n), head_dim, 0, stream>>>(o, ldo, z, ldz, w, head_dim, eps, y, ldy);
  CUDA_LAUNCH_CHECK();
}

}  // namespace tansy::cuda
