// Causal GQA flash attention for prefill on Hopper's warpgroup tensor cores (wgmma), head_dim 256:
// the same arguments and results as the mma.sync kernel (prefill.cu), in the FlashAttention-3 shape.
//
// Rows: as in prefill.cu, a block owns 128 query rows of one KV head flattened as (position, head
// within the group), row r -> position r / G, head kvh*G + r % G, so one K/V tile serves all G
// query heads and the block spans 128/G positions (16 on the real model: a nearly flat causal
// frontier). Blocks run longest rows first over both KV heads (one linear grid).
//
// Warp roles (384 threads, one block per SM): warps 0-7 are two consumer warpgroups of 64 rows
// each; warpgroup 2 is the producer, whose first lane issues every tensor copy (TMA). setmaxnreg
// moves registers from the producer (24) to the consumers (240): their 128 f32 output
// accumulators + BN/2 score accumulators + BN/4 P registers do not fit the 168 of an even split.
//
// Shared memory (1024-aligned; every tile stored as 128-byte rows of 64 bf16 in the 128-byte
// swizzle that TMA writes and wgmma reads, 16-byte chunk c of row r at c ^ (r % 8)):
//   Q  [4 d-blocks][128 rows][64 d]            64 KB, loaded once
//   K  [2 stages][4 d-blocks][BN keys][64 d]   2 x BN/2 KB
//   V  [2 stages][4 d-blocks][BN keys][64 d]   2 x BN/2 KB
// + mbarriers. BN (keys per tile) is 80 by default, as FlashAttention-3 picks for head_dim 256:
// the S accumulators (64 x BN per warpgroup = 40 registers) fit beside the 128 of O and the 20 of
// P under 240, and Q + two stages of K and V fill 224 of the 227 KB (230,528 bytes); fewer tiles
// than BN = 64 (also built, 197,760 bytes) means fewer per-tile costs (the O rescale, the waits).
// Two stages is what the shared memory holds either way.
//
// Per tile j, each consumer warpgroup (FlashAttention-3's intra-warpgroup overlap): issue
// S_j = Q·K_jᵀ as 16 wgmma m64nBNk16 (both operands from shared memory, K-major); while it runs,
// scale O to tile j-1's row max and issue O += P_{j-1}·V_{j-1} as BN/16 wgmma m64n256k16 with P
// from registers (the S accumulators rounded to bf16 are exactly the A fragments) and V read
// N-major (transposed) from the same swizzled rows; wait for S_j only and softmax it (mask on
// the diagonal tiles, f32 online max/sum, exp2) while P_{j-1}·V_{j-1} still runs; wait for that
// and form P_j. With ping-pong (default) the two warpgroups take turns issuing (named barriers),
// so one's softmax overlaps the other's products. K_j is handed back to the producer as soon as
// S_j is done, V_{j-1} after its product. Stage handover on mbarriers: full (the producer's
// expect_tx + the copies' bytes), empty (one arrival per consumer warp, 8).
//
// The key range is not split: one block per 128 rows, so fewer than 132 blocks (prompts under
// 1,056 tokens at 8 heads per KV head, 2 KV heads) leave multiprocessors idle however long the
// cache before them is, as with the mma.sync kernel.
//
// Out-of-range rows come from the tensor maps' bounds: Q positions >= n and keys >= p0 + n are
// zero-filled by the copies, so nothing past the cache's written rows is ever read.
#include <cmath>

#include "core/error.h"
#include "cuda/attention/attention.cuh"
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/common/tensor_map.cuh"
#include "cuda/gemm/wgmma.cuh"

