// Weight-streaming products for decode. Each lane reads one 16-byte chunk of a weight row at a
// time (32 4-bit, 16 8-bit or 8 bf16 columns: always inside one quant group); the token rows of
// x sit in shared memory as f32, each chunk padded by 16 bytes so that the lanes of a warp, which
// read chunks 144/80/48 bytes apart, hit distinct banks. The pad slot holds the chunk's Σx, which
// turns the affine dequant into one multiply-add per chunk: Σ(s·q+b)x = s·Σqx + b·Σx.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/grid_sync.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/gdn/gdn.cuh"
#include "cuda/matvec/chunk.cuh"
#include "cuda/matvec/fused.cuh"
#include "cuda/matvec/matvec.cuh"
#include "cuda/matvec/tc_tile.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/moe/route_device.cuh"

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

using namespace gemv;

// Output rows a warp streams at once (registers: the SwiGLU modes read two rows per output row,
// and the multi-token variant, a prefill path, keeps one row).
constexpr int max_rows_per_warp(int T, int MODE) { return T > 1 ? 1 : MODE == 0 ? 4 : 2; }

// What a decode launch fuses around the product (T == 1, MODE 0 only).
enum class Epi : int { kNone = 0, kRoute = 1, kGdnIn = 2, kResidual = 3 };
struct Fusion {
  NormIn norm;  // norm.w == nullptr: X is read as given
  Epi epi = Epi::kNone;
  RouteEpilogue route;
  GdnInEpilogue gdn;
  ResidualOut resid;
  int batched = 0;  // grid row blockIdx.y is token row t of `rows` (the shared-memory kernel)
  DecodeRows rows;
  ExpertGroups groups;  // matvec_tc_kernel MODE 3: grid row blockIdx.y is item blockIdx.y
};

// The one-row fusion's pointers moved to token row t of a batched launch.
__device__ __forceinline__ NormIn norm_row(const Fusion& fz, int t) {
  NormIn n = fz.norm;
  n.h += t * fz.rows.h;
  n.ss += t * fz.rows.ss;
  if (n.xn_out) n.xn_out += t * fz.rows.xn;
  return n;
}
__device__ __forceinline__ GdnInEpilogue gdn_row(const Fusion& fz, int t) {
  GdnInEpilogue g = fz.gdn;
  if (fz.batched) g.window = fz.rows.window[t];
  g.conv_out += t * fz.rows.conv;
  g.beta += t * fz.rows.gates;
  g.g += t * fz.rows.gates;
  return g;
}

// The last block to finish routes the token from the logits every block stored.
__device__ void route_epilogue(const RouteEpilogue& R, const float* logits, int warp, unsigned blocks) {
  __shared__ float l[kRouteMaxExperts + 1];
  __shared__ int last;
  if (!last_block_arrive(R.counter, blocks, last)) return;  // this block's logits are counted
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
        R.w[R.k] = sigmoid(l[R.E]);
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
      stage_norm<BITS>(fz.norm, W.in, xs, red, blockIdx.x == 0 && blockIdx.y == 0, BlockSync{});
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
    if (fz.epi == Epi::kRoute)
      route_epilogue(fz.route, static_cast<const float*>(Y), warp, gridDim.x * gridDim.y);
  }
}

