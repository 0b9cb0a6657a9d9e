// Chunked Gated DeltaNet prefill with f32 state products (gdn_prefill_f32; gdn_prefill in
// prefill_tc.cu is the tensor-core version of the same algebra). docs/MODEL.md §5.6. One block = one value
// head x 32 state columns; the block walks the chunks of 64 tokens in order, carrying its 128x32 slice of S
// in shared memory.
//
// Per chunk (C = 64 rows, zero-padded past n: k = q = v = β = g = 0 leaves S and outputs exact):
//   G = cumsum(g);  A[i][j] = β_i (k_i·k_j) e^{G_i-G_j} (j < i);  Aqk[i][j] = (q_i·k_j) e^{G_i-G_j} (j <= i)
//   [U | W] = (I + A)^{-1} [β⊙V | β⊙e^G⊙K]          forward substitution, 32 + 128 columns
//   V' = U - W·S
//   O  = e^G ⊙ (Q·S) + Aqk·V'
//   S  = e^{G_last} S + (K ⊙ e^{G_last-G})ᵀ·V'
// Q·Kᵀ and K·Kᵀ use tensor cores: q̂, k̂ arrive in bf16, so their products are exact in f32 and
// the mma result equals the f32 dot product up to summation order. Everything touching S or V'
// stays in f32 on the CUDA cores (the state's rounding compounds over the sequence).
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

// Shared-memory row pitches (elements), padded against bank conflicts for the access patterns
// noted with each buffer.
constexpr int KP = DK + 8;  // bf16 K/Q: 272-byte rows put ldmatrix's 8 rows in 8 bank groups
constexpr int VP = BV + 1;  // f32 V: the solve reads one row per lane
constexpr int WP = DK + 1;  // f32 W: rows 2 apart land 2 banks apart (V' = U - W·S)
constexpr int UP = BV + 4;  // f32 U/V': float4 rows
constexpr int AP = C + 1;   // f32 A, Aqk: the solve reads a column, one row per lane
constexpr int SP = BV + 4;  // f32 S: float4 rows

struct Smem {
  __nv_bfloat16 k[C * KP], q[C * KP];
  float v[C * VP];
  float w[C * WP];
  float u[C * UP];
  float a[C * AP], aqk[C * AP];
  float s[DK * SP];
  float beta[C], graw[C], eg[C], kdec[C], G[C];
};

__device__ __forceinline__ float2 bf2(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}

