// The f32 plan's kernels (see f32_ops.cuh). Straightforward on purpose: a warp per output row,
// a block per token (and head) for the normalisations and attention, a block per value head for
// the GDN recurrence, a thread per channel for the conv.
#include <cmath>
#include <string>

#include "core/error.h"
#include "cuda/common/device_math.cuh"
#include "cuda/f32/ops.cuh"

namespace tansy::cuda::f32 {
namespace {

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }

// Columns c0 .. c0+7 of row r of W, dequantized as Linear::row does (s * q + b in f32).
__device__ __forceinline__ void load8(const Linear& W, int r, int c0, float w[8]) {
  switch (W.fmt) {
    case WFormat::kAffine4: {
      const size_t words = size_t(W.in) / 8, groups = size_t(W.in / W.group);
      const uint32_t v = W.q[size_t(r) * words + c0 / 8];
      const float s = bf16_bits_to_f32(W.scales[size_t(r) * groups + c0 / W.group]);
      const float b = bf16_bits_to_f32(W.biases[size_t(r) * groups + c0 / W.group]);
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = s * float((v >> (4 * k)) & 15u) + b;
      break;
    }
    case WFormat::kAffine8: {
      const size_t words = size_t(W.in) / 4, groups = size_t(W.in / W.group);
      const uint32_t* q = W.q + size_t(r) * words + c0 / 4;
      const float s = bf16_bits_to_f32(W.scales[size_t(r) * groups + c0 / W.group]);
      const float b = bf16_bits_to_f32(W.biases[size_t(r) * groups + c0 / W.group]);
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = s * float((q[k / 4] >> (8 * (k % 4))) & 255u) + b;
      break;
    }
    case WFormat::kBF16:
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = bf16_bits_to_f32(W.bf16[size_t(r) * W.in + c0 + k]);
      break;
    case WFormat::kF32:
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = W.f32[size_t(r) * W.in + c0 + k];
      break;
  }
}

// Block-wide sum of one double per thread (blockDim.x a multiple of 32, <= 1024); every thread
// gets the total. `red` holds 32 doubles.
__device__ double block_sum(double v, double* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  double t = 0;
  for (int i = 0; i < warps; ++i) t += red[i];
  return t;
}

__device__ float block_max(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float t = -INFINITY;
  for (int i = 0; i < warps; ++i) t = fmaxf(t, red[i]);
  return t;
}

constexpr int kWarps = 8;                         // matmul: output rows per block
constexpr int kAttnThreads = 256;                 // attention: keys per chunk, and output dims per pass
constexpr int kMaxExperts = 1024, kMaxTopK = 64;  // route_kernel's per-thread arrays
// Dynamic shared memory a launch may ask for without an opt-in, less what the kernels declare
// statically (their reduction scratch, under 1 KiB).
constexpr size_t kMaxDynamicSmem = 47 * 1024;

// Warp per (output row o, tile of T token rows). Indexed (Ws != nullptr): T == 1 and the row's
// matrix is Ws[idx[r]].
template <int T>
__global__ void matmul_kernel(Linear W, const Linear* Ws, const int32_t* idx, const float* X, int x_div,
                              int rows, float* Y) {
  const int o = blockIdx.y * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * T;
  if (o >= W.out) return;
  const Linear L = Ws ? Ws[idx[r0]] : W;
  const int in = L.in;
  float acc[T];
#pragma unroll
  for (int t = 0; t < T; ++t) acc[t] = 0.f;
  for (int c0 = lane * 8; c0 < in; c0 += 32 * 8) {
    float w[8];
    load8(L, o, c0, w);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      if (r0 + t >= rows) break;
      const float* x = X + size_t((r0 + t) / x_div) * in + c0;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[t] = fmaf(w[k], x[k], acc[t]);
    }
  }
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const float s = warp_sum(acc[t]);
    if (lane == 0 && r0 + t < rows) Y[size_t(r0 + t) * W.out + o] = s;
  }
}

__global__ void embed_kernel(Linear E, const int32_t* ids, float* out) {
  const int t = blockIdx.x, id = ids[t];
  for (int c0 = threadIdx.x * 8; c0 < E.in; c0 += blockDim.x * 8) {
    float w[8];
    load8(E, id, c0, w);
#pragma unroll
    for (int k = 0; k < 8; ++k) out[size_t(t) * E.in + c0 + k] = w[k];
  }
}