// ---- one token row, weights staged in shared memory ----
//
// The block's weight rows (a contiguous range) and their scales and biases are copied into shared
// memory before the kernel waits on its predecessor: with programmatic dependent launch the whole
// weight read of a decode product overlaps the kernel before it, and no registers are spent
// holding loads in flight. The copies are bulk copies (warp 0's lanes, 4 KiB pieces, one
// mbarrier; per-thread 16-byte cp.async measured 0.2-1.2 µs slower per product on the H200,
// docs/PERFORMANCE.md). After the wait only x is staged and the dot products read shared memory.
// MODE 0 plain, MODE 1 SwiGLU row pairs, MODE 2 routed experts (their copy starts after the wait:
// the rows depend on the routing); the Fusion epilogues as in matvec_kernel.

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
__global__ void __launch_bounds__(kThreads, MODE == 2 ? 4 : 3)
    matvec_smem_kernel(DevLinear W, const bf16* __restrict__ X, int64_t ldx, void* Y, int64_t ldy, int y_f32,
                       int out_rows, int rpw, const int* __restrict__ idx, int k, int rows_per_expert,
                       const __grid_constant__ Fusion fz) {
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
  if (threadIdx.x == 0) {
    bulk::mbar_init(&wbar);
    bulk::fence_init();
  }
  __syncthreads();
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
  }
  if constexpr (MODE != 2) {
    pdl_wait();
    pdl_launch_dependents();
  }
  // MODE 2: slot blockIdx.y reads token t0's x. A batched launch (MODE 0): grid row blockIdx.y
  // is token row tb, everything else as in the one-row launch.
  const int t0 = MODE == 2 ? blockIdx.y / k : fz.batched ? blockIdx.y : 0;
  const int tb = MODE == 2 ? 0 : t0;
  if (fz.norm.w)
    stage_norm<BITS>(norm_row(fz, tb), W.in, xs, red, blockIdx.x == 0 && (fz.batched || blockIdx.y == 0),
                     BlockSync{});
  else
    stage_rows<BITS>(X + int64_t(t0) * ldx, ldx, 1, 1, W.in, xs);
  const GdnInEpilogue gz = gdn_row(fz, tb);

  int rows[kR];
  bool ok[kR];
  float conv_w[kR], conv_in[kR];
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    rows[i] = (blockIdx.x * rpw + i) * kWarps + warp;
    ok[i] = i < rpw && rows[i] < out_rows;
    conv_w[i] = conv_in[i] = 0.f;
    if (fz.epi == Epi::kGdnIn && ok[i] && rows[i] < gz.conv_dim) {
      const GdnInEpilogue& G = gz;
      if (lane < G.kernel) conv_w[i] = G.conv_w[int64_t(rows[i]) * G.kernel + lane];
      if (lane < G.kernel - 1) conv_in[i] = __bfloat162float(G.window[int64_t(lane) * G.conv_dim + rows[i]]);
    }
  }
  bulk::mbar_wait(&wbar, 0);
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
        float* h = fz.resid.h + tb * fz.rows.h;
        const float v = h[rows[i]] + y;
        h[rows[i]] = v;
        sq = fmaf(v, v, sq);
      } else {
        const int64_t at = (MODE == 2 || fz.batched ? int64_t(blockIdx.y) * ldy : 0) + rows[i];
        if (y_f32)
          static_cast<float*>(Y)[at] = y;
        else
          static_cast<bf16*>(Y)[at] = __float2bfloat16(y);
      }
    }
    if (fz.epi == Epi::kGdnIn && ok[i]) gdn_in_epilogue(gz, rows[i], y, conv_w[i], conv_in[i], lane);
  }
  if (fz.epi == Epi::kResidual) residual_partial(sq, fz.resid.ss + tb * fz.rows.ss, red);
  if (fz.epi == Epi::kRoute) {
    RouteEpilogue R = fz.route;
    R.idx += tb * fz.rows.route;
    R.w += tb * fz.rows.route;
    R.counter += tb;
    route_epilogue(R, static_cast<const float*>(Y) + tb * ldy, warp,
                   fz.batched ? gridDim.x : gridDim.x * gridDim.y);
  }
}

// ---- the 2048-column 4-bit products on tensor cores (tc_tile.cuh) ----
//
// The in_proj of both mixers (the input norm, then plain rows or the GDN epilogue) and the
// experts' gate|up with SwiGLU: the persistent step computes these with tc16's tiles, so their
// per-op kernels do too, with the same device functions: the same bits (tests/gpu/test_step.cu
// checks the step against these kernels bit for bit). A block stages x once and walks its 16-row
// tiles (grid stride), each copied into shared memory in tc16's layout with cp.async one tile
// ahead (the first before waiting on the previous kernel: weights do not depend on it).
// MODE 0, NT 1: rows [0, out_rows) of W for one token. MODE 0, NT 8: a batched launch's token rows
// 8·blockIdx.y.. (Fusion::rows) as the mma's 8 columns, each token's rows the bits it gets alone.
// MODE 2: the rows_per_expert rows of expert idx[blockIdx.y], x row blockIdx.y / k, SwiGLU pairs
// into Y row blockIdx.y. MODE 3, NT 8: item blockIdx.y of fz.groups (grid rows past the items
// return), its expert's rows for its up to 8 slots as the mma's columns, each slot's SwiGLU pairs
// into its Y row: MODE 2's bits, the tiles read once for the item.
constexpr size_t kTcXsBytes = size_t(tc16::kIn / Chunk<4>::kCols) * Chunk<4>::kStride * sizeof(float);
constexpr size_t tc_smem(int nt) { return 2 * size_t(tc16::kTileBytes) + kTcXsBytes + nt * tc16::kPackBytes; }

