// Decode's head in one launch (see lm_head.cuh). One block of 16 warps per multiprocessor walks
// its share of 32-row tiles through a 5-stage shared-memory pipeline: the codes arrive by 2-D
// tensor copies (TMA, 32 rows x 128 bytes each, 128-byte swizzle so that fragment loads are free
// of bank conflicts), the scales and biases by bulk copies, each stage completing on an mbarrier;
// tile i + 4 is in flight while tile i is used. x lives in registers as mma B fragments, and
// the 4-bit codes become mma A fragments with a shift and a mask per 8 columns: nibbles k and
// k+4 of a word form the bf16 pair 128+q (exact), so the k order inside a word is (0,4),(1,5),
// (2,6),(3,7) and x is packed in the same order.
//
// Work split: warp w owns quant groups w, w+16, ... of every row (so its B fragments fit in
// registers); per tile each warp leaves one partial per row in shared memory and warp 0 adds them
// up during the next tile. Per group the mma accumulator restarts, so that the group's scale and
// bias apply in f32: y = s·Σ(128+q)x + (b - 128s)·Σx, as matvec's chunk_dot.
//
// Measured on the H200 (Timing.DecodeRealShapes, 248320 x 2048): the general matvec 140 µs; this kernel with
// per-thread cp.async copies 142 µs, with one bulk copy per padded row 153-176 µs, with one
// unpadded bulk copy per tile 126 µs (bank conflicts), with swizzled tensor copies 119 µs (2.4
// TB/s, not the ~4.4 TB/s the card reads: the copies do not keep enough in flight; a sixth stage
// and L2 prefetch of later tiles made it slower).
#include <algorithm>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/grid_sync.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/common/tensor_map.cuh"
#include "cuda/head/head.cuh"

namespace tansy::cuda {
namespace {

constexpr int kWarps = 16, kThreads = kWarps * 32;  // 4 warps per scheduler hide the mma latency
constexpr int kTileRows = 32;                       // two mma row blocks of 16
constexpr int kStages = 5;
constexpr int kMaxGroupsPerWarp = kFusedNormMaxDim / kQuantGroup / kWarps;
constexpr int kSlab = 128;                     // bytes of a row per tensor copy (the 128-byte swizzle span)
constexpr int kSlabBytes = kTileRows * kSlab;  // one copy: 32 rows x 128 bytes, 1024-byte aligned

// A stage: the codes as row_bytes / 128 slabs of [32 rows][128 bytes], each stored with the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), so that the 8 rows an mma
// fragment load touches at one column fall in 8 different bank groups; then scales
// [kTileRows][G] and biases [kTileRows][G] (bf16).
struct Layout {
  int sb;     // offset of the scales
  int stage;  // bytes per stage (a multiple of 1024)
};
__host__ __device__ inline Layout layout(int in) {
  Layout L;
  L.sb = (in / 2 / kSlab) * kSlabBytes;
  L.stage = (L.sb + kTileRows * (in / kQuantGroup) * 4 + 1023) / 1024 * 1024;
  return L;
}
// + 1024: the dynamic shared memory is aligned to 1024 bytes inside the kernel
size_t smem_bytes(int in) { return size_t(kStages) * layout(in).stage + size_t(in) * 2 + 1024; }

// Tile `tile` (rows 32·tile …) of W into a stage, by one warp: its lane 0 issues one tensor copy
// per slab of codes (rows past W.out arrive as zeros, still counted) and one bulk copy each for
// the scales and biases; a tail of those under 16 bytes (a partial last tile) is copied by plain
// stores, visible to the other warps after the barrier that precedes the tile's use.
__device__ void issue_tile(const CUtensorMap* map, const DevLinear& W, int tile, uint8_t* stage,
                           const Layout& L, uint64_t* bar, int lane) {
  const int G = W.in / kQuantGroup, row_bytes = W.in / 2;
  const int r0 = tile * kTileRows, rows = min(kTileRows, W.out - r0);
  const int sb = rows * G * 2, sb_bulk = sb & ~15;
  const bf16* gs = W.scales + int64_t(r0) * G;
  const bf16* gb = W.biases + int64_t(r0) * G;
  bf16* ds = reinterpret_cast<bf16*>(stage + L.sb);
  bf16* db = ds + kTileRows * G;
  if (lane == 0) {
    bulk::fence_before_copy();  // earlier reads of the stage come first
    bulk::mbar_expect_tx(bar, unsigned(row_bytes / kSlab * kSlabBytes + 2 * sb_bulk));
    for (int sl = 0; sl < row_bytes / kSlab; ++sl)
      bulk::tensor_copy_2d(stage + sl * kSlabBytes, map, sl * kSlab, r0, bar);
    if (sb_bulk > 0) {
      bulk::copy(ds, gs, sb_bulk, bar);
      bulk::copy(db, gb, sb_bulk, bar);
    }
  }
  for (int i = sb_bulk / 2 + lane; i < sb / 2; i += 32) {
    ds[i] = gs[i];
    db[i] = gb[i];
  }
}

// One word of 8 columns for rows g (wa) and g+8 (wb): two k-steps of 16 (tc::mma_word).
__device__ __forceinline__ void mma_word(float (&c)[4], uint32_t wa, uint32_t wb, const uint32_t (&b)[2][2]) {
  tc::mma_word(c, wa, wb, make_uint4(b[0][0], b[0][1], b[1][0], b[1][1]));
}

__device__ __forceinline__ unsigned long long max_u64(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}

__device__ __forceinline__ unsigned long long warp_max(unsigned long long k) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) k = max_u64(k, __shfl_xor_sync(0xffffffffu, k, o));
  return k;
}