namespace tansy::cuda {
namespace {

constexpr int D = kHeadDim;       // 256
constexpr int BM = 128;           // query rows per block
constexpr int kStages = 2;        // K and V stages each
constexpr int kDBlocks = D / 64;  // 128-byte row slabs per 256-wide row
constexpr int kConsumerWarps = BM / 16;
constexpr int kThreads = (kConsumerWarps + 4) * 32;  // + the producer warpgroup
constexpr int kQSlab = BM * 128;                     // one d-block of Q (16 KB)
constexpr int kQBytes = kDBlocks * kQSlab;           // 64 KB
static_assert(kQSlab % 1024 == 0, "swizzle atoms are 1024-byte aligned");

// Keys per tile BN (64 or 80, a multiple of 16 and of the 8-row swizzle atom).
template <int BN>
struct Cfg {
  static constexpr int kKVSlab = BN * 128;                    // one d-block of a K or V tile
  static constexpr int kKVBytes = kDBlocks * kKVSlab;         // a K or V stage
  static constexpr int kOffK = kQBytes;                       // K stages
  static constexpr int kOffV = kOffK + kStages * kKVBytes;    // V stages
  static constexpr int kOffBar = kOffV + kStages * kKVBytes;  // barriers
  static constexpr int kSmem = kOffBar + 128 + 1024;          // + the in-kernel 1024-byte alignment
  static_assert(BN % 16 == 0 && kKVSlab % 1024 == 0, "swizzle atoms are 1024-byte aligned");
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
};

using wg::desc_sw128_lbo;
using wg::fence_regs;
using wg::wgmma_commit;
using wg::wgmma_rs_n256;
using wg::wgmma_ss;

__device__ __forceinline__ void tensor_copy_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, "
      "%4}], [%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(tc::smem_addr(bar))
      : "memory");
}

// Registers are split per warpgroup (setmaxnreg): the producer's are handed to the consumers,
// 24·128 + 2·240·128 = 64,512 of the SM's 65,536.
constexpr int kProducerRegs = 24, kConsumerRegs = 240;

// S = Q·Kᵀ for one warpgroup: Q's 64 rows at q_addr in d-blocks kQSlab apart, K's BN rows at k_addr
// in d-blocks Cfg<BN>::kKVSlab apart; d-step kk reads 32 bytes at 32·(kk % 4) into the rows of
// d-block kk / 4. Overwrites s.
template <int BN>
__device__ __forceinline__ void issue_s(float (&s)[BN / 2], uint32_t q_addr, uint32_t k_addr) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint32_t off = uint32_t((kk % 4) * 32);
    wgmma_ss<BN>(s, desc_sw128_lbo(q_addr + uint32_t((kk / 4) * kQSlab) + off, 16),
                 desc_sw128_lbo(k_addr + uint32_t((kk / 4) * Cfg<BN>::kKVSlab) + off, 16), kk > 0);
  }
}
// O += P·V: key step kc is rows 16·kc .. 16·kc+15 of every d-block (two 8-row groups, 2048 bytes
// in); the 4 d-blocks of 64 columns are Cfg<BN>::kKVSlab apart (the leading byte offset).
template <int BN>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const uint32_t (&p)[BN / 16][4],
                                         uint32_t v_addr) {
#pragma unroll
  for (int kc = 0; kc < BN / 16; ++kc)
    wgmma_rs_n256<1>(o, p[kc], desc_sw128_lbo(v_addr + uint32_t(kc * 16 * 128), Cfg<BN>::kKVSlab));
}
// P for keys 16·kc ..: rows g / g+8, keys 2c, 2c+1 and 2c+8, 2c+9 (mma.m16n8k16's A fragment),
// from the S accumulators.
template <int BN>
__device__ __forceinline__ void make_p(uint32_t (&p)[BN / 16][4], const float (&s)[BN / 2]) {
#pragma unroll
  for (int kc = 0; kc < BN / 16; ++kc) {
    p[kc][0] = tc::pack_bf16(s[8 * kc + 0], s[8 * kc + 1]);
    p[kc][1] = tc::pack_bf16(s[8 * kc + 2], s[8 * kc + 3]);
    p[kc][2] = tc::pack_bf16(s[8 * kc + 4], s[8 * kc + 5]);
    p[kc][3] = tc::pack_bf16(s[8 * kc + 6], s[8 * kc + 7]);
  }
}
// Named barriers 1 and 2 (0 is __syncthreads) order the two consumer warpgroups' wgmma issues:
// warpgroup w waits on barrier 1 + w (its own 128 threads + the other's 128 arrivals).
template <int kId>
__device__ __forceinline__ void named_sync() {
  asm volatile("bar.sync %0, 256;\n" ::"n"(kId) : "memory");
}
template <int kId>
__device__ __forceinline__ void named_arrive() {
  asm volatile("bar.arrive %0, 256;\n" ::"n"(kId) : "memory");
}

