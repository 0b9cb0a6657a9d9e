#include <algorithm>
#include <cfloat>
#include <cmath>

#include "cuda/attention/attention.cuh"
#include "cuda/common/grid_sync.cuh"
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
// copies of its first STAGES tiles of cached keys and values into shared memory and
// computes the rotation angles; after it, it norms and rotates the group's query heads and the
// new key, and the block whose split holds the position writes the new k/v into the cache (and
// into its last tile in shared memory). The products run on tensor cores (mma m16n8k16, bf16 in,
// f32 out): S = Q·Kᵀ with the G query heads as the rows (padded to 16) and Oᵀ += Vᵀ·Pᵀ with the
// heads as the columns, so P goes from S's accumulator to Pᵀ's operand without a shuffle. Warp
// (grp, ds) = (warp & 1, warp >> 1) takes keys grp*16 .. +15 of every 32-key tile and output dims
// ds*64 .. +63; the two key groups keep their own online softmax and merge at the end into the
// same partials attn_split_kernel writes. P is rounded to bf16 for the product, as in prefill.
// With FusedArgs::counters (one token) the first splits then merge the kv head's query heads
// (merge_task) instead of attn_combine_kernel.
constexpr int kFusedWarps = 8;
constexpr int kFusedTile = 32;  // keys per tile: two groups of 16 (one mma's n x 2)
// Tiles in flight: one token's 2 x 64 blocks take a multiprocessor each, and 3 tiles (96 KiB of K
// and V) keep the long contexts' loads going; a batched step's n x 128 blocks run two a
// multiprocessor with 2 (64 KiB, and at most 128 registers a thread), so that one block's
// prologue (the rotation, Q's fragments) overlaps the other's loads. The stages change only when
// a tile is copied, not the arithmetic: a row gets the same bits in both.
constexpr int kFusedStages = 3, kFusedStagesBatched = 2;
constexpr int kTileElems = kFusedTile * kHeadDim;

template <int G, int STAGES>
constexpr size_t fused_smem_bytes() {
  constexpr size_t tiles = size_t(2) * STAGES * kTileElems * sizeof(bf16);
  constexpr size_t merge = (size_t(2) * 2 * 8 + size_t(2) * 8 * kHeadDim) * sizeof(float);
  static_assert(merge <= tiles, "the key groups' merge reuses the tile buffers");
  // + the new key and value, q as f32 [G][256], q as the bf16 A operand [16][256]
  return tiles + 2 * kHeadDim * sizeof(bf16) + size_t(G) * kHeadDim * sizeof(float) +
         size_t(16) * kHeadDim * sizeof(bf16);
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
  // The splits merged in the kernel (one token, attention_decode_fused's merge_counters): per kv
  // head a counter of its splits done (zero before the launch), and the output [heads][256].
  unsigned* counters;
  bf16* out;
};

// A merge task of the fused kernel: head kvh·G + task / kMergeParts, dims (task % kMergeParts)·64
// .. +63. 256 threads = 4 groups of 64 dims, the combine kernel's 4 groups of interleaved splits.
constexpr int kMergeParts = 4;
constexpr int kMergeDims = kHeadDim / kMergeParts;

// The merge of one task, by the block's 256 threads, with the combine kernel's sums in the same
// order (attn_combine_kernel below: its block reductions over 1,024 threads see zeros past the
// splits in use, which add nothing; the maximum does not depend on the order), so both give the
// same bits. The partials were written by other blocks: read through L2.
__device__ void merge_task(const QkvLayout& L, const float* scratch, int splits, int used, int head, int part,
                           bf16* out) {
  __shared__ float f[kMaxAttnSplits];
  __shared__ float red[2][kFusedWarps];
  __shared__ float po[kMergeParts - 1][kMergeDims];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const float* pt = scratch + int64_t(head) * splits * kAttnPartStride;
  static_assert(kMaxAttnSplits == kFusedWarps * 32 && kMergeParts * kMergeDims == kFusedWarps * 32);
  const float ms = tid < used ? __ldcg(pt + int64_t(tid) * kAttnPartStride + kHeadDim) : -FLT_MAX;
  const float ls = tid < used ? __ldcg(pt + int64_t(tid) * kAttnPartStride + kHeadDim + 1) : 0.f;
  float v = ms;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) red[0][warp] = v;
  __syncthreads();
  float M = red[0][0];
  for (int w = 1; w < kFusedWarps; ++w) M = fmaxf(M, red[0][w]);
  const float fs = ls != 0.f ? __expf(ms - M) : 0.f;
  f[tid] = fs;
  v = fs * ls;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (lane == 0) red[1][warp] = v;
  __syncthreads();  // also publishes f
  float l = red[1][0];
  for (int w = 1; w < kFusedWarps; ++w) l += red[1][w];
  const int g = tid / kMergeDims, d = part * kMergeDims + tid % kMergeDims;
  float o = 0.f;