__global__ void __launch_bounds__(kThreads, 1)
    lm_head_kernel(const __grid_constant__ CUtensorMap map, LmHeadArgs a) {
  extern __shared__ float4 smem4[];
  __shared__ float red[2][kWarps][kTileRows];
  __shared__ float nred[kWarps];
  __shared__ unsigned long long kred[kWarps];
  __shared__ int last;
  __shared__ alignas(8) uint64_t full[kStages];  // stage s holds its tile
  uint8_t* base = reinterpret_cast<uint8_t*>(smem4);
  base += (1024 - (tc::smem_addr(base) & 1023)) & 1023;  // the swizzle pattern needs 1024-byte alignment
  const DevLinear& W = a.W;
  const int G = W.in / kQuantGroup;
  const Layout L = layout(W.in);
  bf16* xb = reinterpret_cast<bf16*>(base + kStages * L.stage);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ntiles = (W.out + kTileRows - 1) / kTileRows;
  const int mine = int(blockIdx.x) < ntiles ? (ntiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
  auto tile_of = [&](int j) { return int(blockIdx.x) + j * int(gridDim.x); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) bulk::mbar_init(&full[s]);
    bulk::fence_init();
  }
  __syncthreads();
  // Weights never depend on the step: the first stages load while the previous kernel finishes.
  constexpr int kIssuer = kWarps - 1;  // the warp that issues the copies (warp 0 adds up the rows)
  if (warp == kIssuer)
    for (int s = 0; s < kStages - 1 && s < mine; ++s)
      issue_tile(&map, W, tile_of(s), base + s * L.stage, L, &full[s], lane);
  pdl_wait();
  pdl_launch_dependents();

  // x = bf16(h·rsqrt(Σss/in + eps)·w), the partials summed in matvec's stage_norm order.
  {
    float part = 0.f;
    // threads < 256 take parts i and i + 256, as matvec's 256-thread stage_norm does (the other
    // warps add zeros), so the scale is bit-identical to the fused products' norms
    if (threadIdx.x < 256)
      for (int i = threadIdx.x; i < kNormParts; i += 256) part += a.x.ss[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) nred[warp] = part;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < kWarps; ++w) tot += nred[w];
    const float scale = rsqrtf(tot / float(W.in) + a.x.eps);
    const bool writer = a.x.xn_out && blockIdx.x == 0;
    for (int i = threadIdx.x; i < W.in; i += kThreads) {
      const bf16 v = __float2bfloat16(a.x.h[i] * scale * a.x.w[i]);
      xb[i] = v;
      if (writer) a.x.xn_out[i] = v;
    }
    __syncthreads();
  }
  // B fragments of this lane: group j, word 2t+wi of the group, k-step kb, register (k and k+8).
  uint32_t bx[kMaxGroupsPerWarp][2][2][2];
  float sx[kMaxGroupsPerWarp];
