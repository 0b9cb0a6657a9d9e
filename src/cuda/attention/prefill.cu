// Causal GQA flash attention for prefill, head_dim 256, mma.sync bf16 with f32 online softmax.
//
// A block owns 128 query rows of one KV head, rows flattened as (position, head within the KV
// group): row r -> position r / G, head kvh*G + r % G. One K/V tile in shared memory thus serves
// every query head of the group, and a block spans only 128/G positions, so its causal frontier is
// nearly flat. 8 warps x 16 rows; each warp keeps its 16x256 output in registers (128 f32 per
// thread) and its 16x32 score tile (16 f32). K/V tiles of 32 keys are double-buffered with cp.async.
// Shared memory: Q 64 KB + 2 x (K 16 KB + V 16 KB) = 128 KB; ~240 registers: one block per SM.
#include <cmath>

#include "core/error.h"
#include "cuda/attention/attention.cuh"
#include "cuda/common/tensor_core.cuh"

namespace tansy::cuda {
namespace {

using tc::swz;

constexpr int D = kHeadDim;     // 256
constexpr int kChunks = D / 8;  // 16-byte chunks per row
constexpr int BQ = 128;         // query rows per block
constexpr int BKV = 32;         // keys per tile (64 spills: 128 output + 32 score registers per thread)
constexpr int kWarps = BQ / 16;
constexpr int kThreads = kWarps * 32;
constexpr int kSmem = (BQ + 4 * BKV) * D * 2;

__global__ void __launch_bounds__(kThreads, 1) attention_prefill_kernel(const AttnPrefillArgs a, int G) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* const Qs = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* const Ks = Qs + BQ * D;       // [2][BKV][D]
  __nv_bfloat16* const Vs = Ks + 2 * BKV * D;  // [2][BKV][D]

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int kvh = blockIdx.y;
  // Blocks with later positions have more keys: launch them first.
  const int row0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int n_rows = a.n * G;
  const int pos_lo = row0 / G;
  const int pos_hi = min(a.n - 1, (row0 + BQ - 1) / G);
  const int kv_len = a.p0 + a.n;  // keys 0 .. kv_len-1 exist
  const int n_tiles = (a.p0 + pos_hi + 1 + BKV - 1) / BKV;
  const int64_t kv_row = int64_t(a.n_kv) * D;  // elements between positions in the cache

  // Q tile: 128 rows x 32 chunks, 16 chunks per thread.
#pragma unroll
  for (int i = 0; i < BQ * kChunks / kThreads; ++i) {
    const int idx = tid + i * kThreads, r = idx / kChunks, c = idx % kChunks, row = row0 + r;
    const bool ok = row < n_rows;
    const __nv_bfloat16* src =
        ok ? a.q + int64_t(row / G) * a.q_stride_t + int64_t(kvh * G + row % G) * a.q_stride_h + c * 8 : a.q;
    tc::cp_async16(Qs + swz<kChunks>(r, c * 8), src, ok);
  }
  auto load_kv = [&](int tile, int stage) {
    __nv_bfloat16* ks = Ks + stage * BKV * D;
    __nv_bfloat16* vs = Vs + stage * BKV * D;
#pragma unroll
    for (int i = 0; i < BKV * kChunks / kThreads; ++i) {
      const int idx = tid + i * kThreads, r = idx / kChunks, c = idx % kChunks, key = tile * BKV + r;
      // Rows past the cache end are zero-filled: their scores are masked, and zero V keeps
      // 0·V finite whatever the unwritten cache memory holds.
      const bool ok = key < kv_len;
      const int64_t off = ok ? int64_t(key) * kv_row + int64_t(kvh) * D + c * 8 : 0;
      tc::cp_async16(ks + swz<kChunks>(r, c * 8), a.k_cache + off, ok);
      tc::cp_async16(vs + swz<kChunks>(r, c * 8), a.v_cache + off, ok);
    }
  };
  load_kv(0, 0);
  tc::cp_async_commit();