// Rows r0.. of W (valid_rows of them; the rest of the tile zero-filled) into a tile at dst.
__device__ __forceinline__ void copy_tile_tc(const DevLinear& W, int64_t r0, int valid_rows, uint8_t* dst) {
  constexpr int kChunks = tc16::kRowBytes / 16, kSbChunks = tc16::kRows * tc16::kGroups * 2 / 16;
  const uint8_t* q = reinterpret_cast<const uint8_t*>(W.q);
  for (int c = threadIdx.x; c < tc16::kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, j = c % kChunks;
    const bool ok = r < valid_rows;
    tc::cp_async16(dst + r * tc16::kPitch + j * 16, q + (r0 + (ok ? r : 0)) * tc16::kRowBytes + j * 16, ok);
  }
  for (int c = threadIdx.x; c < 2 * kSbChunks; c += kThreads) {
    const int arr = c / kSbChunks, j = c % kSbChunks;
    const bool ok = j / (kSbChunks / tc16::kRows) < valid_rows;
    const bf16* src = (arr ? W.biases : W.scales) + r0 * tc16::kGroups + (ok ? j * 8 : 0);
    tc::cp_async16(dst + (arr ? tc16::kBi : tc16::kSc) + j * 16, src, ok);
  }
  tc::cp_async_commit();
}

