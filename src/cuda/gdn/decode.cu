#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/gdn/decode_step.cuh"
#include "cuda/gdn/gdn.cuh"

namespace tansy::cuda {
namespace {

constexpr BlockSync kSync;

__device__ float sum128(float v, float* red) { return gdn_unit::sum128(v, red, kSync); }  // blockDim == 128

// Blocks x < conv_dim/128: one head's 128 channels (thread = channel) for a run of tokens,
// the window held in registers. Block x == conv_dim/128: the gates of the same tokens.
__global__ void __launch_bounds__(kGdnDim) gdn_conv_kernel(GdnConvArgs A, int update_window) {
  __shared__ float red[4];
  pdl_wait();
  pdl_launch_dependents();
  const int C = (2 * A.n_k_heads + A.n_v_heads) * kGdnDim;
  const int t0 = blockIdx.y * kConvTokensPerBlock, t1 = min(A.n, t0 + kConvTokensPerBlock);
  const int K = A.kernel;
  if (blockIdx.x == C / kGdnDim) {
    for (int i = threadIdx.x; i < (t1 - t0) * A.n_v_heads; i += blockDim.x) {
      const int t = t0 + i / A.n_v_heads, h = i % A.n_v_heads;
      const float av = __bfloat162float(A.a[int64_t(t) * A.ld_ab + h]);
      const float bv = __bfloat162float(A.b[int64_t(t) * A.ld_ab + h]);
      A.beta[int64_t(t) * A.n_v_heads + h] = sigmoid(bv);
      A.g[int64_t(t) * A.n_v_heads + h] = gdn_log_decay(av, A.dt_bias[h], A.A_log[h]);
    }
    return;
  }
  const int head_block = blockIdx.x;
  const int c = head_block * kGdnDim + threadIdx.x;
  const bool is_q = head_block < A.n_k_heads, is_k = !is_q && head_block < 2 * A.n_k_heads;
  float w[kMaxConvKernel], prev[kMaxConvKernel];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel; ++j) {
    w[j] = j < K ? A.conv_w[int64_t(c) * K + j] : 0.f;
    // prev[j] = input at t0 - (K-1) + j for j < K-1
    const int tau = t0 - (K - 1) + j;
    prev[j] = 0.f;
    if (j < K - 1)
      prev[j] =
          __bfloat162float(tau >= 0 ? A.x[int64_t(tau) * A.ldx + c] : A.window[int64_t(tau + K - 1) * C + c]);
  }
  const float qscale = rsqrtf(float(kGdnDim));
  for (int t = t0; t < t1; ++t) {
    const float cur = __bfloat162float(A.x[int64_t(t) * A.ldx + c]);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxConvKernel - 1; ++j)
      if (j < K - 1) acc = fmaf(w[j], prev[j], acc);
        // tap K-1 multiplies the current token
#pragma unroll
    for (int j = 0; j < kMaxConvKernel; ++j)
      if (j == K - 1) acc = fmaf(w[j], cur, acc);
#pragma unroll
    for (int j = 0; j < kMaxConvKernel - 1; ++j) {
      if (j < K - 2)
        prev[j] = prev[j + 1];
      else if (j == K - 2)
        prev[j] = cur;
    }
    float y = silu_fast(acc);
    if (is_q || is_k) {
      const float ss = sum128(y * y, red);
      y *= rsqrtf(ss + 1e-6f) * (is_q ? qscale : 1.f);
    }
    A.y[int64_t(t) * C + c] = __float2bfloat16(y);
  }
  if (update_window) {
#pragma unroll
    for (int j = 0; j < kMaxConvKernel - 1; ++j)
      if (j < K - 1) A.window[int64_t(j) * C + c] = __float2bfloat16(prev[j]);
  }
}

// When several blocks share a channel, the window is advanced after all of them have read it.
__global__ void conv_window_kernel(GdnConvArgs A) {
  const int C = (2 * A.n_k_heads + A.n_v_heads) * kGdnDim;
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int K = A.kernel;
  float nw[kMaxConvKernel];
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j) {
    const int tau = A.n - (K - 1) + j;
    nw[j] = 0.f;
    if (j < K - 1)
      nw[j] =
          __bfloat162float(tau >= 0 ? A.x[int64_t(tau) * A.ldx + c] : A.window[int64_t(tau + K - 1) * C + c]);
  }
#pragma unroll
  for (int j = 0; j < kMaxConvKernel - 1; ++j)
    if (j < K - 1) A.window[int64_t(j) * C + c] = __float2bfloat16(nw[j]);
}

constexpr int kColsPerBlock = gdn_unit::kColsPerUnit;