#pragma unroll 8
  for (int sp = g; sp < used; sp += kMergeParts)
    o = fmaf(__ldcg(pt + int64_t(sp) * kAttnPartStride + d), f[sp], o);
  if (g > 0) po[g - 1][tid % kMergeDims] = o;
  __syncthreads();
  if (g == 0) {
#pragma unroll
    for (int i = 0; i < kMergeParts - 1; ++i) o += po[i][tid % kMergeDims];
    o /= l;
    const float gt = __bfloat162float(L.base[int64_t(head) * 2 * kHeadDim + kHeadDim + d]);
    out[int64_t(head) * kHeadDim + d] = __float2bfloat16(o / (1.f + __expf(-gt)));
  }
  __syncthreads();  // f, red and po are reused by the block's next task
}

// Grid z: the token of a batched step (rows), whose sequence's position and cache it reads.
template <int G, int STAGES>
__global__ void __launch_bounds__(kFusedWarps * 32, STAGES == kFusedStagesBatched ? 2 : 1)
    attn_decode_fused_kernel(FusedArgs a, const __grid_constant__ AttnDecodeRows R, int batched) {
  if (batched) {
    const int t = blockIdx.z;
    a.L.base += t * a.L.ld;
    a.pos = R.pos[t];
    a.k_cache = R.k_cache[t];
    a.v_cache = R.v_cache[t];
    a.scratch += int64_t(t) * a.L.n_heads * a.splits * kAttnPartStride;
  }
  using namespace tc;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Kt = reinterpret_cast<bf16*>(smem);  // [stages][tile][256]
  bf16* Vt = Kt + STAGES * kTileElems;
  bf16* Kn = Vt + STAGES * kTileElems;  // the new key and value, bf16 as cached
  bf16* Vn = Kn + kHeadDim;
  float* qs = reinterpret_cast<float*>(Vn + kHeadDim);  // [G][256]
  __shared__ float cs[kHeadDim / 2], sn[kHeadDim / 2];
  const QkvLayout& L = a.L;
  const int kvh = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int p = *a.pos, len = p + 1;
  const int chunk = split_keys(len, a.splits), b = s * chunk;
  if (b >= len) return;  // a split the merge does not read (split 0 always runs and waits)
  const int e = min(len, b + chunk), old_end = min(e, p);
  // Keys of this split: the cached ones (copied by cp.async) and, in the split holding the
  // position, the new one (written into the last tile once it is computed).
  const int n_keys = e - b, n_tiles = (n_keys + kFusedTile - 1) / kFusedTile;
  const int64_t kv_stride = int64_t(L.n_kv) * kHeadDim;
  const bf16* kg = a.k_cache + int64_t(kvh) * kHeadDim;
  const bf16* vg = a.v_cache + int64_t(kvh) * kHeadDim;
  auto issue = [&](int tile) {
    if (tile < n_tiles) {
      bf16* kd = Kt + (tile % STAGES) * kTileElems;
      bf16* vd = Vt + (tile % STAGES) * kTileElems;
      for (int c = tid; c < kFusedTile * (kHeadDim / 8); c += kFusedWarps * 32) {
        const int r = c / (kHeadDim / 8), col = (c % (kHeadDim / 8)) * 8;
        const int key = b + tile * kFusedTile + r;
        const bool ok = key < old_end;
        const int64_t off = int64_t(ok ? key : b) * kv_stride + col;
        cp_async16(kd + swz<kHeadDim / 8>(r, col), kg + off, ok);
        cp_async16(vd + swz<kHeadDim / 8>(r, col), vg + off, ok);
      }
    }
    cp_async_commit();  // one group per tile, empty past the end: the wait count stays uniform
  };
#pragma unroll
  for (int i = 0; i < STAGES; ++i) issue(i);
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
  // Q as the A operand of S = Q·Kᵀ (rows = heads, padded to 16 with zeros), in registers for
  // every tile: 16 k-steps of 16 dims.
  bf16* Qb = reinterpret_cast<bf16*>(qs + G * kHeadDim);  // [16][256] swizzled
  for (int i = tid; i < 16 * kHeadDim; i += kFusedWarps * 32) {
    const int r = i / kHeadDim, c = i % kHeadDim;
    Qb[swz<kHeadDim / 8>(r, c)] = __float2bfloat16(r < G ? qs[r * kHeadDim + c] : 0.f);
  }
  __syncthreads();
  uint32_t qa[kHeadDim / 16][4];
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    ldmatrix_x4(qa[ks],
                Qb + swz<kHeadDim / 8>((lane & 7) + ((lane >> 3) & 1) * 8, ks * 16 + (lane >> 4) * 8));

  // Warp (grp, ds): keys grp*16 .. +15 of every 32-key tile, output dims ds*64 .. +63. The two key
  // groups keep their own online softmax (per head: m, l) and merge at the end; the four dim
  // slices of a key group compute the same scores (16 mma per slice per tile, cheap next to the
  // loads) so that each holds a quarter of the output: 4 m-tiles of Oᵀ [dims x heads].
  const int grp = warp & 1, ds = warp >> 1;
  const int g = lane >> 2, c = lane & 3;  // fragment row group and column pair
  const float scale = rsqrtf(float(kHeadDim));
  float m_run = -FLT_MAX, l_run = 0.f;  // head g's running max and sum (lanes of one quad agree)
  float o[4][4];                        // Oᵀ m-tile mt: dims ds*64 + mt*16 + g (+8), heads 2c, 2c+1
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[mt][i] = 0.f;
  // ldmatrix row addresses shared by K (B operand) and V (A operand, transposed): lane -> key
  // grp*16 + (lane>>4)*8 + (lane&7), dim offset ((lane>>3)&1)*8.
  const int ld_key = grp * 16 + (lane >> 4) * 8 + (lane & 7), ld_dim = ((lane >> 3) & 1) * 8;
  auto process = [&](const bf16* Ks, const bf16* Vs, int nvalid) {
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f},
                      {0.f, 0.f, 0.f, 0.f}};  // S: heads g / g+8 x keys (2c, 2c+1) of n-tiles 0, 1
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      uint32_t kb[4];
      ldmatrix_x4(kb, Ks + swz<kHeadDim / 8>(ld_key, ks * 16 + ld_dim));
      mma_bf16(sc[0], qa[ks], kb[0], kb[1]);
      mma_bf16(sc[1], qa[ks], kb[2], kb[3]);
    }
    // Online softmax for head g over this group's 16 keys (rows g+8 are padding).
    float x[4];
    float tmax = -FLT_MAX;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int key = grp * 16 + nt * 8 + 2 * c + j;
        x[nt * 2 + j] = key < nvalid ? sc[nt][j] * scale : -FLT_MAX;
        tmax = fmaxf(tmax, x[nt * 2 + j]);
      }
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
    const float m_new = fmaxf(m_run, tmax);
    const float corr = __expf(m_run - m_new);
    float pr[4], psum = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = grp * 16 + (i >> 1) * 8 + 2 * c + (i & 1);
      pr[i] = key < nvalid ? __expf(x[i] - m_new) : 0.f;
      psum += pr[i];
    }
    psum += __shfl_xor_sync(0xffffffffu, psum, 1);
    psum += __shfl_xor_sync(0xffffffffu, psum, 2);
    l_run = l_run * corr + psum;
    m_run = m_new;
    // Oᵀ += Vᵀ·Pᵀ: Pᵀ (keys x heads) is the B operand, straight from this lane's S fragment
    // (column n = head g, rows = keys 2c, 2c+1 and +8); Oᵀ's columns 2c, 2c+1 are heads whose
    // rescale factors live in the quads of lanes 8c and 8c+4.
    const uint32_t pb0 = pack_bf16(pr[0], pr[1]), pb1 = pack_bf16(pr[2], pr[3]);
    const float c0 = __shfl_sync(0xffffffffu, corr, 8 * c), c1 = __shfl_sync(0xffffffffu, corr, 8 * c + 4);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) {
      uint32_t va[4];
      ldmatrix_x4_trans(va, Vs + swz<kHeadDim / 8>(ld_key, ds * 64 + mt * 16 + ld_dim));
      o[mt][0] *= c0;
      o[mt][1] *= c1;
      o[mt][2] *= c0;
      o[mt][3] *= c1;
      mma_bf16(o[mt], va, pb0, pb1);
    }
  };
  const int last_tile = n_tiles - 1;
  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const int slot = t % STAGES;
    bf16* ks = Kt + slot * kTileElems;
    bf16* vs = Vt + slot * kTileElems;
    if (e == len && t == last_tile && tid < kHeadDim / 8) {  // the new key joins the last tile
      const int r = p - b - t * kFusedTile, col = tid * 8;
      *reinterpret_cast<uint4*>(ks + swz<kHeadDim / 8>(r, col)) = *reinterpret_cast<const uint4*>(Kn + col);
      *reinterpret_cast<uint4*>(vs + swz<kHeadDim / 8>(r, col)) = *reinterpret_cast<const uint4*>(Vn + col);
    }
    __syncthreads();
    process(ks, vs, min(kFusedTile, n_keys - t * kFusedTile));
    __syncthreads();  // the slot is free for the tile STAGES ahead
    issue(t + STAGES);
  }

  // Merge the two key groups: per head, rescale each group's sums to the common max.
  cp_async_wait<0>();
  __syncthreads();
  float* mb = reinterpret_cast<float*>(smem);  // [grp][8 heads], reusing the tiles
  float* lb = mb + 2 * 8;
  float* ab = lb + 2 * 8;  // [grp][8 heads][256]
  if (c == 0 && ds == 0) {
    mb[grp * 8 + g] = m_run;
    lb[grp * 8 + g] = l_run;
  }
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int dim = ds * 64 + mt * 16 + g + (i >> 1) * 8, head = 2 * c + (i & 1);
      ab[(grp * 8 + head) * kHeadDim + dim] = o[mt][i];
    }
  __syncthreads();
  for (int i = tid; i < G * kHeadDim; i += kFusedWarps * 32) {
    const int h = i / kHeadDim, dim = i % kHeadDim;
    const float M = fmaxf(mb[h], mb[8 + h]);
    float Ls = 0.f, acc = 0.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float lk = lb[k * 8 + h];
      const float f = lk > 0.f ? __expf(mb[k * 8 + h] - M) : 0.f;  // a group with no key has l = 0
      Ls = fmaf(f, lk, Ls);
      acc = fmaf(f, ab[(k * 8 + h) * kHeadDim + dim], acc);
    }
    float* part = a.scratch + (int64_t(kvh * G + h) * a.splits + s) * kAttnPartStride;
    part[dim] = acc;
    if (dim == 0) {
      part[kHeadDim] = M;
      part[kHeadDim + 1] = Ls;
    }
  }
  if (!a.counters) return;
  // The merge in this launch: every split says it is done; the first min(used, G·4) splits then
  // wait for the others and take the kv head's merge tasks (all blocks of the launch are resident
  // by then or will be: the waiting ones are fewer than the multiprocessors, which
  // attention_decode_fused checks, and the next kernel cannot start before every block has).
  __syncthreads();  // the block's partials are written
  if (tid == 0) red_add_release_gpu(a.counters + kvh, 1u);
  const int used = (len + chunk - 1) / chunk, tasks = G * kMergeParts, nm = min(used, tasks);
  if (s >= nm) return;
  if (tid == 0)
    while (ld_acquire_gpu(a.counters + kvh) < unsigned(used)) {
    }
  __syncthreads();
  for (int task = s; task < tasks; task += nm)
    merge_task(L, a.scratch, a.splits, used, kvh * G + task / kMergeParts, task % kMergeParts, a.out);
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
static_assert(kMergeParts == kCombineGroups, "merge_task sums the combine kernel's groups of splits");

