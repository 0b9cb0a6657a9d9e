// Chunked Gated DeltaNet prefill on tensor cores (docs/MODEL.md §5.6), chunks of 64 tokens
// (C = 64 rows, zero-padded past n). Per chunk:
//   G = cumsum(g);  A[i][j] = β_i (k_i·k_j) e^{G_i-G_j} (j < i);  Aqk[i][j] = (q_i·k_j) e^{G_i-G_j} (j <= i)
//   V' = (I + A)^{-1} R,  R = β⊙(V - e^G⊙(K·S))
//   O  = e^G ⊙ (Q·S) + Aqk·V'
//   S  = e^{G_last} S + Kᵀ·(e^{G_last-G} ⊙ V')
// This is the WY form's V' = U - W·S, [U | W] = (I+A)^{-1} [β⊙V | β⊙e^G⊙K], with the inverse moved
// past the product: (I+A)^{-1}(β⊙V) - (I+A)^{-1}(β⊙e^G⊙K)·S = (I+A)^{-1}(β⊙V - β⊙e^G⊙(K·S)), so the
// inverse applies to the 32 value columns instead of 32 + 128, and K·S is a bf16-exact-operand
// product like Q·S. The state-independent parts (T = (I+A)^{-1}, Aqk) are computed for all chunks
// in parallel, the chunk walk keeps only the state products (the two-kernel form below; a single
// kernel walking everything measured 502 vs 409 µs per layer at 4,096 tokens, docs/PERFORMANCE.md).
//
// Every product is mma.sync m16n8k16 (bf16 in, f32 accumulate):
//   Q·Kᵀ, K·Kᵀ              q̂, k̂ are bf16 already: one mma each, exact products.
//   Q·S, K·S, Kᵀ·(kdec⊙V')  one exact bf16 operand; the f32 one (S, kdec⊙V') split x = hi + lo
//                           with hi = bf16(x), lo = bf16(x - hi): two mmas, |x - hi - lo| <= 2^-18 |x|.
//   Aqk·V'                  both f32: three mmas (hi·hi + hi·lo + lo·hi), the dropped lo·lo ~2^-18.
// Why not one bf16 or tf32 pass: the output and the state carried across chunks are checked at
// 1e-4 relative against the f32 token-by-token loop (tests/gpu/test_gdn.cu), and the state's
// rounding is fed back every chunk. A numpy model of this kernel's arithmetic (one head, 4,096
// tokens, the test's input distributions, against a float64 loop) gives relative errors in the
// output / final state of 2.4e-3 / 1.7e-3 with one bf16 pass, 2.9e-4 / 2.2e-4 with tf32,
// 4.5e-6 / 2.5e-6 with the hi/lo split, and 4e-7 / 2e-7 in plain f32: only the split meets the
// tolerance, for 2-3x the mma count of a single pass, which is still small next to the CUDA-core
// work it replaces. The state S itself never leaves f32: each warp keeps its 16 rows x 32 columns
// in registers in the mma accumulator layout (the update accumulates onto e^{G_last}·S directly)
// and writes the bf16 hi/lo copies the next chunk's Q·S and K·S read from shared memory.
//
// Padded rows (t >= n: k = q = v = β = g = 0) give A, Aqk, R and V' rows of zero and leave G at the
// last real token's value, so S and the stored outputs are exact.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "core/error.h"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gdn/gdn.cuh"