  // This thread's two rows: g and g+8 of the warp's 16.
  const int g = lane / 4, c2 = (lane % 4) * 2;
  int qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + warp * 16 + g + h * 8;
    qpos[h] = a.p0 + (row < n_rows ? row / G : a.n - 1);
  }
  const int qpos_min = a.p0 + pos_lo;

  // log2(e)/sqrt(256): scores go straight into exp2.
  const float sl2 = 1.4426950408889634f / 16.f;
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int j = 0; j < n_tiles; ++j) {
    if (j + 1 < n_tiles) load_kv(j + 1, (j + 1) % 2);
    tc::cp_async_commit();  // possibly empty: keeps "all but the newest group" = tile j
    tc::cp_async_wait<1>();
    __syncthreads();
    const __nv_bfloat16* ks = Ks + (j % 2) * BKV * D;
    const __nv_bfloat16* vs = Vs + (j % 2) * BKV * D;

    // S = Q·Kᵀ (16 x BKV per warp)
    float s[BKV / 8][4] = {};
#pragma unroll 2
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t qa[4];
      tc::ldmatrix_x4(qa, Qs + swz<kChunks>(warp * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
#pragma unroll
      for (int np = 0; np < BKV / 16; ++np) {
        uint32_t kb[4];
        tc::ldmatrix_x4(
            kb, ks + swz<kChunks>(np * 16 + (lane / 16) * 8 + (lane % 8), kk * 16 + ((lane / 8) % 2) * 8));
        tc::mma_bf16(s[2 * np], qa, kb[0], kb[1]);
        tc::mma_bf16(s[2 * np + 1], qa, kb[2], kb[3]);
      }
    }

    // Causal mask, only on tiles that reach past the block's first position (this also covers
    // keys >= kv_len, which lie past every query position).
    if ((j + 1) * BKV - 1 > qpos_min) {
#pragma unroll
      for (int nt = 0; nt < BKV / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (j * BKV + nt * 8 + c2 + (e & 1) > qpos[e >> 1]) s[nt][e] = -INFINITY;
    }

    // Online softmax. Key 0 is in tile 0 and visible to every row, so m is finite from tile 0 on.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < BKV / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float alpha = exp2f((m[h] - m_new) * sl2);
      m[h] = m_new;
      const float mb = m_new * sl2;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < BKV / 8; ++nt) {
        s[nt][2 * h] = exp2f(fmaf(s[nt][2 * h], sl2, -mb));
        s[nt][2 * h + 1] = exp2f(fmaf(s[nt][2 * h + 1], sl2, -mb));
        sum += s[nt][2 * h] + s[nt][2 * h + 1];
      }
      l[h] = l[h] * alpha + sum;  // per-thread partial; the quad's partials are summed at the end
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * h] *= alpha;
        o[dt][2 * h + 1] *= alpha;
      }
    }

    // O += P·V: the score accumulators are already laid out as mma A fragments.
#pragma unroll
    for (int kc = 0; kc < BKV / 16; ++kc) {
      uint32_t pa[4] = {tc::pack_bf16(s[2 * kc][0], s[2 * kc][1]), tc::pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                        tc::pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                        tc::pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t vb[4];
        tc::ldmatrix_x4_trans(
            vb, vs + swz<kChunks>(kc * 16 + ((lane / 8) % 2) * 8 + (lane % 8), dp * 16 + (lane / 16) * 8));
        tc::mma_bf16(o[2 * dp], pa, vb[0], vb[1]);
        tc::mma_bf16(o[2 * dp + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // stage j%2 is reloaded next iteration
  }
  tc::cp_async_wait<0>();

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + warp * 16 + g + h * 8;
    if (row >= n_rows) continue;
    const int pos = row / G, head = kvh * G + row % G;
    const float inv = 1.f / sum;
    __nv_bfloat16* out = a.out + int64_t(pos) * a.out_stride_t + int64_t(head) * a.out_stride_h;
    const __nv_bfloat16* gate =
        a.gate ? a.gate + int64_t(pos) * a.gate_stride_t + int64_t(head) * a.gate_stride_h : nullptr;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      const int col = dt * 8 + c2;
      float v0 = o[dt][2 * h] * inv, v1 = o[dt][2 * h + 1] * inv;
      if (gate) {
        const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + col));
        v0 /= 1.f + __expf(-gv.x);
        v1 /= 1.f + __expf(-gv.y);
      }
      *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v0, v1);
    }
  }
}

