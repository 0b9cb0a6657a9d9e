#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gdn/decode_step.cuh"
#include "cuda/gdn/gdn.cuh"

namespace tansy::cuda {
namespace {

constexpr BlockSync kSync;

// Prefill conv + gates. Warp = one head (128 channels, 4 per lane: one 8-byte load per token row)
// for a run of kConvTokensPerWarp tokens, the K-1 previous inputs and the taps in registers; the
// q/k l2norm is a warp reduction (no block barrier per token). A block's 4 warps take 4 consecutive
// runs of the same head.
// Every token row of x is loaded before any is used, so the loads of a run are in flight at once.
constexpr int kConvWarps = 4;
constexpr int kConvTokensPerWarp = kConvTokensPerBlock / kConvWarps;

__device__ __forceinline__ void load4(const bf16* p, float (&v)[4]) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}

template <int K>  // the taps, a constant so that the window stays in registers
__global__ void __launch_bounds__(32 * kConvWarps) gdn_conv_kernel(GdnConvArgs A, int update_window) {
  pdl_wait();
  pdl_launch_dependents();
  const int C = (2 * A.n_k_heads + A.n_v_heads) * kGdnDim;
  const int tb0 = blockIdx.y * kConvTokensPerBlock, tb1 = min(A.n, tb0 + kConvTokensPerBlock);
  // The gates of the block row's tokens, spread over its blocks (one block doing them all was the
  // launch's last to finish).
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (tb1 - tb0) * A.n_v_heads;
       i += gridDim.x * blockDim.x) {
    const int t = tb0 + i / A.n_v_heads, h = i % A.n_v_heads;
    const float av = __bfloat162float(A.a[int64_t(t) * A.ld_ab + h]);
    const float bv = __bfloat162float(A.b[int64_t(t) * A.ld_ab + h]);
    A.beta[int64_t(t) * A.n_v_heads + h] = sigmoid(bv);
    A.g[int64_t(t) * A.n_v_heads + h] = gdn_log_decay(av, A.dt_bias[h], A.A_log[h]);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x, c = head * kGdnDim + 4 * lane;  // this lane's channels c..c+3
  const bool is_q = head < A.n_k_heads, is_k = !is_q && head < 2 * A.n_k_heads;
  const int t0 = tb0 + warp * kConvTokensPerWarp, t1 = min(A.n, t0 + kConvTokensPerWarp);
  // w[j][i]: tap j of channel c+i (tap K-1 multiplies the current token); prev[j][i]: the input
  // at t0 - (K-1) + j
  float w[K][4], prev[K - 1][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < K; ++j) w[j][i] = A.conv_w[int64_t(c + i) * K + j];
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int tau = t0 - (K - 1) + j;
    if (t0 < t1)
      load4(tau >= 0 ? A.x + int64_t(tau) * A.ldx + c : A.window + int64_t(tau + K - 1) * C + c, prev[j]);
  }
  if (update_window) __syncthreads();  // every warp has read the old window before it is rewritten
  // The run's inputs as loaded (bf16 pairs): every load is issued before the first is used.
  uint2 raw[kConvTokensPerWarp];
#pragma unroll
  for (int u = 0; u < kConvTokensPerWarp; ++u)
    raw[u] =
        t0 + u < t1 ? *reinterpret_cast<const uint2*>(A.x + int64_t(t0 + u) * A.ldx + c) : make_uint2(0, 0);
  const float qscale = rsqrtf(float(kGdnDim));
#pragma unroll
  for (int u = 0; u < kConvTokensPerWarp; ++u) {
    if (t0 + u >= t1) break;
    float cur[4], y[4], ss = 0.f;
    {
      const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].x));
      const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw[u].y));
      cur[0] = a.x, cur[1] = a.y, cur[2] = b.x, cur[3] = b.y;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < K - 1; ++j) acc = fmaf(w[j][i], prev[j][i], acc);
      acc = fmaf(w[K - 1][i], cur[i], acc);
#pragma unroll
      for (int j = 0; j + 1 < K - 1; ++j) prev[j][i] = prev[j + 1][i];
      prev[K - 2][i] = cur[i];
      y[i] = silu_fast(acc);
      ss = fmaf(y[i], y[i], ss);
    }
    if (is_q || is_k) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      const float sc = rsqrtf(ss + 1e-6f) * (is_q ? qscale : 1.f);
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i] *= sc;
    }
    uint2 out;
    out.x = tc::pack_bf16(y[0], y[1]);
    out.y = tc::pack_bf16(y[2], y[3]);
    *reinterpret_cast<uint2*>(A.y + int64_t(t0 + u) * C + c) = out;
  }
  // One block covers every token (update_window): the warp holding the last token advances it.
  if (update_window && t0 < t1 && t1 == A.n) {
#pragma unroll
    for (int j = 0; j < K - 1; ++j) {
      uint2 out;
      out.x = tc::pack_bf16(prev[j][0], prev[j][1]);
      out.y = tc::pack_bf16(prev[j][2], prev[j][3]);
      *reinterpret_cast<uint2*>(A.window + int64_t(j) * C + c) = out;
    }
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
  // 8-byte loads and stores of 4 channels
  TANSY_CHECK(a.ldx % 4 == 0 && reinterpret_cast<uintptr_t>(a.x) % 8 == 0 &&
                  reinterpret_cast<uintptr_t>(a.y) % 8 == 0 && reinterpret_cast<uintptr_t>(a.window) % 8 == 0,
              "gdn_conv: x (ld {}), y and the window must be 8-byte aligned", a.ldx);
  const dim3 grid(C / kGdnDim, chunks), block(32 * kConvWarps);
  const int update = chunks == 1 ? 1 : 0;
  // One instantiation per tap count (checked above: 2 .. kMaxConvKernel).
  static constexpr void (*kKernels[])(GdnConvArgs, int) = {nullptr,
                                                           nullptr,
                                                           gdn_conv_kernel<2>,
                                                           gdn_conv_kernel<3>,
                                                           gdn_conv_kernel<4>,
                                                           gdn_conv_kernel<5>,
                                                           gdn_conv_kernel<6>,
                                                           gdn_conv_kernel<7>,
                                                           gdn_conv_kernel<8>};
  static_assert(sizeof(kKernels) / sizeof(kKernels[0]) == kMaxConvKernel + 1);
  pdl_launch(kKernels[a.kernel], grid, block, 0, stream, a, update);
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