namespace tansy::cuda {
namespace {

constexpr int C = kGdnChunk;  // 64
constexpr int DK = kGdnDim;   // 128
constexpr int BV = 32;        // state columns per block
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
static_assert(kWarps * 16 == DK, "one warp per 16 state rows");
static_assert(kWarps * 4 == BV, "the substitution gives each warp 4 columns");

// Shared-memory row pitches (elements), padded against bank conflicts.
constexpr int KP = DK + 8;  // bf16 K/Q: 272-byte rows put ldmatrix's 8 rows in 8 bank groups
constexpr int HP = BV + 8;  // bf16 hi/lo copies of S and V': 80-byte rows, the same for ldmatrix.trans
constexpr int FP = BV + 4;  // f32 64x32 tiles (V, R, e^G⊙Q·S): float4 rows for the substitution
constexpr int AP = C + 1;   // f32 A: the substitution reads a column, one row per lane
constexpr int QP = C + 8;   // f32 Aqk: float2 fragment reads, half-warps conflict-free

__device__ __forceinline__ float2 bf2(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}

// (x0, x1) ≈ hi + lo, each a packed bf16 pair (x0 in the low half, as mma fragments want it).
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// Element offset, in a [k][n] row-major bf16 tile of pitch `pitch`, of this lane's row address for
// ldmatrix.x4.trans giving the B fragments (b0, b1) of the n-tiles n0 and n0+8 at k-step k0.
__device__ __forceinline__ int b_trans_off(int lane, int k0, int n0, int pitch) {
  return (k0 + ((lane / 8) % 2) * 8 + lane % 8) * pitch + n0 + (lane / 16) * 8;
}

// ---- The two-kernel form (gdn_prefill) ----
// gdn_chunk_prep_kernel, one block per (chunk, value head), every chunk of a window at once: what
// a chunk needs that does not depend on the carried state, T = (I + A)^{-1} and Aqk (64 x 64 f32
// each, lower triangular) into a workspace. gdn_chunk_state_kernel, one block per (value head, 32
// state columns), walks the window's chunks in order with only the state-dependent products left
// on its serial path:
//   R = β⊙(V - e^G⊙(K·S)),  V' = T·R,  O = e^G⊙(Q·S) + Aqk·V',  S = e^{G_last} S + Kᵀ·(e^{G_last-G}⊙V').
// V' = T·R is the forward substitution as a product (both operands f32:
// three mmas, the same class as Aqk·V'); the Gram matrices, the decay matrices and the 64-step
// substitution run in parallel over the chunks instead of once per chunk in sequence.

constexpr int kTile = C * C;                       // floats per 64 x 64 matrix
constexpr int kPrepPerChunkHead = 2 * kTile;       // T, then Aqk, row-major
constexpr size_t kWindowFloats = size_t(1) << 24;  // 64 MiB of workspace: 64 chunks of 32 heads

struct PrepSmem {
  __nv_bfloat16 k[C * KP], q[C * KP];
  float a[C * AP];
  float beta[C], graw[C], G[C];
};

__global__ void __launch_bounds__(kThreads)
    gdn_chunk_prep_kernel(const GdnPrefillArgs p, int ch0, float* ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c2 = (lane % 4) * 2;
  const int ch = blockIdx.x, h = blockIdx.y;
  const int kh = h / (p.n_v_heads / p.n_k_heads);
  const int t0 = (ch0 + ch) * C;
  float* const out = ws + (size_t(ch) * p.n_v_heads + h) * kPrepPerChunkHead;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int idx = tid + i * kThreads, r = idx / 16, c = idx % 16, t = t0 + r;
    const bool ok = t < p.n;
    *reinterpret_cast<uint4*>(sm.k + r * KP + c * 8) =
        ok ? *reinterpret_cast<const uint4*>(p.k + int64_t(t) * p.k_stride + kh * DK + c * 8)
           : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(sm.q + r * KP + c * 8) =
        ok ? *reinterpret_cast<const uint4*>(p.q + int64_t(t) * p.q_stride + kh * DK + c * 8)
           : make_uint4(0, 0, 0, 0);
  }
  if (tid < 2 * C) {
    const int t = t0 + tid % C;
    const float x = t < p.n ? (tid < C ? p.beta : p.g)[int64_t(t) * p.n_v_heads + h] : 0.f;
    if (tid < C)
      sm.beta[tid] = x;
    else
      sm.graw[tid - C] = x;
  }
  __syncthreads();

