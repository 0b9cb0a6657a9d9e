#include <cfloat>
#include <cmath>

#include "cuda/attention/attention.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/tensor_core.cuh"

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

__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* f) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 f32_to_bf16x8(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    w[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Threads j < rot / 2 of the block write cos and sin of position p's angle for frequency j
// (NeoX: theta^(-2j/rot)) to cs[j] / sn[j]; the caller syncs before reading them.
__device__ __forceinline__ void rope_table(int p, int rot, double theta, float* cs, float* sn) {
  const int j = threadIdx.x;
  if (j >= rot / 2) return;
  // The angle in double: at positions ~1e5 an f32 product would be off by ~1e-2 rad.
  const double inv_freq = exp(-(2.0 * j / rot) * log(theta));
  sincosf(float(fmod(double(p) * inv_freq, kTwoPi)), &sn[j], &cs[j]);
}

// One warp RMS-norms the 256 values at src (weight w) and rotates the first `rot` dims (NeoX
// halves) by the angles of rope_table. Lane owns dims lane*8 .. lane*8+7, returned in y (f32).
// Needs rot % 16 == 0, so that a dim's rotation partner sits in another lane at the same slot.
__device__ __forceinline__ void norm_rope_warp(const bf16* __restrict__ src, const float* __restrict__ w,
                                               float eps, int rot, const float* cs, const float* sn,
                                               float (&y)[8]) {
  const int lane = threadIdx.x % 32;
  float x[8];
  bf16x8_to_f32(*reinterpret_cast<const uint4*>(src + lane * 8), x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(x[i], x[i], s);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  const float r = rsqrtf(s / float(kHeadDim) + eps);
#pragma unroll
  for (int i = 0; i < 8; ++i) y[i] = x[i] * r * w[lane * 8 + i];
  const int half = rot / 2, lanes_half = half / 8;
  const bool rotated = lane * 8 < rot;
  const int partner_lane = !rotated ? lane : lane < lanes_half ? lane + lanes_half : lane - lanes_half;
  float partner[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) partner[i] = __shfl_sync(0xffffffffu, y[i], partner_lane);
  if (!rotated) return;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int d = lane * 8 + i, j = d % half;
    y[i] = d < half ? y[i] * cs[j] - partner[i] * sn[j] : y[i] * cs[j] + partner[i] * sn[j];
  }
}

// Warp per (head, token); head < n_heads is a query head, else a kv head. 8 heads per block.
// The position (advanced by the previous step, never by the kernel just before) is read before
// the PDL wait, so the rotation angles are computed while the predecessor finishes.
constexpr int kRopeWarps = 8;
__global__ void __launch_bounds__(kRopeWarps * 32)
    qk_norm_rope_kernel(QkvLayout L, const int* __restrict__ pos, const float* __restrict__ q_norm,
                        const float* __restrict__ k_norm, float eps, int rot, double theta, bf16* k_cache,
                        bf16* v_cache) {
  __shared__ float cs[kHeadDim / 2], sn[kHeadDim / 2];
  const int head = blockIdx.x * kRopeWarps + threadIdx.x / 32, t = blockIdx.y, lane = threadIdx.x % 32;
  const int p = *pos + t;
  rope_table(p, rot, theta, cs, sn);
  __syncthreads();
  pdl_wait();
  pdl_launch_dependents();
  if (head >= L.n_heads + L.n_kv) return;
  const bool is_q = head < L.n_heads;
  const int kvh = head - L.n_heads;
  bf16* row = L.base + int64_t(t) * L.ld;
  bf16* src = is_q ? row + int64_t(head) * 2 * kHeadDim : row + L.k_off() + int64_t(kvh) * kHeadDim;
  float y[8];
  norm_rope_warp(src, is_q ? q_norm : k_norm, eps, rot, cs, sn, y);
  const uint4 packed = f32_to_bf16x8(y);
  if (is_q) {
    *reinterpret_cast<uint4*>(src + lane * 8) = packed;
  } else {
    const int64_t c = (int64_t(p) * L.n_kv + kvh) * kHeadDim + lane * 8;
    *reinterpret_cast<uint4*>(k_cache + c) = packed;
    *reinterpret_cast<uint4*>(v_cache + c) =
        *reinterpret_cast<const uint4*>(row + L.v_off() + int64_t(kvh) * kHeadDim + lane * 8);
  }
}

// Block per (kv head, split, token); warp w handles query heads w, w+8, ... of the group; each
// lane owns 8 of the 256 dims. Online softmax over the split's keys, partial results to scratch.
__global__ void __launch_bounds__(kWarps * 32)
    attn_split_kernel(QkvLayout L, const int* __restrict__ pos, const bf16* __restrict__ k_cache,
                      const bf16* __restrict__ v_cache, int splits, float* __restrict__ scratch) {
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
    bf16x8_to_f32(
        *reinterpret_cast<const uint4*>(L.base + int64_t(t) * L.ld + int64_t(h) * 2 * kHeadDim + lane * 8),
        q);
    float m = -FLT_MAX, l = 0.f, acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j0 = b; j0 < e; j0 += kKeysPerStep) {
      // The step's keys and values are loaded together: one memory latency per step.
      uint4 kr[kKeysPerStep], vr[kKeysPerStep];
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        const bool in = j0 + u < e;
        kr[u] = in ? *reinterpret_cast<const uint4*>(kbase + int64_t(j0 + u) * kv_stride)
                   : make_uint4(0, 0, 0, 0);
        vr[u] = in ? *reinterpret_cast<const uint4*>(vbase + int64_t(j0 + u) * kv_stride)
                   : make_uint4(0, 0, 0, 0);
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

// ---- One-token decode: q/k norm + RoPE + cache write + split attention in one kernel ----
// Block per (kv head, split), 8 warps. Before the PDL wait (the position and the cache rows < pos
// were written by earlier steps, never by the projection just before) the block starts cp.async
// copies of its first kFusedStages tiles of cached keys and values into shared memory and
// computes the rotation angles; after it, it norms and rotates the group's query heads and the
// new key, and the block whose split holds the position writes the new k/v into the cache. Warp w
// handles keys 4w .. 4w+3 of every 32-key tile for all G query heads (lane = 8 dims) with its own
// online softmax; the warps merge at the end into the same partials attn_split_kernel writes.
constexpr int kFusedWarps = 8;
constexpr int kKeysPerWarp = 4;
constexpr int kFusedTile = kFusedWarps * kKeysPerWarp;  // keys per tile
constexpr int kFusedStages = 3;                         // tiles in flight
constexpr int kTileElems = kFusedTile * kHeadDim;

template <int G>
constexpr size_t fused_smem_bytes() {
  constexpr size_t tiles = size_t(2) * kFusedStages * kTileElems * sizeof(bf16);
  constexpr size_t merge = (size_t(2) * kFusedWarps * G + size_t(kFusedWarps) * G * kHeadDim) * sizeof(float);
  static_assert(merge <= tiles, "the warps' merge reuses the tile buffers");
  return tiles + 2 * kHeadDim * sizeof(bf16) + size_t(G) * kHeadDim * sizeof(float);
}

struct FusedArgs {
  QkvLayout L;
  const int* pos;
  const float* q_norm;
  const float* k_norm;
  float eps;
  int rot;
  double theta;
  bf16* k_cache;
  bf16* v_cache;
  int splits;
  float* scratch;
};

// Reduce-scatter of N values over a warp: at lane offset O a lane keeps the half of its values
// selected by lane bit O and adds its partner's copy of them; once one value is left the rest of
// the levels are a plain sum. In the end lane holds the warp's total of value lane / (32 / N).
template <int N, int O>
__device__ __forceinline__ void reduce_scatter(float* v, int lane) {
  if constexpr (O >= 1) {
    if constexpr (N > 1) {
      const bool upper = lane & O;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = upper ? v[i] : v[i + N / 2];
        const float keep = upper ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, O);
      }
      reduce_scatter<N / 2, O / 2>(v, lane);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], O);
      reduce_scatter<1, O / 2>(v, lane);
    }
  }
}

