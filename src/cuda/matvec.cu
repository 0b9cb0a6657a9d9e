// Weight-streaming products for decode. Each lane reads one 16-byte chunk of a weight row at a
// time (32 4-bit, 16 8-bit or 8 bf16 columns: always inside one quant group); the token rows of
// x sit in shared memory as f32, each chunk padded by 16 bytes so that the lanes of a warp, which
// read chunks 144/80/48 bytes apart, hit distinct banks. The pad slot holds the chunk's Σx, which
// turns the affine dequant into one multiply-add per chunk: Σ(s·q+b)x = s·Σqx + b·Σx.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/bulk_copy.cuh"
#include "cuda/matvec.cuh"
#include "cuda/moe.cuh"
#include "cuda/pdl.cuh"
#include "cuda/route_device.cuh"

namespace tansy::cuda {

DevLinear DevLinear::rows(int r0, int n) const {
  TANSY_CHECK(r0 >= 0 && n >= 0 && r0 + n <= out, "DevLinear::rows({}, {}) outside {} rows", r0, n, out);
  DevLinear v = *this;
  v.out = n;
  if (fmt == WFormat::kBF16) {
    v.w = w + int64_t(r0) * in;
  } else {
    v.q = q + int64_t(r0) * words_per_row();
    v.scales = scales + int64_t(r0) * (in / kQuantGroup);
    v.biases = biases + int64_t(r0) * (in / kQuantGroup);
  }
  return v;
}

void DevLinear::check(const char* what) const {
  if (fmt != WFormat::kAffine4 && fmt != WFormat::kAffine8 && fmt != WFormat::kBF16)
    fail("{}: weight format {} has no CUDA kernel", what, wformat_name(fmt));
  TANSY_CHECK(out > 0 && in > 0, "{}: empty weight [{}, {}]", what, out, in);
  TANSY_CHECK(in % kQuantGroup == 0, "{}: in = {} is not a multiple of {}", what, in, kQuantGroup);
  TANSY_CHECK(in <= kMatvecMaxIn, "{}: in = {} exceeds the kernel limit {}", what, in, kMatvecMaxIn);
  if (fmt == WFormat::kBF16) {
    TANSY_CHECK(w && aligned16(w), "{}: bf16 weights missing or not 16-byte aligned", what);
  } else {
    TANSY_CHECK(q && scales && biases && aligned16(q), "{}: affine weights missing or not 16-byte aligned",
                what);
  }
}

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Output rows a warp streams at once (registers: the SwiGLU modes read two rows per output row,
// and the multi-token variant, a prefill path, keeps one row).
constexpr int max_rows_per_warp(int T, int MODE) { return T > 1 ? 1 : MODE == 0 ? 4 : 2; }
constexpr int kMaxTopK = 16;
constexpr size_t kSmemMatvecMax = 100 * 1024;  // two blocks per multiprocessor

template <int BITS>
struct Chunk {
  static constexpr int kCols = BITS == 4 ? 32 : BITS == 8 ? 16 : 8;  // columns per 16-byte chunk
  static constexpr int kStride = kCols + 4;                          // f32 slots per chunk in smem
};

__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// Row r, chunk c of W as 16 raw bytes.
template <int BITS>
__device__ __forceinline__ uint4 load_chunk(const DevLinear& W, int64_t r, int c) {
  if constexpr (BITS == 16)
    return load_stream(W.w + r * W.in + int64_t(c) * 8);
  else
    return load_stream(W.q + r * (int64_t(W.in) * BITS / 32) + int64_t(c) * 4);
}

// A chunk's quant scale and bias (unused for bf16), loaded with its codes so that one memory
// round trip brings all three.
template <int BITS>
__device__ __forceinline__ void load_sb(const DevLinear& W, int64_t r, int c, float& s, float& b) {
  if constexpr (BITS != 16) {
    const int64_t gi = r * (W.in / kQuantGroup) + (c * Chunk<BITS>::kCols) / kQuantGroup;
    s = __bfloat162float(W.scales[gi]);
    b = __bfloat162float(W.biases[gi]);
  } else {
    s = b = 0.f;
  }
}

// A chunk's contribution to its row: xs points at the chunk's staged x (kCols f32 + Σx).
template <int BITS>
__device__ __forceinline__ float chunk_dot(uint4 wv, const float* xs, float s, float b) {
  const uint32_t wd[4] = {wv.x, wv.y, wv.z, wv.w};
  const float4* x4 = reinterpret_cast<const float4*>(xs);
  float raw = 0.f;
  if constexpr (BITS == 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xa = x4[2 * j], xb = x4[2 * j + 1];
      const float xl[4] = {xa.x, xa.y, xa.z, xa.w}, xh[4] = {xb.x, xb.y, xb.z, xb.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        // Nibbles k and k+4 of the word become bf16 128+q in the two halves.
        const uint32_t v = ((wd[j] >> (4 * k)) & 0x000F000Fu) | 0x43004300u;
        raw = fmaf(bf_lo(v), xl[k], raw);
        raw = fmaf(bf_hi(v), xh[k], raw);
      }
    }
  } else if constexpr (BITS == 8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 xa = x4[j];
      raw = fmaf(float(wd[j] & 0xffu), xa.x, raw);
      raw = fmaf(float((wd[j] >> 8) & 0xffu), xa.y, raw);
      raw = fmaf(float((wd[j] >> 16) & 0xffu), xa.z, raw);
      raw = fmaf(float(wd[j] >> 24), xa.w, raw);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {  // word m holds columns 2m (low half) and 2m+1
      const float4 xa = x4[j];
      raw = fmaf(bf_lo(wd[2 * j]), xa.x, raw);
      raw = fmaf(bf_hi(wd[2 * j]), xa.y, raw);
      raw = fmaf(bf_lo(wd[2 * j + 1]), xa.z, raw);
      raw = fmaf(bf_hi(wd[2 * j + 1]), xa.w, raw);
    }
  }
  if constexpr (BITS == 16) {
    return raw;
  } else {
    const float sum = xs[Chunk<BITS>::kCols];
    // 4-bit codes were read as 128+q: fold the offset into the bias term.
    return BITS == 4 ? fmaf(s, raw, (b - 128.f * s) * sum) : fmaf(s, raw, b * sum);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for row r of W (codes or bf16 values, and its scales and biases), 128-byte lines
// spread over the warp's lanes.
template <int BITS>
__device__ __forceinline__ void prefetch_row(const DevLinear& W, int64_t r, int lane) {
  constexpr int kLine = 128;
  const int64_t bytes = int64_t(W.in) * BITS / 8;
  const char* row = BITS == 16 ? reinterpret_cast<const char*>(W.w + r * W.in)
                               : reinterpret_cast<const char*>(W.q + r * (int64_t(W.in) * BITS / 32));
  for (int64_t off = int64_t(lane) * kLine; off < bytes; off += 32 * kLine) prefetch_l2(row + off);
  if constexpr (BITS != 16) {
    const int groups = W.in / kQuantGroup;
    if (lane == 0) prefetch_l2(W.scales + r * groups);
    if (lane == 1) prefetch_l2(W.biases + r * groups);
  }
}

// Stages one chunk of x (kCols values) as f32 plus its Σx; zeros when `valid` is false. The
// chunk's loads all precede its shared-memory stores (which the compiler cannot tell apart from
// the source), so they are in flight together.
template <int BITS>
__device__ __forceinline__ void stage_chunk(const bf16* src, bool valid, float* dst) {
  constexpr int C = Chunk<BITS>::kCols;
  uint4 raw[C / 8];
#pragma unroll
  for (int v = 0; v < C / 8; ++v)
    raw[v] = valid ? *reinterpret_cast<const uint4*>(src + v * 8) : make_uint4(0, 0, 0, 0);
  float sum = 0.f;
#pragma unroll
  for (int v = 0; v < C / 8; ++v) {
    const float f[8] = {bf_lo(raw[v].x), bf_hi(raw[v].x), bf_lo(raw[v].y), bf_hi(raw[v].y),
                        bf_lo(raw[v].z), bf_hi(raw[v].z), bf_lo(raw[v].w), bf_hi(raw[v].w)};
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += f[e];
    reinterpret_cast<float4*>(dst)[2 * v] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(dst)[2 * v + 1] = make_float4(f[4], f[5], f[6], f[7]);
  }
  dst[C] = sum;
}

// Stages `rows` rows of X (`ldx` apart, `in` columns) into smem chunks, row j at xs + j*cpr*kStride;
// rows from `valid_rows` on are zeros. The block's threads share all rows' chunks at once.
template <int BITS>
__device__ void stage_rows(const bf16* x, int64_t ldx, int rows, int valid_rows, int in, float* xs) {
  constexpr int C = Chunk<BITS>::kCols, S = Chunk<BITS>::kStride;
  const int cpr = in / C;
  for (int it = threadIdx.x; it < rows * cpr; it += blockDim.x) {
    const int j = it / cpr, c = it - j * cpr;
    stage_chunk<BITS>(x + j * ldx + int64_t(c) * C, j < valid_rows, xs + (j * cpr + c) * S);
  }
}

// What a decode launch fuses around the product (T == 1, MODE 0 only).
enum class Epi : int { kNone = 0, kRoute = 1, kGdnIn = 2, kResidual = 3 };
struct Fusion {
  NormIn norm;  // norm.w == nullptr: X is read as given
  Epi epi = Epi::kNone;
  RouteEpilogue route;
  GdnInEpilogue gdn;
  ResidualOut resid;
};

__device__ __forceinline__ float round_bf(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Stages the normed residual (NormIn) as chunks of one token row; red: kWarps floats of smem.
template <int BITS>
__device__ void stage_norm(const NormIn& nz, int in, float* xs, float* red) {
  constexpr int C = Chunk<BITS>::kCols, S = Chunk<BITS>::kStride;
  const int warps = blockDim.x / 32;
  float part = 0.f;
  for (int i = threadIdx.x; i < kNormParts; i += blockDim.x) part += nz.ss[i];
  // h and w are loaded before the reduction completes: one memory round trip in all.
  constexpr int kMaxPieces = kFusedNormMaxDim / 4 / kThreads;
  float4 hv[kMaxPieces], wv[kMaxPieces];
#pragma unroll
  for (int j = 0; j < kMaxPieces; ++j) {
    const int i = 4 * (threadIdx.x + j * int(blockDim.x));
    if (i < in) {
      hv[j] = *reinterpret_cast<const float4*>(nz.h + i);
      wv[j] = *reinterpret_cast<const float4*>(nz.w + i);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = part;
  __syncthreads();
  float tot = 0.f;
  for (int w = 0; w < warps; ++w) tot += red[w];
  const float scale = rsqrtf(tot / float(in) + nz.eps);
  const bool writer = nz.xn_out && blockIdx.x == 0 && blockIdx.y == 0;
  // Piece j of a thread is 4 columns; the C/4 consecutive lanes holding one chunk add up its Σx
  // with shuffles (in is a multiple of 64, so those lanes are all valid or all not).
#pragma unroll
  for (int j = 0; j < kMaxPieces; ++j) {
    const int i = 4 * (threadIdx.x + j * int(blockDim.x));
    const bool valid = i < in;
    const int c = i / C, e0 = i % C;
    float x[4] = {0.f, 0.f, 0.f, 0.f};
    if (valid) {
      x[0] = round_bf(hv[j].x * scale * wv[j].x);
      x[1] = round_bf(hv[j].y * scale * wv[j].y);
      x[2] = round_bf(hv[j].z * scale * wv[j].z);
      x[3] = round_bf(hv[j].w * scale * wv[j].w);
      *reinterpret_cast<float4*>(xs + c * S + e0) = make_float4(x[0], x[1], x[2], x[3]);
      if (writer)
        for (int e = 0; e < 4; ++e) nz.xn_out[i + e] = __float2bfloat16(x[e]);
    }
    float sum = (x[0] + x[1]) + (x[2] + x[3]);
#pragma unroll
    for (int o = 1; o < C / 4; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (valid && e0 == 0) xs[c * S + C] = sum;
  }
}

// A block's share of ResidualOut: its threads' squares summed into ss[block].
__device__ __forceinline__ void residual_partial(float sq, float* ss, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  __syncthreads();  // red may still be read from the staging
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sq;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[w];
    ss[blockIdx.x] = t;
  }
}

template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }

__device__ __forceinline__ float swiglu_bf16(float g, float u) {
  g = __bfloat162float(__float2bfloat16(g));
  u = __bfloat162float(__float2bfloat16(u));
  return silu(g) * u;
}

// Row `row` of the GDN in_proj is y (every lane holds it): conv channel, z (stored by the caller
// only), or a gate input. Called by the whole warp.
__device__ __forceinline__ void gdn_in_epilogue(const GdnInEpilogue& G, int row, float y, float w, float in,
                                                int lane) {
  const float x = round_bf(y);  // the projection as the bf16 prefill path stores it
  if (row < G.conv_dim) {
    if (lane == G.kernel - 1) in = x;
    const float conv = group_sum<32>(lane < G.kernel ? w * in : 0.f);
    const float next = __shfl_down_sync(0xffffffffu, in, 1);  // lane j: tap j+1's input
    if (lane < G.kernel - 1) G.window[int64_t(lane) * G.conv_dim + row] = __float2bfloat16(next);
    if (lane == 0) G.conv_out[row] = silu(conv);
    return;
  }
  const int j = row - G.conv_dim - G.value_dim;
  if (lane != 0 || j < 0) return;
  if (j < G.n_v_heads) {
    const float sp = x + G.dt_bias[j];
    const float softplus = sp > 20.f ? sp : log1pf(expf(sp));
    G.g[j] = -expf(G.A_log[j]) * softplus;
  } else if (j < 2 * G.n_v_heads) {
    G.beta[j - G.n_v_heads] = 1.f / (1.f + expf(-x));
  }
}

// The last block to finish routes the token from the logits every block stored.
__device__ void route_epilogue(const RouteEpilogue& R, const float* logits, int warp) {
  __shared__ float l[kRouteMaxExperts + 1];
  __shared__ int last;
  __threadfence();  // this block's logits are visible before it is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(R.counter, 1u) == gridDim.x * gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = threadIdx.x; e <= R.E; e += blockDim.x) l[e] = __ldcg(logits + e);  // L2: other blocks' stores
  __syncthreads();
  if (warp == 0) {
    if (R.E <= 8 * 32)
      route_warp<8>(l, R.E, R.k, R.idx, R.w);
    else
      route_warp<32>(l, R.E, R.k, R.idx, R.w);
    if (threadIdx.x == 0) {
      if (R.shared_slot) {
        R.idx[R.k] = R.E;
        R.w[R.k] = 1.f / (1.f + expf(-l[R.E]));
      }
      *R.counter = 0;
    }
  }
}

// One lane's loads of one chunk for each of a warp's rows (two rows each in the SwiGLU modes):
// codes, scales and biases issued together.
template <int BITS, int R, bool PAIR>
struct Batch {
  uint4 w1[R], w2[R];
  float s1[R], b1[R], s2[R], b2[R];
  __device__ __forceinline__ void load(const DevLinear& W, const int64_t (&r1)[R], const bool (&ok)[R],
                                       int c) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!ok[i]) continue;
      w1[i] = load_chunk<BITS>(W, r1[i], c);
      load_sb<BITS>(W, r1[i], c, s1[i], b1[i]);
      if constexpr (PAIR) {
        w2[i] = load_chunk<BITS>(W, r1[i] + 1, c);
        load_sb<BITS>(W, r1[i] + 1, c, s2[i], b2[i]);
      }
    }
  }
};

// MODE 0: plain, T token rows per block (blockIdx.y picks the T-row chunk).
// MODE 1: SwiGLU over interleaved row pairs, T token rows per block.
// MODE 2: SwiGLU over expert idx[slot] of a stacked matrix, one slot per blockIdx.y (T == 1).
// Each warp owns `rpw` (1..max_rows_per_warp) output rows and streams them together, so that
// rpw times as many loads are in flight as with one row at a time (decode is latency-bound on
// small matrices); the launcher lowers rpw when that leaves too few blocks to fill the chip.
// Loads are software-pipelined one chunk ahead, and for MODE 0/1 the first chunk's loads are
// issued before waiting on the previous kernel (weights never depend on it). A grid smaller
// than the row blocks (the lm_head) loops over them.
template <int BITS, int T, int MODE>
__global__ void __launch_bounds__(kThreads, 3)
    matvec_kernel(DevLinear W, const bf16* __restrict__ X, int64_t ldx, int n, void* Y, int64_t ldy,
                  int y_f32, int out_rows, const int* __restrict__ idx, int k, int rows_per_expert, int rpw,
                  Fusion fz) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  constexpr int S = Chunk<BITS>::kStride;
  constexpr bool kFusable = T == 1 && MODE == 0;
  constexpr bool kPair = MODE != 0;
  constexpr int R = max_rows_per_warp(T, MODE);
  __shared__ float red[kWarps];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cpr = W.in / Chunk<BITS>::kCols;
  const int row_blocks = (out_rows + kWarps * rpw - 1) / (kWarps * rpw);

  int rows[R];
  bool ok[R];
  int64_t r1[R];
  auto set_rows = [&](int rb, int64_t base) {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      rows[i] = (rb * rpw + i) * kWarps + warp;
      ok[i] = i < rpw && rows[i] < out_rows;
      r1[i] = MODE == 0 ? int64_t(rows[i]) : base + 2 * int64_t(rows[i]);
    }
  };
  Batch<BITS, R, kPair> cur;
  int rb = blockIdx.x;
  if constexpr (MODE != 2) {
    set_rows(rb, 0);
    if (lane < cpr) cur.load(W, r1, ok, lane);
    // The rest of the rows (more than one chunk per lane) into L2 meanwhile.
    if (cpr > 32) {
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!ok[i]) break;
        prefetch_row<BITS>(W, r1[i], lane);
        if constexpr (kPair) prefetch_row<BITS>(W, r1[i] + 1, lane);
      }
    }
  }
  pdl_wait();
  pdl_launch_dependents();
  int t0 = blockIdx.y * T;
  int64_t row_base = 0;
  if constexpr (MODE == 2) {
    t0 = blockIdx.y / k;
    row_base = int64_t(idx[blockIdx.y]) * rows_per_expert;
    set_rows(rb, row_base);
    if (lane < cpr) cur.load(W, r1, ok, lane);
  }
  if constexpr (kFusable) {
    if (fz.norm.w)
      stage_norm<BITS>(fz.norm, W.in, xs, red);
    else
      stage_rows<BITS>(X + int64_t(t0) * ldx, ldx, T, n - t0, W.in, xs);
  } else {
    stage_rows<BITS>(X + int64_t(t0) * ldx, ldx, T, n - t0, W.in, xs);
  }
  __syncthreads();

  for (;;) {
    // GDN epilogue operands, loaded early: lane j < kernel holds tap j's weight and input (the
    // window's values; lane kernel-1 takes this token's projection at the end).
    float conv_w[R], conv_in[R];
    if constexpr (kFusable) {
      if (fz.epi == Epi::kGdnIn) {
        const GdnInEpilogue& G = fz.gdn;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          conv_w[i] = conv_in[i] = 0.f;
          if (ok[i] && rows[i] < G.conv_dim) {
            if (lane < G.kernel) conv_w[i] = G.conv_w[int64_t(rows[i]) * G.kernel + lane];
            if (lane < G.kernel - 1)
              conv_in[i] = __bfloat162float(G.window[int64_t(lane) * G.conv_dim + rows[i]]);
          }
        }
      }
    }
    float acc[R][T], acc2[R][T];
    float sq = 0.f;  // kResidual: this lane's squares of the new h
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int t = 0; t < T; ++t) acc[i][t] = acc2[i][t] = 0.f;
    for (int c = lane; c < cpr; c += 32) {
      Batch<BITS, R, kPair> nxt;
      const bool more = c + 32 < cpr;
      if (more) nxt.load(W, r1, ok, c + 32);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!ok[i]) continue;