__global__ void __launch_bounds__(kThreads, 1) gdn_prefill_kernel(const GdnPrefillArgs p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int h = blockIdx.x, v0 = blockIdx.y * BV;
  const int kh = h / (p.n_v_heads / p.n_k_heads);
  float* const state = p.state + size_t(h) * DK * DK;

  for (int i = tid; i < DK * BV; i += kThreads) {
    const int r = i / BV, c = i % BV;
    sm.s[r * SP + c] = state[r * DK + v0 + c];
  }

  // Next chunk's inputs, fetched into registers while the current one is processed.
  uint4 kpre[4], qpre[4], vpre;
  float bgpre = 0.f;
  auto fetch = [&](int t0) {
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
  };
  fetch(0);

  const int n_chunks = (p.n + C - 1) / C;
  for (int ch = 0; ch < n_chunks; ++ch) {
    const int t0 = ch * C;
    // ---- 1. stage the chunk's inputs, start fetching the next ----
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = tid + i * kThreads, r = idx / 16, c = idx % 16;
      *reinterpret_cast<uint4*>(sm.k + r * KP + c * 8) = kpre[i];
      *reinterpret_cast<uint4*>(sm.q + r * KP + c * 8) = qpre[i];
    }
    {
      const int r = tid / 4, c = tid % 4;
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&vpre);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = bf2(w[i]);
        sm.v[r * VP + c * 8 + 2 * i] = f.x;
        sm.v[r * VP + c * 8 + 2 * i + 1] = f.y;
      }
    }
    if (tid < C)
      sm.beta[tid] = bgpre;
    else if (tid < 2 * C)
      sm.graw[tid - C] = bgpre;
    if (ch + 1 < n_chunks) fetch(t0 + C);
    __syncthreads();

    // ---- 2. decay prefix sums (warp 0) and the two 64x64 Gram matrices (tensor cores) ----
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
      sm.G[lane] = a;
      sm.G[lane + 32] = b;
      sm.eg[lane] = expf(a);
      sm.eg[lane + 32] = expf(b);
      sm.kdec[lane] = expf(glast - a);
      sm.kdec[lane + 32] = expf(glast - b);
    }
    const int g = lane / 4, c2 = (lane % 4) * 2;
    const int rt = warp / 2, cbase = (warp % 2) * 32;  // this warp's 16 x 32 block of the 64 x 64
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
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = rt * 16 + g + (e / 2) * 8, j = cbase + nt * 8 + c2 + (e & 1);
        // e^{G_i-G_j} only where j <= i: above the diagonal it can overflow.
        const float dec = j <= i ? expf(sm.G[i] - sm.G[j]) : 0.f;
        sm.a[i * AP + j] = j < i ? sm.beta[i] * ckk[nt][e] * dec : 0.f;
        sm.aqk[i * AP + j] = cqk[nt][e] * dec;
      }
    __syncthreads();

    // ---- 3. [U | W] = (I + A)^{-1} [β⊙V | β⊙e^G⊙K]: each warp owns 20 of the 160 columns,
    // each lane rows lane and lane+32; right-looking substitution, x_i broadcast by shuffle. ----
    {
      constexpr int kCols = (BV + DK) / kWarps;  // 20
      float x[kCols][2];
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) {
        const int col = warp * kCols + cc;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int r = lane + 32 * s;
          x[cc][s] = sm.beta[r] *
                     (col < BV ? sm.v[r * VP + col] : sm.eg[r] * __bfloat162float(sm.k[r * KP + col - BV]));
        }
      }
      // A is strictly lower triangular with explicit zeros, so rows <= i are left unchanged.
      for (int i = 0; i < 32; ++i) {
        const float a0 = sm.a[lane * AP + i], a1 = sm.a[(lane + 32) * AP + i];
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) {
          const float xi = __shfl_sync(0xffffffffu, x[cc][0], i);
          x[cc][0] -= a0 * xi;
          x[cc][1] -= a1 * xi;
        }
      }
      for (int i = 32; i < C; ++i) {
        const float a1 = sm.a[(lane + 32) * AP + i];
#pragma unroll
        for (int cc = 0; cc < kCols; ++cc) x[cc][1] -= a1 * __shfl_sync(0xffffffffu, x[cc][1], i - 32);
      }
#pragma unroll
      for (int cc = 0; cc < kCols; ++cc) {
        const int col = warp * kCols + cc;
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int r = lane + 32 * s;
          if (col < BV)
            sm.u[r * UP + col] = x[cc][s];
          else
            sm.w[r * WP + col - BV] = x[cc][s];
        }
      }
    }
    __syncthreads();

    // ---- 4. V' = U - W·S (in place in u): thread = rows 2rg, 2rg+1 x columns 4cg..4cg+3 ----
    const int rg = tid / 8, cg = tid % 8, r0 = 2 * rg, c0 = 4 * cg;
    {
      float acc[2][4];
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const float4 u = *reinterpret_cast<const float4*>(sm.u + (r0 + ri) * UP + c0);
        acc[ri][0] = u.x;
        acc[ri][1] = u.y;
        acc[ri][2] = u.z;
        acc[ri][3] = u.w;
      }
#pragma unroll 8
      for (int d = 0; d < DK; ++d) {
        const float4 s = *reinterpret_cast<const float4*>(sm.s + d * SP + c0);
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const float w = sm.w[(r0 + ri) * WP + d];
          acc[ri][0] -= w * s.x;
          acc[ri][1] -= w * s.y;
          acc[ri][2] -= w * s.z;
          acc[ri][3] -= w * s.w;
        }
      }
      __syncthreads();  // all reads of U done before it becomes V'
#pragma unroll
      for (int ri = 0; ri < 2; ++ri)
        *reinterpret_cast<float4*>(sm.u + (r0 + ri) * UP + c0) =
            make_float4(acc[ri][0], acc[ri][1], acc[ri][2], acc[ri][3]);
    }
    __syncthreads();

    // ---- 5. O = e^G ⊙ (Q·S) + Aqk·V'  (same thread tiling as step 4) ----
    {
      float acc[2][4] = {};
#pragma unroll 4
      for (int d = 0; d < DK; d += 2) {
        const float4 sa = *reinterpret_cast<const float4*>(sm.s + d * SP + c0);
        const float4 sb = *reinterpret_cast<const float4*>(sm.s + (d + 1) * SP + c0);
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const float2 qv = bf2(*reinterpret_cast<const uint32_t*>(sm.q + (r0 + ri) * KP + d));
          acc[ri][0] += qv.x * sa.x + qv.y * sb.x;
          acc[ri][1] += qv.x * sa.y + qv.y * sb.y;
          acc[ri][2] += qv.x * sa.z + qv.y * sb.z;
          acc[ri][3] += qv.x * sa.w + qv.y * sb.w;
        }
      }
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const float e = sm.eg[r0 + ri];
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[ri][c] *= e;
      }
