// Device pieces of the fused decode products, shared by the per-op kernels (matvec.cu) and the
// persistent decode step (step/step.cu), so that both compute every value with the same
// arithmetic in the same order. `sync` is the barrier of the threads taking part (the block's
// __syncthreads, or a named barrier of the step's consumer warps); they are gemv::kThreads.
#pragma once
#include "cuda/common/device_math.cuh"
#include "cuda/gdn/gdn.cuh"
#include "cuda/matvec/chunk.cuh"

namespace tansy::cuda::gemv {

// Stages the normed residual (NormIn) as chunks of one token row; red: kWarps floats of smem.
// `writer` also stores x to nz.xn_out.
template <int BITS, typename Sync>
__device__ void stage_norm(const NormIn& nz, int in, float* xs, float* red, bool writer, Sync sync) {
  constexpr int C = Chunk<BITS>::kCols, S = Chunk<BITS>::kStride;
  float part = 0.f;
  // h and ss come through L2 (ld.cg): in the persistent step other blocks wrote them since this
  // block last read them.
  for (int i = threadIdx.x; i < kNormParts; i += kThreads) part += __ldcg(nz.ss + i);
  // h and w are loaded before the reduction completes: one memory round trip in all.
  constexpr int kMaxPieces = kFusedNormMaxDim / 4 / kThreads;
  float4 hv[kMaxPieces], wv[kMaxPieces];
#pragma unroll
  for (int j = 0; j < kMaxPieces; ++j) {
    const int i = 4 * (threadIdx.x + j * kThreads);
    if (i < in) {
      hv[j] = __ldcg(reinterpret_cast<const float4*>(nz.h + i));
      wv[j] = *reinterpret_cast<const float4*>(nz.w + i);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = part;
  sync();
  float tot = 0.f;
  for (int w = 0; w < kWarps; ++w) tot += red[w];
  const float scale = rsqrtf(tot / float(in) + nz.eps);
  writer = writer && nz.xn_out;
  // Piece j of a thread is 4 columns; the C/4 consecutive lanes holding one chunk add up its Σx
  // with shuffles (in is a multiple of 64, so those lanes are all valid or all not).
#pragma unroll
  for (int j = 0; j < kMaxPieces; ++j) {
    const int i = 4 * (threadIdx.x + j * kThreads);
    const bool valid = i < in;
    const int c = i / C, e0 = i % C;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (valid) {
      x[0] = round_bf(hv[j].x * scale * wv[j].x);
      x[1] = round_bf(hv[j].y * scale * wv[j].y);
      x[2] = round_bf(hv[j].z * scale * wv[j].z);
      x[3] = round_bf(hv[j].w * scale * wv[j].w);
      *reinterpret_cast<float4*>(xs + c * S + e0) = make_float4(x[0], x[1], x[2], x[3]);
      if (writer)
        for (int e = 0; e < 4; ++e) nz.xn_out[i + e] = __float2bfloat16(x[e]);
    }
    float sum = (x[0] + x[1]) + (x[2] + x[3]);
#pragma unroll
    for (int o = 1; o < C / 4; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (valid && e0 == 0) xs[c * S + C] = sum;
  }
}

__device__ __forceinline__ float swiglu_bf16(float g, float u) {
  g = __bfloat162float(__float2bfloat16(g));
  u = __bfloat162float(__float2bfloat16(u));
  return silu_fast(g) * u;
}

// Row `row` of the GDN in_proj is y (every lane holds it): conv channel, z (stored by the caller
// only), or a gate input. Called by the whole warp; lane j < kernel holds tap j's weight `w` and
// input `in` (the window's values; lane kernel-1 takes this token's projection here).
__device__ __forceinline__ void gdn_in_epilogue(const GdnInEpilogue& G, int row, float y, float w, float in,
                                                int lane) {
  const float x = round_bf(y);  // the projection as the bf16 prefill path stores it
  if (row < G.conv_dim) {
    if (lane == G.kernel - 1) in = x;
    const float conv = group_sum<32>(lane < G.kernel ? w * in : 0.f);
    const float next = __shfl_down_sync(0xffffffffu, in, 1);  // lane j: tap j+1's input
    if (lane < G.kernel - 1) G.window[int64_t(lane) * G.conv_dim + row] = __float2bfloat16(next);
    if (lane == 0) G.conv_out[row] = silu_fast(conv);
    return;
  }
  const int j = row - G.conv_dim - G.value_dim;
  if (lane != 0 || j < 0) return;
  if (j < G.n_v_heads) {
    G.g[j] = gdn_log_decay(x, G.dt_bias[j], G.A_log[j]);
  } else if (j < 2 * G.n_v_heads) {
    G.beta[j - G.n_v_heads] = sigmoid(x);
  }
}

// gdn_in_epilogue for a 4-tap conv computed by one thread (no shuffles), with the same sums in
// the same order: group_sum<32> over lanes 0..3 (the others 0) adds, for lane 0, +0 at the
// strides 16, 8 and 4, then the pairs (0,2), (1,3), then the two. w: the row's taps, in: the
// window's 3 inputs (oldest first); the token's projection is the 4th input.
__device__ __forceinline__ void gdn_in_epilogue_k4(const GdnInEpilogue& G, int row, float y,
                                                   const float (&w)[4], const float (&in)[3]) {
  const float x = round_bf(y);
  if (row < G.conv_dim) {
    const float v[4] = {w[0] * in[0], w[1] * in[1], w[2] * in[2], w[3] * x};
    float c[4];
#pragma unroll
    for (int l = 0; l < 4; ++l) c[l] = ((v[l] + 0.f) + 0.f) + 0.f;
    const float conv = (c[0] + c[2]) + (c[1] + c[3]);
    G.window[row] = __float2bfloat16(in[1]);
    G.window[int64_t(G.conv_dim) + row] = __float2bfloat16(in[2]);
    G.window[2 * int64_t(G.conv_dim) + row] = __float2bfloat16(x);
    G.conv_out[row] = silu_fast(conv);
    return;
  }
  const int j = row - G.conv_dim - G.value_dim;
  if (j < 0) return;
  if (j < G.n_v_heads) {
    G.g[j] = gdn_log_decay(x, G.dt_bias[j], G.A_log[j]);
  } else if (j < 2 * G.n_v_heads) {
    G.beta[j - G.n_v_heads] = sigmoid(x);
  }
}

// One ResidualOut part: the squares `sq` of the participating threads summed into *slot (warp
// sums, then the warps in order).
template <typename Sync>
__device__ __forceinline__ void residual_part(float sq, float* slot, float* red, Sync sync) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  sync();  // red may still be read from the staging
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sq;
  sync();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < kWarps; ++w) t += red[w];
    *slot = t;
  }
}

// A block's share of ResidualOut: its threads' squares summed into ss[block].
__device__ __forceinline__ void residual_partial(float sq, float* ss, float* red) {
  residual_part(sq, ss + blockIdx.x, red, BlockSync{});
}

}  // namespace tansy::cuda::gemv