  // Decay prefix sums (warp 0) and the Gram matrices Q·Kᵀ, K·Kᵀ (warp: 16 x 32 of each).
  if (warp == 0) {
    float a = sm.graw[lane], b = sm.graw[lane + 32];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const float x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
      if (lane >= o) {
        a += x;
        b += y;
      }
    }
    b += __shfl_sync(0xffffffffu, a, 31);
    sm.G[lane] = a;
    sm.G[lane + 32] = b;
  }
  const int rt = warp / 2, cbase = (warp % 2) * 32;
  float ckk[4][4] = {}, cqk[4][4] = {};
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    uint32_t ak[4], aq[4];
    tc::ldmatrix_x4(ak, sm.k + (rt * 16 + lane % 16) * KP + kk * 16 + (lane / 16) * 8);
    tc::ldmatrix_x4(aq, sm.q + (rt * 16 + lane % 16) * KP + kk * 16 + (lane / 16) * 8);
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      uint32_t b[4];
      tc::ldmatrix_x4(
          b, sm.k + (cbase + np * 16 + (lane / 16) * 8 + lane % 8) * KP + kk * 16 + ((lane / 8) % 2) * 8);
      tc::mma_bf16(ckk[2 * np], ak, b[0], b[1]);
      tc::mma_bf16(ckk[2 * np + 1], ak, b[2], b[3]);
      tc::mma_bf16(cqk[2 * np], aq, b[0], b[1]);
      tc::mma_bf16(cqk[2 * np + 1], aq, b[2], b[3]);
    }
  }
  __syncthreads();  // G visible
  float* const aqk_out = out + kTile;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int i = rt * 16 + g + 8 * hf, j = cbase + nt * 8 + c2;
      float av[2], qv[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        // e^{G_i-G_j} only where j <= i: above the diagonal it can overflow.
        const float dec = j + u <= i ? expf(sm.G[i] - sm.G[j + u]) : 0.f;
        av[u] = j + u < i ? sm.beta[i] * ckk[nt][2 * hf + u] * dec : 0.f;
        qv[u] = cqk[nt][2 * hf + u] * dec;
        sm.a[i * AP + j + u] = av[u];
      }
      *reinterpret_cast<float2*>(aqk_out + i * C + j) = make_float2(qv[0], qv[1]);
    }
  __syncthreads();

  // T = (I + A)^{-1}: the forward substitution on the identity, each warp 8 of the
  // 64 columns, each lane rows lane and lane+32.
  {
    const int cb = 8 * warp;
    float x[8][2];
#pragma unroll
    for (int cc = 0; cc < 8; ++cc)
#pragma unroll
      for (int sh = 0; sh < 2; ++sh) x[cc][sh] = lane + 32 * sh == cb + cc ? 1.f : 0.f;
    constexpr int kSub = 4;
#pragma unroll 2
    for (int i = 0; i < 32; i += kSub) {
      float tri[kSub][kSub], a0[kSub], a1[kSub];
#pragma unroll
      for (int u = 0; u < kSub; ++u) {
#pragma unroll
        for (int w = 0; w < u; ++w) tri[u][w] = sm.a[(i + u) * AP + i + w];
        a0[u] = sm.a[lane * AP + i + u];
        a1[u] = sm.a[(lane + 32) * AP + i + u];
      }
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
        float xb[kSub];
#pragma unroll
        for (int u = 0; u < kSub; ++u) xb[u] = __shfl_sync(0xffffffffu, x[cc][0], i + u);
#pragma unroll
        for (int u = 1; u < kSub; ++u)
#pragma unroll
          for (int w = 0; w < u; ++w) xb[u] -= tri[u][w] * xb[w];
#pragma unroll
        for (int w = 0; w < kSub; ++w) {
          x[cc][0] -= a0[w] * xb[w];
          x[cc][1] -= a1[w] * xb[w];
        }
      }
    }
