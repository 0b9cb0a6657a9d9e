#include <cfloat>
#include <cmath>

#include "cuda/attention_decode.cuh"

#include "cuda/pdl.cuh"

namespace tansy::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kKeysPerStep = 8;  // keys whose loads are in flight together
// Splits shorter than this cost more in the merge than they save; short contexts use fewer.
constexpr int kMinKeysPerSplit = 16;

// Keys per split for a context of `len` keys and at most `splits` splits; the splits in use are
// ceil(len / keys), none of them empty. Both kernels derive the same numbers from the position.
__device__ __forceinline__ int split_keys(int len, int splits) {
  const int used = min(splits, (len + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
  return (len + used - 1) / used;
}
constexpr double kTwoPi = 6.283185307179586476925286766559;

// Block per (head, token); head < n_heads is a query head, else a kv head. blockDim = 256.
__global__ void __launch_bounds__(kHeadDim) qk_norm_rope_kernel(QkvLayout L, const int* __restrict__ pos,
                                                                const float* __restrict__ q_norm,
                                                                const float* __restrict__ k_norm, float eps, int rot,
                                                                double theta, bf16* k_cache, bf16* v_cache) {
  __shared__ float xs[kHeadDim];
  __shared__ float red[kHeadDim / 32];
  pdl_wait();
  pdl_launch_dependents();
  const int head = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
  const int p = *pos + t;
  const bool is_q = head < L.n_heads;
  const int kvh = head - L.n_heads;
  bf16* row = L.base + int64_t(t) * L.ld;
  bf16* src = is_q ? row + int64_t(head) * 2 * kHeadDim : row + L.k_off() + int64_t(kvh) * kHeadDim;
  const float x = __bfloat162float(src[d]);
  float s = x * x;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (d % 32 == 0) red[d / 32] = s;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < kHeadDim / 32; ++i) tot += red[i];
  const float y = x * rsqrtf(tot / float(kHeadDim) + eps) * (is_q ? q_norm[d] : k_norm[d]);
  xs[d] = y;
  __syncthreads();
  float out = y;
  if (d < rot) {
    const int half = rot / 2, j = d % half;
    // The angle in double: at positions ~1e5 an f32 product would be off by ~1e-2 rad.
    const double inv_freq = exp(-(2.0 * j / rot) * log(theta));
    const float ang = float(fmod(double(p) * inv_freq, kTwoPi));
    float sn, cs;
    sincosf(ang, &sn, &cs);
    out = d < half ? y * cs - xs[d + half] * sn : y * cs + xs[d - half] * sn;
  }
  if (is_q) {
    src[d] = __float2bfloat16(out);
  } else {
    const int64_t c = (int64_t(p) * L.n_kv + kvh) * kHeadDim + d;
    k_cache[c] = __float2bfloat16(out);
    v_cache[c] = row[L.v_off() + int64_t(kvh) * kHeadDim + d];
  }
}

__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Block per (kv head, split, token); warp w handles query heads w, w+8, ... of the group; each
// lane owns 8 of the 256 dims. Online softmax over the split's keys, partial results to scratch.
__global__ void __launch_bounds__(kWarps * 32) attn_split_kernel(QkvLayout L, const int* __restrict__ pos,
                                                                 const bf16* __restrict__ k_cache,
                                                                 const bf16* __restrict__ v_cache, int splits,
                                                                 float* __restrict__ scratch) {
  const int kvh = blockIdx.x, s = blockIdx.y, t = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = L.n_heads / L.n_kv;
  pdl_wait();
  pdl_launch_dependents();
  const int len = *pos + t + 1;
  const int chunk = split_keys(len, splits);
  if (s * chunk >= len) return;  // a split the merge does not read
  const int b = s * chunk, e = min(len, b + chunk);
  const float scale = rsqrtf(float(kHeadDim));
  const int64_t kv_stride = int64_t(L.n_kv) * kHeadDim;
  const bf16* kbase = k_cache + int64_t(kvh) * kHeadDim + lane * 8;
  const bf16* vbase = v_cache + int64_t(kvh) * kHeadDim + lane * 8;
  for (int hi = warp; hi < group; hi += kWarps) {
    const int h = kvh * group + hi;
    float q[8];
    bf16x8_to_f32(*reinterpret_cast<const uint4*>(L.base + int64_t(t) * L.ld + int64_t(h) * 2 * kHeadDim + lane * 8), q);
    float m = -FLT_MAX, l = 0.f, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j0 = b; j0 < e; j0 += kKeysPerStep) {
      // The step's keys and values are loaded together: one memory latency per step.
      uint4 kr[kKeysPerStep], vr[kKeysPerStep];
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        const bool in = j0 + u < e;
        kr[u] = in ? *reinterpret_cast<const uint4*>(kbase + int64_t(j0 + u) * kv_stride) : make_uint4(0, 0, 0, 0);
        vr[u] = in ? *reinterpret_cast<const uint4*>(vbase + int64_t(j0 + u) * kv_stride) : make_uint4(0, 0, 0, 0);
      }
      float sc[kKeysPerStep];
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        float kf[8];
        bf16x8_to_f32(kr[u], kf);
        float dsum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dsum = fmaf(q[i], kf[i], dsum);
        sc[u] = dsum;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int u = 0; u < kKeysPerStep; ++u) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], o);
      float mx = m;
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        sc[u] = j0 + u < e ? sc[u] * scale : -FLT_MAX;
        mx = fmaxf(mx, sc[u]);
      }
      const float corr = __expf(m - mx);
      l *= corr;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] *= corr;
      m = mx;
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        const float pr = j0 + u < e ? __expf(sc[u] - m) : 0.f;
        l += pr;
        float vf[8];
        bf16x8_to_f32(vr[u], vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(pr, vf[i], acc[i]);
      }
    }
    float* part = scratch + ((int64_t(t) * L.n_heads + h) * splits + s) * kAttnPartStride;
    *reinterpret_cast<float4*>(part + lane * 8) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    *reinterpret_cast<float4*>(part + lane * 8 + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
    if (lane == 0) {
      part[kHeadDim] = m;
      part[kHeadDim + 1] = l;
    }
  }
}