struct Barriers {
  uint64_t q, k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
};

template <int BN, bool kPingPong>
__global__ void __launch_bounds__(kThreads, 1)
    attention_prefill_wgmma_kernel(const __grid_constant__ CUtensorMap q_map,
                                   const __grid_constant__ CUtensorMap k_map,
                                   const __grid_constant__ CUtensorMap v_map, const AttnPrefillArgs a, int G,
                                   int row_tiles) {
  using C = Cfg<BN>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  unsigned char* const smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t base = tc::smem_addr(smem);
  Barriers* const bar = reinterpret_cast<Barriers*>(smem + C::kOffBar);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  // Longest rows first, the KV heads interleaved.
  const int tile = row_tiles - 1 - int(blockIdx.x) / a.n_kv;
  const int kvh = int(blockIdx.x) % a.n_kv;
  const int row0 = tile * BM;  // a multiple of G (G divides 128)
  const int n_rows = a.n * G;
  const int pos_lo = row0 / G;
  const int pos_hi = min(a.n - 1, (row0 + BM - 1) / G);
  const int n_tiles = (a.p0 + pos_hi) / BN + 1;  // tiles holding keys 0 .. p0+pos_hi

  if (tid == 0) {
    bulk::mbar_init(&bar->q);
    for (int s = 0; s < kStages; ++s) {
      bulk::mbar_init(&bar->k_full[s]);
      bulk::mbar_init(&bar->v_full[s]);
      bulk::mbar_init_count(&bar->k_empty[s], kConsumerWarps);
      bulk::mbar_init_count(&bar->v_empty[s], kConsumerWarps);
    }
    bulk::fence_init();
  }
  __syncthreads();

  if (warp >= kConsumerWarps) {
    tc::setmaxnreg_dec<kProducerRegs>();
    // Producer. Tile j goes to stage j % 2 once the consumers handed back tile j - 2 (the empty
    // barrier's phase (j/2 - 1)); rows past the tensor maps' ends arrive as zeros, still counted.
    if (warp == kConsumerWarps && lane == 0) {
      bulk::mbar_expect_tx(&bar->q, kQBytes);
      for (int db = 0; db < kDBlocks; ++db)
        tensor_copy_3d(base + db * kQSlab, &q_map, db * 64, kvh * G, pos_lo, &bar->q);
      for (int j = 0; j < n_tiles; ++j) {
        const int s = j % kStages;
        const unsigned parity = unsigned(j / kStages - 1) & 1;
        if (j >= kStages) bulk::mbar_wait(&bar->k_empty[s], parity);
        bulk::mbar_expect_tx(&bar->k_full[s], C::kKVBytes);
        for (int db = 0; db < kDBlocks; ++db)
          tensor_copy_3d(base + C::kOffK + s * C::kKVBytes + db * C::kKVSlab, &k_map, db * 64, kvh, j * BN,
                         &bar->k_full[s]);
        if (j >= kStages) bulk::mbar_wait(&bar->v_empty[s], parity);
        bulk::mbar_expect_tx(&bar->v_full[s], C::kKVBytes);
        for (int db = 0; db < kDBlocks; ++db)
          tensor_copy_3d(base + C::kOffV + s * C::kKVBytes + db * C::kKVSlab, &v_map, db * 64, kvh, j * BN,
                         &bar->v_full[s]);
      }
    }
    return;
  }

  // Consumers. Warpgroup wg owns tile rows 64·wg .. 64·wg+63; this thread rows g and g+8 of its
  // warp's 16 (wgmma accumulator layout: element i at row 16·w + g + 8·((i >> 1) & 1), column
  // 8·(i >> 2) + 2·c + (i & 1)).
  tc::setmaxnreg_inc<kConsumerRegs>();
  const int wg = warp / 4, w = warp % 4, g = lane / 4, c = lane % 4;
  int qpos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + wg * 64 + w * 16 + g + h * 8;
    qpos[h] = a.p0 + (row < n_rows ? row / G : a.n - 1);
  }
  const int qpos_min = a.p0 + min(a.n - 1, (row0 + wg * 64) / G);  // the warpgroup's first position
  const uint32_t q_addr = base + uint32_t(wg * 64 * 128);

  const float sl2 = 1.4426950408889634f / 16.f;  // log2(e)/sqrt(256): scores go straight into exp2
  float o[D / 2];                                // 64 x 256 per warpgroup
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float s[BN / 2];  // 64 x BN scores per warpgroup
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  uint32_t p[BN / 16][4];  // P as A fragments, one per 16 keys
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  // Masks S_j (tiles reaching past the warpgroup's first position; keys >= p0 + n lie past every
  // query position, so this masks them too), updates the running max and sum, and leaves
  // exp(S - max) in s; returns the factor the earlier output must be scaled by, per row.
  auto softmax = [&](int j, float(&alpha)[2]) {
    if (j * BN + BN - 1 > qpos_min) {
#pragma unroll
      for (int i = 0; i < BN / 2; ++i)
        if (j * BN + 8 * (i >> 2) + 2 * c + (i & 1) > qpos[(i >> 1) & 1]) s[i] = -INFINITY;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < BN / 8; ++b) mx = fmaxf(mx, fmaxf(s[4 * b + 2 * h], s[4 * b + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      // Key 0 is in tile 0 and visible to every row, so m_new is finite; the guard keeps a row
      // without a visible key at zero weights instead of NaN.
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = exp2f((m[h] - m_use) * sl2);
      m[h] = m_new;
      const float mb = m_use * sl2;
      float sum = 0.f;
#pragma unroll
      for (int b = 0; b < BN / 8; ++b) {
        s[4 * b + 2 * h] = exp2f(fmaf(s[4 * b + 2 * h], sl2, -mb));
        s[4 * b + 2 * h + 1] = exp2f(fmaf(s[4 * b + 2 * h + 1], sl2, -mb));
        sum += s[4 * b + 2 * h] + s[4 * b + 2 * h + 1];
      }
      l[h] = l[h] * alpha[h] + sum;  // per-thread partial; the quad's partials are summed at the end
    }
  };
  auto rescale = [&](const float(&f)[2]) {
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] *= f[(i >> 1) & 1];
  };
  auto release = [&](uint64_t* b) {
    if (lane == 0) bulk::mbar_arrive(b);
  };

  bulk::mbar_wait(&bar->q, 0);
  bulk::mbar_wait(&bar->k_full[0], 0);
  fence_regs(s);
  wg::wgmma_arrive();
  issue_s<BN>(s, q_addr, base + C::kOffK);
  wgmma_commit();
  wg::wgmma_wait0();
  fence_regs(s);
  release(&bar->k_empty[0]);
  float alpha[2];  // the factor O is scaled by before the next P·V (tile 0's: O is zero anyway)
  softmax(0, alpha);
  make_p<BN>(p, s);

  // Ping-pong (kPingPong): the warpgroups take turns issuing a tile's products, so that one's
  // softmax runs while the other's products hold the tensor cores. Warpgroup 1 lets 0 go first;
  // each turn passes the other its next one; warpgroup 0 takes the last pass after the loop, so
  // every barrier phase completes.
  if (kPingPong && wg == 1) named_arrive<1>();
  for (int j = 1; j < n_tiles; ++j) {
    const int st = j % kStages, sp = (j - 1) % kStages;
    bulk::mbar_wait(&bar->k_full[st], unsigned(j / kStages) & 1);
    bulk::mbar_wait(&bar->v_full[sp], unsigned((j - 1) / kStages) & 1);
    if (kPingPong) {
      if (wg == 0)
        named_sync<1>();
      else
        named_sync<2>();
    }
    wg::wgmma_arrive();
    issue_s<BN>(s, q_addr, base + C::kOffK + uint32_t(st * C::kKVBytes));
    wgmma_commit();
    // While S_j runs: O (up to tile j-2, at max m_{j-2}) to the max of tile j-1, then += P_{j-1}·V_{j-1}.
    rescale(alpha);
    fence_regs(o);
    wg::wgmma_arrive();
    issue_pv<BN>(o, p, base + C::kOffV + uint32_t(sp * C::kKVBytes));
    wgmma_commit();
    if (kPingPong) {
      if (wg == 0)
        named_arrive<2>();
      else
        named_arrive<1>();
    }
    wg::wgmma_wait1();  // S_j done; P_{j-1}·V_{j-1} may still run
    fence_regs(s);
    release(&bar->k_empty[st]);
    softmax(j, alpha);
    wg::wgmma_wait0();
    fence_regs(o);
    fence_regs(p);
    release(&bar->v_empty[sp]);
    make_p<BN>(p, s);
  }
  if (kPingPong && wg == 0) named_sync<1>();
  {
    const int sp = (n_tiles - 1) % kStages;
    bulk::mbar_wait(&bar->v_full[sp], unsigned((n_tiles - 1) / kStages) & 1);
    rescale(alpha);
    fence_regs(o);
    wg::wgmma_arrive();
    issue_pv<BN>(o, p, base + C::kOffV + uint32_t(sp * C::kKVBytes));
    wgmma_commit();
    wg::wgmma_wait0();
    fence_regs(o);
    fence_regs(p);
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row0 + wg * 64 + w * 16 + g + h * 8;
    if (row >= n_rows) continue;
    const int pos = row / G, head = kvh * G + row % G;
    const float inv = 1.f / sum;
    __nv_bfloat16* out = a.out + int64_t(pos) * a.out_stride_t + int64_t(head) * a.out_stride_h;
    const __nv_bfloat16* gate =
        a.gate ? a.gate + int64_t(pos) * a.gate_stride_t + int64_t(head) * a.gate_stride_h : nullptr;
#pragma unroll
    for (int b = 0; b < D / 8; ++b) {
      const int col = 8 * b + 2 * c;
      float v0 = o[4 * b + 2 * h] * inv, v1 = o[4 * b + 2 * h + 1] * inv;
      if (gate) {
        const float2 gv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + col));
        v0 /= 1.f + __expf(-gv.x);
        v1 /= 1.f + __expf(-gv.y);
      }
      *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(v0, v1);
    }
  }
}