// Block per (value head, 32 state columns); warp w holds rows 32w..32w+31 of those columns in
// registers for the whole token run, so the state is read and written once per call.
__global__ void __launch_bounds__(128) gdn_recurrent_kernel(GdnPrefillArgs A) {
  __shared__ float qs[kGdnDim], ks[kGdnDim];
  __shared__ float red_u[4][32], red_o[4][32];
  pdl_wait();
  pdl_launch_dependents();
  const int h = blockIdx.x, c0 = blockIdx.y * kColsPerBlock;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hk = h / (A.n_v_heads / A.n_k_heads);
  float* S = A.state + (int64_t(h) * kGdnDim + warp * 32) * kGdnDim + c0 + lane;
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = S[int64_t(i) * kGdnDim];
  for (int t = 0; t < A.n; ++t) {
    qs[threadIdx.x] = __bfloat162float(A.q[int64_t(t) * A.q_stride + hk * kGdnDim + threadIdx.x]);
    ks[threadIdx.x] = __bfloat162float(A.k[int64_t(t) * A.k_stride + hk * kGdnDim + threadIdx.x]);
    const float v = __bfloat162float(A.v[int64_t(t) * A.v_stride + h * kGdnDim + c0 + lane]);
    const float beta = A.beta[int64_t(t) * A.n_v_heads + h];
    const float decay = __expf(A.g[int64_t(t) * A.n_v_heads + h]);
    __syncthreads();
    const float o = gdn_unit::delta_rule_step(s, qs, ks, v, beta, decay, red_u, warp, lane, kSync);
    red_o[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
      const float out = red_o[0][lane] + red_o[1][lane] + red_o[2][lane] + red_o[3][lane];
      const int64_t oi = int64_t(t) * A.o_stride + h * kGdnDim + c0 + lane;
      if (A.o_f32)
        A.o_f32[oi] = out;
      else
        A.o_bf16[oi] = __float2bfloat16(out);
    }
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) S[int64_t(i) * kGdnDim] = s[i];
}

// Block (value head h, columns c0..c0+31), 128 threads: the recurrence of gdn_recurrent_kernel
// for one token, with q/k normalised in the block and the gated norm done by the head's last block.
// Grid z: the token of a batched step (rows), whose pointers are moved to its row.
__global__ void __launch_bounds__(128)
    gdn_decode_kernel(GdnDecodeArgs A, const __grid_constant__ GdnDecodeRows R, int batched) {
  __shared__ gdn_unit::Smem sm;
  pdl_wait();
  pdl_launch_dependents();
  const int h = blockIdx.x, cb = blockIdx.y;
  if (batched) {
    const int t = blockIdx.z;
    A.conv += t * R.conv;
    A.beta += t * R.gates;
    A.g += t * R.gates;
    A.z += t * R.z;
    A.o += t * R.o;
    A.y += t * R.y;
    A.counters += t * A.n_v_heads;
    A.state = R.state[t];
  }
  float* S = gdn_unit::state_column(A, h, cb * kColsPerBlock);
  float s[32];
  gdn_unit::load_state(S, s);
  gdn_unit::decode_unit(A, h, cb, int(gridDim.y), s, S, sm, kSync);
}

}  // namespace

void gdn_decode_step(const GdnDecodeArgs& a, cudaStream_t stream, const GdnDecodeRows* rows) {
  TANSY_CHECK(a.n_k_heads >= 1 && a.n_v_heads >= 1 && a.n_v_heads % a.n_k_heads == 0,
              "gdn_decode_step: heads {}/{} invalid", a.n_k_heads, a.n_v_heads);
  TANSY_CHECK(a.conv && a.beta && a.g && a.state && a.z && a.norm_w && a.o && a.counters && a.y,
              "gdn_decode_step: missing buffers");
  const GdnDecodeRows one;
  const GdnDecodeRows& r = rows ? *rows : one;
  TANSY_CHECK(r.n >= 1 && r.n <= kMaxBatch && (!rows || r.n == 1 || r.state[r.n - 1]),
              "gdn_decode_step: {} batched rows (1..{}, each with its state)", r.n, kMaxBatch);
  pdl_launch(gdn_decode_kernel, dim3(a.n_v_heads, kGdnDim / kColsPerBlock, r.n), dim3(128), 0, stream, a, r,
             rows ? 1 : 0);
}

void gdn_conv(const GdnConvArgs& a, cudaStream_t stream) {
  TANSY_CHECK(a.n >= 1 && a.n_k_heads >= 1 && a.n_v_heads >= 1 && a.n_v_heads % a.n_k_heads == 0,
              "gdn_conv: n {} heads {}/{} invalid", a.n, a.n_k_heads, a.n_v_heads);
  TANSY_CHECK(a.kernel >= 2 && a.kernel <= kMaxConvKernel, "gdn_conv: conv kernel {} outside 2..{}", a.kernel,
              kMaxConvKernel);
  TANSY_CHECK(a.x && a.a && a.b && a.conv_w && a.window && a.A_log && a.dt_bias && a.y && a.beta && a.g,
              "gdn_conv: missing buffers");
  const int C = (2 * a.n_k_heads + a.n_v_heads) * kGdnDim;
  const unsigned chunks = ceil_div(a.n, kConvTokensPerBlock);
  TANSY_CHECK(chunks <= 65535u, "gdn_conv: {} tokens exceed the grid limit", a.n);
  pdl_launch(gdn_conv_kernel, dim3(C / kGdnDim + 1, chunks), dim3(kGdnDim), 0, stream, a,
             chunks == 1 ? 1 : 0);
  if (chunks > 1) {
    conv_window_kernel<<<ceil_div(C, 256), 256, 0, stream>>>(a);
    launch_check("gdn_conv");
  }
}

void gdn_recurrent(const GdnPrefillArgs& a, cudaStream_t stream) {
  TANSY_CHECK(a.n >= 1 && a.n_k_heads >= 1 && a.n_v_heads % a.n_k_heads == 0,
              "gdn_recurrent: n {} heads {}/{} invalid", a.n, a.n_k_heads, a.n_v_heads);
  TANSY_CHECK(a.q && a.k && a.v && a.beta && a.g && a.state && (a.o_f32 || a.o_bf16),
              "gdn_recurrent: missing buffers");
  pdl_launch(gdn_recurrent_kernel, dim3(a.n_v_heads, kGdnDim / kColsPerBlock), dim3(128), 0, stream, a);
}

}  // namespace tansy::cuda