#pragma unroll 2
    for (int i = 32; i < C; i += kSub) {
      float tri[kSub][kSub], a1[kSub];
#pragma unroll
      for (int u = 0; u < kSub; ++u) {
#pragma unroll
        for (int w = 0; w < u; ++w) tri[u][w] = sm.a[(i + u) * AP + i + w];
        a1[u] = sm.a[(lane + 32) * AP + i + u];
      }
#pragma unroll
      for (int cc = 0; cc < 8; ++cc) {
        float xb[kSub];
#pragma unroll
        for (int u = 0; u < kSub; ++u) xb[u] = __shfl_sync(0xffffffffu, x[cc][1], i - 32 + u);
#pragma unroll
        for (int u = 1; u < kSub; ++u)
#pragma unroll
          for (int w = 0; w < u; ++w) xb[u] -= tri[u][w] * xb[w];
#pragma unroll
        for (int w = 0; w < kSub; ++w) x[cc][1] -= a1[w] * xb[w];
      }
    }
#pragma unroll
    for (int sh = 0; sh < 2; ++sh) {
      float* const row = out + (lane + 32 * sh) * C + cb;
      *reinterpret_cast<float4*>(row) = make_float4(x[0][sh], x[1][sh], x[2][sh], x[3][sh]);
      *reinterpret_cast<float4*>(row + 4) = make_float4(x[4][sh], x[5][sh], x[6][sh], x[7][sh]);
    }
  }
}

struct StateSmem {
  __nv_bfloat16 k[C * KP], q[C * KP];
  __nv_bfloat16 s_hi[DK * HP], s_lo[DK * HP];  // S (rows d, columns v)
  __nv_bfloat16 r_hi[C * HP], r_lo[C * HP];    // R
  __nv_bfloat16 v_hi[C * HP], v_lo[C * HP];    // V'
  __nv_bfloat16 vd_hi[C * HP], vd_lo[C * HP];  // e^{G_last-G} ⊙ V'
  float v[C * FP], oqs[C * FP];
  float t[C * QP], aqk[C * QP];
  float beta[C], graw[C], eg[C], kdec[C];
};