#pragma unroll
        for (int t = 0; t < T; ++t) {
          const float* xc = xs + (t * cpr + c) * S;
          acc[i][t] += chunk_dot<BITS>(cur.w1[i], xc, cur.s1[i], cur.b1[i]);
          if constexpr (kPair) acc2[i][t] += chunk_dot<BITS>(cur.w2[i], xc, cur.s2[i], cur.b2[i]);
        }
      }
      if (more) cur = nxt;
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (i >= rpw) break;  // uniform across the warp: the shuffles below need every lane
#pragma unroll
      for (int t = 0; t < T; ++t) {
        const float a = group_sum<32>(acc[i][t]);
        float y = a;
        if constexpr (MODE != 0) y = swiglu_bf16(a, group_sum<32>(acc2[i][t]));
        if (ok[i] && lane == t && t0 + t < n) {
          const int64_t row = MODE == 2 ? int64_t(blockIdx.y) : int64_t(t0 + t);
          if (kFusable && fz.epi == Epi::kResidual) {
            const float v = fz.resid.h[rows[i]] + y;
            fz.resid.h[rows[i]] = v;
            sq = fmaf(v, v, sq);
          } else if (y_f32) {
            static_cast<float*>(Y)[row * ldy + rows[i]] = y;
          } else {
            static_cast<bf16*>(Y)[row * ldy + rows[i]] = __float2bfloat16(y);
          }
        }
        if constexpr (kFusable) {
          if (fz.epi == Epi::kGdnIn && ok[i])
            gdn_in_epilogue(fz.gdn, rows[i], y, conv_w[i], conv_in[i], lane);
        }
      }
    }
    if constexpr (kFusable) {
      if (fz.epi == Epi::kResidual) residual_partial(sq, fz.resid.ss, red);  // grid == row blocks here
    }
    rb += gridDim.x;
    if (rb >= row_blocks) break;
    set_rows(rb, row_base);
    if (lane < cpr) cur.load(W, r1, ok, lane);
  }
  if constexpr (kFusable) {
    if (fz.epi == Epi::kRoute) route_epilogue(fz.route, static_cast<const float*>(Y), warp);
  }
}