__global__ void rmsnorm_kernel(const float* x, const float* w, int dim, float eps, float* y) {
  __shared__ double red[32];
  const float* xr = x + size_t(blockIdx.x) * dim;
  float* yr = y + size_t(blockIdx.x) * dim;
  double ss = 0;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += double(xr[i]) * xr[i];
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(float(ss / dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = xr[i] * inv * w[i];
}

__global__ void add_kernel(float* h, const float* x, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    h[i] += x[i];
}

// Thread per channel: its window column is its own.
__global__ void conv1d_kernel(const float* x, int n, float* window, const float* w, int C, int kernel,
                              float* y) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int hist = kernel - 1;
  for (int t = 0; t < n; ++t) {
    const float xc = x[size_t(t) * C + c];
    float acc = w[size_t(c) * kernel + hist] * xc;
    for (int j = 0; j < hist; ++j) acc += w[size_t(c) * kernel + j] * window[size_t(j) * C + c];
    y[size_t(t) * C + c] = acc / (1.0f + expf(-acc));
    for (int j = 0; j + 1 < hist; ++j) window[size_t(j) * C + c] = window[size_t(j + 1) * C + c];
    if (hist > 0) window[size_t(hist - 1) * C + c] = xc;
  }
}

// Block per value head; tokens in order. Shared: q, k [dk], v, o [dv], gates.
__global__ void gdn_core_kernel(GdnCoreArgs a) {
  extern __shared__ float sm[];
  __shared__ double red[32];
  __shared__ float gates[2];
  float* q = sm;
  float* k = q + a.dk;
  float* v = k + a.dk;
  float* o = v + a.dv;
  const int h = blockIdx.x, kh = h / (a.n_v / a.n_k), tid = threadIdx.x, nt = blockDim.x;
  const int C = 2 * a.n_k * a.dk + a.n_v * a.dv, VD = a.n_v * a.dv;
  float* S = a.S + size_t(h) * a.dk * a.dv;
  const float qscale = 1.0f / sqrtf(float(a.dk));
  for (int t = 0; t < a.n; ++t) {
    const float* yt = a.y + size_t(t) * C;
    double sq = 0, sk = 0;
    for (int i = tid; i < a.dk; i += nt) {
      q[i] = yt[size_t(kh) * a.dk + i];
      k[i] = yt[size_t(a.n_k) * a.dk + size_t(kh) * a.dk + i];
      sq += double(q[i]) * q[i];
      sk += double(k[i]) * k[i];
    }
    for (int i = tid; i < a.dv; i += nt) v[i] = yt[size_t(2 * a.n_k) * a.dk + size_t(h) * a.dv + i];
    sq = block_sum(sq, red);
    sk = block_sum(sk, red);
    const float iq = 1.0f / sqrtf(float(sq) + 1e-6f) * qscale, ik = 1.0f / sqrtf(float(sk) + 1e-6f);
    for (int i = tid; i < a.dk; i += nt) {
      q[i] *= iq;
      k[i] *= ik;
    }
    if (tid == 0) {
      gates[0] = sigmoid(a.b[size_t(t) * a.n_v + h]);
      gates[1] = gdn_log_decay(a.a[size_t(t) * a.n_v + h], a.dt_bias[h], a.A_log[h]);
    }
    __syncthreads();
    const float beta = gates[0], decay = expf(gates[1]);
    double so = 0;
    for (int c = tid; c < a.dv; c += nt) {
      float u = 0;
      for (int r = 0; r < a.dk; ++r) {
        float& s = S[size_t(r) * a.dv + c];
        s *= decay;
        u += s * k[r];
      }
      const float d = beta * (v[c] - u);
      float acc = 0;
      for (int r = 0; r < a.dk; ++r) {
        float& s = S[size_t(r) * a.dv + c];
        s += k[r] * d;
        acc += s * q[r];
      }
      o[c] = acc;
      so += double(acc) * acc;
    }
    so = block_sum(so, red);
    const float inv = 1.0f / sqrtf(float(so / a.dv) + a.eps);
    for (int c = tid; c < a.dv; c += nt) {
      const float zc = a.z[size_t(t) * VD + size_t(h) * a.dv + c];
      const float silu = zc / (1.0f + expf(-zc));
      a.out[size_t(t) * VD + size_t(h) * a.dv + c] = a.norm[c] * (o[c] * inv) * silu;
    }
    __syncthreads();  // q, k, v, o are rewritten by the next token
  }
}

// Block per (token, head) with heads [0, n_heads) the queries and [n_heads, n_heads + n_kv) the keys.
__global__ void attention_prep_kernel(AttnPrepArgs a) {
  extern __shared__ float x[];
  __shared__ double red[32];
  const int t = blockIdx.x, j = blockIdx.y, hd = a.hd, pos = a.pos0 + t;
  const bool is_q = j < a.n_heads;
  const int kv = j - a.n_heads;
  const float* src = is_q ? a.qg + size_t(t) * a.n_heads * 2 * hd + size_t(j) * 2 * hd
                          : a.k + size_t(t) * a.n_kv * hd + size_t(kv) * hd;
  const float* w = is_q ? a.q_norm : a.k_norm;
  float* dst = is_q ? a.q + size_t(t) * a.n_heads * hd + size_t(j) * hd
                    : a.K + size_t(pos) * a.n_kv * hd + size_t(kv) * hd;
  double ss = 0;
  for (int i = threadIdx.x; i < hd; i += blockDim.x) ss += double(src[i]) * src[i];
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(float(ss / hd) + a.eps);
  for (int i = threadIdx.x; i < hd; i += blockDim.x) x[i] = src[i] * inv * w[i];
  __syncthreads();
  const int half = a.rotary_dim / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    const double inv_freq = pow(a.theta, -2.0 * i / a.rotary_dim);
    const double ang = double(pos) * inv_freq;
    const float c = float(cos(ang)), s = float(sin(ang));
    const float p = x[i], q = x[i + half];
    x[i] = p * c - q * s;
    x[i + half] = q * c + p * s;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < hd; i += blockDim.x) dst[i] = x[i];
  if (!is_q) {
    const float* vs = a.v + size_t(t) * a.n_kv * hd + size_t(kv) * hd;
    float* vd = a.V + size_t(pos) * a.n_kv * hd + size_t(kv) * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) vd[i] = vs[i];
  }
}