__global__ void __launch_bounds__(kThreads, 1)
    gdn_chunk_state_kernel(const GdnPrefillArgs p, int ch0, int n_chunks, const float* ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StateSmem& sm = *reinterpret_cast<StateSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c2 = (lane % 4) * 2;
  const int h = blockIdx.x, v0 = blockIdx.y * BV;
  const int kh = h / (p.n_v_heads / p.n_k_heads);
  float* const state = p.state + size_t(h) * DK * DK;

  // This warp's rows of S in the mma accumulator layout: s[nt][e] = S[d][v0 + col] with
  // d = 16 warp + g + 8 (e / 2), col = 8 nt + c2 + e % 2.
  const int d0 = 16 * warp + g;
  float s[4][4];
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float2 x = *reinterpret_cast<const float2*>(state + (d0 + 8 * hf) * DK + v0 + 8 * nt + c2);
      s[nt][2 * hf] = x.x;
      s[nt][2 * hf + 1] = x.y;
    }
  auto store_s_copies = [&] {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        uint32_t hi, lo;
        split2(s[nt][2 * hf], s[nt][2 * hf + 1], hi, lo);
        const int off = (d0 + 8 * hf) * HP + 8 * nt + c2;
        *reinterpret_cast<uint32_t*>(sm.s_hi + off) = hi;
        *reinterpret_cast<uint32_t*>(sm.s_lo + off) = lo;
      }
  };
  store_s_copies();

  // Next chunk's inputs, fetched into registers while the current one is processed. T and Aqk:
  // only their 16 x 16 blocks on or below the diagonal are read (the mmas skip the rest).
  uint4 kpre[4], qpre[4], vpre;
  float4 tpre[8];
  float bgpre = 0.f;
  auto fetch = [&](int ch) {
    const int t0 = (ch0 + ch) * C;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kThreads, r = idx / 16, c = idx % 16, t = t0 + r;
      const bool ok = t < p.n;
      kpre[i] = ok ? *reinterpret_cast<const uint4*>(p.k + int64_t(t) * p.k_stride + kh * DK + c * 8)
                   : make_uint4(0, 0, 0, 0);
      qpre[i] = ok ? *reinterpret_cast<const uint4*>(p.q + int64_t(t) * p.q_stride + kh * DK + c * 8)
                   : make_uint4(0, 0, 0, 0);
    }
    {
      const int r = tid / 4, c = tid % 4, t = t0 + r;
      vpre = t < p.n ? *reinterpret_cast<const uint4*>(p.v + int64_t(t) * p.v_stride + h * DK + v0 + c * 8)
                     : make_uint4(0, 0, 0, 0);
    }
    if (tid < 2 * C) {
      const int t = t0 + tid % C;
      bgpre = t < p.n ? (tid < C ? p.beta : p.g)[int64_t(t) * p.n_v_heads + h] : 0.f;
    }
    const float* const src = ws + (size_t(ch) * p.n_v_heads + h) * kPrepPerChunkHead;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = tid + i * kThreads, w = idx % (kTile / 4), r = w / 16, c4 = w % 16;
      tpre[i] = c4 / 4 <= r / 16
                    ? *reinterpret_cast<const float4*>(src + (idx / (kTile / 4)) * kTile + r * C + c4 * 4)
                    : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  };
  fetch(0);

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int t0 = (ch0 + ch) * C;
    // ---- 1. stage the chunk's inputs, start fetching the next ----
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kThreads, r = idx / 16, c = idx % 16;
      *reinterpret_cast<uint4*>(sm.k + r * KP + c * 8) = kpre[i];
      *reinterpret_cast<uint4*>(sm.q + r * KP + c * 8) = qpre[i];
    }
    {
      const int r = tid / 4, c = tid % 4;
      const float2 f0 = bf2(vpre.x), f1 = bf2(vpre.y), f2 = bf2(vpre.z), f3 = bf2(vpre.w);
      *reinterpret_cast<float4*>(sm.v + r * FP + c * 8) = make_float4(f0.x, f0.y, f1.x, f1.y);
      *reinterpret_cast<float4*>(sm.v + r * FP + c * 8 + 4) = make_float4(f2.x, f2.y, f3.x, f3.y);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int idx = tid + i * kThreads, w = idx % (kTile / 4), r = w / 16, c4 = w % 16;
      *reinterpret_cast<float4*>((idx < kTile / 4 ? sm.t : sm.aqk) + r * QP + c4 * 4) = tpre[i];
    }
    if (tid < C)
      sm.beta[tid] = bgpre;
    else if (tid < 2 * C)
      sm.graw[tid - C] = bgpre;
    if (ch + 1 < n_chunks) fetch(ch + 1);
    __syncthreads();

    // ---- 2. decay prefix sums (warp 0); Q·S (warps 0-3) and K·S (warps 4-7), warp: 16 rows x
    // 32 columns ----
    if (warp == 0) {
      float a = sm.graw[lane], b = sm.graw[lane + 32];
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const float x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) {
          a += x;
          b += y;
        }
      }
      b += __shfl_sync(0xffffffffu, a, 31);
      const float glast = __shfl_sync(0xffffffffu, b, 31);
      sm.eg[lane] = expf(a);
      sm.eg[lane + 32] = expf(b);
      sm.kdec[lane] = expf(glast - a);
      sm.kdec[lane + 32] = expf(glast - b);
    }
    const int mt = warp % 4;  // Q·S / K·S row tile
    // hi and lo parts into separate accumulators: two dependency chains of 8 mmas, not one of 16
    float xs[4][4] = {}, xl[4][4] = {};
    {
      const __nv_bfloat16* X = warp < 4 ? sm.q : sm.k;
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        uint32_t a[4];
        tc::ldmatrix_x4(a, X + (mt * 16 + lane % 16) * KP + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bh[4], bl[4];
          const int off = b_trans_off(lane, kk * 16, np * 16, HP);
          tc::ldmatrix_x4_trans(bh, sm.s_hi + off);
          tc::ldmatrix_x4_trans(bl, sm.s_lo + off);
          tc::mma_bf16(xs[2 * np], a, bh[0], bh[1]);
          tc::mma_bf16(xl[2 * np], a, bl[0], bl[1]);
          tc::mma_bf16(xs[2 * np + 1], a, bh[2], bh[3]);
          tc::mma_bf16(xl[2 * np + 1], a, bl[2], bl[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) xs[nt][e] += xl[nt][e];
    }
    __syncthreads();  // e^G visible
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = mt * 16 + g + 8 * hf, col = nt * 8 + c2;
        const float e = sm.eg[i], x0 = xs[nt][2 * hf], x1 = xs[nt][2 * hf + 1];
        if (warp < 4) {
          *reinterpret_cast<float2*>(sm.oqs + i * FP + col) = make_float2(e * x0, e * x1);
        } else {
          const float2 vv = *reinterpret_cast<const float2*>(sm.v + i * FP + col);
          const float b = sm.beta[i];
          uint32_t hi, lo;
          split2(b * (vv.x - e * x0), b * (vv.y - e * x1), hi, lo);
          *reinterpret_cast<uint32_t*>(sm.r_hi + i * HP + col) = hi;
          *reinterpret_cast<uint32_t*>(sm.r_lo + i * HP + col) = lo;
        }
      }
    __syncthreads();

    // ---- 3. V' = T·R, warp = row tile warp/2 x columns 16 (warp%2) .. +16; T is zero above the
    // diagonal. Then the bf16 hi/lo copies of V' and e^{G_last-G} ⊙ V' for step 4. ----
    const int ot = warp / 2, n0 = 16 * (warp % 2);
    {
      float vp[2][4] = {}, vq[2][4] = {}, vr[2][4] = {};  // hi·hi, hi·lo, lo·hi: three chains
      for (int kk = 0; kk <= ot; ++kk) {
        uint32_t ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 x = *reinterpret_cast<const float2*>(sm.t + (ot * 16 + g + 8 * (r % 2)) * QP +
                                                            kk * 16 + c2 + 8 * (r / 2));
          split2(x.x, x.y, ah[r], al[r]);
        }
        uint32_t bh[4], bl[4];
        const int off = b_trans_off(lane, kk * 16, n0, HP);
        tc::ldmatrix_x4_trans(bh, sm.r_hi + off);
        tc::ldmatrix_x4_trans(bl, sm.r_lo + off);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          tc::mma_bf16(vp[nt], ah, bh[2 * nt], bh[2 * nt + 1]);
          tc::mma_bf16(vq[nt], ah, bl[2 * nt], bl[2 * nt + 1]);
          tc::mma_bf16(vr[nt], al, bh[2 * nt], bh[2 * nt + 1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) vp[nt][e] += vq[nt][e] + vr[nt][e];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = ot * 16 + g + 8 * hf, off = row * HP + n0 + 8 * nt + c2;
          const float kd = sm.kdec[row], x0 = vp[nt][2 * hf], x1 = vp[nt][2 * hf + 1];
          uint32_t hi, lo;
          split2(x0, x1, hi, lo);
          *reinterpret_cast<uint32_t*>(sm.v_hi + off) = hi;
          *reinterpret_cast<uint32_t*>(sm.v_lo + off) = lo;
          split2(kd * x0, kd * x1, hi, lo);
          *reinterpret_cast<uint32_t*>(sm.vd_hi + off) = hi;
          *reinterpret_cast<uint32_t*>(sm.vd_lo + off) = lo;
        }
    }
    __syncthreads();

    // ---- 4a. O = e^G⊙(Q·S) + Aqk·V', the same warp tiles as step 3 ----
    {
      float o[2][4], oq[2][4] = {}, orr[2][4] = {};  // hi·hi onto e^G⊙(Q·S), hi·lo, lo·hi
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const float2 x =
              *reinterpret_cast<const float2*>(sm.oqs + (ot * 16 + g + 8 * hf) * FP + n0 + 8 * nt + c2);
          o[nt][2 * hf] = x.x;
          o[nt][2 * hf + 1] = x.y;
        }
      for (int kk = 0; kk <= ot; ++kk) {
        uint32_t ah[4], al[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const float2 x = *reinterpret_cast<const float2*>(sm.aqk + (ot * 16 + g + 8 * (r % 2)) * QP +
                                                            kk * 16 + c2 + 8 * (r / 2));
          split2(x.x, x.y, ah[r], al[r]);
        }
        uint32_t bh[4], bl[4];
        const int off = b_trans_off(lane, kk * 16, n0, HP);
        tc::ldmatrix_x4_trans(bh, sm.v_hi + off);
        tc::ldmatrix_x4_trans(bl, sm.v_lo + off);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          tc::mma_bf16(o[nt], ah, bh[2 * nt], bh[2 * nt + 1]);
          tc::mma_bf16(oq[nt], ah, bl[2 * nt], bl[2 * nt + 1]);
          tc::mma_bf16(orr[nt], al, bh[2 * nt], bh[2 * nt + 1]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[nt][e] += oq[nt][e] + orr[nt][e];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = t0 + ot * 16 + g + 8 * hf;
        if (t >= p.n) continue;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int64_t off = int64_t(t) * p.o_stride + h * DK + v0 + n0 + 8 * nt + c2;
          if (p.o_f32)
            *reinterpret_cast<float2*>(p.o_f32 + off) = make_float2(o[nt][2 * hf], o[nt][2 * hf + 1]);
          else
            *reinterpret_cast<uint32_t*>(p.o_bf16 + off) = tc::pack_bf16(o[nt][2 * hf], o[nt][2 * hf + 1]);
        }
      }
    }

    // ---- 4b. S = e^{G_last} S + Kᵀ·(e^{G_last-G} ⊙ V') ----
    {
      const float eglast = sm.eg[C - 1];
      float sl[4][4] = {};  // the lo parts' chain
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= eglast;
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
        uint32_t a[4];
        tc::ldmatrix_x4_trans(
            a, sm.k + (kk * 16 + lane % 8 + (lane / 16) * 8) * KP + 16 * warp + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bh[4], bl[4];
          const int off = b_trans_off(lane, kk * 16, np * 16, HP);
          tc::ldmatrix_x4_trans(bh, sm.vd_hi + off);
          tc::ldmatrix_x4_trans(bl, sm.vd_lo + off);
          tc::mma_bf16(s[2 * np], a, bh[0], bh[1]);
          tc::mma_bf16(sl[2 * np], a, bl[0], bl[1]);
          tc::mma_bf16(s[2 * np + 1], a, bh[2], bh[3]);
          tc::mma_bf16(sl[2 * np + 1], a, bl[2], bl[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += sl[nt][e];
      store_s_copies();
    }
    __syncthreads();  // every shared tile is free for the next chunk
  }

#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      *reinterpret_cast<float2*>(state + (d0 + 8 * hf) * DK + v0 + 8 * nt + c2) =
          make_float2(s[nt][2 * hf], s[nt][2 * hf + 1]);
}

bool aligned(const void* ptr, size_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; }

void check_args(const GdnPrefillArgs& a, const char* who) {
  TANSY_CHECK(a.n >= 1, "{}: need at least one token, got {}", who, a.n);
  TANSY_CHECK(a.n_k_heads >= 1 && a.n_v_heads >= a.n_k_heads && a.n_v_heads % a.n_k_heads == 0 &&
                  a.n_v_heads <= 65535,
              "{}: {} value heads over {} key heads unsupported", who, a.n_v_heads, a.n_k_heads);
  TANSY_CHECK(a.q && a.k && a.v && a.beta && a.g && a.state, "{}: null input", who);
  TANSY_CHECK(!a.o_bf16 != !a.o_f32, "{}: exactly one of o_bf16 / o_f32 must be set (got {})", who,
              a.o_bf16 ? "both" : "neither");
  TANSY_CHECK(aligned(a.q, 16) && aligned(a.k, 16) && aligned(a.v, 16) && a.q_stride % 8 == 0 &&
                  a.k_stride % 8 == 0 && a.v_stride % 8 == 0,
              "{}: q/k/v rows must be 16-byte aligned (strides {}, {}, {})", who, a.q_stride, a.k_stride,
              a.v_stride);
  TANSY_CHECK(a.q_stride >= int64_t(a.n_k_heads) * kGdnDim && a.k_stride >= int64_t(a.n_k_heads) * kGdnDim &&
                  a.v_stride >= int64_t(a.n_v_heads) * kGdnDim &&
                  a.o_stride >= int64_t(a.n_v_heads) * kGdnDim,
              "{}: a row stride is shorter than its heads (q {}, k {}, v {}, o {})", who, a.q_stride,
              a.k_stride, a.v_stride, a.o_stride);
  TANSY_CHECK(
      a.o_f32 ? (aligned(a.o_f32, 16) && a.o_stride % 4 == 0) : (aligned(a.o_bf16, 8) && a.o_stride % 4 == 0),
      "{}: output rows must be aligned for 4-wide stores (stride {})", who, a.o_stride);
}

int window_chunks(int n_v_heads) {
  return std::max(1, int(kWindowFloats / (size_t(std::max(1, n_v_heads)) * kPrepPerChunkHead)));
}

// T and Aqk of one window, per (device, stream) so that calls on different streams never share
// one; grown on demand and kept for the life of the process.
float* prep_workspace(size_t floats, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, std::pair<float*, size_t>> bufs;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard lock(mu);
  auto& [ptr, cap] = bufs[{dev, stream}];
  if (cap < floats) {
    if (ptr) CUDA_CHECK(cudaFree(ptr));  // synchronises: no kernel still reads the old one
    ptr = nullptr;
    cap = 0;
    CUDA_CHECK(cudaMalloc(&ptr, floats * sizeof(float)));
    cap = floats;
  }
  return ptr;
}

}  // namespace