// ---- one token row, weights staged in shared memory ----
//
// The block's weight rows (a contiguous range) and their scales and biases are copied into shared
// memory before the kernel waits on its predecessor: with programmatic dependent launch the whole
// weight read of a decode product overlaps the kernel before it, and no registers are spent
// holding loads in flight. The copies are bulk copies (warp 0's lanes, 4 KiB pieces, one
// mbarrier) or, with TANSY_MATVEC_BULK=0, per-thread 16-byte cp.async (measured: bulk copies
// 0.2-1.2 µs faster per product on the H200). After the wait only x is staged and the dot
// products read shared memory. MODE 0 plain, MODE 1 SwiGLU row pairs, MODE 2 routed experts
// (their copy starts after the wait: the rows depend on the routing); the Fusion epilogues as in
// matvec_kernel.

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__host__ __device__ constexpr size_t align16(size_t b) { return (b + 15) / 16 * 16; }

struct SmemLayout {
  size_t xs, w, sb, total;  // byte offsets of the staged x, weight rows, scales|biases; total bytes
};
template <int BITS>
__host__ __device__ inline SmemLayout smem_layout(int in, int weight_rows) {
  SmemLayout L;
  L.xs = 0;
  L.w = align16(size_t(in / Chunk<BITS>::kCols) * Chunk<BITS>::kStride * sizeof(float));
  const size_t row_bytes = size_t(in) * BITS / 8;
  L.sb = L.w + size_t(weight_rows) * row_bytes;
  const size_t sb_bytes = BITS == 16 ? 0 : size_t(weight_rows) * (in / kQuantGroup) * 2 * 2;
  L.total = L.sb + sb_bytes;
  return L;
}