template <int MODE, int NT>
__global__ void __launch_bounds__(kThreads, 2)
    matvec_tc_kernel(DevLinear W, const bf16* __restrict__ X, int64_t ldx, void* Y, int64_t ldy, int y_f32,
                     int out_rows, const int* __restrict__ idx, int k, int rows_per_expert,
                     const __grid_constant__ Fusion fz) {
  static_assert(NT == 1 || (NT == tc16::kCols && (MODE == 0 || MODE == 3)));
  static_assert(kGroupCols == tc16::kCols);
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float red[kWarps];
  __shared__ float part[kWarps][NT][tc16::kRows];
  float(*const part1)[tc16::kRows] = reinterpret_cast<float(*)[tc16::kRows]>(part);  // NT == 1: [warp][row]
  uint8_t* const tiles[2] = {smem, smem + tc16::kTileBytes};
  float* const xs = reinterpret_cast<float*>(smem + 2 * tc16::kTileBytes);
  uint8_t* const packs = smem + 2 * tc16::kTileBytes + kTcXsBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nt = (out_rows + tc16::kRows - 1) / tc16::kRows;
  int64_t w0 = 0;  // the matrix's first row (MODE 2: the expert's)
  auto copy = [&](int i, int buf) {
    copy_tile_tc(W, w0 + int64_t(i) * tc16::kRows, min(tc16::kRows, out_rows - i * tc16::kRows), tiles[buf]);
  };
  if constexpr (MODE < 2) copy(blockIdx.x, 0);
  pdl_wait();
  pdl_launch_dependents();
  [[maybe_unused]] int4 item{};  // MODE 3: {expert, first index into fz.groups.sorted, slots, 0}
  if constexpr (MODE == 2) {
    w0 = int64_t(idx[blockIdx.y]) * rows_per_expert;  // the expert the previous kernel chose
    copy(blockIdx.x, 0);
  } else if constexpr (MODE == 3) {
    if (int(blockIdx.y) >= *fz.groups.n_items) return;  // the grid is sized for the most items
    item = fz.groups.items[blockIdx.y];
    w0 = int64_t(item.x) * rows_per_expert;
    copy(blockIdx.x, 0);
  }
  // x: MODE 2 slot blockIdx.y reads token blockIdx.y / k; MODE 0 token rows t0..t0+nv-1; MODE 3
  // slot sorted[item.y + j] reads token sorted[item.y + j] / k
  const int t0 = MODE == 2 ? blockIdx.y / k : MODE == 0 && fz.batched ? blockIdx.y * NT : 0;
  const int nv = NT == 1 ? 1 : MODE == 3 ? item.z : min(NT, fz.rows.n - t0);
  [[maybe_unused]] tc16::XFrag xf;
  [[maybe_unused]] tc16::XFrag8 xf8;
  for (int j = 0; j < nv; ++j) {
    if (MODE == 0 && fz.norm.w)
      stage_norm<4>(norm_row(fz, t0 + j), tc16::kIn, xs, red,
                    blockIdx.x == 0 && (fz.batched || blockIdx.y == 0), BlockSync{});
    else
      stage_rows<4>(X + int64_t(MODE == 3 ? fz.groups.sorted[item.y + j] / k : t0 + j) * ldx, ldx, 1, 1,
                    tc16::kIn, xs);
    __syncthreads();
    tc16::pack_x(xs, packs + j * tc16::kPackBytes);
    __syncthreads();  // the pack is complete, and xs is free for the next token
  }
  if constexpr (NT == 1)
    tc16::stage_x_frags(packs, xf);
  else
    tc16::load_x8(packs, nv, xf8);
  // Row `row` of token row t (the launch's Y row) is y: stored, with the GDN epilogue.
  auto finish = [&](int t, int row, float y) {
    const int64_t at = (MODE == 2 || fz.batched ? int64_t(t) * ldy : 0) + row;
    if (MODE == 0 && fz.epi == Epi::kGdnIn) {
      static_cast<bf16*>(Y)[at] = __float2bfloat16(y);
      const GdnInEpilogue gz = gdn_row(fz, t);
      float w[4] = {0.f, 0.f, 0.f, 0.f}, in[3] = {0.f, 0.f, 0.f};
      if (row < gz.conv_dim) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          w[q] = gz.conv_w[int64_t(row) * 4 + q];
          if (q < 3) in[q] = __bfloat162float(gz.window[int64_t(q) * gz.conv_dim + row]);
        }
      }
      gdn_in_epilogue_k4(gz, row, y, w, in);
    } else if (y_f32) {
      static_cast<float*>(Y)[at] = y;
    } else {
      static_cast<bf16*>(Y)[at] = __float2bfloat16(y);
    }
  };
  // MODE 3: thread (j, p) finishes pair p of slot j's rows (8 slots x 8 pairs of a tile)
  [[maybe_unused]] const int gj = threadIdx.x / (tc16::kRows / 2), gp = threadIdx.x % (tc16::kRows / 2);
  [[maybe_unused]] const int gslot = MODE == 3 && gj < nv ? fz.groups.sorted[item.y + gj] : 0;
  int buf = 0;
  for (int i = blockIdx.x; i < nt; i += gridDim.x, buf ^= 1) {
    const bool more = i + int(gridDim.x) < nt;
    if (more) copy(i + gridDim.x, buf ^ 1);
    if (more)
      tc::cp_async_wait<1>();
    else
      tc::cp_async_wait<0>();
    __syncthreads();  // tile i landed for every thread; `part` read by the last tile's epilogue
    if constexpr (NT == 1)
      tc16::tile_partials(tiles[buf], xf, part1);
    else
      tc16::tile_partials8(tiles[buf], xf8, part);
    __syncthreads();  // every warp's partial sums are in `part`, and tile i's buffer is free
    const int r0 = i * tc16::kRows;
    if constexpr (MODE == 2) {
      if (warp == 0 && lane < tc16::kRows / 2 && r0 + 2 * lane + 1 < out_rows) {
        const float g = tc16::row_sum(part1, 2 * lane);
        const float u = tc16::row_sum(part1, 2 * lane + 1);
        static_cast<bf16*>(Y)[int64_t(blockIdx.y) * ldy + r0 / 2 + lane] =
            __float2bfloat16(swiglu_bf16(g, u));
      }
    } else if constexpr (MODE == 3) {
      if (gj < nv && r0 + 2 * gp + 1 < out_rows) {
        const float g = tc16::row_sum8(part, gj, 2 * gp);
        const float u = tc16::row_sum8(part, gj, 2 * gp + 1);
        static_cast<bf16*>(Y)[int64_t(gslot) * ldy + r0 / 2 + gp] = __float2bfloat16(swiglu_bf16(g, u));
      }
    } else if constexpr (NT == 1) {
      if (warp == 0 && lane < tc16::kRows && r0 + lane < out_rows)
        finish(t0, r0 + lane, tc16::row_sum(part1, lane));
    } else {
      const int j = threadIdx.x / tc16::kRows, r = threadIdx.x % tc16::kRows;  // 8 tokens x 16 rows
      if (j < nv && r0 + r < out_rows) finish(t0 + j, r0 + r, tc16::row_sum8(part, j, r));
    }
  }
}