// batched: token t = blockIdx.y is the one new token of its own sequence (position R.pos[t]).
__global__ void __launch_bounds__(kCombineThreads)
    attn_combine_kernel(QkvLayout L, const int* __restrict__ pos, int splits,
                        const float* __restrict__ scratch, bf16* __restrict__ out, int64_t ldo,
                        const __grid_constant__ AttnDecodeRows R, int batched) {
  __shared__ float f[kMaxAttnSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float part_o[kCombineGroups - 1][kHeadDim];
  const int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, d = tid % kHeadDim, g = tid / kHeadDim;
  pdl_wait();
  pdl_launch_dependents();
  const int len = (batched ? *R.pos[t] : *pos + t) + 1, chunk = split_keys(len, splits);
  const int used = (len + chunk - 1) / chunk;
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
             scratch, out, ldo, AttnDecodeRows{}, 0);
}

namespace {
template <int G, int STAGES>
void launch_fused_stages(const FusedArgs& a, const AttnDecodeRows& r, int batched, cudaStream_t stream) {
  constexpr size_t kSmem = fused_smem_bytes<G, STAGES>();
  constexpr auto kern = attn_decode_fused_kernel<G, STAGES>;
  static const bool attr_set =
      cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)) == cudaSuccess;
  TANSY_CHECK(attr_set, "attention_decode_fused: cannot reserve {} bytes of shared memory per block", kSmem);
  pdl_launch(kern, dim3(a.L.n_kv, a.splits, r.n), dim3(kFusedWarps * 32), kSmem, stream, a, r, batched);
}
template <int G>
void launch_fused(const FusedArgs& a, const AttnDecodeRows& r, int batched, cudaStream_t stream) {
  if (batched)
    launch_fused_stages<G, kFusedStagesBatched>(a, r, batched, stream);
  else
    launch_fused_stages<G, kFusedStages>(a, r, batched, stream);
}
}  // namespace