// Block per (token, query head): chunks of kAttnThreads keys, online softmax (the running
// maximum rescales the partial sums), output dims spread over the threads.
__global__ void attention_kernel(const float* qall, const float* qg, const float* K, const float* V, int pos0,
                                 int n_heads, int n_kv, int hd, float* out) {
  extern __shared__ float sm[];
  __shared__ double red[32];
  __shared__ float redf[32];
  float* q = sm;                  // [hd]
  float* p = sm + hd;             // [kAttnThreads] this chunk's weights
  float* acc = p + kAttnThreads;  // [hd]
  const int t = blockIdx.x, h = blockIdx.y, kvh = h / (n_heads / n_kv), tid = threadIdx.x;
  const int n_ctx = pos0 + t + 1, row = n_kv * hd;
  const float scale = 1.0f / sqrtf(float(hd));
  for (int i = tid; i < hd; i += blockDim.x) {
    q[i] = qall[size_t(t) * n_heads * hd + size_t(h) * hd + i];
    acc[i] = 0.f;
  }
  __syncthreads();
  float m = -INFINITY;
  double l = 0;
  for (int j0 = 0; j0 < n_ctx; j0 += kAttnThreads) {
    const int j = j0 + tid;
    float s = -INFINITY;
    if (j < n_ctx) {
      const float* kr = K + size_t(j) * row + size_t(kvh) * hd;
      s = 0;
      for (int i = 0; i < hd; ++i) s += q[i] * kr[i];
      s *= scale;
    }
    const float m_new = fmaxf(m, block_max(s, redf));
    const float e = j < n_ctx ? expf(s - m_new) : 0.f;
    p[tid] = e;
    const float alpha = expf(m - m_new);        // 0 on the first chunk (m = -inf)
    l = l * alpha + block_sum(double(e), red);  // block_sum's barriers also publish p
    const int cnt = min(kAttnThreads, n_ctx - j0);
    for (int i = tid; i < hd; i += blockDim.x) {
      float a = acc[i] * alpha;
      for (int jj = 0; jj < cnt; ++jj) a += p[jj] * V[size_t(j0 + jj) * row + size_t(kvh) * hd + i];
      acc[i] = a;
    }
    m = m_new;
    __syncthreads();  // p is rewritten by the next chunk
  }
  const float* gate = qg + size_t(t) * n_heads * 2 * hd + size_t(h) * 2 * hd + hd;
  float* o = out + size_t(t) * n_heads * hd + size_t(h) * hd;
  for (int i = tid; i < hd; i += blockDim.x) o[i] = float(acc[i] / l) * sigmoid(gate[i]);
}

