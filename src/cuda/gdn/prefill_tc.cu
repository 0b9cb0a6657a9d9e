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
// work it replaces. The state S itself never leaves f32: each warp keeps its 16 rows x 16 columns
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
static_assert(kWarps * 8 == C, "the prep kernel's substitution gives each warp 8 of T's columns");

// Shared-memory row pitches (elements), padded against bank conflicts.
constexpr int KP = DK + 8;  // bf16 K/Q: 272-byte rows put ldmatrix's 8 rows in 8 bank groups
constexpr int HP = BV + 8;  // bf16 hi/lo copies of S and V': 80-byte rows, the same for ldmatrix.trans
constexpr int FP = BV + 4;  // f32 e^G⊙(Q·S): float2 rows, half-warps conflict-free
constexpr int AP = C + 1;   // f32 A: the substitution reads a column, one row per lane
constexpr int TP = C + 8;   // bf16 T / Aqk planes: 144-byte rows, ldmatrix conflict-free
constexpr int VP = BV + 8;  // bf16 V: 80-byte rows

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

// A 16 x 16 product onto two n8 tiles, hi and lo parts of B in chains of their own: hi[nt] += a·bh,
// lo[nt] += a·bl for the n-tiles of an ldmatrix.x4.trans pair (b[0..1] tile 0, b[2..3] tile 1).
__device__ __forceinline__ void mma_hi_lo(float (&hi)[2][4], float (&lo)[2][4], const uint32_t (&a)[4],
                                          const uint32_t (&bh)[4], const uint32_t (&bl)[4]) {
  tc::mma_bf16(hi[0], a, bh[0], bh[1]);
  tc::mma_bf16(lo[0], a, bl[0], bl[1]);
  tc::mma_bf16(hi[1], a, bh[2], bh[3]);
  tc::mma_bf16(lo[1], a, bl[2], bl[3]);
}

// Element offset, in a [k][n] row-major bf16 tile of pitch `pitch`, of this lane's row address for
// ldmatrix.x4.trans giving the B fragments (b0, b1) of the n-tiles n0 and n0+8 at k-step k0.
__device__ __forceinline__ int b_trans_off(int lane, int k0, int n0, int pitch) {
  return (k0 + ((lane / 8) % 2) * 8 + lane % 8) * pitch + n0 + (lane / 16) * 8;
}

// ---- The two-kernel form (gdn_prefill) ----
// gdn_chunk_prep_kernel, one block per (chunk, value head), every chunk of a window at once: what
// a chunk needs that does not depend on the carried state, T = (I + A)^{-1} and Aqk (64 x 64,
// lower triangular, as bf16 hi/lo pairs) into a workspace. gdn_chunk_state_kernel, one block per (value head,
// 32 state columns), walks the window's chunks in order with only the state-dependent products left on its
// serial path:
//   R = β⊙(V - e^G⊙(K·S)),  V' = T·R,  O = e^G⊙(Q·S) + Aqk·V',  S = e^{G_last} S + Kᵀ·(e^{G_last-G}⊙V').
// V' = T·R is the forward substitution as a product (both operands f32:
// three mmas, the same class as Aqk·V'); the Gram matrices, the decay matrices and the 64-step
// substitution run in parallel over the chunks instead of once per chunk in sequence.

// The workspace holds, per (chunk, value head), four 64 x 64 bf16 planes, row-major: T's hi and lo
// parts, then Aqk's (split2 of the f32 values, so the state kernel loads its A fragments with
// ldmatrix instead of converting them each time it uses them).
constexpr int kTile = C * C;                      // elements of one 64 x 64 plane
constexpr int kPrepPerChunkHead = 4 * kTile;      // bf16: T hi, T lo, Aqk hi, Aqk lo
constexpr size_t kWindowElems = size_t(1) << 25;  // 64 MiB of workspace: 64 chunks of 32 heads

struct PrepSmem {
  __nv_bfloat16 k[C * KP], q[C * KP];
  float a[C * AP];
  float beta[C], graw[C], G[C];
};