// Whether a product runs matvec_tc_kernel: the persistent step's tensor-core products (4-bit,
// 2048 columns), which must keep its arithmetic wherever the step could have run them. MODE 0
// needs the input norm and no epilogue but the GDN's (4 taps).
bool tc_product(const DevLinear& W, const Fusion* fz) {
  if (W.fmt != WFormat::kAffine4 || W.in != tc16::kIn) return false;
  if (!fz) return true;
  return fz->norm.w && (fz->epi == Epi::kNone || (fz->epi == Epi::kGdnIn && fz->gdn.kernel == 4));
}

template <int MODE, int NT>
void launch_tc(const DevLinear& W, const bf16* X, int64_t ldx, void* Y, int64_t ldy, bool y_f32, int out_rows,
               const int* idx, int k, int rows_per_expert, unsigned grid_y, cudaStream_t stream,
               const Fusion& fz) {
  // about two blocks a multiprocessor over all grid rows: each block stages x once for its tiles
  const unsigned tiles = ceil_div(out_rows, tc16::kRows);
  const unsigned gx = std::max(1u, std::min(tiles, ceil_div(2 * sm_count(), int(grid_y))));
  // the tiles' scales and biases are copied in 16-byte pieces (DevLinear::check covers the codes)
  TANSY_CHECK(aligned16(W.scales) && aligned16(W.biases),
              "matvec (tensor cores): scales and biases must be 16-byte aligned");
  constexpr auto kern = matvec_tc_kernel<MODE, NT>;
  allow_smem<kern>(tc_smem(NT), "matvec (tensor cores)");
  pdl_launch(kern, dim3(gx, grid_y), dim3(kThreads), tc_smem(NT), stream, W, X, ldx, Y, ldy, y_f32 ? 1 : 0,
             out_rows, idx, k, rows_per_expert, fz);
}

// Rows per warp: as many as still give every multiprocessor a block.
int rows_per_warp(int max_rpw, int out_rows, unsigned grid_y) {
  const int sms = sm_count();
  int rpw = max_rpw;
  while (rpw > 1 && int64_t(ceil_div(out_rows, kWarps * rpw)) * grid_y < sms) rpw /= 2;
  return rpw;
}

template <int BITS, int T, int MODE>
void launch_matvec_t(const DevLinear& W, const bf16* X, int64_t ldx, int n, void* Y, int64_t ldy, bool y_f32,
                     int out_rows, const int* idx, int k, int rows_per_expert, unsigned grid_y,
                     cudaStream_t stream, const Fusion& fz = Fusion{}) {
  // A batched launch keeps the one-row launch's rows per block (the partial sums of h² are per
  // block), so its rows per warp are chosen as for one grid row.
  const int rpw = rows_per_warp(max_rows_per_warp(T, MODE), out_rows, fz.batched ? 1u : grid_y);
  if constexpr (T == 1) {
    // One token: the shared-memory kernel, when the block's rows fit (and scales come in 16-byte
    // pieces).
    const SmemLayout lay = smem_layout<BITS>(W.in, kWarps * rpw * (MODE != 0 ? 2 : 1));
    const bool fits = lay.total <= kSmemMatvecMax && (BITS == 16 || (W.in / kQuantGroup) % 8 == 0);
    TANSY_CHECK(!fz.batched || fits,
                "matvec: a batched decode product [{}, {}] does not fit the shared-memory kernel", W.out,
                W.in);
    if ((MODE == 2 || (n == 1 && grid_y == 1) || fz.batched) && fits) {
      constexpr auto skern = matvec_smem_kernel<BITS, MODE>;
      allow_smem<skern>(lay.total, "matvec");
      pdl_launch(skern, dim3(ceil_div(out_rows, kWarps * rpw), grid_y), dim3(kThreads), lay.total, stream, W,
                 X, ldx, Y, ldy, y_f32 ? 1 : 0, out_rows, rpw, idx, k, rows_per_expert, fz);
      return;
    }
  }
  const size_t smem = stage_bytes<BITS>(W.in, T);
  constexpr auto kern = matvec_kernel<BITS, T, MODE>;
  allow_smem<kern>(smem, "matvec");
  const dim3 grid(ceil_div(out_rows, kWarps * rpw), grid_y);
  pdl_launch(kern, grid, dim3(kThreads), smem, stream, W, X, ldx, n, Y, ldy, y_f32 ? 1 : 0, out_rows, idx, k,
             rows_per_expert, rpw, fz);
}