#pragma unroll 8
      for (int j = 0; j < C; ++j) {
        const float4 vv = *reinterpret_cast<const float4*>(sm.u + j * UP + c0);
#pragma unroll
        for (int ri = 0; ri < 2; ++ri) {
          const float a = sm.aqk[(r0 + ri) * AP + j];
          acc[ri][0] += a * vv.x;
          acc[ri][1] += a * vv.y;
          acc[ri][2] += a * vv.z;
          acc[ri][3] += a * vv.w;
        }
      }
#pragma unroll
      for (int ri = 0; ri < 2; ++ri) {
        const int t = t0 + r0 + ri;
        if (t >= p.n) continue;
        const int64_t off = int64_t(t) * p.o_stride + h * DK + v0 + c0;
        if (p.o_f32) {
          *reinterpret_cast<float4*>(p.o_f32 + off) =
              make_float4(acc[ri][0], acc[ri][1], acc[ri][2], acc[ri][3]);
        } else {
          uint2 o;
          o.x = tc::pack_bf16(acc[ri][0], acc[ri][1]);
          o.y = tc::pack_bf16(acc[ri][2], acc[ri][3]);
          *reinterpret_cast<uint2*>(p.o_bf16 + off) = o;
        }
      }
    }

    // ---- 6. S = e^{G_last} S + (K ⊙ e^{G_last-G})ᵀ·V': thread = rows 4rg'..+3 x columns 4cg ----
    {
      const int kd0 = 4 * rg;
      const float eglast = sm.eg[C - 1];
      float acc[4][4];
#pragma unroll
      for (int ri = 0; ri < 4; ++ri) {
        const float4 s = *reinterpret_cast<const float4*>(sm.s + (kd0 + ri) * SP + c0);
        acc[ri][0] = eglast * s.x;
        acc[ri][1] = eglast * s.y;
        acc[ri][2] = eglast * s.z;
        acc[ri][3] = eglast * s.w;
      }
#pragma unroll 4
      for (int i = 0; i < C; ++i) {
        const float4 vv = *reinterpret_cast<const float4*>(sm.u + i * UP + c0);
        const uint2 kr = *reinterpret_cast<const uint2*>(sm.k + i * KP + kd0);
        const float dec = sm.kdec[i];
        const float2 ka = bf2(kr.x), kb = bf2(kr.y);
        const float kv[4] = {ka.x * dec, ka.y * dec, kb.x * dec, kb.y * dec};
#pragma unroll
        for (int ri = 0; ri < 4; ++ri) {
          acc[ri][0] += kv[ri] * vv.x;
          acc[ri][1] += kv[ri] * vv.y;
          acc[ri][2] += kv[ri] * vv.z;
          acc[ri][3] += kv[ri] * vv.w;
        }
      }
      __syncthreads();  // every read of S (steps 4-6) is done
#pragma unroll
      for (int ri = 0; ri < 4; ++ri)
        *reinterpret_cast<float4*>(sm.s + (kd0 + ri) * SP + c0) =
            make_float4(acc[ri][0], acc[ri][1], acc[ri][2], acc[ri][3]);
    }
    __syncthreads();
  }

  for (int i = tid; i < DK * BV; i += kThreads) {
    const int r = i / BV, c = i % BV;
    state[r * DK + v0 + c] = sm.s[r * SP + c];
  }
}

bool aligned(const void* ptr, size_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; }

}  // namespace

void check_gdn_prefill_args(const GdnPrefillArgs& a, const char* who) {
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

void gdn_prefill_f32(const GdnPrefillArgs& a, cudaStream_t stream) {
  check_gdn_prefill_args(a, "gdn_prefill_f32");
  constexpr int kSmem = sizeof(Smem);
  static const bool attr_set =
      cudaFuncSetAttribute(gdn_prefill_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) ==
      cudaSuccess;
  TANSY_CHECK(attr_set, "gdn_prefill_f32: cannot reserve {} bytes of shared memory per block", kSmem);
  gdn_prefill_kernel<<<dim3(a.n_v_heads, kGdnDim / BV), kThreads, kSmem, stream>>>(a);
  launch_check("gdn_prefill_f32");
}

}  // namespace tansy::cuda