__global__ void __launch_bounds__(kThreads)
    gdn_chunk_prep_kernel(const GdnPrefillArgs p, int ch0, __nv_bfloat16* ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepSmem& sm = *reinterpret_cast<PrepSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c2 = (lane % 4) * 2;
  const int ch = blockIdx.x, h = blockIdx.y;
  const int kh = h / (p.n_v_heads / p.n_k_heads);
  const int t0 = (ch0 + ch) * C;
  __nv_bfloat16* const out = ws + (size_t(ch) * p.n_v_heads + h) * kPrepPerChunkHead;
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
  __nv_bfloat16* const aqk_hi = out + 2 * kTile;
  __nv_bfloat16* const aqk_lo = out + 3 * kTile;
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
      uint32_t hi, lo;
      split2(qv[0], qv[1], hi, lo);
      *reinterpret_cast<uint32_t*>(aqk_hi + i * C + j) = hi;
      *reinterpret_cast<uint32_t*>(aqk_lo + i * C + j) = lo;
    }
  __syncthreads();

  // T = (I + A)^{-1}: the forward substitution on the identity, each warp 8 of the
  // 64 columns, each lane rows lane and lane+32. T is lower triangular: warp w's columns are zero
  // above row 8w, so its substitution starts there (the steps before it only subtract zeros).
  {
    const int cb = 8 * warp;
    float x[8][2];
#pragma unroll
    for (int cc = 0; cc < 8; ++cc)
#pragma unroll
      for (int sh = 0; sh < 2; ++sh) x[cc][sh] = lane + 32 * sh == cb + cc ? 1.f : 0.f;
    constexpr int kSub = 4;
#pragma unroll 2
    for (int i = cb; i < 32; i += kSub) {
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
    for (int i = cb < 32 ? 32 : cb; i < C; i += kSub) {
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
      uint4 hi, lo;
      split2(x[0][sh], x[1][sh], hi.x, lo.x);
      split2(x[2][sh], x[3][sh], hi.y, lo.y);
      split2(x[4][sh], x[5][sh], hi.z, lo.z);
      split2(x[6][sh], x[7][sh], hi.w, lo.w);
      const int off = (lane + 32 * sh) * C + cb;
      *reinterpret_cast<uint4*>(out + off) = hi;
      *reinterpret_cast<uint4*>(out + kTile + off) = lo;
    }
  }
}

// The state kernel's block: 16 warps, so that each multiprocessor (one block: the state lives in
// registers and the two staged chunks fill shared memory) has two warps per scheduler to hide the
// mma and shared-memory latencies of the walk's short dependent phases. Warp w keeps S rows
// 16 (w / 2) .. +16, columns 16 (w % 2) .. +16 of the block's 128 x 32 slice.
constexpr int kStateThreads = 512;
constexpr int kStateWarps = kStateThreads / 32;
static_assert(kStateWarps == 2 * (DK / 16) && BV == 32, "two warps of 16 columns per 16 state rows");

// One chunk's inputs, copied (cp.async) one chunk ahead into the other of two stages.
struct StateStage {
  __nv_bfloat16 k[C * KP], q[C * KP];
  __nv_bfloat16 t_hi[C * TP], t_lo[C * TP], aqk_hi[C * TP], aqk_lo[C * TP];
  __nv_bfloat16 v[C * VP];
  float beta[C], graw[C];
};

struct StateSmem {
  StateStage st[2];
  __nv_bfloat16 s_hi[DK * HP], s_lo[DK * HP];  // S (rows d, columns v)
  __nv_bfloat16 r_hi[C * HP], r_lo[C * HP];    // R
  __nv_bfloat16 v_hi[C * HP], v_lo[C * HP];    // V'
  __nv_bfloat16 vd_hi[C * HP], vd_lo[C * HP];  // e^{G_last-G} ⊙ V'
  float oqs[C * FP];                           // e^G ⊙ (Q·S)
  float eg[C], kdec[C];
};