void attention_decode_fused(const QkvLayout& qkv, const int* pos, const float* q_norm, const float* k_norm,
                            float eps, int rotary_dim, double theta, bf16* k_cache, bf16* v_cache, int splits,
                            float* scratch, bf16* out, int64_t ldo, cudaStream_t stream,
                            const AttnDecodeRows* rows, unsigned* merge_counters) {
  const AttnDecodeRows one;
  const AttnDecodeRows& r = rows ? *rows : one;
  TANSY_CHECK(r.n >= 1 && r.n <= kMaxBatch, "attention_decode_fused: {} batched rows outside 1..{}", r.n,
              kMaxBatch);
  if (rows)
    for (int t = 0; t < r.n; ++t)
      TANSY_CHECK(
          r.pos[t] && r.k_cache[t] && r.v_cache[t] && aligned16(r.k_cache[t]) && aligned16(r.v_cache[t]),
          "attention_decode_fused: batched row {} lacks its position or cache", t);
  check_layout(qkv, r.n, "attention_decode_fused");
  check_rotary(rotary_dim, "attention_decode_fused");
  check_splits(qkv, pos, k_cache, v_cache, splits, scratch, out, ldo, "attention_decode_fused");
  TANSY_CHECK(theta > 0 && q_norm && k_norm, "attention_decode_fused: bad arguments");
  const int G = qkv.n_heads / qkv.n_kv;
  if (merge_counters) {
    TANSY_CHECK(!rows, "attention_decode_fused: the merge in the kernel is for one token (no batched rows)");
    // The blocks that wait for the others' partials must leave them multiprocessors to run on.
    const int waiting = qkv.n_kv * std::min(splits, G * kMergeParts);
    TANSY_CHECK(waiting < sm_count(),
                "attention_decode_fused: {} merging blocks would wait on {} multiprocessors; merge with the "
                "combine kernel instead (no counters)",
                waiting, sm_count());
  }
  FusedArgs a{qkv,
              pos,
              q_norm,
              k_norm,
              eps,
              rotary_dim,
              theta,
              k_cache,
              v_cache,
              splits,
              scratch,
              merge_counters,
              merge_counters ? out : nullptr};
  switch (G) {
    case 1:
      launch_fused<1>(a, r, rows ? 1 : 0, stream);
      break;
    case 2:
      launch_fused<2>(a, r, rows ? 1 : 0, stream);
      break;
    case 4:
      launch_fused<4>(a, r, rows ? 1 : 0, stream);
      break;
    case 8:
      launch_fused<8>(a, r, rows ? 1 : 0, stream);
      break;
    default:
      fail("attention_decode_fused: {} query heads per kv head unsupported (1, 2, 4 or 8)",
           qkv.n_heads / qkv.n_kv);
  }
  if (merge_counters) return;
  pdl_launch(attn_combine_kernel, dim3(qkv.n_heads, r.n), dim3(kCombineThreads), 0, stream, qkv, pos, splits,
             scratch, out, ldo, r, rows ? 1 : 0);
}

}  // namespace tansy::cuda