#pragma unroll
  for (int j = 0; j < kMaxGroupsPerWarp; ++j) {
    const int gi = warp + j * kWarps;
    sx[j] = 0.f;
    if (gi >= G) continue;
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      const uint4 v = *reinterpret_cast<const uint4*>(xb + gi * kQuantGroup + (2 * t + wi) * 8);
      bx[j][wi][0][0] = __byte_perm(v.x, v.z, 0x5410);  // columns 0, 4
      bx[j][wi][0][1] = __byte_perm(v.x, v.z, 0x7632);  // 1, 5
      bx[j][wi][1][0] = __byte_perm(v.y, v.w, 0x5410);  // 2, 6
      bx[j][wi][1][1] = __byte_perm(v.y, v.w, 0x7632);  // 3, 7
      const uint32_t e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) s += __uint_as_float(e[m] << 16) + __uint_as_float(e[m] & 0xffff0000u);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    sx[j] = s;
  }

  // Warp 0: the rows of tile `tile` from the warps' partials; logits out, argmax candidates kept.
  unsigned long long best = 0;
  auto finish_tile = [&](int tile, const float(*part)[kTileRows]) {
    const int r = tile * kTileRows + lane;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += part[w][lane];
    if (r < W.out) {
      a.logits[r] = v;
      if (r < a.limit) best = max_u64(best, argmax_key(v, r));
    }
  };

  for (int it = 0; it < mine; ++it) {
    bulk::mbar_wait(&full[it % kStages], (it / kStages) & 1);  // tile `it` landed
    __syncthreads();  // ... and every warp is done with tile it-1's stage (and the tails are visible)
    if (warp == kIssuer) {
      const int nx = it + kStages - 1;
      if (nx < mine)
        issue_tile(&map, W, tile_of(nx), base + (nx % kStages) * L.stage, L, &full[nx % kStages], lane);
    }
    if (warp == 0 && it > 0) finish_tile(tile_of(it - 1), red[(it - 1) & 1]);
    const uint8_t* st = base + (it % kStages) * L.stage;
    const bf16* ssm = reinterpret_cast<const bf16*>(st + L.sb);
    const bf16* bsm = ssm + kTileRows * G;
    // All codes first, then the 2 x J accumulation chains (row block x group) interleaved, so
    // that independent mma are in flight instead of one dependent chain.
    constexpr int J = kMaxGroupsPerWarp;
    uint2 wv[2][J][2];  // [row block][group][row g, row g + 8]
    float c[2][J][4];
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        c[sub][j][0] = c[sub][j][1] = c[sub][j][2] = c[sub][j][3] = 0.f;
        const int gi = warp + j * kWarps;
        if (gi >= G) continue;
        // row r = 16 sub + g (+ 8: same r % 8), bytes 32 gi + 8t: slab gi / 4, chunk 2 (gi % 4) + t / 2
        const int chunk = (((gi & 3) << 1) | (t >> 1)) ^ g;
        const uint8_t* p = st + (gi >> 2) * kSlabBytes + (sub * 16 + g) * kSlab + chunk * 16 + (t & 1) * 8;
        wv[sub][j][0] = *reinterpret_cast<const uint2*>(p);
        wv[sub][j][1] = *reinterpret_cast<const uint2*>(p + 8 * kSlab);
      }