template <int G>
__global__ void __launch_bounds__(kFusedWarps * 32, 1) attn_decode_fused_kernel(FusedArgs a) {
  using namespace tc;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Kt = reinterpret_cast<bf16*>(smem);  // [stages][tile][256]
  bf16* Vt = Kt + kFusedStages * kTileElems;
  bf16* Kn = Vt + kFusedStages * kTileElems;  // the new key and value, bf16 as cached
  bf16* Vn = Kn + kHeadDim;
  float* qs = reinterpret_cast<float*>(Vn + kHeadDim);  // [G][256]
  __shared__ float cs[kHeadDim / 2], sn[kHeadDim / 2];
  const QkvLayout& L = a.L;
  const int kvh = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int p = *a.pos, len = p + 1;
  const int chunk = split_keys(len, a.splits), b = s * chunk;
  if (b >= len) return;  // a split the merge does not read (split 0 always runs and waits)
  const int e = min(len, b + chunk), old_end = min(e, p);
  const int n_old = max(0, old_end - b), n_tiles = (n_old + kFusedTile - 1) / kFusedTile;
  const int64_t kv_stride = int64_t(L.n_kv) * kHeadDim;
  const bf16* kg = a.k_cache + int64_t(kvh) * kHeadDim;
  const bf16* vg = a.v_cache + int64_t(kvh) * kHeadDim;
  auto issue = [&](int tile) {
    if (tile < n_tiles) {
      bf16* kd = Kt + (tile % kFusedStages) * kTileElems;
      bf16* vd = Vt + (tile % kFusedStages) * kTileElems;
      for (int c = tid; c < kFusedTile * (kHeadDim / 8); c += kFusedWarps * 32) {
        const int r = c / (kHeadDim / 8), col = (c % (kHeadDim / 8)) * 8;
        const int key = b + tile * kFusedTile + r;
        const bool ok = key < old_end;
        const int64_t off = int64_t(ok ? key : b) * kv_stride + col;
        cp_async16(kd + r * kHeadDim + col, kg + off, ok);
        cp_async16(vd + r * kHeadDim + col, vg + off, ok);
      }
    }
    cp_async_commit();  // one group per tile, empty past the end: the wait count stays uniform
  };
#pragma unroll
  for (int i = 0; i < kFusedStages; ++i) issue(i);
  rope_table(p, a.rot, a.theta, cs, sn);
  __syncthreads();
  pdl_wait();
  pdl_launch_dependents();

  // The new token: G query heads and the kv head's key, normed and rotated; q rounded to bf16 as
  // the unfused path stores it, k as the cache stores it.
  for (int hh = warp; hh <= G; hh += kFusedWarps) {
    float y[8];
    if (hh < G) {
      norm_rope_warp(L.base + int64_t(kvh * G + hh) * 2 * kHeadDim, a.q_norm, a.eps, a.rot, cs, sn, y);
      float r[8];
      bf16x8_to_f32(f32_to_bf16x8(y), r);
      *reinterpret_cast<float4*>(qs + hh * kHeadDim + lane * 8) = make_float4(r[0], r[1], r[2], r[3]);
      *reinterpret_cast<float4*>(qs + hh * kHeadDim + lane * 8 + 4) = make_float4(r[4], r[5], r[6], r[7]);
    } else {
      norm_rope_warp(L.base + L.k_off() + int64_t(kvh) * kHeadDim, a.k_norm, a.eps, a.rot, cs, sn, y);
      const uint4 kb = f32_to_bf16x8(y);
      const uint4 vb =
          *reinterpret_cast<const uint4*>(L.base + L.v_off() + int64_t(kvh) * kHeadDim + lane * 8);
      *reinterpret_cast<uint4*>(Kn + lane * 8) = kb;
      *reinterpret_cast<uint4*>(Vn + lane * 8) = vb;
      if (e == len) {  // this split holds the position: the only block that writes the cache row
        *reinterpret_cast<uint4*>(a.k_cache + int64_t(p) * kv_stride + int64_t(kvh) * kHeadDim + lane * 8) =
            kb;
        *reinterpret_cast<uint4*>(a.v_cache + int64_t(p) * kv_stride + int64_t(kvh) * kHeadDim + lane * 8) =
            vb;
      }
    }
  }
  __syncthreads();
  float q[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h)
#pragma unroll
    for (int i = 0; i < 8; ++i) q[h][i] = qs[h * kHeadDim + lane * 8 + i];
  float m[G], l[G], acc[G][8];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
  }
  const float scale = rsqrtf(float(kHeadDim));
  // (key, head) pairs of a warp per tile; after the reduce-scatter below lane holds pair
  // lane / (32 / NP), i.e. key lane / 8 and head (lane % 8) / (8 / G): keys differ in lane bits 3, 4.
  constexpr int NP = kKeysPerWarp * G;
  constexpr int kHeadLanes = 8 / G;
  static_assert(NP <= 32 && 32 % NP == 0 && 8 % G == 0, "G must be 1, 2, 4 or 8");
  auto process = [&](const bf16* Ks, const bf16* Vs, int nvalid) {
    float v[NP];
    uint4 vr[kKeysPerWarp];
#pragma unroll
    for (int k = 0; k < kKeysPerWarp; ++k) {
      const int kk = warp * kKeysPerWarp + k;
      uint4 kr = make_uint4(0, 0, 0, 0);
      vr[k] = make_uint4(0, 0, 0, 0);
      if (kk < nvalid) {
        kr = *reinterpret_cast<const uint4*>(Ks + kk * kHeadDim + lane * 8);
        vr[k] = *reinterpret_cast<const uint4*>(Vs + kk * kHeadDim + lane * 8);
      }
      float kf[8];
      bf16x8_to_f32(kr, kf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) d = fmaf(q[h][i], kf[i], d);
        v[k * G + h] = d;
      }
    }
    reduce_scatter<NP, 16>(v, lane);
    const int my_k = lane / 8, my_h = (lane % 8) / kHeadLanes;
    const bool valid = warp * kKeysPerWarp + my_k < nvalid;
    const float sc = valid ? v[0] * scale : -FLT_MAX;
    float tmax = fmaxf(sc, __shfl_xor_sync(0xffffffffu, sc, 8));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 16));
    float mnew[G], corr[G], mine = 0.f;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      mnew[h] = fmaxf(m[h], __shfl_sync(0xffffffffu, tmax, h * kHeadLanes));
      corr[h] = __expf(m[h] - mnew[h]);
      if (h == my_h) mine = mnew[h];
    }
    const float pr = valid ? __expf(sc - mine) : 0.f;
    float ps = pr + __shfl_xor_sync(0xffffffffu, pr, 8);
    ps += __shfl_xor_sync(0xffffffffu, ps, 16);