// The building blocks alone, for tests: tile 0 of kv head 0 (the first 128 rows of Q, keys 0 ..
// BN-1) through the kernel's tensor maps, shared layout and wgmma calls, each warpgroup on its
// own 64 rows: S = Q·Kᵀ written raw, then O = P·V with P read from global memory.
template <int BN>
__global__ void __launch_bounds__(256, 1)
    attention_wgmma_probe_kernel(const __grid_constant__ CUtensorMap q_map,
                                 const __grid_constant__ CUtensorMap k_map,
                                 const __grid_constant__ CUtensorMap v_map, const __nv_bfloat16* p_in,
                                 float* s_out, float* o_out) {
  using C = Cfg<BN>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  unsigned char* const smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t base = tc::smem_addr(smem);
  uint64_t* const bar = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) {
    bulk::mbar_init(bar);
    bulk::fence_init();
  }
  __syncthreads();
  if (tid == 0) {
    bulk::mbar_expect_tx(bar, kQBytes + 2 * C::kKVBytes);
    for (int db = 0; db < kDBlocks; ++db) {
      tensor_copy_3d(base + db * kQSlab, &q_map, db * 64, 0, 0, bar);
      tensor_copy_3d(base + C::kOffK + db * C::kKVSlab, &k_map, db * 64, 0, 0, bar);
      tensor_copy_3d(base + C::kOffV + db * C::kKVSlab, &v_map, db * 64, 0, 0, bar);
    }
  }
  bulk::mbar_wait(bar, 0);
  const int wg = warp / 4, w = warp % 4, g = lane / 4, c = lane % 4;
  auto row_of = [&](int i) { return wg * 64 + w * 16 + g + 8 * ((i >> 1) & 1); };
  auto col_of = [&](int i) { return 8 * (i >> 2) + 2 * c + (i & 1); };
  float s[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
  fence_regs(s);
  wg::wgmma_arrive();
  issue_s<BN>(s, base + uint32_t(wg * 64 * 128), base + C::kOffK);
  wgmma_commit();
  wg::wgmma_wait0();
  fence_regs(s);
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s_out[row_of(i) * BN + col_of(i)] = s[i];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = __bfloat162float(p_in[row_of(i) * BN + col_of(i)]);
  uint32_t p[BN / 16][4];
  make_p<BN>(p, s);
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  fence_regs(o);
  fence_regs(p);
  wg::wgmma_arrive();
  issue_pv<BN>(o, p, base + C::kOffV);
  wgmma_commit();
  wg::wgmma_wait0();
  fence_regs(o);
  fence_regs(p);
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o_out[row_of(i) * D + col_of(i)] = o[i];
}