template <bool MAX>
__device__ float block_reduce(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = MAX ? fmaxf(v, w) : v + w;
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < int(blockDim.x / 32); ++w) r = MAX ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is reused by the next reduction
  return r;
}

// Block per (head, token): merge the splits, normalise, gate. Thread s first reads split s's max
// and sum (so the merge weights cost one load latency, not one per split); then kCombineGroups
// groups of kHeadDim threads (thread = dim) sum interleaved splits' partial outputs with many
// loads in flight, and group 0 adds the groups up.
constexpr int kCombineGroups = 4;
constexpr int kCombineThreads = kHeadDim * kCombineGroups;
static_assert(kMaxAttnSplits <= kCombineThreads);

__global__ void __launch_bounds__(kCombineThreads) attn_combine_kernel(QkvLayout L, const int* __restrict__ pos,
                                                                       int splits, const float* __restrict__ scratch,
                                                                       bf16* __restrict__ out, int64_t ldo) {
  __shared__ float f[kMaxAttnSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float part_o[kCombineGroups - 1][kHeadDim];
  const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, d = tid % kHeadDim, g = tid / kHeadDim;
  pdl_wait();
  pdl_launch_dependents();
  const int len = *pos + t + 1, chunk = split_keys(len, splits), used = (len + chunk - 1) / chunk;
  const float* part = scratch + (int64_t(t) * L.n_heads + h) * splits * kAttnPartStride;
  const float ms = tid < used ? part[int64_t(tid) * kAttnPartStride + kHeadDim] : -FLT_MAX;
  const float ls = tid < used ? part[int64_t(tid) * kAttnPartStride + kHeadDim + 1] : 0.f;
  const float M = block_reduce<true>(ms, red);
  const float fs = ls != 0.f ? __expf(ms - M) : 0.f;  // every split in use holds >= 1 key: ls >= 1
  if (tid < kMaxAttnSplits) f[tid] = fs;
  const float l = block_reduce<false>(fs * ls, red);  // its barriers also publish f
  float o = 0.f;
#pragma unroll 8
  for (int s = g; s < used; s += kCombineGroups) o = fmaf(part[int64_t(s) * kAttnPartStride + d], f[s], o);
  if (g > 0) part_o[g - 1][d] = o;
  __syncthreads();
  if (g != 0) return;
#pragma unroll
  for (int i = 0; i < kCombineGroups - 1; ++i) o += part_o[i][d];
  o /= l;
  const float gt = __bfloat162float(L.base[int64_t(t) * L.ld + int64_t(h) * 2 * kHeadDim + kHeadDim + d]);
  out[int64_t(t) * ldo + int64_t(h) * kHeadDim + d] = __float2bfloat16(o / (1.f + __expf(-gt)));
}

void check_layout(const QkvLayout& L, int n, const char* what) {
  TANSY_CHECK(L.base && aligned16(L.base) && L.ld % 8 == 0 && L.ld >= L.v_off() + int64_t(L.n_kv) * kHeadDim,
              "{}: qkv rows must be 16-byte aligned and hold {} values (ld {})", what,
              L.v_off() + int64_t(L.n_kv) * kHeadDim, L.ld);
  TANSY_CHECK(L.n_kv >= 1 && L.n_heads >= L.n_kv && L.n_heads % L.n_kv == 0, "{}: {} heads over {} kv heads", what,
              L.n_heads, L.n_kv);
  TANSY_CHECK(n >= 1 && n <= 65535, "{}: {} tokens outside 1..65535", what, n);
}

}  // namespace