#pragma unroll
    for (int h = 0; h < G; ++h) {
      l[h] = l[h] * corr[h] + __shfl_sync(0xffffffffu, ps, h * kHeadLanes);
      m[h] = mnew[h];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] *= corr[h];
    }
#pragma unroll
    for (int k = 0; k < kKeysPerWarp; ++k) {
      float vf[8];
      bf16x8_to_f32(vr[k], vf);
#pragma unroll
      for (int h = 0; h < G; ++h) {
        const float pk = __shfl_sync(0xffffffffu, pr, k * 8 + h * kHeadLanes);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(pk, vf[i], acc[h][i]);
      }
    }
  };
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kFusedStages - 1>();
    __syncthreads();
    const int slot = t % kFusedStages;
    process(Kt + slot * kTileElems, Vt + slot * kTileElems, min(kFusedTile, n_old - t * kFusedTile));
    __syncthreads();  // the slot is free for the tile kFusedStages ahead
    issue(t + kFusedStages);
  }
  if (e == len) process(Kn, Vn, 1);

  // Merge the warps: per head, rescale each warp's sums to the common max.
  cp_async_wait<0>();
  __syncthreads();
  float* mb = reinterpret_cast<float*>(smem);  // [warp][G], reusing the tiles
  float* lb = mb + kFusedWarps * G;
  float* ab = lb + kFusedWarps * G;  // [warp][G][256]
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (lane == 0) {
      mb[warp * G + h] = m[h];
      lb[warp * G + h] = l[h];
    }
    float* dst = ab + (warp * G + h) * kHeadDim + lane * 8;
    *reinterpret_cast<float4*>(dst) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
    *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
  }
  __syncthreads();
  if (warp >= G) return;
  const int h = warp;
  float M = -FLT_MAX;