#pragma unroll
    for (int wi = 0; wi < 2; ++wi)
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int j = 0; j < J; ++j) {
          if (warp + j * kWarps >= G) continue;
          mma_word(c[sub][j], wi ? wv[sub][j][0].y : wv[sub][j][0].x, wi ? wv[sub][j][1].y : wv[sub][j][1].x,
                   bx[j][wi]);
        }
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      const int ra = sub * 16 + g, rb = ra + 8;
      float ta = 0.f, tb = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int gi = warp + j * kWarps;
        if (gi >= G) continue;
        const float sa = __bfloat162float(ssm[ra * G + gi]), ba = __bfloat162float(bsm[ra * G + gi]);
        const float sb = __bfloat162float(ssm[rb * G + gi]), bb = __bfloat162float(bsm[rb * G + gi]);
        ta += fmaf(sa, c[sub][j][0], (ba - 128.f * sa) * sx[j]);
        tb += fmaf(sb, c[sub][j][2], (bb - 128.f * sb) * sx[j]);
      }
      if (t == 0) {
        red[it & 1][warp][ra] = ta;
        red[it & 1][warp][rb] = tb;
      }
    }
  }
  __syncthreads();
  if (warp == 0) {
    if (mine > 0) finish_tile(tile_of(mine - 1), red[(mine - 1) & 1]);
    best = warp_max(best);
    if (lane == 0) a.scratch[blockIdx.x] = best;
  }
  // The last block to finish picks the winner among the blocks' candidates.
  if (!last_block_arrive(a.counter, gridDim.x, last)) return;
  unsigned long long b = 0;
  for (int i = threadIdx.x; i < int(gridDim.x); i += kThreads) b = max_u64(b, __ldcg(a.scratch + i));
  b = warp_max(b);
  if (lane == 0) kred[warp] = b;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) b = max_u64(b, kred[w]);
    *a.token = argmax_index(b);
    if (a.pos) *a.pos += 1;
    *a.counter = 0;
  }
}

// lm_head_kernel for up to kLmHeadRows token rows: row t is column t of the mma's B operand (lane
// g of a quad group loads row g's x), so each tile's codes serve every row. Everything a row's
// value depends on is computed as lm_head_kernel computes it for one row: the norm (its partial
// sums in the same order), Σx of each group (the same lanes, the same shuffles), the products and
// the fold of scale and bias per group, the warps' partials added in order. Four stages instead
// of five: the rows' x and partials take the fifth's shared memory.
constexpr int kRowStages = 4;
size_t rows_smem_bytes(int in) {
  return size_t(kRowStages) * layout(in).stage + size_t(kLmHeadRows) * in * 2 +
         size_t(2) * kWarps * kTileRows * kLmHeadRows * sizeof(float) + 1024;
}