// A bf16 tensor [dim2][dim1][256] with the given byte strides, read in boxes of 64 x box1 x box2
// with the 128-byte swizzle; coordinates past the dims read as zeros.
CUtensorMap bf16_map(const void* ptr, int dim1, int dim2, int64_t stride1_bytes, int64_t stride2_bytes,
                     int box1, int box2, const char* what) {
  const cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(dim1), cuuint64_t(dim2)};
  const cuuint64_t strides[2] = {cuuint64_t(stride1_bytes), cuuint64_t(stride2_bytes)};
  const cuuint32_t box[3] = {64, cuuint32_t(box1), cuuint32_t(box2)}, estrides[3] = {1, 1, 1};
  CUtensorMap map{};
  const CUresult r =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(ptr), dims, strides,
                           box, estrides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    fail("attention_prefill (wgmma): cuTensorMapEncodeTiled of {} failed ({})", what, int(r));
  return map;
}

}  // namespace

bool attention_prefill_wgmma_supports(const AttnPrefillArgs& a) {
  const int G = a.n_kv >= 1 ? a.n_heads / a.n_kv : 0;
  return G >= 1 && a.n_heads == G * a.n_kv && BM % G == 0;
}

namespace {

struct Maps {
  CUtensorMap q, k, v;
};
template <int BN>
Maps make_maps(const AttnPrefillArgs& a, int G) {
  const int kv_len = a.p0 + a.n;
  const int64_t kv_row_bytes = int64_t(a.n_kv) * D * 2;
  return {bf16_map(a.q, a.n_heads, a.n, a.q_stride_h * 2, a.q_stride_t * 2, G, BM / G, "q"),
          bf16_map(a.k_cache, a.n_kv, kv_len, D * 2, kv_row_bytes, 1, BN, "k_cache"),
          bf16_map(a.v_cache, a.n_kv, kv_len, D * 2, kv_row_bytes, 1, BN, "v_cache")};
}

template <int BN>
void probe(const AttnPrefillArgs& a, const __nv_bfloat16* p, float* s_out, float* o_out,
           cudaStream_t stream) {
  using C = Cfg<BN>;
  const Maps m = make_maps<BN>(a, a.n_heads / a.n_kv);
  static const bool attr_set =
      cudaFuncSetAttribute(attention_wgmma_probe_kernel<BN>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           C::kSmem) == cudaSuccess;
  TANSY_CHECK(attr_set, "attention_prefill_wgmma_probe: cannot reserve {} bytes of shared memory", C::kSmem);
  attention_wgmma_probe_kernel<BN><<<1, 256, C::kSmem, stream>>>(m.q, m.k, m.v, p, s_out, o_out);
  launch_check("attention_prefill_wgmma_probe");
}

template <int BN, bool kPingPong>
void launch(const AttnPrefillArgs& a, int G, int64_t row_tiles, cudaStream_t stream) {
  using C = Cfg<BN>;
  const Maps m = make_maps<BN>(a, G);
  static const bool attr_set =
      cudaFuncSetAttribute(attention_prefill_wgmma_kernel<BN, kPingPong>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem) == cudaSuccess;
  TANSY_CHECK(attr_set, "attention_prefill (wgmma): cannot reserve {} bytes of shared memory per block",
              C::kSmem);
  attention_prefill_wgmma_kernel<BN, kPingPong>
      <<<unsigned(row_tiles * a.n_kv), kThreads, C::kSmem, stream>>>(m.q, m.k, m.v, a, G, int(row_tiles));
  launch_check("attention_prefill (wgmma)");
}

int g_keys_per_tile = 80;
// Off by default: with 80 keys per tile the two consumer warpgroups issuing freely measured
// faster than taking turns (H200, Attention.PrefillTiming: 12.9 vs 13.7 ms at 32K, 203 vs 219 ms
// at 128K tokens).
bool g_pingpong = false;

}  // namespace

