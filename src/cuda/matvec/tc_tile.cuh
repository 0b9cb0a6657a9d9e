// The tensor-core dot of a 16-row tile of a 2048-column 4-bit matrix with one token row, shared by
// the persistent decode step (step/step.cu: the in_proj of both mixers, the experts' gate|up) and
// the per-op decode kernels of the same products (matvec.cu's matvec_tc_kernel), so that both
// compute every row with the same arithmetic in the same order: the same bits.
//
// Why tensor cores: on CUDA cores a 4-bit weight costs ~4-5 instructions (shift, mask, bf16 halves
// to f32, FMA; docs/PERFORMANCE.md), and the decode products are bound by issue, not bytes. Here a
// code word becomes mma A fragments with one shift and one mask per nibble pair (tc::mma_word:
// nibbles k and k+4 as the exact bf16 pair 128+q), so x is packed in that k order as B fragments.
//
// Warp w takes quant groups 4w..4w+3 (256 columns) of all 16 rows. The mma accumulator restarts
// per group, so that the group's scale and bias apply in f32 as in chunk_dot:
// s·Σ(128+q)x + (b − 128s)·Σx. Every lane loads the token's B fragments (its B column is the
// token; the other columns' products are ignored). One lane adds a row's 8 warp partial sums in
// warp order (row_sum).
//
// The tile in shared memory (kTileBytes): row r's 1024 bytes of codes at r·kPitch — the 16 lanes of
// a half warp read 8 bytes at one column offset from 4 rows, which a 1056-byte pitch puts in 16
// different 8-byte bank pairs — then scales [16 rows][32 groups] and biases [16][32], bf16.
#pragma once
#include <cstdint>

#include "cuda/common/tensor_core.cuh"
#include "cuda/matvec/chunk.cuh"

namespace tansy::cuda::gemv::tc16 {

constexpr int kIn = 2048;                            // columns: the model's hidden size
constexpr int kRows = 16;                            // rows of a tile: mma m16
constexpr int kGroups = kIn / kQuantGroup;           // 32 quant groups a row
constexpr int kWarpGroups = kGroups / kWarps;        // 4 groups (256 columns) a warp
constexpr uint32_t kRowBytes = kIn / 2;              // 1024 bytes of codes a row
constexpr uint32_t kPitch = kRowBytes + 32;          // a row's codes in the tile
constexpr uint32_t kSc = kRows * kPitch;             // scales [16][32] bf16
constexpr uint32_t kBi = kSc + kRows * kGroups * 2;  // biases [16][32] bf16
constexpr uint32_t kTileBytes = kBi + kRows * kGroups * 2;
// x packed for the B fragments: 256 words of 8 columns [uint4: (x0,x4) (x1,x5) (x2,x6) (x3,x7)],
// then the 32 groups' Σx (f32).
constexpr uint32_t kPackBytes = kIn / 8 * 16 + kGroups * 4;
static_assert(kWarpGroups * kWarps == kGroups && kIn / 8 == kThreads);

// A warp's B fragments for its 4 groups, held for the whole product.
struct XFrag {
  uint4 b[kWarpGroups][2];  // [group][word of the lane's 8 bytes]: the 4 B registers of its 2 mma
  float sx[kWarpGroups];    // Σx of the group
};

// x, staged as f32 chunks (stage_norm / stage_rows<4> over kIn columns) in xs, packed into `pack`
// (kPackBytes of shared memory) by threads 0..255 (the caller syncs before reading it). The group
// sums are the two chunks' Σx added, so they are the chunks' own sums.
__device__ __forceinline__ void pack_x(const float* xs, uint8_t* pack) {
  constexpr int S = Chunk<4>::kStride;
  static_assert(kQuantGroup == 2 * Chunk<4>::kCols);
  uint4* pairs = reinterpret_cast<uint4*>(pack);
  float* gsum = reinterpret_cast<float*>(pack + kIn / 8 * 16);
  const int j = threadIdx.x;  // word j: columns 8j..8j+7 of chunk j/4
  if (j < kIn / 8) {
    const float* src = xs + (j / 4) * S + (j % 4) * 8;
    const float4 lo = *reinterpret_cast<const float4*>(src), hi = *reinterpret_cast<const float4*>(src + 4);
    pairs[j] = make_uint4(tc::pack_bf16(lo.x, hi.x), tc::pack_bf16(lo.y, hi.y), tc::pack_bf16(lo.z, hi.z),
                          tc::pack_bf16(lo.w, hi.w));
    if (j < kGroups) gsum[j] = xs[(2 * j) * S + Chunk<4>::kCols] + xs[(2 * j + 1) * S + Chunk<4>::kCols];
  }
}
// Warp w's B fragments of group 4w + q from a packed x (lane 4g + t: the word pair of its t).
__device__ __forceinline__ void load_b(const uint8_t* pack, int q, uint4 (&b)[2]) {
  const uint4* pairs = reinterpret_cast<const uint4*>(pack);
  const int gi = kWarpGroups * (threadIdx.x / 32) + q, t = threadIdx.x & 3;
  b[0] = pairs[8 * gi + 2 * t];
  b[1] = pairs[8 * gi + 2 * t + 1];
}
__device__ __forceinline__ float group_sum_x(const uint8_t* pack, int q) {
  return reinterpret_cast<const float*>(pack + kIn / 8 * 16)[kWarpGroups * (threadIdx.x / 32) + q];
}

// One token's fragments from its pack (pack_x, synced).
__device__ __forceinline__ void stage_x_frags(const uint8_t* pack, XFrag& X) {
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) {
    load_b(pack, q, X.b[q]);
    X.sx[q] = group_sum_x(pack, q);
  }
}
// One token: pack_x, then each warp's fragments into X.
template <typename Sync>
__device__ __forceinline__ void stage_x(const float* xs, uint8_t* pack, XFrag& X, Sync sync) {
  pack_x(xs, pack);
  sync();
  stage_x_frags(pack, X);
}