template <int BITS, int MODE>
__global__ void __launch_bounds__(kThreads, 2)
    matvec_smem_kernel(DevLinear W, const bf16* __restrict__ X, int64_t ldx, void* Y, int64_t ldy, int y_f32,
                       int out_rows, int rpw, const int* __restrict__ idx, int k, int rows_per_expert,
                       int bulk_copies, Fusion fz) {
  extern __shared__ float4 smem4[];
  __shared__ alignas(8) uint64_t wbar;  // bulk copies: the block's weights have landed
  constexpr bool kPair = MODE != 0;
  constexpr int S = Chunk<BITS>::kStride, kR = 4;  // kR: max rows per warp
  __shared__ float red[kWarps];
  uint8_t* base = reinterpret_cast<uint8_t*>(smem4);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int cpr = W.in / Chunk<BITS>::kCols, groups = W.in / kQuantGroup;
  const int64_t row_bytes = int64_t(W.in) * BITS / 8;
  const int out0 = blockIdx.x * kWarps * rpw;
  const int wmul = kPair ? 2 : 1;
  const int wrows = min(kWarps * rpw, out_rows - out0) * wmul;  // weight rows of this block
  const SmemLayout lay = smem_layout<BITS>(W.in, kWarps * rpw * wmul);
  float* xs = reinterpret_cast<float*>(base + lay.xs);
  const uint8_t* wsm = base + lay.w;
  const bf16* ssm = reinterpret_cast<const bf16*>(base + lay.sb);
  const bf16* bsm = ssm + int64_t(kWarps) * rpw * wmul * groups;
  if (bulk_copies) {
    if (threadIdx.x == 0) {
      bulk::mbar_init(&wbar);
      bulk::fence_init();
    }
    __syncthreads();
  }
  // MODE 2 (routed experts, one slot per blockIdx.y): the rows come from the expert the previous
  // kernel chose, so their copy starts after the wait.
  if constexpr (MODE == 2) {
    pdl_wait();
    pdl_launch_dependents();
  }
  {
    int64_t w0 = int64_t(out0) * wmul;
    if constexpr (MODE == 2) w0 += int64_t(idx[blockIdx.y]) * rows_per_expert;
    const uint8_t* gw = BITS == 16 ? reinterpret_cast<const uint8_t*>(W.w + w0 * W.in)
                                   : reinterpret_cast<const uint8_t*>(W.q) + w0 * row_bytes;
    const int64_t wbytes = int64_t(wrows) * row_bytes;
    if (bulk_copies) {
      // warp 0: 4 KiB pieces of the rows over its lanes, then the scales and biases
      const int64_t sbytes = BITS == 16 ? 0 : int64_t(wrows) * groups * 2;
      if (warp == 0) {
        constexpr int64_t kPiece = 4096;
        if (lane == 0) bulk::mbar_expect_tx(&wbar, unsigned(wbytes + 2 * sbytes));
        __syncwarp();
        for (int64_t o = lane * kPiece; o < wbytes; o += 32 * kPiece)
          bulk::copy(base + lay.w + o, gw + o, unsigned(min(kPiece, wbytes - o)), &wbar);
        if (BITS != 16 && lane == 1) {
          uint8_t* ds = base + lay.sb;
          bulk::copy(ds, W.scales + w0 * groups, unsigned(sbytes), &wbar);
          bulk::copy(ds + int64_t(kWarps) * rpw * wmul * groups * 2, W.biases + w0 * groups, unsigned(sbytes),
                     &wbar);
        }
      }
    } else {
      for (int64_t o = int64_t(threadIdx.x) * 16; o < wbytes; o += kThreads * 16)
        cp_async16(base + lay.w + o, gw + o);
      if constexpr (BITS != 16) {
        const int64_t sbytes = int64_t(wrows) * groups * 2;  // a multiple of 16 (launcher)
        const uint8_t* gs = reinterpret_cast<const uint8_t*>(W.scales + w0 * groups);
        const uint8_t* gb = reinterpret_cast<const uint8_t*>(W.biases + w0 * groups);
        uint8_t* ds = base + lay.sb;
        uint8_t* db = ds + int64_t(kWarps) * rpw * wmul * groups * 2;
        for (int64_t o = int64_t(threadIdx.x) * 16; o < sbytes; o += kThreads * 16) {
          cp_async16(ds + o, gs + o);
          cp_async16(db + o, gb + o);
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    }
  }
  if constexpr (MODE != 2) {
    pdl_wait();
    pdl_launch_dependents();
  }
  const int t0 = MODE == 2 ? blockIdx.y / k : 0;
  if (fz.norm.w)
    stage_norm<BITS>(fz.norm, W.in, xs, red);
  else
    stage_rows<BITS>(X + int64_t(t0) * ldx, ldx, 1, 1, W.in, xs);

  int rows[kR];
  bool ok[kR];
  float conv_w[kR], conv_in[kR];
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    rows[i] = (blockIdx.x * rpw + i) * kWarps + warp;
    ok[i] = i < rpw && rows[i] < out_rows;
    conv_w[i] = conv_in[i] = 0.f;
    if (fz.epi == Epi::kGdnIn && ok[i] && rows[i] < fz.gdn.conv_dim) {
      const GdnInEpilogue& G = fz.gdn;
      if (lane < G.kernel) conv_w[i] = G.conv_w[int64_t(rows[i]) * G.kernel + lane];
      if (lane < G.kernel - 1) conv_in[i] = __bfloat162float(G.window[int64_t(lane) * G.conv_dim + rows[i]]);
    }
  }
  if (bulk_copies)
    bulk::mbar_wait(&wbar, 0);
  else
    cp_async_wait_all();
  __syncthreads();

  float acc[kR], acc2[kR];
#pragma unroll
  for (int i = 0; i < kR; ++i) acc[i] = acc2[i] = 0.f;
  for (int c = lane; c < cpr; c += 32) {
    const float* xc = xs + c * S;
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      if (!ok[i]) continue;
      const int lw = (rows[i] - out0) * wmul;  // local weight row
      const int g = (c * Chunk<BITS>::kCols) / kQuantGroup;
      const uint4 w1 = *reinterpret_cast<const uint4*>(wsm + lw * row_bytes + int64_t(c) * 16);
      float s1 = 0.f, b1 = 0.f;
      if constexpr (BITS != 16) {
        s1 = __bfloat162float(ssm[lw * groups + g]);
        b1 = __bfloat162float(bsm[lw * groups + g]);
      }
      acc[i] += chunk_dot<BITS>(w1, xc, s1, b1);
      if constexpr (kPair) {
        const uint4 w2 = *reinterpret_cast<const uint4*>(wsm + (lw + 1) * row_bytes + int64_t(c) * 16);
        float s2 = 0.f, b2 = 0.f;
        if constexpr (BITS != 16) {
          s2 = __bfloat162float(ssm[(lw + 1) * groups + g]);
          b2 = __bfloat162float(bsm[(lw + 1) * groups + g]);
        }
        acc2[i] += chunk_dot<BITS>(w2, xc, s2, b2);
      }
    }
  }
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    if (i >= rpw) break;  // uniform across the warp: the shuffles below need every lane
    const float a = group_sum<32>(acc[i]);
    float y = a;
    if constexpr (kPair) y = swiglu_bf16(a, group_sum<32>(acc2[i]));
    if (ok[i] && lane == 0) {
      if (fz.epi == Epi::kResidual) {
        const float v = fz.resid.h[rows[i]] + y;
        fz.resid.h[rows[i]] = v;
        sq = fmaf(v, v, sq);
      } else {
        const int64_t at = (MODE == 2 ? int64_t(blockIdx.y) * ldy : 0) + rows[i];
        if (y_f32)
          static_cast<float*>(Y)[at] = y;
        else
          static_cast<bf16*>(Y)[at] = __float2bfloat16(y);
      }
    }
    if (fz.epi == Epi::kGdnIn && ok[i]) gdn_in_epilogue(fz.gdn, rows[i], y, conv_w[i], conv_in[i], lane);
  }
  if (fz.epi == Epi::kResidual) residual_partial(sq, fz.resid.ss, red);
  if (fz.epi == Epi::kRoute) route_epilogue(fz.route, static_cast<const float*>(Y), warp);
}