// Thread per token; as cpu::route_topk (softmax with a double sum, then the k largest, ties to the
// lower index, renormalised in selection order).
__global__ void route_kernel(const float* logits, int n, int stride, int E, int k, int32_t* idx,
                             float* weight) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= n) return;
  const float* l = logits + size_t(t) * stride;
  float mx = -INFINITY;
  for (int e = 0; e < E; ++e) mx = fmaxf(mx, l[e]);
  double sum = 0;
  for (int e = 0; e < E; ++e) sum += expf(l[e] - mx);
  uint32_t taken[kMaxExperts / 32] = {};
  float tot = 0;
  float pk[kMaxTopK];
  int ik[kMaxTopK];
  for (int i = 0; i < k; ++i) {
    int best = -1;
    float bp = 0;
    for (int e = 0; e < E; ++e) {
      if (taken[e / 32] >> (e % 32) & 1u) continue;
      const float pe = float(double(expf(l[e] - mx)) / sum);
      if (best < 0 || pe > bp) {
        best = e;
        bp = pe;
      }
    }
    taken[best / 32] |= 1u << (best % 32);
    ik[i] = best;
    pk[i] = bp;
    tot += bp;
  }
  for (int i = 0; i < k; ++i) {
    idx[size_t(t) * k + i] = ik[i];
    weight[size_t(t) * k + i] = pk[i] / tot;
  }
}

__global__ void swiglu_kernel(const float* g, const float* u, size_t n, float* y) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

// The routed terms are added in ascending expert index, the CPU forward pass's order.
__global__ void moe_combine_kernel(const float* D, const int32_t* idx, const float* weight, int n, int k,
                                   const float* sd, const float* sgate, int H, float* out) {
  const size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (i >= size_t(n) * H) return;
  const int t = int(i / H), c = int(i % H);
  const int32_t* e = idx + size_t(t) * k;
  float acc = 0;
  int prev = -1;
  for (int step = 0; step < k; ++step) {
    int j = -1;  // the slot with the smallest expert index above prev
    for (int s = 0; s < k; ++s)
      if (e[s] > prev && (j < 0 || e[s] < e[j])) j = s;
    acc += weight[size_t(t) * k + j] * D[(size_t(t) * k + j) * H + c];
    prev = e[j];
  }
  out[i] = acc + sigmoid(sgate[t]) * sd[i];
}

int grid_for(size_t n, int threads) { return int(std::min<size_t>((n + threads - 1) / threads, 65535)); }

}  // namespace

void check_linear(const Linear& W, const std::string& what) {
  if (W.in <= 0 || W.in % 8 != 0) fail("f32 plan: {} has input size {}, not a multiple of 8", what, W.in);
  if ((W.fmt == WFormat::kAffine4 || W.fmt == WFormat::kAffine8) && (W.group % 8 != 0 || W.in % W.group != 0))
    fail("f32 plan: {}'s quant group {} does not divide its input size {} in multiples of 8", what, W.group,
         W.in);
  if (W.out <= 0 || (W.out + kWarps - 1) / kWarps > 65535)
    fail("f32 plan: {} has {} output rows (at most {})", what, W.out, 65535 * kWarps);
}

void check_gdn(int n_k, int n_v, int dk, int dv) {
  if (n_k <= 0 || n_v % n_k != 0) fail("f32 plan: {} GDN value heads over {} key heads", n_v, n_k);
  if (sizeof(float) * size_t(2 * dk + 2 * dv) > kMaxDynamicSmem)
    fail("f32 plan: GDN head dims {} / {} exceed the shared memory of one block", dk, dv);
}

void check_attention(int n_heads, int n_kv, int hd, int rotary_dim) {
  if (n_kv <= 0 || n_heads % n_kv != 0)
    fail("f32 plan: {} attention heads over {} key-value heads", n_heads, n_kv);
  if (rotary_dim < 0 || rotary_dim > hd || rotary_dim % 2 != 0)
    fail("f32 plan: rotary dims {} of head_dim {}", rotary_dim, hd);
  if (sizeof(float) * size_t(2 * hd + kAttnThreads) > kMaxDynamicSmem)
    fail("f32 plan: head_dim {} exceeds the shared memory of one block", hd);
}

void check_route(int n_experts, int k) {
  if (n_experts < 1 || n_experts > kMaxExperts || k < 1 || k > kMaxTopK || k > n_experts)
    fail("f32 plan: {} experts, top {} (at most {} experts, top {})", n_experts, k, kMaxExperts, kMaxTopK);
}