// The calling warp's mma over its 4 groups of a tile: c[q] = the group's Σ(128+q)x, rows g, g+8
// (lane 4g + t) by B columns 2t, 2t+1 (C layout), and the rows' scales and biases of each group.
struct TileGroups {
  float c[kWarpGroups][4];
  float sa[kWarpGroups], ba[kWarpGroups], sb[kWarpGroups], bb[kWarpGroups];
};
// Four bf16 at p (8-byte aligned) as f32, in order.
__device__ __forceinline__ void bf16_quad(const uint8_t* p, float (&f)[kWarpGroups]) {
  static_assert(kWarpGroups == 4);
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  f[0] = bf_lo(v.x);
  f[1] = bf_hi(v.x);
  f[2] = bf_lo(v.y);
  f[3] = bf_hi(v.y);
}
static_assert(kSc % 8 == 0 && kBi % 8 == 0 && (kGroups * 2) % 8 == 0);

__device__ __forceinline__ void tile_groups(const uint8_t* tile, const uint4 (&b)[kWarpGroups][2],
                                            TileGroups& T) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  uint2 wa[kWarpGroups], wb[kWarpGroups];
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) {
    const int gi = kWarpGroups * warp + q;
    wa[q] = *reinterpret_cast<const uint2*>(tile + g * kPitch + 32 * gi + 8 * t);
    wb[q] = *reinterpret_cast<const uint2*>(tile + (g + 8) * kPitch + 32 * gi + 8 * t);
  }
  // the warp's 4 groups' scales and biases of rows g and g+8: 4 bf16 side by side, one 8-byte load each
  const int gw = kWarpGroups * warp * 2;
  bf16_quad(tile + kSc + g * kGroups * 2 + gw, T.sa);
  bf16_quad(tile + kBi + g * kGroups * 2 + gw, T.ba);
  bf16_quad(tile + kSc + (g + 8) * kGroups * 2 + gw, T.sb);
  bf16_quad(tile + kBi + (g + 8) * kGroups * 2 + gw, T.bb);
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) T.c[q][0] = T.c[q][1] = T.c[q][2] = T.c[q][3] = 0.f;
#pragma unroll
  for (int wi = 0; wi < 2; ++wi)