__global__ void __launch_bounds__(kStateThreads, 1)
    gdn_chunk_state_kernel(const GdnPrefillArgs p, int ch0, int n_chunks, const __nv_bfloat16* ws) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  StateSmem& sm = *reinterpret_cast<StateSmem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, c2 = (lane % 4) * 2;
  const int h = blockIdx.x, v0 = blockIdx.y * BV;
  const int kh = h / (p.n_v_heads / p.n_k_heads);
  float* const state = p.state + size_t(h) * DK * DK;

  // This warp's part of S in the mma accumulator layout: s[nt][e] = S[d][v0 + col] with
  // d = 16 (warp / 2) + g + 8 (e / 2), col = 16 (warp % 2) + 8 nt + c2 + e % 2.
  const int d0 = 16 * (warp / 2) + g, sc0 = 16 * (warp % 2);
  float s[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float2 x = *reinterpret_cast<const float2*>(state + (d0 + 8 * hf) * DK + v0 + sc0 + 8 * nt + c2);
      s[nt][2 * hf] = x.x;
      s[nt][2 * hf + 1] = x.y;
    }
  auto store_s_copies = [&] {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        uint32_t hi, lo;
        split2(s[nt][2 * hf], s[nt][2 * hf + 1], hi, lo);
        const int off = (d0 + 8 * hf) * HP + sc0 + 8 * nt + c2;
        *reinterpret_cast<uint32_t*>(sm.s_hi + off) = hi;
        *reinterpret_cast<uint32_t*>(sm.s_lo + off) = lo;
      }
  };
  store_s_copies();

  // Chunk ch's inputs into stage st, asynchronously; rows past n are zero-filled. Of T and Aqk
  // only the 16 x 16 blocks on or below the diagonal are copied (the mmas read no others). What
  // this thread copies is fixed for the walk (its pointers only advance by a chunk): K and Q rows
  // tid/16 and tid/16 + 32, chunk tid%16; row tid/8, chunk tid%8 of each T / Aqk plane; V row
  // tid/4, chunk tid%4 (tid < 256); one β or g (256 <= tid < 384).
  const int kq_r = tid / 16, kq_c = (tid % 16) * 8, kq_dst = kq_r * KP + kq_c;
  const __nv_bfloat16* const k_src = p.k + int64_t(kq_r) * p.k_stride + kh * DK + kq_c;
  const __nv_bfloat16* const q_src = p.q + int64_t(kq_r) * p.q_stride + kh * DK + kq_c;
  const int64_t k_half = int64_t(C / 2) * p.k_stride, q_half = int64_t(C / 2) * p.q_stride;
  const int tw_r = tid / 8, tw_c = (tid % 8) * 8, tw_dst = tw_r * TP + tw_c;
  const bool tw_on = tw_c / 16 <= tw_r / 16;
  const __nv_bfloat16* const tw_src = ws + size_t(h) * kPrepPerChunkHead + tw_r * C + tw_c;
  const size_t ws_chunk = size_t(p.n_v_heads) * kPrepPerChunkHead;
  const bool is_v = tid < C * (BV / 8), is_bg = !is_v && tid < C * (BV / 8) + 2 * C;
  const int v_r = tid / 4, v_dst = v_r * VP + (tid % 4) * 8, bg_i = (tid - C * (BV / 8)) % C;
  const __nv_bfloat16* const v_src = p.v + h * DK + v0 + (tid % 4) * 8;
  const float* const bg_src = (tid < C * (BV / 8) + C ? p.beta : p.g) + h;
  auto fetch = [&](int ch, StateStage& st) {
    const int t0 = (ch0 + ch) * C;
    const bool lo = t0 + kq_r < p.n, hi = t0 + kq_r + C / 2 < p.n;
    const __nv_bfloat16* const kc = k_src + int64_t(t0) * p.k_stride;
    const __nv_bfloat16* const qc = q_src + int64_t(t0) * p.q_stride;
    tc::cp_async16(st.k + kq_dst, lo ? kc : p.k, lo);
    tc::cp_async16(st.k + kq_dst + (C / 2) * KP, hi ? kc + k_half : p.k, hi);
    tc::cp_async16(st.q + kq_dst, lo ? qc : p.q, lo);
    tc::cp_async16(st.q + kq_dst + (C / 2) * KP, hi ? qc + q_half : p.q, hi);
    if (tw_on) {
      const __nv_bfloat16* const src = tw_src + size_t(ch) * ws_chunk;
      tc::cp_async16(st.t_hi + tw_dst, src, true);
      tc::cp_async16(st.t_lo + tw_dst, src + kTile, true);
      tc::cp_async16(st.aqk_hi + tw_dst, src + 2 * kTile, true);
      tc::cp_async16(st.aqk_lo + tw_dst, src + 3 * kTile, true);
    }
    if (is_v) {
      const bool ok = t0 + v_r < p.n;
      tc::cp_async16(st.v + v_dst, ok ? v_src + int64_t(t0 + v_r) * p.v_stride : p.v, ok);
    } else if (is_bg) {
      const bool ok = t0 + bg_i < p.n;
      tc::cp_async4((tid < C * (BV / 8) + C ? st.beta : st.graw) + bg_i,
                    ok ? bg_src + int64_t(t0 + bg_i) * p.n_v_heads : bg_src, ok);
    }
    tc::cp_async_commit();
  };
  fetch(0, sm.st[0]);

  for (int ch = 0; ch < n_chunks; ++ch) {
    const int t0 = (ch0 + ch) * C;
    const StateStage& st = sm.st[ch % 2];
    // ---- 1. start the next chunk's copies (into the stage the previous chunk used), wait for
    // this one's ----
    if (ch + 1 < n_chunks) {
      fetch(ch + 1, sm.st[(ch + 1) % 2]);
      tc::cp_async_wait<1>();
    } else {
      tc::cp_async_wait<0>();
    }
    __syncthreads();

    // ---- 2. decay prefix sums (warp 0); Q·S (warps 0-7) and K·S (warps 8-15), warp: 16 rows x
    // 16 columns ----
    if (warp == 0) {
      float a = st.graw[lane], b = st.graw[lane + 32];
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
    const int mt = (warp % 8) / 2, nh = 16 * (warp % 2);  // Q·S / K·S row tile, column half
    // hi and lo parts into separate accumulators: two dependency chains of 8 mmas, not one of 16
    float xs[2][4] = {}, xl[2][4] = {};
    {
      const __nv_bfloat16* X = warp < 8 ? st.q : st.k;
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk) {
        uint32_t a[4], bh[4], bl[4];
        tc::ldmatrix_x4(a, X + (mt * 16 + lane % 16) * KP + kk * 16 + (lane / 16) * 8);
        const int off = b_trans_off(lane, kk * 16, nh, HP);
        tc::ldmatrix_x4_trans(bh, sm.s_hi + off);
        tc::ldmatrix_x4_trans(bl, sm.s_lo + off);
        mma_hi_lo(xs, xl, a, bh, bl);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) xs[nt][e] += xl[nt][e];
    }
    __syncthreads();  // e^G visible
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = mt * 16 + g + 8 * hf, col = nh + nt * 8 + c2;
        const float e = sm.eg[i], x0 = xs[nt][2 * hf], x1 = xs[nt][2 * hf + 1];
        if (warp < 8) {
          *reinterpret_cast<float2*>(sm.oqs + i * FP + col) = make_float2(e * x0, e * x1);
        } else {
          const float2 vv = bf2(*reinterpret_cast<const uint32_t*>(st.v + i * VP + col));
          const float b = st.beta[i];
          uint32_t hi, lo;
          split2(b * (vv.x - e * x0), b * (vv.y - e * x1), hi, lo);
          *reinterpret_cast<uint32_t*>(sm.r_hi + i * HP + col) = hi;
          *reinterpret_cast<uint32_t*>(sm.r_lo + i * HP + col) = lo;
        }
      }
    __syncthreads();

    // ---- 3. V' = T·R, warp = row tile warp/4 x columns 8 (warp%4) .. +8; T is zero above the
    // diagonal. Then the bf16 hi/lo copies of V' and e^{G_last-G} ⊙ V' for step 4. ----
    const int ot = warp / 4, n0 = 8 * (warp % 4);
    // Aqk·V' and T·R: rows ot*16.., columns n0.., k-steps 0..ot; hi·hi onto acc, hi·lo, lo·hi
    // in chains of their own, added at the end.
    auto tri_product = [&](float(&acc)[4], const __nv_bfloat16* a_hi, const __nv_bfloat16* a_lo,
                           const __nv_bfloat16* b_hi, const __nv_bfloat16* b_lo) {
      float q[4] = {}, r[4] = {};
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
        if (kk > ot) break;
        uint32_t ah[4], al[4], bh[2], bl[2];
        const int aoff = (ot * 16 + lane % 16) * TP + kk * 16 + (lane / 16) * 8;
        tc::ldmatrix_x4(ah, a_hi + aoff);
        tc::ldmatrix_x4(al, a_lo + aoff);
        const int boff = b_trans_off(lane, kk * 16, n0, HP);
        tc::ldmatrix_x2_trans(bh, b_hi + boff);
        tc::ldmatrix_x2_trans(bl, b_lo + boff);
        tc::mma_bf16(acc, ah, bh[0], bh[1]);
        tc::mma_bf16(q, ah, bl[0], bl[1]);
        tc::mma_bf16(r, al, bh[0], bh[1]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[e] += q[e] + r[e];
    };
    {
      float vp[4] = {};
      tri_product(vp, st.t_hi, st.t_lo, sm.r_hi, sm.r_lo);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = ot * 16 + g + 8 * hf, off = row * HP + n0 + c2;
        const float kd = sm.kdec[row], x0 = vp[2 * hf], x1 = vp[2 * hf + 1];
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
      float o[4];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const float2 x = *reinterpret_cast<const float2*>(sm.oqs + (ot * 16 + g + 8 * hf) * FP + n0 + c2);
        o[2 * hf] = x.x;
        o[2 * hf + 1] = x.y;
      }
      tri_product(o, st.aqk_hi, st.aqk_lo, sm.v_hi, sm.v_lo);
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = t0 + ot * 16 + g + 8 * hf;
        if (t >= p.n) continue;
        const int64_t off = int64_t(t) * p.o_stride + h * DK + v0 + n0 + c2;
        if (p.o_f32)
          *reinterpret_cast<float2*>(p.o_f32 + off) = make_float2(o[2 * hf], o[2 * hf + 1]);
        else
          *reinterpret_cast<uint32_t*>(p.o_bf16 + off) = tc::pack_bf16(o[2 * hf], o[2 * hf + 1]);
      }
    }

    // ---- 4b. S = e^{G_last} S + Kᵀ·(e^{G_last-G} ⊙ V'), on this warp's part of S ----
    {
      const float eglast = sm.eg[C - 1];
      float sl[2][4] = {};  // the lo parts' chain
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] *= eglast;
#pragma unroll
      for (int kk = 0; kk < C / 16; ++kk) {
        uint32_t a[4], bh[4], bl[4];
        tc::ldmatrix_x4_trans(
            a, st.k + (kk * 16 + lane % 8 + (lane / 16) * 8) * KP + 16 * (warp / 2) + ((lane / 8) % 2) * 8);
        const int off = b_trans_off(lane, kk * 16, sc0, HP);
        tc::ldmatrix_x4_trans(bh, sm.vd_hi + off);
        tc::ldmatrix_x4_trans(bl, sm.vd_lo + off);
        mma_hi_lo(s, sl, a, bh, bl);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] += sl[nt][e];
      store_s_copies();
    }
    __syncthreads();  // every shared tile (and this chunk's stage) is free for the next chunk
  }