#pragma unroll
  for (int w = 0; w < kFusedWarps; ++w) M = fmaxf(M, mb[w * G + h]);
  float Ls = 0.f, o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int w = 0; w < kFusedWarps; ++w) {
    const float lw = lb[w * G + h];
    const float f = lw > 0.f ? __expf(mb[w * G + h] - M) : 0.f;  // a warp with no key has l = 0
    Ls = fmaf(f, lw, Ls);
    const float* src = ab + (w * G + h) * kHeadDim + lane * 8;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = fmaf(f, src[i], o[i]);
  }
  float* part = a.scratch + (int64_t(kvh * G + h) * a.splits + s) * kAttnPartStride;
  *reinterpret_cast<float4*>(part + lane * 8) = make_float4(o[0], o[1], o[2], o[3]);
  *reinterpret_cast<float4*>(part + lane * 8 + 4) = make_float4(o[4], o[5], o[6], o[7]);
  if (lane == 0) {
    part[kHeadDim] = M;
    part[kHeadDim + 1] = Ls;
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

__global__ void __launch_bounds__(kCombineThreads)
    attn_combine_kernel(QkvLayout L, const int* __restrict__ pos, int splits,
                        const float* __restrict__ scratch, bf16* __restrict__ out, int64_t ldo) {
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
  TANSY_CHECK(L.n_kv >= 1 && L.n_heads >= L.n_kv && L.n_heads % L.n_kv == 0, "{}: {} heads over {} kv heads",
              what, L.n_heads, L.n_kv);
  TANSY_CHECK(n >= 1 && n <= 65535, "{}: {} tokens outside 1..65535", what, n);
}

void check_rotary(int rotary_dim, const char* what) {
  TANSY_CHECK(rotary_dim >= 0 && rotary_dim <= kHeadDim && rotary_dim % 16 == 0,
              "{}: rotary_dim {} unsupported (a multiple of 16 up to {})", what, rotary_dim, kHeadDim);
}

// The split pass's arguments, shared by attention_decode and attention_decode_fused.
void check_splits(const QkvLayout& L, const int* pos, const void* k_cache, const void* v_cache, int splits,
                  const float* scratch, const bf16* out, int64_t ldo, const char* what) {
  TANSY_CHECK(splits >= 1 && splits <= kMaxAttnSplits, "{}: {} splits outside 1..{}", what, splits,
              kMaxAttnSplits);
  TANSY_CHECK(pos && k_cache && v_cache && scratch && out && ldo >= int64_t(L.n_heads) * kHeadDim,
              "{}: bad arguments", what);
  TANSY_CHECK(aligned16(k_cache) && aligned16(v_cache) && aligned16(scratch), "{}: misaligned buffers", what);
}

}  // namespace