__global__ void __launch_bounds__(kThreads, 1)
    lm_head_rows_kernel(const __grid_constant__ CUtensorMap map, LmHeadArgs a,
                        const __grid_constant__ LmHeadRows R) {
  extern __shared__ float4 smem4[];
  __shared__ float nred[kLmHeadRows][kWarps];
  __shared__ unsigned long long kred[kWarps];
  __shared__ int last;
  __shared__ alignas(8) uint64_t full[kRowStages];
  uint8_t* base = reinterpret_cast<uint8_t*>(smem4);
  base += (1024 - (tc::smem_addr(base) & 1023)) & 1023;
  const DevLinear& W = a.W;
  const int G = W.in / kQuantGroup, nt = R.n;
  const Layout L = layout(W.in);
  bf16* xb = reinterpret_cast<bf16*>(base + kRowStages * L.stage);         // [rows][in]
  float* red = reinterpret_cast<float*>(xb + size_t(kLmHeadRows) * W.in);  // [2][warp][row][token]
  auto red_at = [&](int buf, int w, int r, int tok) {
    return red + ((size_t(buf) * kWarps + w) * kTileRows + r) * kLmHeadRows + tok;
  };
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int ntiles = (W.out + kTileRows - 1) / kTileRows;
  const int mine = int(blockIdx.x) < ntiles ? (ntiles - 1 - int(blockIdx.x)) / int(gridDim.x) + 1 : 0;
  auto tile_of = [&](int j) { return int(blockIdx.x) + j * int(gridDim.x); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < kRowStages; ++s) bulk::mbar_init(&full[s]);
    bulk::fence_init();
  }
  __syncthreads();
  constexpr int kIssuer = kWarps - 1;
  if (warp == kIssuer)
    for (int s = 0; s < kRowStages - 1 && s < mine; ++s)
      issue_tile(&map, W, tile_of(s), base + s * L.stage, L, &full[s], lane);
  pdl_wait();
  pdl_launch_dependents();

  // Each row's x = bf16(h·rsqrt(Σss/in + eps)·w), as lm_head_kernel's norm.
  for (int tok = 0; tok < nt; ++tok) {
    const float* ss = a.x.ss + tok * R.ss;
    float part = 0.f;
    if (threadIdx.x < 256)
      for (int i = threadIdx.x; i < kNormParts; i += 256) part += ss[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if (lane == 0) nred[tok][warp] = part;
  }
  __syncthreads();
  for (int tok = 0; tok < nt; ++tok) {
    float tot = 0.f;
    for (int w = 0; w < kWarps; ++w) tot += nred[tok][w];
    const float scale = rsqrtf(tot / float(W.in) + a.x.eps);
    const float* h = a.x.h + tok * R.h;
    bf16* xn = a.x.xn_out && blockIdx.x == 0 ? a.x.xn_out + tok * R.xn : nullptr;
    for (int i = threadIdx.x; i < W.in; i += kThreads) {
      const bf16 v = __float2bfloat16(h[i] * scale * a.x.w[i]);
      xb[size_t(tok) * W.in + i] = v;
      if (xn) xn[i] = v;
    }
  }
  __syncthreads();
  // B fragments: lane (g, t) holds column g = row g's x; sx[j]: Σx of row g's group, then the
  // sums of the rows of this lane's two accumulator columns 2t and 2t+1.
  uint32_t bx[kMaxGroupsPerWarp][2][2][2];
  float sxa[kMaxGroupsPerWarp], sxb[kMaxGroupsPerWarp];
#pragma unroll
  for (int j = 0; j < kMaxGroupsPerWarp; ++j) {
    const int gi = warp + j * kWarps;
    sxa[j] = sxb[j] = 0.f;
    if (gi >= G) continue;
    float s = 0.f;
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      const uint4 v =
          g < nt
              ? *reinterpret_cast<const uint4*>(xb + size_t(g) * W.in + gi * kQuantGroup + (2 * t + wi) * 8)
              : make_uint4(0, 0, 0, 0);
      bx[j][wi][0][0] = __byte_perm(v.x, v.z, 0x5410);
      bx[j][wi][0][1] = __byte_perm(v.x, v.z, 0x7632);
      bx[j][wi][1][0] = __byte_perm(v.y, v.w, 0x5410);
      bx[j][wi][1][1] = __byte_perm(v.y, v.w, 0x7632);
      const uint32_t e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int m = 0; m < 4; ++m) s += __uint_as_float(e[m] << 16) + __uint_as_float(e[m] & 0xffff0000u);
    }
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    sxa[j] = __shfl_sync(0xffffffffu, s, 4 * (2 * t));
    sxb[j] = __shfl_sync(0xffffffffu, s, 4 * (2 * t + 1));
  }

  unsigned long long best[kLmHeadRows];