#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf)
      *reinterpret_cast<float2*>(state + (d0 + 8 * hf) * DK + v0 + sc0 + 8 * nt + c2) =
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
  return std::max(1, int(kWindowElems / (size_t(std::max(1, n_v_heads)) * kPrepPerChunkHead)));
}

// T and Aqk of one window, per (device, stream) so that calls on different streams never share
// one; grown on demand and kept for the life of the process.
__nv_bfloat16* prep_workspace(size_t elems, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, std::pair<__nv_bfloat16*, size_t>> bufs;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  const std::lock_guard lock(mu);
  auto& [ptr, cap] = bufs[{dev, stream}];
  if (cap < elems) {
    if (ptr) CUDA_CHECK(cudaFree(ptr));  // synchronises: no kernel still reads the old one
    ptr = nullptr;
    cap = 0;
    CUDA_CHECK(cudaMalloc(&ptr, elems * sizeof(__nv_bfloat16)));
    cap = elems;
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
  __nv_bfloat16* const ws = prep_workspace(size_t(window) * a.n_v_heads * kPrepPerChunkHead, stream);
  for (int c0 = 0; c0 < n_chunks; c0 += window) {
    const int nc = std::min(window, n_chunks - c0);
    gdn_chunk_prep_kernel<<<dim3(nc, a.n_v_heads), kThreads, kPrepSmem, stream>>>(a, c0, ws);
    gdn_chunk_state_kernel<<<dim3(a.n_v_heads, kGdnDim / BV), kStateThreads, kStateSmem, stream>>>(a, c0, nc,
                                                                                                   ws);
  }
  launch_check("gdn_prefill");
}

int gdn_prefill_launches(int n, int n_v_heads) {
  const int chunks = (std::max(1, n) + C - 1) / C, w = window_chunks(n_v_heads);
  return 2 * ((chunks + w - 1) / w);
}

}  // namespace tansy::cuda