bool aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

}  // namespace

void attention_prefill_check(const AttnPrefillArgs& a) {
  TANSY_CHECK(a.n >= 1 && a.p0 >= 0, "attention_prefill: bad n={} p0={}", a.n, a.p0);
  TANSY_CHECK(int64_t(a.p0) + a.n < (int64_t(1) << 31) / 2, "attention_prefill: context {} too long",
              int64_t(a.p0) + a.n);
  TANSY_CHECK(
      a.n_kv >= 1 && a.n_heads >= a.n_kv && a.n_heads % a.n_kv == 0 && a.n_heads / a.n_kv <= kAttnMaxGroup,
      "attention_prefill: {} query heads over {} kv heads unsupported (group <= {})", a.n_heads, a.n_kv,
      kAttnMaxGroup);
  TANSY_CHECK(a.q && a.k_cache && a.v_cache && a.out, "attention_prefill: null pointer");
  TANSY_CHECK(aligned(a.q, 16) && a.q_stride_t % 8 == 0 && a.q_stride_h % 8 == 0 && aligned(a.k_cache, 16) &&
                  aligned(a.v_cache, 16),
              "attention_prefill: q rows/heads and the caches must be 16-byte aligned");
  TANSY_CHECK(aligned(a.out, 4) && a.out_stride_t % 2 == 0 && a.out_stride_h % 2 == 0,
              "attention_prefill: output strides must be even");
  TANSY_CHECK(!a.gate || (aligned(a.gate, 4) && a.gate_stride_t % 2 == 0 && a.gate_stride_h % 2 == 0),
              "attention_prefill: gate strides must be even");
}

// The warpgroup kernel by default: 2.5-2.7x the mma.sync one at 32K and 128K tokens on the H200
// (Attention.PrefillTiming, docs/PERFORMANCE.md's change log); mma.sync runs the groups it does
// not support (a tiny model's).
static AttnPrefillKernel g_prefill_kernel = AttnPrefillKernel::kWgmma;
void attention_prefill_set_kernel(AttnPrefillKernel k) { g_prefill_kernel = k; }
AttnPrefillKernel attention_prefill_current_kernel() { return g_prefill_kernel; }

void attention_prefill(const AttnPrefillArgs& a, cudaStream_t stream) {
  attention_prefill_check(a);
  if (g_prefill_kernel == AttnPrefillKernel::kWgmma && attention_prefill_wgmma_supports(a)) {
    attention_prefill_wgmma(a, stream);
    return;
  }
  const int G = a.n_heads / a.n_kv;
  const int64_t blocks = (int64_t(a.n) * G + BQ - 1) / BQ;
  TANSY_CHECK(blocks < (int64_t(1) << 31) && a.n_kv <= 65535, "attention_prefill: grid too large");
  static const bool attr_set =
      cudaFuncSetAttribute(attention_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) ==
      cudaSuccess;
  TANSY_CHECK(attr_set, "attention_prefill: cannot reserve {} bytes of shared memory per block", kSmem);
  attention_prefill_kernel<<<dim3(unsigned(blocks), a.n_kv), kThreads, kSmem, stream>>>(a, G);
  launch_check("attention_prefill");
}

}  // namespace tansy::cuda