template <int BITS>
size_t stage_bytes(int in, int rows) {
  return size_t(rows) * (in / Chunk<BITS>::kCols) * Chunk<BITS>::kStride * sizeof(float);
}

// Rows per warp: as many as still give every multiprocessor a block.
int rows_per_warp(int max_rpw, int out_rows, unsigned grid_y) {
  const int sms = sm_count();
  int rpw = max_rpw;
  while (rpw > 1 && int64_t(ceil_div(out_rows, kWarps * rpw)) * grid_y < sms) rpw /= 2;
  return rpw;
}

// TANSY_MATVEC_SMEM=0 keeps the register kernels where the shared-memory ones would run (for
// comparisons); read once.
bool smem_staging_on() {
  static const bool on = [] {
    const char* v = std::getenv("TANSY_MATVEC_SMEM");
    return !v || std::strcmp(v, "0") != 0;
  }();
  return on;
}

// TANSY_MATVEC_BULK=0 stages the shared-memory kernels' weights with per-thread cp.async copies
// instead of bulk copies (for comparisons); read once.
bool bulk_copies_on() {
  static const bool on = env_flag("TANSY_MATVEC_BULK", true);
  return on;
}

template <int BITS, int T, int MODE>
void launch_matvec_t(const DevLinear& W, const bf16* X, int64_t ldx, int n, void* Y, int64_t ldy, bool y_f32,
                     int out_rows, const int* idx, int k, int rows_per_expert, unsigned grid_y,
                     cudaStream_t stream, const Fusion& fz = Fusion{}) {
  const int rpw = rows_per_warp(max_rows_per_warp(T, MODE), out_rows, grid_y);
  if constexpr (T == 1) {
    // One token: the shared-memory kernel, when the block's rows fit (and scales come in 16-byte
    // pieces).
    const bool smem_on = smem_staging_on();
    const SmemLayout lay = smem_layout<BITS>(W.in, kWarps * rpw * (MODE != 0 ? 2 : 1));
    if (smem_on && (MODE == 2 || (n == 1 && grid_y == 1)) && lay.total <= kSmemMatvecMax &&
        (BITS == 16 || (W.in / kQuantGroup) % 8 == 0)) {
      constexpr auto skern = matvec_smem_kernel<BITS, MODE>;
      allow_smem<skern>(lay.total, "matvec");
      pdl_launch(skern, dim3(ceil_div(out_rows, kWarps * rpw), grid_y), dim3(kThreads), lay.total, stream, W,
                 X, ldx, Y, ldy, y_f32 ? 1 : 0, out_rows, rpw, idx, k, rows_per_expert,
                 bulk_copies_on() ? 1 : 0, fz);
      return;
    }
  }
  const size_t smem = stage_bytes<BITS>(W.in, T);
  constexpr auto kern = matvec_kernel<BITS, T, MODE>;
  allow_smem<kern>(smem, "matvec");
  // TANSY_MATVEC_GRID_CAP=N (blocks per multiprocessor, tests and tuning): very tall matrices
  // run a resident grid that loops over the row blocks, staging x once per block.
  static const int cap = [] {
    const char* v = std::getenv("TANSY_MATVEC_GRID_CAP");
    return v ? std::atoi(v) : 0;
  }();
  unsigned gx = ceil_div(out_rows, kWarps * rpw);
  if (cap > 0 && T == 1 && MODE != 2 && fz.epi == Epi::kNone && !fz.norm.w)
    gx = std::min<unsigned>(gx, unsigned(sm_count()) * unsigned(cap));
  dim3 grid(gx, grid_y);
  pdl_launch(kern, grid, dim3(kThreads), smem, stream, W, X, ldx, n, Y, ldy, y_f32 ? 1 : 0, out_rows, idx, k,
             rows_per_expert, rpw, fz);
}