#pragma unroll
  for (int tok = 0; tok < kLmHeadRows; ++tok) best[tok] = 0;
  auto finish_tile = [&](int tile, int buf) {
    const int r = tile * kTileRows + lane;
#pragma unroll
    for (int tok = 0; tok < kLmHeadRows; ++tok) {
      if (tok >= nt) break;
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) v += *red_at(buf, w, lane, tok);
      if (r < W.out) {
        a.logits[int64_t(tok) * W.out + r] = v;
        if (r < R.limit[tok]) best[tok] = max_u64(best[tok], argmax_key(v, r));
      }
    }
  };

  for (int it = 0; it < mine; ++it) {
    bulk::mbar_wait(&full[it % kRowStages], (it / kRowStages) & 1);
    __syncthreads();
    if (warp == kIssuer) {
      const int nx = it + kRowStages - 1;
      if (nx < mine)
        issue_tile(&map, W, tile_of(nx), base + (nx % kRowStages) * L.stage, L, &full[nx % kRowStages], lane);
    }
    if (warp == 0 && it > 0) finish_tile(tile_of(it - 1), (it - 1) & 1);
    const uint8_t* st = base + (it % kRowStages) * L.stage;
    const bf16* ssm = reinterpret_cast<const bf16*>(st + L.sb);
    const bf16* bsm = ssm + kTileRows * G;
    constexpr int J = kMaxGroupsPerWarp;
    uint2 wv[2][J][2];
    float c[2][J][4];
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        c[sub][j][0] = c[sub][j][1] = c[sub][j][2] = c[sub][j][3] = 0.f;
        const int gi = warp + j * kWarps;
        if (gi >= G) continue;
        const int chunk = (((gi & 3) << 1) | (t >> 1)) ^ g;
        const uint8_t* p = st + (gi >> 2) * kSlabBytes + (sub * 16 + g) * kSlab + chunk * 16 + (t & 1) * 8;
        wv[sub][j][0] = *reinterpret_cast<const uint2*>(p);
        wv[sub][j][1] = *reinterpret_cast<const uint2*>(p + 8 * kSlab);
      }
#pragma unroll
    for (int wi = 0; wi < 2; ++wi)
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int j = 0; j < J; ++j) {
          if (warp + j * kWarps >= G) continue;
          mma_word(c[sub][j], wi ? wv[sub][j][0].y : wv[sub][j][0].x, wi ? wv[sub][j][1].y : wv[sub][j][1].x,
                   bx[j][wi]);
        }
#pragma unroll
    for (int sub = 0; sub < 2; ++sub) {
      const int ra = sub * 16 + g, rb = ra + 8;
      float ta0 = 0.f, ta1 = 0.f, tb0 = 0.f, tb1 = 0.f;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int gi = warp + j * kWarps;
        if (gi >= G) continue;
        const float sa = __bfloat162float(ssm[ra * G + gi]), ba = __bfloat162float(bsm[ra * G + gi]);
        const float sb = __bfloat162float(ssm[rb * G + gi]), bb = __bfloat162float(bsm[rb * G + gi]);
        ta0 += fmaf(sa, c[sub][j][0], (ba - 128.f * sa) * sxa[j]);
        ta1 += fmaf(sa, c[sub][j][1], (ba - 128.f * sa) * sxb[j]);
        tb0 += fmaf(sb, c[sub][j][2], (bb - 128.f * sb) * sxa[j]);
        tb1 += fmaf(sb, c[sub][j][3], (bb - 128.f * sb) * sxb[j]);
      }
      *red_at(it & 1, warp, ra, 2 * t) = ta0;
      *red_at(it & 1, warp, ra, 2 * t + 1) = ta1;
      *red_at(it & 1, warp, rb, 2 * t) = tb0;
      *red_at(it & 1, warp, rb, 2 * t + 1) = tb1;
    }
  }
  __syncthreads();
  if (warp == 0) {
    if (mine > 0) finish_tile(tile_of(mine - 1), (mine - 1) & 1);
#pragma unroll
    for (int tok = 0; tok < kLmHeadRows; ++tok) {
      if (tok >= nt) break;
      const unsigned long long b = warp_max(best[tok]);
      if (lane == 0) a.scratch[int64_t(tok) * gridDim.x + blockIdx.x] = b;
    }
  }
  if (!last_block_arrive(a.counter, gridDim.x, last)) return;
  for (int tok = 0; tok < nt; ++tok) {
    unsigned long long b = 0;
    for (int i = threadIdx.x; i < int(gridDim.x); i += kThreads)
      b = max_u64(b, __ldcg(a.scratch + int64_t(tok) * gridDim.x + i));
    b = warp_max(b);
    if (lane == 0) kred[warp] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 0; w < kWarps; ++w) b = max_u64(b, kred[w]);
      a.token[tok] = argmax_index(b);
      if (R.pos[tok]) *R.pos[tok] += 1;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *a.counter = 0;
}

}  // namespace