void attention_prefill_wgmma_set_tile(int keys) {
  TANSY_CHECK(keys == 64 || keys == 80, "attention_prefill (wgmma): {} keys per tile is not built (64, 80)",
              keys);
  g_keys_per_tile = keys;
}
int attention_prefill_wgmma_tile() { return g_keys_per_tile; }
void attention_prefill_wgmma_set_pingpong(bool on) { g_pingpong = on; }
bool attention_prefill_wgmma_pingpong() { return g_pingpong; }

void attention_prefill_wgmma_probe(const AttnPrefillArgs& a, const __nv_bfloat16* p, float* s_out,
                                   float* o_out, cudaStream_t stream) {
  attention_prefill_check(a);
  TANSY_CHECK(attention_prefill_wgmma_supports(a), "attention_prefill_wgmma_probe: unsupported group");
  if (g_keys_per_tile == 64)
    probe<64>(a, p, s_out, o_out, stream);
  else
    probe<80>(a, p, s_out, o_out, stream);
}

void attention_prefill_wgmma(const AttnPrefillArgs& a, cudaStream_t stream) {
  attention_prefill_check(a);
  TANSY_CHECK(attention_prefill_wgmma_supports(a),
              "attention_prefill (wgmma): {} query heads per kv head unsupported (a divisor of {})",
              a.n_heads / a.n_kv, BM);
  const int G = a.n_heads / a.n_kv;
  const int64_t row_tiles = (int64_t(a.n) * G + BM - 1) / BM;
  TANSY_CHECK(row_tiles * a.n_kv < (int64_t(1) << 31), "attention_prefill (wgmma): grid too large");
  if (g_keys_per_tile == 64)
    g_pingpong ? launch<64, true>(a, G, row_tiles, stream) : launch<64, false>(a, G, row_tiles, stream);
  else
    g_pingpong ? launch<80, true>(a, G, row_tiles, stream) : launch<80, false>(a, G, row_tiles, stream);
}

}  // namespace tansy::cuda