// One token row with an optional fused input norm (X null) and epilogue.
void launch_fused(const DevLinear& W, const bf16* X, const Fusion& fz, void* Y, int64_t ldy, bool y_f32,
                  cudaStream_t stream) {
  if (!X) {
    const NormIn& x = fz.norm;
    TANSY_CHECK(x.h && x.ss && x.w && aligned16(x.h) && aligned16(x.w),
                "matvec_norm: h, ss and w must be present, h and w 16-byte aligned");
    TANSY_CHECK(W.in % 4 == 0 && W.in <= kFusedNormMaxDim,
                "matvec_norm: in = {} must be a multiple of 4 and <= {}", W.in, kFusedNormMaxDim);
  }
  TANSY_CHECK(Y || fz.epi == Epi::kResidual, "matvec_norm: no output");
  static_assert(kFusedNormMaxDim % (4 * kThreads) == 0);
  switch (W.fmt) {
    case WFormat::kAffine4:
      launch_matvec_t<4, 1, 0>(W, X, W.in, 1, Y, ldy, y_f32, W.out, nullptr, 0, 0, 1, stream, fz);
      break;
    case WFormat::kAffine8:
      launch_matvec_t<8, 1, 0>(W, X, W.in, 1, Y, ldy, y_f32, W.out, nullptr, 0, 0, 1, stream, fz);
      break;
    default:
      launch_matvec_t<16, 1, 0>(W, X, W.in, 1, Y, ldy, y_f32, W.out, nullptr, 0, 0, 1, stream, fz);
      break;
  }
}

// Token rows per block for the multi-row variant: one weight pass serves 4 token rows.
constexpr int kTokensPerPass = 4;

template <int MODE>
void launch_matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, void* Y, int64_t ldy, bool y_f32,
                   int out_rows, const int* idx, int k, int rows_per_expert, cudaStream_t stream) {
  const bool multi = MODE != 2 && n > 1;
  const unsigned grid_y = MODE == 2 ? unsigned(n * k) : multi ? ceil_div(n, kTokensPerPass) : unsigned(n);
  TANSY_CHECK(grid_y <= 65535u, "matvec: {} token rows exceed the grid limit", n);
  auto go = [&]<int BITS>() {
    if (multi)
      launch_matvec_t<BITS, kTokensPerPass, MODE>(W, X, ldx, n, Y, ldy, y_f32, out_rows, idx, k,
                                                  rows_per_expert, grid_y, stream);
    else
      launch_matvec_t<BITS, 1, MODE>(W, X, ldx, n, Y, ldy, y_f32, out_rows, idx, k, rows_per_expert, grid_y,
                                     stream);
  };
  switch (W.fmt) {
    case WFormat::kAffine4:
      go.template operator()<4>();
      break;
    case WFormat::kAffine8:
      go.template operator()<8>();
      break;
    default:
      go.template operator()<16>();
      break;
  }
}

void check_x(const bf16* X, int64_t ldx, int n, int in, const char* what) {
  TANSY_CHECK(n >= 1, "{}: no token rows", what);
  TANSY_CHECK(X && aligned16(X) && ldx % 8 == 0 && ldx >= in,
              "{}: X must be 16-byte aligned rows (ldx {} >= in {})", what, ldx, in);
}

// ---- routed experts: down projections + weighted combine ----