void qk_norm_rope(const QkvLayout& qkv, int n, const int* pos, const float* q_norm, const float* k_norm, float eps,
                  int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, cudaStream_t stream) {
  check_layout(qkv, n, "qk_norm_rope");
  TANSY_CHECK(rotary_dim >= 0 && rotary_dim <= kHeadDim && rotary_dim % 2 == 0, "qk_norm_rope: rotary_dim {} invalid",
              rotary_dim);
  TANSY_CHECK(theta > 0 && pos && q_norm && k_norm && k_cache && v_cache, "qk_norm_rope: bad arguments");
  pdl_launch(qk_norm_rope_kernel, dim3(qkv.n_heads + qkv.n_kv, n), dim3(kHeadDim), 0, stream, qkv, pos, q_norm,
             k_norm, eps, rotary_dim, theta, k_cache, v_cache);
}

void attention_decode(const QkvLayout& qkv, int n, const int* pos, const bf16* k_cache, const bf16* v_cache,
                      int splits, float* scratch, bf16* out, int64_t ldo, cudaStream_t stream) {
  check_layout(qkv, n, "attention_decode");
  TANSY_CHECK(splits >= 1 && splits <= kMaxAttnSplits, "attention_decode: {} splits outside 1..{}", splits,
              kMaxAttnSplits);
  TANSY_CHECK(pos && k_cache && v_cache && scratch && out && ldo >= int64_t(qkv.n_heads) * kHeadDim,
              "attention_decode: bad arguments");
  TANSY_CHECK(aligned16(k_cache) && aligned16(v_cache) && aligned16(scratch), "attention_decode: misaligned buffers");
  pdl_launch(attn_split_kernel, dim3(qkv.n_kv, splits, n), dim3(kWarps * 32), 0, stream, qkv, pos, k_cache, v_cache,
             splits, scratch);
  pdl_launch(attn_combine_kernel, dim3(qkv.n_heads, n), dim3(kCombineThreads), 0, stream, qkv, pos, splits, scratch,
             out, ldo);
}

}  // namespace tansy::cuda