// One token row with an optional fused input norm (X null) and epilogue; with `rows`, rows->n of
// them in one launch (X rows ldx apart, Y rows rows->y apart).
void launch_fused(const DevLinear& W, const bf16* X, int64_t ldx, Fusion fz, void* Y, int64_t ldy, bool y_f32,
                  cudaStream_t stream, const DecodeRows* rows) {
  unsigned grid_y = 1;
  if (rows) {
    TANSY_CHECK(rows->n >= 1 && rows->n <= kMaxBatch, "matvec: {} batched rows outside 1..{}", rows->n,
                kMaxBatch);
    TANSY_CHECK(fz.epi != Epi::kGdnIn || rows->window[rows->n - 1],
                "matvec_norm_gdn: a batched row without its conv window");
    fz.batched = 1;
    fz.rows = *rows;
    grid_y = unsigned(rows->n);
    ldy = rows->y;
  }
  if (!X) {
    const NormIn& x = fz.norm;
    TANSY_CHECK(x.h && x.ss && x.w && aligned16(x.h) && aligned16(x.w),
                "matvec_norm: h, ss and w must be present, h and w 16-byte aligned");
    TANSY_CHECK(W.in % 4 == 0 && W.in <= kFusedNormMaxDim,
                "matvec_norm: in = {} must be a multiple of 4 and <= {}", W.in, kFusedNormMaxDim);
  }
  TANSY_CHECK(Y || fz.epi == Epi::kResidual, "matvec_norm: no output");
  static_assert(kFusedNormMaxDim % (4 * kThreads) == 0);
  if (tc_product(W, &fz)) {
    if (fz.batched)
      launch_tc<0, tc16::kCols>(W, X, ldx, Y, ldy, y_f32, W.out, nullptr, 0, 0, ceil_div(grid_y, tc16::kCols),
                                stream, fz);
    else
      launch_tc<0, 1>(W, X, ldx, Y, ldy, y_f32, W.out, nullptr, 0, 0, 1, stream, fz);
    return;
  }
  switch (W.fmt) {
    case WFormat::kAffine4:
      launch_matvec_t<4, 1, 0>(W, X, ldx, int(grid_y), Y, ldy, y_f32, W.out, nullptr, 0, 0, grid_y, stream,
                               fz);
      break;
    case WFormat::kAffine8:
      launch_matvec_t<8, 1, 0>(W, X, ldx, int(grid_y), Y, ldy, y_f32, W.out, nullptr, 0, 0, grid_y, stream,
                               fz);
      break;
    default:
      launch_matvec_t<16, 1, 0>(W, X, ldx, int(grid_y), Y, ldy, y_f32, W.out, nullptr, 0, 0, grid_y, stream,
                                fz);
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
  with_bits(W.fmt, go);
}

void check_x(const bf16* X, int64_t ldx, int n, int in, const char* what) {
  TANSY_CHECK(n >= 1, "{}: no token rows", what);
  TANSY_CHECK(X && aligned16(X) && ldx % 8 == 0 && ldx >= in,
              "{}: X must be 16-byte aligned rows (ldx {} >= in {})", what, ldx, in);
}

}  // namespace

void matvec(const DevLinear& W, const bf16* X, int64_t ldx, int n, const MatvecOut& Y, cudaStream_t stream) {
  W.check("matvec");
  check_x(X, ldx, n, W.in, "matvec");
  TANSY_CHECK(Y.ptr && Y.ld >= W.out, "matvec: output ld {} < out {}", Y.ld, W.out);
  launch_matvec<0>(W, X, ldx, n, Y.ptr, Y.ld, Y.f32, W.out, nullptr, 0, 0, stream);
}

void matvec_residual(const DevLinear& W, const bf16* X, const ResidualOut& out, cudaStream_t stream,
                     const DecodeRows* rows) {
  W.check("matvec_residual");
  const int64_t ldx = rows ? rows->y : W.in;  // the batched rows of X
  check_x(X, ldx, rows ? rows->n : 1, W.in, "matvec_residual");
  TANSY_CHECK(out.h && out.ss, "matvec_residual: missing h or ss");
  TANSY_CHECK(ceil_div(W.out, kWarps) <= kNormParts,
              "matvec_residual: {} rows need more than {} partial sums", W.out, kNormParts);
  TANSY_CHECK(!rows || rows->n == 1 || (rows->h >= W.out && rows->ss >= kNormParts),
              "matvec_residual: batched rows' h ({} apart) or partial sums ({} apart) overlap",
              rows ? rows->h : 0, rows ? rows->ss : 0);
  Fusion fz;
  fz.epi = Epi::kResidual;
  fz.resid = out;
  launch_fused(W, X, ldx, fz, nullptr, W.out, true, stream, rows);
}