void matmul(const Linear& W, const float* X, int n, float* Y) {
  if (n <= 0) return;
  check_linear(W, "matmul");
  constexpr int T = 8;
  const dim3 grid((n + T - 1) / T, (W.out + kWarps - 1) / kWarps);
  matmul_kernel<T><<<grid, kWarps * 32>>>(W, nullptr, nullptr, X, 1, n, Y);
  launch_check("f32 matmul");
}

void matmul_indexed(const Linear* Ws, int n_w, const Linear& shape, const int32_t* idx, const float* X,
                    int x_div, int rows, float* Y) {
  if (rows <= 0) return;
  check_linear(shape, "matmul_indexed");
  TANSY_CHECK(n_w > 0 && x_div > 0, "f32 matmul_indexed: {} matrices, x_div {}", n_w, x_div);
  const dim3 grid(rows, (shape.out + kWarps - 1) / kWarps);
  matmul_kernel<1><<<grid, kWarps * 32>>>(shape, Ws, idx, X, x_div, rows, Y);
  launch_check("f32 matmul_indexed");
}

void embed(const Linear& E, const int32_t* ids, int n, float* out) {
  if (n <= 0) return;
  check_linear(E, "embed");
  embed_kernel<<<n, 128>>>(E, ids, out);
  launch_check("f32 embed");
}

void rmsnorm(const float* x, const float* w, int rows, int dim, float eps, float* y) {
  if (rows <= 0) return;
  rmsnorm_kernel<<<rows, 256>>>(x, w, dim, eps, y);
  launch_check("f32 rmsnorm");
}

void add(float* h, const float* x, size_t n) {
  if (n == 0) return;
  add_kernel<<<grid_for(n, 256), 256>>>(h, x, n);
  launch_check("f32 add");
}

void conv1d(const float* x, int n, float* window, const float* w, int C, int kernel, float* y) {
  if (n <= 0) return;
  TANSY_CHECK(kernel >= 1, "f32 conv1d: kernel {}", kernel);
  conv1d_kernel<<<(C + 127) / 128, 128>>>(x, n, window, w, C, kernel, y);
  launch_check("f32 conv1d");
}

void gdn_core(const GdnCoreArgs& a) {
  if (a.n <= 0) return;
  check_gdn(a.n_k, a.n_v, a.dk, a.dv);
  gdn_core_kernel<<<a.n_v, 128, sizeof(float) * size_t(2 * a.dk + 2 * a.dv)>>>(a);
  launch_check("f32 gdn_core");
}

void attention_prep(const AttnPrepArgs& a) {
  if (a.n <= 0) return;
  check_attention(a.n_heads, a.n_kv, a.hd, a.rotary_dim);
  attention_prep_kernel<<<dim3(a.n, a.n_heads + a.n_kv), 128, sizeof(float) * a.hd>>>(a);
  launch_check("f32 attention_prep");
}

void attention(const float* q, const float* qg, const float* K, const float* V, int n, int pos0, int n_heads,
               int n_kv, int hd, float* out) {
  if (n <= 0) return;
  check_attention(n_heads, n_kv, hd, 0);
  const size_t smem = sizeof(float) * size_t(2 * hd + kAttnThreads);
  attention_kernel<<<dim3(n, n_heads), kAttnThreads, smem>>>(q, qg, K, V, pos0, n_heads, n_kv, hd, out);
  launch_check("f32 attention");
}

void route_topk(const float* logits, int n, int stride, int n_experts, int k, int32_t* idx, float* weight) {
  if (n <= 0) return;
  check_route(n_experts, k);
  TANSY_CHECK(stride >= n_experts, "f32 route: row stride {} < {} experts", stride, n_experts);
  route_kernel<<<(n + 63) / 64, 64>>>(logits, n, stride, n_experts, k, idx, weight);
  launch_check("f32 route_topk");
}

void swiglu(const float* g, const float* u, size_t n, float* y) {
  if (n == 0) return;
  swiglu_kernel<<<grid_for(n, 256), 256>>>(g, u, n, y);
  launch_check("f32 swiglu");
}

void moe_combine(const float* D, const int32_t* idx, const float* weight, int n, int k, const float* sd,
                 const float* sgate, int H, float* out) {
  if (n <= 0) return;
  const size_t total = size_t(n) * H;
  moe_combine_kernel<<<unsigned((total + 255) / 256), 256>>>(D, idx, weight, n, k, sd, sgate, H, out);
  launch_check("f32 moe_combine");
}

}  // namespace tansy::cuda::f32