// The tensor map of W's codes as bytes [out][in / 2], boxes of 32 rows x 128 bytes, 128-byte
// swizzle, rows past the end read as zeros. Encoded on the host (driver entry point); the last
// one is kept, since one model has one lm_head.
static CUtensorMap codes_map(const DevLinear& W) {
  static struct {
    const void* q = nullptr;
    int out = 0, in = 0;
    CUtensorMap map{};
  } last;
  if (last.q == W.q && last.out == W.out && last.in == W.in) return last.map;
  const CUtensorMap map =
      byte_matrix_map(W.q, W.out, W.in / 2, kSlab, kTileRows, CU_TENSOR_MAP_SWIZZLE_128B, "lm_head_argmax");
  last.q = W.q;
  last.out = W.out;
  last.in = W.in;
  last.map = map;
  return map;
}

int lm_head_scratch() { return sm_count(); }

bool lm_head_argmax_supports(const DevLinear& W) {
  return W.fmt == WFormat::kAffine4 && W.in % (2 * kSlab) == 0 && W.in <= kFusedNormMaxDim;
}

void lm_head_argmax(const LmHeadArgs& a, cudaStream_t stream) {
  const DevLinear& W = a.W;
  W.check("lm_head_argmax");
  TANSY_CHECK(lm_head_argmax_supports(W),
              "lm_head_argmax: a {} weight with in = {} unsupported (4-bit, in a multiple of {} up to {})",
              wformat_name(W.fmt), W.in, 2 * kSlab, kFusedNormMaxDim);
  TANSY_CHECK(aligned16(W.scales) && aligned16(W.biases),
              "lm_head_argmax: scales and biases must be 16-byte aligned");
  TANSY_CHECK(a.x.h && a.x.ss && a.x.w, "lm_head_argmax: the norm input (h, ss, w) is missing");
  TANSY_CHECK(a.logits && a.token && a.scratch && a.counter,
              "lm_head_argmax: logits, token, scratch and counter are required");
  TANSY_CHECK(a.limit >= 1 && a.limit <= W.out, "lm_head_argmax: limit {} outside 1..{}", a.limit, W.out);
  const int grid = std::min<int>(ceil_div(W.out, kTileRows), lm_head_scratch());
  const size_t smem = smem_bytes(W.in);
  allow_smem<lm_head_kernel>(smem, "lm_head_argmax");
  pdl_launch(lm_head_kernel, dim3(grid), dim3(kThreads), smem, stream, codes_map(W), a);
}

void lm_head_argmax_rows(const LmHeadArgs& a, const LmHeadRows& rows, cudaStream_t stream) {
  const DevLinear& W = a.W;
  W.check("lm_head_argmax_rows");
  TANSY_CHECK(lm_head_argmax_supports(W) && aligned16(W.scales) && aligned16(W.biases),
              "lm_head_argmax_rows: a {} weight with in = {} unsupported", wformat_name(W.fmt), W.in);
  TANSY_CHECK(rows.n >= 1 && rows.n <= kLmHeadRows, "lm_head_argmax_rows: {} rows outside 1..{}", rows.n,
              kLmHeadRows);
  TANSY_CHECK(a.x.h && a.x.ss && a.x.w && a.logits && a.token && a.scratch && a.counter,
              "lm_head_argmax_rows: norm input, logits, token, scratch and counter are required");
  TANSY_CHECK(rows.n == 1 || (rows.h >= W.in && rows.ss >= kNormParts), "lm_head_argmax_rows: rows overlap");
  for (int t = 0; t < rows.n; ++t)
    TANSY_CHECK(rows.limit[t] >= 1 && rows.limit[t] <= W.out, "lm_head_argmax_rows: limit {} outside 1..{}",
                rows.limit[t], W.out);
  const int grid = std::min<int>(ceil_div(W.out, kTileRows), lm_head_scratch());
  const size_t smem = rows_smem_bytes(W.in);
  allow_smem<lm_head_rows_kernel>(smem, "lm_head_argmax_rows");
  pdl_launch(lm_head_rows_kernel, dim3(grid), dim3(kThreads), smem, stream, codes_map(W), a, rows);
}

}  // namespace tansy::cuda
