// Small device functions used by several kernel families, defined once. The fast variants
// (__expf) are the bf16 plan's; the f32 plan and every gate that the CPU reference computes with
// expf use the precise ones, so the two plans keep their own arithmetic.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace tansy::cuda {

// Sum over the G lanes of an aligned lane group (G a power of two <= 32), every lane gets it.
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_sum(float v) { return group_sum<32>(v); }

// Sum over a block of THREADS threads (every thread gets it): warp sums, then the warps' sums in
// warp order. red: THREADS / 32 floats of shared memory. The RMSNorm kernels' reduction: one
// order, so that a fused norm gives the separate launch's bits.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) r += red[w];
  return r;
}

// The value as a bf16 store would keep it (activations between ops are bf16 in the bf16 plan).
__device__ __forceinline__ float round_bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

__device__ __forceinline__ float silu_fast(float x) { return x / (1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_fast(float x) { return 1.f / (1.f + __expf(-x)); }

// GDN log-decay of one value head (docs/MODEL.md §5.4): g = -exp(A_log)·softplus(a + dt_bias),
// softplus linear above 20 as torch's. beta = sigmoid(b) goes with it. CPU: cpu::gdn_gates.
__device__ __forceinline__ float gdn_log_decay(float a, float dt_bias, float A_log) {
  const float sp = a + dt_bias;
  const float softplus = sp > 20.f ? sp : log1pf(expf(sp));
  return -expf(A_log) * softplus;
}

// Barriers for device functions shared by kernels of different shapes: the whole block, or the
// first N threads of it (named barrier ID; N a multiple of 32, ID 1..15).
struct BlockSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};
template <int ID, int N>
struct NamedSync {
  __device__ __forceinline__ void operator()() const {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(N) : "memory");
  }
};

// Nibbles 0 and 16 of w as the bf16 pair (128 + q, 128 + q'): (w & 0x000F000F) | 0x43004300 in one
// LOP3. Written plainly the compiler emits an AND and an OR, each with its immediate (a LOP3 has
// room for one), so the exponent pattern is passed in a register: one instruction a pair fewer
// in every 4-bit dot product.
__device__ __forceinline__ uint32_t nibbles_bf16x2(uint32_t w) {
  uint32_t magic, r;
  asm("mov.b32 %0, 0x43004300;" : "=r"(magic));
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xea;" : "=r"(r) : "r"(w), "r"(magic));
  return r;
}

}  // namespace tansy::cuda