// G lanes per output row: in = I is small (512 on the real model: 16 chunks of 4-bit), so a warp
// works on 32/G rows at once instead of leaving lanes idle.
template <int BITS, int G, bool SMEM>
__global__ void __launch_bounds__(kThreads, 3)
    moe_down_kernel(DevLinear Wd, int H, const int* __restrict__ idx, const float* __restrict__ wts,
                    const bf16* __restrict__ act, int k, const bf16* shared, const float* sh_logit,
                    int64_t sh_ld, bf16* out, ResidualOut res, int bulk_copies) {
  extern __shared__ float4 smem4[];
  __shared__ alignas(8) uint64_t wbar;  // bulk copies (SMEM): the slots' rows have landed
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ int s_e[kMaxTopK];
  __shared__ float s_w[kMaxTopK];
  __shared__ float red[kWarps];
  constexpr int S = Chunk<BITS>::kStride;
  // SMEM: the block's R rows of every slot's expert (and their scales and biases) in shared memory.
  constexpr int R = kThreads / G;
  const int t = blockIdx.y, cpr = Wd.in / Chunk<BITS>::kCols;
  const int groups = Wd.in / kQuantGroup, r0 = blockIdx.x * R, rows = min(R, H - r0);
  const int64_t row_bytes = int64_t(Wd.in) * BITS / 8;
  uint8_t* wsm = reinterpret_cast<uint8_t*>(smem4) + align16(size_t(k) * cpr * S * sizeof(float));
  bf16* ssm = reinterpret_cast<bf16*>(wsm + int64_t(k) * R * row_bytes);
  bf16* bsm = ssm + int64_t(k) * R * groups;
  const bool bulk = SMEM && bulk_copies;
  if (bulk && threadIdx.x == 0) {
    bulk::mbar_init(&wbar);
    bulk::fence_init();
  }
  pdl_wait();
  pdl_launch_dependents();
  if (bulk && threadIdx.x < 32) {  // lane j < k copies slot j's rows, scales and biases
    if (threadIdx.x == 0) {
      const int64_t per = rows * row_bytes + (BITS == 16 ? 0 : 2 * int64_t(rows) * groups * 2);
      bulk::mbar_expect_tx(&wbar, unsigned(k * per));
    }
    __syncwarp();
    if (int(threadIdx.x) < k) {
      const int j = threadIdx.x;
      const int64_t g0 = int64_t(idx[t * k + j]) * H + r0;
      const uint8_t* gw = BITS == 16 ? reinterpret_cast<const uint8_t*>(Wd.w + g0 * Wd.in)
                                     : reinterpret_cast<const uint8_t*>(Wd.q) + g0 * row_bytes;
      bulk::copy(wsm + int64_t(j) * R * row_bytes, gw, unsigned(rows * row_bytes), &wbar);
      if constexpr (BITS != 16) {
        bulk::copy(ssm + int64_t(j) * R * groups, Wd.scales + g0 * groups, unsigned(rows * groups * 2),
                   &wbar);
        bulk::copy(bsm + int64_t(j) * R * groups, Wd.biases + g0 * groups, unsigned(rows * groups * 2),
                   &wbar);
      }
    }
  }
  stage_rows<BITS>(act + int64_t(t) * k * Wd.in, Wd.in, k, k, Wd.in, xs);
  if (threadIdx.x < k) {
    s_e[threadIdx.x] = idx[t * k + threadIdx.x];
    s_w[threadIdx.x] = wts[t * k + threadIdx.x];
  }
  __syncthreads();
  const float sg = shared ? 1.f / (1.f + __expf(-sh_logit[int64_t(t) * sh_ld])) : 0.f;

  // One row per G lanes, one pass: rows past H compute nothing (shuffles need the whole warp).
  // The (expert, chunk) pairs of a row are one flat loop so that several loads are in flight.
  const int sub = threadIdx.x % G;
  const int r = blockIdx.x * (kThreads / G) + threadIdx.x / G;
  const bool valid = r < H;
  float acc = 0.f;
  if constexpr (SMEM) {
    const int rl = threadIdx.x / G;
    if (bulk) {
      bulk::mbar_wait(&wbar, 0);  // initialised before the barrier above
    } else {
      for (int j = 0; j < k; ++j) {
        const int64_t g0 = int64_t(s_e[j]) * H + r0;
        const uint8_t* gw = BITS == 16 ? reinterpret_cast<const uint8_t*>(Wd.w + g0 * Wd.in)
                                       : reinterpret_cast<const uint8_t*>(Wd.q) + g0 * row_bytes;
        uint8_t* dw = wsm + int64_t(j) * R * row_bytes;
        for (int64_t o = int64_t(threadIdx.x) * 16; o < rows * row_bytes; o += kThreads * 16)
          cp_async16(dw + o, gw + o);
        if constexpr (BITS != 16) {
          const uint8_t* gs = reinterpret_cast<const uint8_t*>(Wd.scales + g0 * groups);
          const uint8_t* gb = reinterpret_cast<const uint8_t*>(Wd.biases + g0 * groups);
          uint8_t* ds = reinterpret_cast<uint8_t*>(ssm + int64_t(j) * R * groups);
          uint8_t* db = reinterpret_cast<uint8_t*>(bsm + int64_t(j) * R * groups);
          for (int64_t o = int64_t(threadIdx.x) * 16; o < int64_t(rows) * groups * 2; o += kThreads * 16) {
            cp_async16(ds + o, gs + o);
            cp_async16(db + o, gb + o);
          }
        }
      }
      cp_async_wait_all();
    }
    __syncthreads();
    if (valid) {
#pragma unroll 4
      for (int it = sub; it < k * cpr; it += G) {
        const int j = it / cpr, c = it - j * cpr;
        const int lr = j * R + rl;
        const uint4 wv = *reinterpret_cast<const uint4*>(wsm + lr * row_bytes + int64_t(c) * 16);
        float sc = 0.f, bi = 0.f;
        if constexpr (BITS != 16) {
          const int g = (c * Chunk<BITS>::kCols) / kQuantGroup;
          sc = __bfloat162float(ssm[lr * groups + g]);
          bi = __bfloat162float(bsm[lr * groups + g]);
        }
        acc = fmaf(s_w[j], chunk_dot<BITS>(wv, xs + (j * cpr + c) * S, sc, bi), acc);
      }
    }
  } else if (valid) {
    // Up to kU chunks per lane are loaded in one batch (codes, scales, biases), then used (the
    // batch size keeps the kernel at three blocks per multiprocessor).
    constexpr int kU = 8;
    for (int base = sub; base < k * cpr; base += kU * G) {
      uint4 wv[kU];
      float sc[kU], bi[kU];
      int off[kU];
      float wt[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int it = base + u * G;
        if (it >= k * cpr) break;
        const int j = it / cpr, c = it - j * cpr;
        const int64_t row = int64_t(s_e[j]) * H + r;
        wv[u] = load_chunk<BITS>(Wd, row, c);
        load_sb<BITS>(Wd, row, c, sc[u], bi[u]);
        off[u] = (j * cpr + c) * S;
        wt[u] = s_w[j];
      }
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        if (base + u * G >= k * cpr) break;
        acc = fmaf(wt[u], chunk_dot<BITS>(wv[u], xs + off[u], sc[u], bi[u]), acc);
      }
    }
  }
  acc = group_sum<G>(acc);
  float sq = 0.f;
  if (valid && sub == 0) {
    float y = acc;
    if (shared) y += sg * __bfloat162float(shared[int64_t(t) * H + r]);
    if (res.h) {
      const float v = res.h[r] + y;
      res.h[r] = v;
      sq = v * v;
    } else {
      out[int64_t(t) * H + r] = __float2bfloat16(y);
    }
  }
  if (res.h) residual_partial(sq, res.ss, red);
}

}  // namespace

int sm_count() {
  static const int sms = [] {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  return sms;
}

void matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, const MatvecOut& Y, cudaStream_t stream) {
  W.check("matvec");
  check_x(X, ldx, n, W.in, "matvec");
  TANSY_CHECK(Y.ptr && Y.ld >= W.out, "matvec: output ld {} < out {}", Y.ld, W.out);
  launch_matvec<0>(W, X, ldx, n, Y.ptr, Y.ld, Y.f32, W.out, nullptr, 0, 0, stream);
}

void matvec_residual(const DevLinear& W, const bf16* X, const ResidualOut& out, cudaStream_t stream) {
  W.check("matvec_residual");
  check_x(X, W.in, 1, W.in, "matvec_residual");
  TANSY_CHECK(out.h && out.ss, "matvec_residual: missing h or ss");
  TANSY_CHECK(ceil_div(W.out, kWarps) <= kNormParts,
              "matvec_residual: {} rows need more than {} partial sums", W.out, kNormParts);
  Fusion fz;
  fz.epi = Epi::kResidual;
  fz.resid = out;
  launch_fused(W, X, fz, nullptr, W.out, true, stream);
}

void matvec_norm(const DevLinear& W, const NormIn& x, const MatvecOut& Y, cudaStream_t stream) {
  W.check("matvec_norm");
  TANSY_CHECK(Y.ld >= W.out, "matvec_norm: output ld {} < out {}", Y.ld, W.out);
  Fusion fz;
  fz.norm = x;
  launch_fused(W, nullptr, fz, Y.ptr, Y.ld, Y.f32, stream);
}