void gdn_prefill(const GdnPrefillArgs& a, cudaStream_t stream, int max_window_chunks) {
  check_args(a, "gdn_prefill");
  constexpr int kPrepSmem = sizeof(PrepSmem), kStateSmem = sizeof(StateSmem);
  static const bool attr_set =
      cudaFuncSetAttribute(gdn_chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPrepSmem) ==
          cudaSuccess &&
      cudaFuncSetAttribute(gdn_chunk_state_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStateSmem) ==
          cudaSuccess;
  TANSY_CHECK(attr_set, "gdn_prefill: cannot reserve {} bytes of shared memory per block", kStateSmem);
  const int n_chunks = (a.n + C - 1) / C;
  TANSY_CHECK(max_window_chunks >= 0, "gdn_prefill: window of {} chunks", max_window_chunks);
  int window = std::min(n_chunks, window_chunks(a.n_v_heads));
  if (max_window_chunks > 0) window = std::min(window, max_window_chunks);
  float* const ws = prep_workspace(size_t(window) * a.n_v_heads * kPrepPerChunkHead, stream);
  for (int c0 = 0; c0 < n_chunks; c0 += window) {
    const int nc = std::min(window, n_chunks - c0);
    gdn_chunk_prep_kernel<<<dim3(nc, a.n_v_heads), kThreads, kPrepSmem, stream>>>(a, c0, ws);
    gdn_chunk_state_kernel<<<dim3(a.n_v_heads, kGdnDim / BV), kThreads, kStateSmem, stream>>>(a, c0, nc, ws);
  }
  launch_check("gdn_prefill");
}

int gdn_prefill_launches(int n, int n_v_heads) {
  const int chunks = (std::max(1, n) + C - 1) / C, w = window_chunks(n_v_heads);
  return 2 * ((chunks + w - 1) / w);
}

}  // namespace tansy::cuda