void qk_norm_rope(const QkvLayout& qkv, int n, const int* pos, const float* q_norm, const float* k_norm,
                  float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache,
                  cudaStream_t stream) {
  check_layout(qkv, n, "qk_norm_rope");
  check_rotary(rotary_dim, "qk_norm_rope");
  TANSY_CHECK(theta > 0 && pos && q_norm && k_norm && k_cache && v_cache, "qk_norm_rope: bad arguments");
  pdl_launch(qk_norm_rope_kernel, dim3((qkv.n_heads + qkv.n_kv + kRopeWarps - 1) / kRopeWarps, n),
             dim3(kRopeWarps * 32), 0, stream, qkv, pos, q_norm, k_norm, eps, rotary_dim, theta, k_cache,
             v_cache);
}

void attention_decode(const QkvLayout& qkv, int n, const int* pos, const bf16* k_cache, const bf16* v_cache,
                      int splits, float* scratch, bf16* out, int64_t ldo, cudaStream_t stream) {
  check_layout(qkv, n, "attention_decode");
  check_splits(qkv, pos, k_cache, v_cache, splits, scratch, out, ldo, "attention_decode");
  pdl_launch(attn_split_kernel, dim3(qkv.n_kv, splits, n), dim3(kWarps * 32), 0, stream, qkv, pos, k_cache,
             v_cache, splits, scratch);
  pdl_launch(attn_combine_kernel, dim3(qkv.n_heads, n), dim3(kCombineThreads), 0, stream, qkv, pos, splits,
             scratch, out, ldo);
}

namespace {
template <int G>
void launch_fused(const FusedArgs& a, cudaStream_t stream) {
  constexpr size_t kSmem = fused_smem_bytes<G>();
  static const bool attr_set =
      cudaFuncSetAttribute(attn_decode_fused_kernel<G>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           int(kSmem)) == cudaSuccess;
  TANSY_CHECK(attr_set, "attention_decode_fused: cannot reserve {} bytes of shared memory per block", kSmem);
  pdl_launch(attn_decode_fused_kernel<G>, dim3(a.L.n_kv, a.splits), dim3(kFusedWarps * 32), kSmem, stream, a);
}
}  // namespace

void attention_decode_fused(const QkvLayout& qkv, const int* pos, const float* q_norm, const float* k_norm,
                            float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, int splits,
                            float* scratch, bf16* out, int64_t ldo, cudaStream_t stream) {
  check_layout(qkv, 1, "attention_decode_fused");
  check_rotary(rotary_dim, "attention_decode_fused");
  check_splits(qkv, pos, k_cache, v_cache, splits, scratch, out, ldo, "attention_decode_fused");
  TANSY_CHECK(theta > 0 && q_norm && k_norm, "attention_decode_fused: bad arguments");
  FusedArgs a{qkv, pos, q_norm, k_norm, eps, rotary_dim, theta, k_cache, v_cache, splits, scratch};
  switch (qkv.n_heads / qkv.n_kv) {
    case 1:
      launch_fused<1>(a, stream);
      break;
    case 2:
      launch_fused<2>(a, stream);
      break;
    case 4:
      launch_fused<4>(a, stream);
      break;
    case 8:
      launch_fused<8>(a, stream);
      break;
    default:
      fail("attention_decode_fused: {} query heads per kv head unsupported (1, 2, 4 or 8)",
           qkv.n_heads / qkv.n_kv);
  }
  pdl_launch(attn_combine_kernel, dim3(qkv.n_heads, 1), dim3(kCombineThreads), 0, stream, qkv, pos, splits,
             scratch, out, ldo);
}

}  // namespace tansy::cuda
