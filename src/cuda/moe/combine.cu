// MoE prefill combine (docs/MODEL.md §6 step 5): the weighted sum of each token's k expert rows
// (sorted order) plus the gated shared expert and the residual, deterministic (no atomics).
// CPU reference: CpuModel::moe's combine.
#include "cuda/common/device_math.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/norm/norm.cuh"

namespace tansy::cuda {
namespace {

constexpr int kCombineThreads = 256;

// The 8 bf16 values of a 16-byte word, as f32.
__device__ __forceinline__ void unpack8(const __nv_bfloat16* src, float (&f)[8]) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// Token t's mixture at columns c..c+7: its k expert rows in slot order, weighted, then the shared
// expert gated by sg (both kernels' arithmetic, in this order).
__device__ __forceinline__ void mixture8(const __nv_bfloat16* Yd, const int* slot_row, const float* weight,
                                         int k, int d, int t, int c, const __nv_bfloat16* shared, float sg,
                                         float (&mix)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) mix[i] = 0.f;
  for (int j = 0; j < k; ++j) {
    const float w = weight[size_t(t) * k + j];
    float f[8];
    unpack8(Yd + size_t(slot_row[size_t(t) * k + j]) * d + c, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) mix[i] += w * f[i];
  }
  if (shared) {
    float f[8];
    unpack8(shared + size_t(t) * d + c, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) mix[i] += sg * f[i];
  }
}

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int k, int d,
                       const __nv_bfloat16* residual, const __nv_bfloat16* shared, const float* sh_logit,
                       int64_t sh_ld, __nv_bfloat16* out) {
  const int t = blockIdx.x;
  const float sg = shared ? sigmoid_fast(sh_logit[t * sh_ld]) : 0.f;
  for (int c = threadIdx.x * 8; c < d; c += kCombineThreads * 8) {
    float acc[8] = {};
    if (residual) unpack8(residual + size_t(t) * d + c, acc);
    float mix[8];
    mixture8(Yd, slot_row, weight, k, d, t, c, shared, sg, mix);
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int i = 0; i < 4; ++i)
      ow[i] = tc::pack_bf16(acc[2 * i] + mix[2 * i], acc[2 * i + 1] + mix[2 * i + 1]);
    *reinterpret_cast<uint4*>(out + size_t(t) * d + c) = o;
  }
}

// moe_combine (residual null) then add_rmsnorm in one pass over the row: the mixture r is rounded
// to bf16 as moe_combine stores it and staged in shared memory, where the norm takes it in its own
// element order (element i is thread i % 256's), so h and xn get add_rmsnorm's bits.
// [d <= kCombineNormMaxDim] one block per token, kNormThreads threads.
constexpr int kNormPer = kCombineNormMaxDim / kNormThreads;  // [8] row values a thread holds
static_assert(kCombineThreads == kNormThreads && kCombineNormMaxDim % (8 * kCombineThreads) == 0);

__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_norm_kernel(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int k, int d,
                            const __nv_bfloat16* shared, const float* sh_logit, int64_t sh_ld, float* h,
                            const float* __restrict__ norm_w, float eps, __nv_bfloat16* __restrict__ xn) {
  __shared__ __align__(16) __nv_bfloat16 r_row[kCombineNormMaxDim];  // [d] bf16: the mixture
  __shared__ float red[kNormThreads / 32];
  const int t = blockIdx.x;
  const float sg = shared ? sigmoid_fast(sh_logit[t * sh_ld]) : 0.f;
  // moe_combine's loop, its 8 contiguous values a thread, into shared memory instead of r.
  for (int c = threadIdx.x * 8; c < d; c += kCombineThreads * 8) {
    float mix[8];
    mixture8(Yd, slot_row, weight, k, d, t, c, shared, sg, mix);
    uint4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
    const float zero = 0.f;  // moe_combine's residual-free accumulator (0 + -0 is +0)
#pragma unroll
    for (int i = 0; i < 4; ++i) ow[i] = tc::pack_bf16(zero + mix[2 * i], zero + mix[2 * i + 1]);
    *reinterpret_cast<uint4*>(r_row + c) = o;
  }
  __syncthreads();
  // add_rmsnorm_kernel's body, r read from shared memory.
  float* hr = h + int64_t(t) * d;
  float v[kNormPer];
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    v[j] = i < d ? hr[i] + __bfloat162float(r_row[i]) : 0.f;
  }
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < d) hr[i] = v[j];
    ss += v[j] * v[j];
  }
  const float scale = rsqrtf(block_sum<kNormThreads>(ss, red) / float(d) + eps);
  __nv_bfloat16* xr = xn + int64_t(t) * d;
#pragma unroll
  for (int j = 0; j < kNormPer; ++j) {
    const int i = threadIdx.x + j * kNormThreads;
    if (i < d) xr[i] = __float2bfloat16(v[j] * scale * norm_w[i]);
  }
}

}  // namespace

void moe_combine_add_rmsnorm(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k,
                             int d, const __nv_bfloat16* shared, const float* sh_logit, int64_t sh_ld,
                             float* h, const float* norm_w, float eps, __nv_bfloat16* xn,
                             cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && d >= 8 && d % 8 == 0 && d <= kCombineNormMaxDim,
              "moe_combine_add_rmsnorm: bad n={} k={} d={} (d a multiple of 8 up to {})", n, k, d,
              kCombineNormMaxDim);
  TANSY_CHECK(Yd && slot_row && weight && h && norm_w && xn, "moe_combine_add_rmsnorm: null pointer");
  TANSY_CHECK(!shared == !sh_logit,
              "moe_combine_add_rmsnorm: shared expert output and its gate logit come together");
  TANSY_CHECK(aligned16(Yd) && (!shared || aligned16(shared)),
              "moe_combine_add_rmsnorm: rows must be 16-byte aligned");
  moe_combine_norm_kernel<<<n, kCombineThreads, 0, stream>>>(Yd, slot_row, weight, k, d, shared, sh_logit,
                                                             sh_ld, h, norm_w, eps, xn);
  launch_check("moe_combine_add_rmsnorm");
}

void moe_combine(const __nv_bfloat16* Yd, const int* slot_row, const float* weight, int n, int k, int d,
                 const __nv_bfloat16* residual, const __nv_bfloat16* shared, const float* sh_logit,
                 int64_t sh_ld, __nv_bfloat16* out, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && d >= 8 && d % 8 == 0, "moe_combine: bad n={} k={} d={}", n, k, d);
  TANSY_CHECK(Yd && slot_row && weight && out, "moe_combine: null pointer");
  TANSY_CHECK(!shared == !sh_logit, "moe_combine: shared expert output and its gate logit come together");
  TANSY_CHECK(
      aligned16(Yd) && aligned16(out) && (!residual || aligned16(residual)) && (!shared || aligned16(shared)),
      "moe_combine: rows must be 16-byte aligned");
  moe_combine_kernel<<<n, kCombineThreads, 0, stream>>>(Yd, slot_row, weight, k, d, residual, shared,
                                                        sh_logit, sh_ld, out);
  launch_check("moe_combine");
}

}  // namespace tansy::cuda