void matvec_norm(const DevLinear& W, const NormIn& x, const MatvecOut& Y, cudaStream_t stream,
                 const DecodeRows* rows) {
  W.check("matvec_norm");
  TANSY_CHECK(Y.ld >= W.out, "matvec_norm: output ld {} < out {}", Y.ld, W.out);
  Fusion fz;
  fz.norm = x;
  DecodeRows r;
  if (rows) (r = *rows).y = Y.ld;  // the output rows are Y's
  launch_fused(W, nullptr, 0, fz, Y.ptr, Y.ld, Y.f32, stream, rows ? &r : nullptr);
}

void matvec_norm_route(const DevLinear& W, const NormIn& x, float* logits, const RouteEpilogue& route,
                       cudaStream_t stream, const DecodeRows* rows) {
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
  TANSY_CHECK(!rows || rows->y >= W.out, "matvec_norm_route: logit rows {} apart hold fewer than {}",
              rows ? rows->y : 0, W.out);
  launch_fused(W, nullptr, 0, fz, logits, W.out, true, stream, rows);
}

void matvec_norm_gdn(const DevLinear& W, const NormIn& x, bf16* Y, const GdnInEpilogue& g,
                     cudaStream_t stream, const DecodeRows* rows) {
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
  TANSY_CHECK(!rows || rows->y >= W.out, "matvec_norm_gdn: output rows {} apart hold fewer than {}",
              rows ? rows->y : 0, W.out);
  launch_fused(W, nullptr, 0, fz, Y, W.out, false, stream, rows);
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
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && idx && act, "matvec_swiglu_experts: k = {} outside 1..{}", k,
              kRouteMaxTopK);
  const int rows_per_expert = W.out / n_experts;
  if (tc_product(W, nullptr) && rows_per_expert % tc16::kRows == 0) {
    const unsigned slots = unsigned(n) * unsigned(k);
    TANSY_CHECK(slots <= 65535u, "matvec_swiglu_experts: {} slots exceed the grid limit", slots);
    launch_tc<2, 1>(W, X, ldx, act, rows_per_expert / 2, false, rows_per_expert, idx, k, rows_per_expert,
                    slots, stream, Fusion{});
    return;
  }
  launch_matvec<2>(W, X, ldx, n, act, rows_per_expert / 2, false, rows_per_expert / 2, idx, k,
                   rows_per_expert, stream);
}

bool experts_grouped_ok(const DevLinear& W, int n_experts) {
  return n_experts > 0 && W.out % (2 * n_experts) == 0 && tc_product(W, nullptr) &&
         (W.out / n_experts) % tc16::kRows == 0;
}

void matvec_swiglu_experts_grouped(const DevLinear& W, int n_experts, const int* idx, int n, int k,
                                   const bf16* X, int64_t ldx, bf16* act, const ExpertGroups& g,
                                   cudaStream_t stream) {
  W.check("matvec_swiglu_experts_grouped");
  check_x(X, ldx, n, W.in, "matvec_swiglu_experts_grouped");
  TANSY_CHECK(k >= 1 && k <= kRouteMaxTopK && idx && act,
              "matvec_swiglu_experts_grouped: k = {} outside 1..{}", k, kRouteMaxTopK);
  TANSY_CHECK(
      experts_grouped_ok(W, n_experts),
      "matvec_swiglu_experts_grouped: [{}, {}] {} over {} experts has no tensor-core tiles (4-bit, {} "
      "columns, each expert's rows a multiple of {})",
      W.out, W.in, wformat_name(W.fmt), n_experts, tc16::kIn, tc16::kRows);
  const int rows_per_expert = W.out / n_experts;
  expert_groups(idx, n, k, n_experts, g, stream);
  Fusion fz;
  fz.groups = g;
  launch_tc<3, tc16::kCols>(W, X, ldx, act, rows_per_expert / 2, false, rows_per_expert, nullptr, k,
                            rows_per_expert, unsigned(expert_group_items_max(n * k, n_experts)), stream, fz);
}

}  // namespace tansy::cuda