#pragma unroll
    for (int q = 0; q < kWarpGroups; ++q)
      tc::mma_word(T.c[q], wi ? wa[q].y : wa[q].x, wi ? wb[q].y : wb[q].x, b[q][wi]);
}
// A row's fold over the warp's groups: Σ_q s·c + (b − 128s)·Σx, in group order. Explicit fmaf
// throughout: the step and the per-op kernels must not differ by a contraction.
__device__ __forceinline__ float fold(const float (&s)[kWarpGroups], const float (&b)[kWarpGroups],
                                      const float (&c)[kWarpGroups], const float (&sx)[kWarpGroups]) {
  float y = 0.f;
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) y += fmaf(s[q], c[q], fmaf(-128.f, s[q], b[q]) * sx[q]);
  return y;
}

// The calling warp's partial sums of the tile's 16 rows over its 4 groups, into part[warp][row]
// (lane 4g holds rows g and g+8: B's column 0). Every read of the tile is done when it returns.
__device__ __forceinline__ void tile_partials(const uint8_t* tile, const XFrag& X, float (*part)[kRows]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  TileGroups T;
  tile_groups(tile, X.b, T);
  float c0[kWarpGroups], c2[kWarpGroups];
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) c0[q] = T.c[q][0], c2[q] = T.c[q][2];
  if (t == 0) {
    part[warp][g] = fold(T.sa, T.ba, c0, X.sx);
    part[warp][g + 8] = fold(T.sb, T.bb, c2, X.sx);
  }
}

// Row r's dot product: the 8 warps' partial sums in warp order.
__device__ __forceinline__ float row_sum(const float (*part)[kRows], int r) {
  float y = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) y += part[w][r];
  return y;
}

// ---- up to 8 tokens at once, as the mma's 8 columns (the batched decode step) ----
//
// Column j of an mma's result is A times B's column j alone, so a token's value here is the one
// it gets as the only token (where every column holds it): the same fragments, the same mma
// chain, the same fold with its own Σx. A batch's rows are therefore bit for bit the rows alone
// (batch invariance), while the tile's codes are dequantized once for all 8 tokens.
constexpr int kCols = 8;

struct XFrag8 {
  uint4 b[kWarpGroups][2];   // token g's fragments (lane 4g + t)
  float sx[kWarpGroups][2];  // Σx of tokens 2t and 2t+1 (the C columns of lane 4g + t)
};

// packs: kCols packed tokens kPackBytes apart (pack_x each, synced); tokens past `n` read token 0.
__device__ __forceinline__ void load_x8(const uint8_t* packs, int n, XFrag8& X) {
  const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const uint8_t* mine = packs + (g < n ? g : 0) * kPackBytes;
  const uint8_t* c0 = packs + (2 * t < n ? 2 * t : 0) * kPackBytes;
  const uint8_t* c1 = packs + (2 * t + 1 < n ? 2 * t + 1 : 0) * kPackBytes;
#pragma unroll
  for (int q = 0; q < kWarpGroups; ++q) {
    load_b(mine, q, X.b[q]);
    X.sx[q][0] = group_sum_x(c0, q);
    X.sx[q][1] = group_sum_x(c1, q);
  }
}

// tile_partials for 8 tokens: part[warp][token][row].
__device__ __forceinline__ void tile_partials8(const uint8_t* tile, const XFrag8& X,
                                               float (*part)[kCols][kRows]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  TileGroups T;
  tile_groups(tile, X.b, T);
#pragma unroll
  for (int col = 0; col < 2; ++col) {  // tokens 2t + col: C registers col (row g) and 2 + col (row g+8)
    float ca[kWarpGroups], cb[kWarpGroups], sx[kWarpGroups];
#pragma unroll
    for (int q = 0; q < kWarpGroups; ++q) ca[q] = T.c[q][col], cb[q] = T.c[q][2 + col], sx[q] = X.sx[q][col];
    part[warp][2 * t + col][g] = fold(T.sa, T.ba, ca, sx);
    part[warp][2 * t + col][g + 8] = fold(T.sb, T.bb, cb, sx);
  }
}

__device__ __forceinline__ float row_sum8(const float (*part)[kCols][kRows], int j, int r) {
  float y = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) y += part[w][j][r];
  return y;
}

}  // namespace tansy::cuda::gemv::tc16