void matvec_norm_route(const DevLinear& W, const NormIn& x, float* logits, const RouteEpilogue& route,
                       cudaStream_t stream) {
  W.check("matvec_norm_route");
  const int need = route.E + (route.shared_slot ? 1 : 0);
  TANSY_CHECK(route.E >= 1 && route.E <= kRouteMaxExperts && route.k >= 1 && route.k <= kRouteMaxTopK &&
                  route.k <= route.E && W.out >= need,
              "matvec_norm_route: top-{} of {} experts over {} logits unsupported", route.k, route.E, W.out);
  TANSY_CHECK(route.idx && route.w && route.counter, "matvec_norm_route: missing routing buffers");
  Fusion fz;
  fz.norm = x;
  fz.epi = Epi::kRoute;
  fz.route = route;
  launch_fused(W, nullptr, fz, logits, W.out, true, stream);
}

void matvec_norm_gdn(const DevLinear& W, const NormIn& x, bf16* Y, const GdnInEpilogue& g,
                     cudaStream_t stream) {
  W.check("matvec_norm_gdn");
  TANSY_CHECK(g.kernel >= 2 && g.kernel <= 32, "matvec_norm_gdn: conv kernel {} outside 2..32", g.kernel);
  TANSY_CHECK(g.conv_dim > 0 && g.value_dim >= 0 && g.n_v_heads > 0 &&
                  W.out >= g.conv_dim + g.value_dim + 2 * g.n_v_heads,
              "matvec_norm_gdn: {} rows cannot hold conv {} + z {} + 2 x {} gate rows", W.out, g.conv_dim,
              g.value_dim, g.n_v_heads);
  TANSY_CHECK(g.conv_w && g.window && g.A_log && g.dt_bias && g.conv_out && g.beta && g.g,
              "matvec_norm_gdn: missing buffers");
  Fusion fz;
  fz.norm = x;
  fz.epi = Epi::kGdnIn;
  fz.gdn = g;
  launch_fused(W, nullptr, fz, Y, W.out, false, stream);
}

void matvec_swiglu(const DevLinear& W, const bf16* X, int64_t ldx, int n, bf16* Y, int64_t ldy,
                   cudaStream_t stream) {
  W.check("matvec_swiglu");
  check_x(X, ldx, n, W.in, "matvec_swiglu");
  TANSY_CHECK(W.out % 2 == 0, "matvec_swiglu: {} rows are not gate/up pairs", W.out);
  TANSY_CHECK(Y && ldy >= W.out / 2, "matvec_swiglu: output ld {} < {}", ldy, W.out / 2);
  launch_matvec<1>(W, X, ldx, n, Y, ldy, false, W.out / 2, nullptr, 0, 0, stream);
}

void matvec_swiglu_experts(const DevLinear& W, int n_experts, const int* idx, int n, int k, const bf16* X,
                           int64_t ldx, bf16* act, cudaStream_t stream) {
  W.check("matvec_swiglu_experts");
  check_x(X, ldx, n, W.in, "matvec_swiglu_experts");
  TANSY_CHECK(n_experts > 0 && W.out % (2 * n_experts) == 0, "matvec_swiglu_experts: {} rows over {} experts",
              W.out, n_experts);
  TANSY_CHECK(k >= 1 && k <= kMaxTopK && idx && act, "matvec_swiglu_experts: k = {} outside 1..{}", k,
              kMaxTopK);
  const int rows_per_expert = W.out / n_experts;
  launch_matvec<2>(W, X, ldx, n, act, rows_per_expert / 2, false, rows_per_expert / 2, idx, k,
                   rows_per_expert, stream);
}

namespace {
void launch_moe_down(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                     int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                     const ResidualOut& res, cudaStream_t stream) {
  Wd.check("moe_down_combine");
  TANSY_CHECK(n_experts > 0 && Wd.out % n_experts == 0, "moe_down_combine: {} rows over {} experts", Wd.out,
              n_experts);
  TANSY_CHECK(k >= 1 && k <= kMaxTopK, "moe_down_combine: k = {} outside 1..{}", k, kMaxTopK);
  TANSY_CHECK(n >= 1 && n <= 65535, "moe_down_combine: {} tokens outside the grid limit", n);
  TANSY_CHECK(idx && wts && act && (out || res.h) && aligned16(act),
              "moe_down_combine: missing or misaligned buffers");
  TANSY_CHECK(!res.h || (n == 1 && res.ss),
              "moe_down_combine: the residual output takes one token and its ss");
  TANSY_CHECK(!shared || sh_logit, "moe_down_combine: shared expert output without its gate logit");
  const int H = Wd.out / n_experts;
  auto go = [&]<int BITS>() {
    const int cpr = Wd.in / Chunk<BITS>::kCols;
    const size_t smem = stage_bytes<BITS>(Wd.in, k);
    auto launch = [&]<int G>() {
      constexpr int R = kThreads / G;  // output rows per block
      TANSY_CHECK(!res.h || ceil_div(H, R) <= unsigned(kNormParts),
                  "moe_down_combine: {} rows need more than {} partial sums", H, kNormParts);
      auto run = [&]<bool STAGED>(size_t bytes) {
        constexpr auto kern = moe_down_kernel<BITS, G, STAGED>;
        allow_smem<kern>(bytes, "moe_down_combine");
        pdl_launch(kern, dim3(ceil_div(H, R), n), dim3(kThreads), bytes, stream, Wd, H, idx, wts, act, k,
                   shared, sh_logit, sh_ld, out, res, bulk_copies_on() ? 1 : 0);
      };
      // Shared-memory staging of the slots' rows when they fit (and scales come in 16-byte pieces).
      const size_t big = align16(smem) + size_t(k) * R * Wd.in * BITS / 8 +
                         (BITS == 16 ? 0 : size_t(k) * R * (Wd.in / kQuantGroup) * 4);
      if (smem_staging_on() && big <= kSmemMatvecMax && (BITS == 16 || (Wd.in / kQuantGroup) % 8 == 0))
        run.template operator()<true>(big);
      else
        run.template operator()<false>(smem);
    };
    if (cpr >= 32)
      launch.template operator()<32>();
    else if (cpr >= 16)
      launch.template operator()<16>();
    else
      launch.template operator()<8>();
  };
  switch (Wd.fmt) {
    case WFormat::kAffine4:
      go.template operator()<4>();
      break;
    case WFormat::kAffine8:
      go.template operator()<8>();
      break;
    default:
      go.template operator()<16>();
      break;
  }
}
}  // namespace

void moe_down_combine(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                      int n, int k, const bf16* shared, const float* sh_logit, int64_t sh_ld, bf16* out,
                      cudaStream_t stream) {
  TANSY_CHECK(out, "moe_down_combine: no output");
  launch_moe_down(Wd, n_experts, idx, wts, act, n, k, shared, sh_logit, sh_ld, out, ResidualOut{}, stream);
}

void moe_down_residual(const DevLinear& Wd, int n_experts, const int* idx, const float* wts, const bf16* act,
                       int k, const bf16* shared, const float* sh_logit, const ResidualOut& out,
                       cudaStream_t stream) {
  TANSY_CHECK(out.h && out.ss, "moe_down_residual: missing h or ss");
  launch_moe_down(Wd, n_experts, idx, wts, act, 1, k, shared, sh_logit, 0, nullptr, out, stream);
}

}  // namespace tansy::cuda
