// Prefill GEMM with fused affine dequant, grouped MoE variant.
//
// Tile: BM rows x BN outputs per block, BN = 32 x warps (8 warps: 256 columns, 4 warps: 128 for
// launches too small to fill the machine, and for every 16-row tile); every warp owns a BM x 32
// output tile over all BM rows, so each weight column is dequantized by exactly one warp. BM is 64,
// or 16 for the grouped products of short prompts (kGroupedSmallBM: a few rows an expert, 4-bit
// weights with staged scales). k-tile 64 = one quant group: one (scale, bias) per weight row per
// k-tile. 4 cp.async stages of the X tile and of the weight tile in its packed form; one barrier
// per k-tile. The mma computes the transposed product: the weights are its A operand (m16 = 16
// output columns), X its B operand (n8 = 8 rows of X).
//
// The weights never go through a dequantized shared tile. Each lane reads its packed codes from the
// stage and dequantizes them straight into mma A fragments. That works because a dot product does
// not care about the order of k as long as A and B agree: in a 64-wide k-tile, lane (g, t) (g =
// lane/4, t = lane%4) takes the 8-element chunks j = 2t and 2t+1 (physical k 8j..8j+7) for its two
// k32 halves c = 0, 1, and inside a chunk the mma pair (s = 0, 1) of that half sees
//   logical k {2t, 2t+1}   (a0/a1, b0) = physical 8j + 4s + {0, 1}
//   logical k {2t+8, 2t+9} (a2/a3, b1) = physical 8j + 4s + {2, 3}.
// So one packed word (4-bit) or two (8-bit) or one 16-byte chunk (bf16) of weight row g (and of row
// g+8) holds the lane's A values of both mmas, and one 16-byte load of X row g at chunk j holds
// (b0, b1) of both, already in consecutive registers: a lane reads exactly the codes it
// dequantizes, with no redundancy, no ldmatrix, no register moves and no second barrier.
// Shared-memory reads are conflict-free: X and bf16 weight rows use the XOR swizzle (chunk ^ row%8;
// the 8 lanes of a 16-byte load phase are rows 2q, 2q+1 whose chunk sets then differ in parity),
// packed rows are 32 (4-bit) or 64 (8-bit) contiguous bytes read as 8 / 16 bytes per lane. The
// accumulators (output columns by X rows) go through an f32 tile in the freed stage memory, so the
// epilogue writes whole output rows.
//
// The (scale, bias) pairs of the affine formats go through shared memory too when a row's groups
// come in whole 16-byte runs (groups % 8 == 0, every product of the model): 8 groups of the block's
// rows are copied with the stage of the k-tile that starts them, into one of two buffers. Loaded
// into registers one k-tile ahead instead (the path of narrow test shapes), each k-tile waited on a
// global load: with a few rows per expert a k-tile's products take far less than that load, so a
// short prompt's experts ran at the load's latency (1.4 TB/s at 256 tokens, H100, 2026-12-07).
//
// The 16-row tiles take their weights by 2-D tensor copies (TMA: one instruction a stage for the
// block's 128 rows x 32 bytes, of the experts' stacked codes; a box past an expert's last row reads
// the next expert's rows or zeros, which reach only columns never stored) in kSmallTileStages stages.
// Nsight Compute at 256 tokens (H100, 2026-12-07): gate|up 171 -> 163 µs a layer, DRAM 69% -> 67% of
// peak, down 89 -> 91 µs at 55% -> 53%; the schedulers issue in 61-65% of cycles either way, so the
// next gain is fewer instructions a weight (the dequant), not the copies.
#include <algorithm>
#include <type_traits>

#include "core/error.h"
#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/tensor_core.cuh"
#include "cuda/common/tensor_map.cuh"
#include "cuda/gemm/gemm.cuh"
#include "cuda/gemm/gemm_impl.cuh"

namespace tansy::cuda {
namespace {

using gemm_impl::dequant4;
using gemm_impl::kSbGroups;
using gemm_impl::Params;
using gemm_impl::sb_offset;
using gemm_impl::store_tile;
using tc::swz;

// Row tiles: kGroupedBM (dense products, and moe_route_sort's usual schedule) or kGroupedSmallBM.
constexpr int kBM = kGroupedBM;
constexpr int BK = 64;
constexpr int kStages = 4;
// Stages of the 16-row tiles, whose weights come by tensor copies: 6 measured +2.1% prefill at 256
// tokens over per-thread copies in 4 stages and +0.3% at 512; 4 stages by tensor copies -0.7% / +0.3%;
// 8 stages +0.1% / -5.6% (four blocks a multiprocessor; H100, 2026-12-07).
constexpr int kSmallTileStages = 6;
constexpr int kWideWarps = 8, kNarrowWarps = 4;

// Bytes of one weight row in one k-tile, as stored.
template <WFormat F>
constexpr int kWRowBytes = F == WFormat::kAffine4   ? BK / 2
                           : F == WFormat::kAffine8 ? BK
                                                    : BK * 2;

// Shared memory carve-up (bytes) for one instantiation. kTmaStages > 0: the weights come by
// tensor copies in that many stages, each completing on its own mbarrier (after the epilogue's tile).
template <int BM, int kWarps, WFormat F, bool kStagedSb, int kTmaStages = 0>
struct Layout {
  static constexpr bool kTma = kTmaStages > 0;
  static constexpr int S = kTma ? kTmaStages : kStages;
  static constexpr int BN = 32 * kWarps;
  static constexpr int kA = BM * BK * 2;               // one X stage
  static constexpr int kW = BN * kWRowBytes<F>;        // one weight stage
  static constexpr int kSb = kStagedSb ? BN * 32 : 0;  // one (scale, bias) buffer (gemm_impl.cuh)
  static constexpr int kStaged = S * (kA + kW) + 2 * kSb;
  static constexpr int kCld = BN + 4;  // f32 output tile row (the epilogue reuses the stages)
  static constexpr int kC = BM * kCld * 4;
  static constexpr int kBars = ((kStaged > kC ? kStaged : kC) + 7) / 8 * 8;
  static constexpr int kTotal = kBars + (kTma ? S * 8 : 0);
};

// 2 words of 8-bit codes -> 8 bf16 values. 8-bit codes exceed bf16's exact-integer trick, so go
// through f32 (only the router and shared-expert gate are 8-bit: tiny matrices).
__device__ __forceinline__ uint4 dequant8(uint32_t w0, uint32_t w1, float s, float b) {
  uint32_t r[4];
  const uint32_t w[2] = {w0, w1};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t word = w[i / 2];
    const int sh = (i % 2) * 16;
    const float c0 = __uint_as_float(0x4b000000u | ((word >> sh) & 0xffu)) - 8388608.f;
    const float c1 = __uint_as_float(0x4b000000u | ((word >> (sh + 8)) & 0xffu)) - 8388608.f;
    r[i] = tc::pack_bf16(fmaf(s, c0, b), fmaf(s, c1, b));
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ uint4 lds128(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// Warps a multiprocessor holds (the launch bounds' register budget): 16 with 64-row tiles (their
// stages take 96 KiB, two blocks of 8 warps), 24 with 16-row tiles (a quarter of the accumulators,
// 80 registers; their 6 stages take 44 KiB a 4-warp block, so shared memory holds five).
template <int BM, int kWarps>
constexpr int kMinBlocks = (BM == kGroupedBM ? 16 : 24) / kWarps;

template <int BM, int kWarps, WFormat F, bool kStagedSb, int kTmaStages>
__global__ void __launch_bounds__(32 * kWarps, (kMinBlocks<BM, kWarps>))
    gemm_kernel(const __grid_constant__ CUtensorMap wmap, const Params p) {
  using L = Layout<BM, kWarps, F, kStagedSb, kTmaStages>;
  constexpr bool kTma = L::kTma;
  constexpr int kStages = L::S;
  constexpr int kThreads = 32 * kWarps;
  constexpr int BN = L::BN;
  constexpr int kMT = 2;       // m16 tiles of weight rows (output columns) per warp: 32 columns
  constexpr int kNT = BM / 8;  // n8 tiles of X rows per warp: all BM rows of the tile
  constexpr int kAChunksAll = BM * (BK / 8);                         // 16-byte X chunks per stage
  constexpr int kAChunks = (kAChunksAll + kThreads - 1) / kThreads;  // ... per thread (16 rows: some none)
  constexpr int kWRowChunks = kWRowBytes<F> / 16;                    // 16-byte chunks of one weight row
  constexpr int kWChunks = BN * kWRowChunks / kThreads;              // ... per thread per stage
  constexpr bool kAffine = F != WFormat::kBF16;
  static_assert(kWChunks * kThreads == BN * kWRowChunks);
  static_assert(kAChunksAll % kThreads == 0 || kAChunks == 1);
  static_assert(!kStagedSb || kAffine);
  static_assert(!kTma || F == WFormat::kAffine4);
  constexpr int kSbChunks = 2 * BN / kThreads;  // 16-byte (scale | bias) copies per thread per run

  extern __shared__ __align__(128) unsigned char smem[];
  const __nv_bfloat16* const As = reinterpret_cast<const __nv_bfloat16*>(smem);
  unsigned char* const Ws = smem + kStages * L::kA;
  unsigned char* const Sbs = smem + kStages * (L::kA + L::kW);  // kStagedSb: two (scale, bias) buffers
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + L::kBars);  // kTma: stage s has landed

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.y * BN;  // first output column of this block

  // Row range of this block and the weight matrix it multiplies.
  int row0, row_end;
  const uint32_t* q = p.q;
  const __nv_bfloat16 *scales = p.scales, *biases = p.biases, *wdense = p.w;
  int map_row0 = n0;  // kTma: the first weight row of the block in the map's rows
  if (p.tile_offsets) {
    const int tile = blockIdx.x;
    if (tile >= p.tile_offsets[p.n_experts]) return;  // grid is an upper bound on the tile count
    const int e = gemm_impl::tile_expert(p, tile);
    map_row0 = e * p.out + n0;
    row0 = p.expert_offsets[e] + (tile - p.tile_offsets[e]) * BM;
    row_end = p.expert_offsets[e + 1];
    const size_t rows = size_t(p.out);
    if constexpr (kAffine) {
      q += size_t(e) * rows * (size_t(p.in) * (F == WFormat::kAffine4 ? 4 : 8) / 32);
      scales += size_t(e) * rows * (p.in / kQuantGroup);
      biases += size_t(e) * rows * (p.in / kQuantGroup);
    } else {
      wdense += size_t(e) * rows * p.in;
    }
  } else {
    row0 = blockIdx.x * BM;
    row_end = p.n_rows;
  }

  // n8 tiles of X rows holding rows of this tile: a grouped tile at the end of an expert's rows
  // (or the last dense tile) skips the products of the empty ones, and their rows are not copied
  // (with a few rows per expert, as in a short prompt's MoE, most of a tile).
  const int nt_used = min(kNT, (row_end - row0 + 7) / 8);

  // This thread's 16-byte copies per stage, as 32-bit offsets fixed across k-tiles (the launchers
  // check X and one weight matrix fit): X chunk idx = tid + i*kThreads -> tile row idx/8, chunk
  // idx%8 (idx < kAChunksAll); weight chunk idx -> tile row idx / kWRowChunks, chunk idx % kWRowChunks. Rows
  // past the tile's end (X) or the matrix's (weights) copy a valid row instead of zeros: they only reach
  // output rows / columns that are never stored.
  uint32_t a_off[kAChunks], a_dst[kAChunks];
  bool a_on[kAChunks];  // a row of a used n8 tile
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int idx = tid + i * kThreads, r = min(idx / 8, BM - 1);
    const int grow = row0 + r < row_end ? row0 + r : row0;
    const int xrow = p.sorted_slot ? p.sorted_slot[grow] / p.gather_k : grow;
    a_off[i] = uint32_t(xrow) * uint32_t(p.ldx) + uint32_t(tid % 8) * 8;
    a_dst[i] = uint32_t(swz<BK / 8>(r, (tid % 8) * 8)) * 2;
    a_on[i] = idx < kAChunksAll && idx / 8 < nt_used * 8;
  }
  const unsigned char* const w_base =
      kAffine ? reinterpret_cast<const unsigned char*>(q) : reinterpret_cast<const unsigned char*>(wdense);
  uint32_t w_off[kWChunks], w_dst[kWChunks];
  {
    const uint32_t row_bytes = uint32_t(p.in) * kWRowBytes<F> / BK;
#pragma unroll
    for (int i = 0; i < kWChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / kWRowChunks, c = idx % kWRowChunks;
      w_off[i] = uint32_t(min(n0 + r, p.out - 1)) * row_bytes + uint32_t(c) * 16;
      w_dst[i] =
          F == WFormat::kBF16 ? uint32_t(swz<BK / 8>(r, c * 8)) * 2 : uint32_t(r * kWRowBytes<F> + c * 16);
    }
  }

  const int KT = p.in / BK;
  const int groups = p.in / kQuantGroup;
  // kStagedSb: copy i of a run is row r = (tid + i*kThreads) / 2 of the block's tile, its scales
  // (half 0) or biases (half 1); rows past the matrix copy the last row's, as above.
  [[maybe_unused]] uint32_t sb_src[kStagedSb ? kSbChunks : 1], sb_dst[kStagedSb ? kSbChunks : 1];
  [[maybe_unused]] bool sb_half[kStagedSb ? kSbChunks : 1];
  if constexpr (kStagedSb) {
#pragma unroll
    for (int i = 0; i < kSbChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / 2;
      sb_half[i] = idx % 2;
      sb_src[i] = uint32_t(min(n0 + r, p.out - 1)) * uint32_t(groups);
      sb_dst[i] = sb_offset(r, idx % 2);
    }
  }

  if constexpr (kTma) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < kStages; ++s) bulk::mbar_init(&bars[s]);
      bulk::fence_init();
    }
    __syncthreads();
  }
  auto load_stage = [&](int kt, int stage) {
    unsigned char* as = smem + stage * L::kA;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i)
      if (a_on[i]) tc::cp_async16(as + a_dst[i], p.X + a_off[i] + uint32_t(kt) * BK, true);
    unsigned char* ws = Ws + stage * L::kW;
    if constexpr (kTma) {
      if (tid == 0) {
        bulk::fence_before_copy();  // the block's earlier reads of the stage come first
        bulk::mbar_expect_tx(&bars[stage], unsigned(L::kW));
        bulk::tensor_copy_2d(ws, &wmap, kt * kWRowBytes<F>, map_row0, &bars[stage]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kWChunks; ++i)
        tc::cp_async16_l2_256(ws + w_dst[i], w_base + w_off[i] + uint32_t(kt) * kWRowBytes<F>);
    }
    // The run of kSbGroups (scale, bias) pairs that k-tile kt starts goes with its stage, into
    // buffer run % 2. That buffer last held run - 2, whose last k-tile (kt - kSbGroups - 1) every
    // warp has finished: the stage of k-tile kt is copied after the barrier of k-tile kt - kStages + 1.
    if constexpr (kStagedSb) {
      static_assert(kStages - 1 <= kSbGroups);
      if (kt % kSbGroups == 0) {
        unsigned char* sbs = Sbs + ((kt / kSbGroups) & 1) * L::kSb;
#pragma unroll
        for (int i = 0; i < kSbChunks; ++i)
          tc::cp_async16(sbs + sb_dst[i], (sb_half[i] ? biases : scales) + sb_src[i] + uint32_t(kt), true);
      }
    }
  };

  // Without kStagedSb, the (scale, bias) of the lane's 4 weight rows for one k-tile, fetched a
  // k-tile ahead into registers. Row wrow(i) = warp*32 + (i/2)*16 + (i%2)*8 + g of the block's tile (m16 tile
  // i/2, half i%2).
  auto wrow = [&](int i) { return warp * 32 + (i / 2) * 16 + (i % 2) * 8 + g; };
  uint32_t sb_off[4];  // rows past the matrix read the last row's (never stored)
#pragma unroll
  for (int i = 0; i < 4; ++i) sb_off[i] = uint32_t(min(n0 + wrow(i), p.out - 1)) * uint32_t(groups);
  __nv_bfloat162 sb_next[4] = {};  // (scale, bias)
  auto load_sb = [&](int kt) {
    if constexpr (kAffine && !kStagedSb) {
      const uint32_t k = uint32_t(min(kt, KT - 1));  // past the end: a valid, unused group
#pragma unroll
      for (int i = 0; i < 4; ++i)
        sb_next[i] = __halves2bfloat162(scales[sb_off[i] + k], biases[sb_off[i] + k]);
    }
  };

  // acc[mt][nt]: the m16 x n8 product of weight rows warp*32 + mt*16 + (g, g+8) and tile rows
  // (tokens) nt*8 + 2t, 2t+1 (mma C layout with the weights as A).
  float acc[kMT][kNT][4] = {};

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    tc::cp_async_commit();
  }
  load_sb(0);

  // The k loop, in two copies: full tiles without the row checks, partial ones with them.
  auto k_loop = [&](auto full_tile) {
    for (int kt = 0; kt < KT; ++kt) {
      tc::cp_async_wait<kStages - 2>();
      __syncthreads();  // stage kt visible to all; everyone is done with stage kt-1
      if (kt + kStages - 1 < KT) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
      tc::cp_async_commit();

      const int stage = kt % kStages;
      if constexpr (kTma) bulk::mbar_wait(&bars[stage], unsigned(kt / kStages) & 1u);
      const __nv_bfloat16* as = As + stage * (BM * BK);
      const unsigned char* ws = Ws + stage * L::kW;
      __nv_bfloat162 sb[4];  // the lane's 4 (scale, bias) pairs of k-tile kt
      if constexpr (kStagedSb) {
        const unsigned char* sbs = Sbs + ((kt / kSbGroups) & 1) * L::kSb + (kt % kSbGroups) * 2;
#pragma unroll
        for (int i = 0; i < 4; ++i)
          sb[i] = __halves2bfloat162(*reinterpret_cast<const __nv_bfloat16*>(sbs + sb_offset(wrow(i), 0)),
                                     *reinterpret_cast<const __nv_bfloat16*>(sbs + sb_offset(wrow(i), 1)));
      } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) sb[i] = sb_next[i];
        load_sb(kt + 1);
      }

      // Packed codes of the lane's 4 weight rows for the whole k-tile: chunks 2t and 2t+1.
      [[maybe_unused]] uint32_t packed[4][F == WFormat::kAffine4 ? 2 : 4];
      if constexpr (F == WFormat::kAffine4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint2 v = *reinterpret_cast<const uint2*>(ws + wrow(i) * kWRowBytes<F> + t * 8);
          packed[i][0] = v.x;
          packed[i][1] = v.y;
        }
      } else if constexpr (F == WFormat::kAffine8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 v = lds128(ws + wrow(i) * kWRowBytes<F> + t * 16);
          packed[i][0] = v.x;
          packed[i][1] = v.y;
          packed[i][2] = v.z;
          packed[i][3] = v.w;
        }
      }

#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int chunk = 2 * t + c;  // physical k 8*chunk .. +7 of this k-tile
        // Weight values of chunk `chunk` for the lane's 4 rows, 4 k-pairs each: pair 2s (a0/a1) and
        // 2s+1 (a2/a3) of mma s.
        uint4 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          if constexpr (F == WFormat::kAffine4) {
            w[i] = dequant4(packed[i][c], __low2bfloat162(sb[i]), __high2bfloat162(sb[i]));
          } else if constexpr (F == WFormat::kAffine8) {
            w[i] = dequant8(packed[i][2 * c], packed[i][2 * c + 1], __low2float(sb[i]), __high2float(sb[i]));
          } else {
            w[i] = lds128(reinterpret_cast<const __nv_bfloat16*>(ws) + swz<BK / 8>(wrow(i), chunk * 8));
          }
        }
        uint32_t a[kMT][2][4];  // [m16 tile][mma s]: rows g (i = 2mt) and g+8 (i = 2mt+1)
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          const uint4 lo = w[2 * mt], hi = w[2 * mt + 1];
          a[mt][0][0] = lo.x, a[mt][0][1] = hi.x, a[mt][0][2] = lo.y, a[mt][0][3] = hi.y;
          a[mt][1][0] = lo.z, a[mt][1][1] = hi.z, a[mt][1][2] = lo.w, a[mt][1][3] = hi.w;
        }
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          if (!decltype(full_tile)::value && nt >= nt_used) break;  // past the tile's rows (never stored)
          // X row (token) nt*8 + g, chunk `chunk`: (b0, b1) of mma 0, then of mma 1.
          const uint4 x = lds128(as + swz<BK / 8>(nt * 8 + g, chunk * 8));
#pragma unroll
          for (int mt = 0; mt < kMT; ++mt) {
            tc::mma_bf16(acc[mt][nt], a[mt][0], x.x, x.y);
            tc::mma_bf16(acc[mt][nt], a[mt][1], x.z, x.w);
          }
        }
      }
    }
  };
  if (nt_used == kNT)
    k_loop(std::true_type{});
  else
    k_loop(std::false_type{});
  tc::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: reuse them for the output tile

  // Accumulators -> f32 tile C[token][column] in shared memory (rows kCld floats apart: the 32
  // lanes of one store hit 32 banks), then each thread writes column pairs of whole rows.
  float* const Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int r = 0; r < 4; ++r)
        Cs[(nt * 8 + 2 * t + (r & 1)) * L::kCld + warp * 32 + mt * 16 + g + (r >> 1) * 8] = acc[mt][nt][r];
  __syncthreads();

  store_tile<BN, BM, kThreads, L::kCld>(p, Cs, row0, row_end, n0, tid);
}

// The 4-bit codes of every matrix of p (the experts stacked: n_experts * out rows), read in boxes
// of one k-tile's bytes x rows rows, unswizzled: row r of a box lands at r * kWRowBytes, the
// layout the cp.async copies write.
CUtensorMap codes_map(const Params& p, int rows) {
  const int64_t matrices = p.tile_offsets ? p.n_experts : 1;
  return byte_matrix_map(p.q, int64_t(p.out) * matrices, p.in / 2, kWRowBytes<WFormat::kAffine4>, rows,
                         CU_TENSOR_MAP_SWIZZLE_NONE, "gemm");
}

template <int BM, int kWarps, WFormat F, bool kStagedSb, int kTmaStages = 0>
void launch(const Params& p, dim3 grid, cudaStream_t stream) {
  using L = Layout<BM, kWarps, F, kStagedSb, kTmaStages>;
  constexpr int kSmem = L::kTotal;
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(gemm_kernel<BM, kWarps, F, kStagedSb, kTmaStages>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) == cudaSuccess;
  }();
  if (!attr_set) fail("gemm: cannot reserve {} bytes of shared memory per block", kSmem);
  CUtensorMap map{};
  if constexpr (L::kTma) map = codes_map(p, L::BN);
  gemm_kernel<BM, kWarps, F, kStagedSb, kTmaStages><<<grid, 32 * kWarps, kSmem, stream>>>(map, p);
  launch_check("gemm");
}

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Affine weights whose rows hold whole 16-byte runs of kSbGroups (scale, bias) pairs stage them
// in shared memory (every product of the model: in = 512, 2,048 or 4,096); others load them a
// k-tile ahead into registers. The two compute the same values.
template <int kWarps, WFormat F>
void launch_affine(const Params& p, dim3 grid, cudaStream_t stream) {
  if (gemm_impl::stages_scales(p)) return launch<kBM, kWarps, F, true>(p, grid, stream);
  launch<kBM, kWarps, F, false>(p, grid, stream);
}

template <int kWarps>
void dispatch(const Params& p, WFormat fmt, dim3 grid, cudaStream_t stream) {
  switch (fmt) {
    case WFormat::kAffine4:
      return launch_affine<kWarps, WFormat::kAffine4>(p, grid, stream);
    case WFormat::kAffine8:
      return launch_affine<kWarps, WFormat::kAffine8>(p, grid, stream);
    case WFormat::kBF16:
      return launch<kBM, kWarps, WFormat::kBF16, false>(p, grid, stream);
    default:
      fail("gemm: weight format {} is not supported", wformat_name(fmt));
  }
}

// 256-column tiles halve the X re-reads; fall back to 128 columns when 256 would leave the
// multiprocessors short of two blocks each (small n, narrow matrices). 16-row tiles (4-bit weights
// with staged scales, gemm_grouped checks) read little X and take 128 columns at every size: 6
// blocks of 4 warps a multiprocessor measured +4% over 3 of 8 at 256-512 prompt tokens (H100,
// 2026-12-07).
void dispatch_tiles(const Params& p, WFormat fmt, int bm, long row_tiles, cudaStream_t stream,
                    const char* what) {
  const long wide = (p.out + 32L * kWideWarps - 1) / (32L * kWideWarps);
  const long narrow = (p.out + 32L * kNarrowWarps - 1) / (32L * kNarrowWarps);
  TANSY_CHECK(narrow <= 65535 && row_tiles <= 0x7fffffffL, "{}: out {} or {} row tiles exceed the grid limit",
              what, p.out, row_tiles);
  if (bm == kGroupedSmallBM) {
    launch<kGroupedSmallBM, kNarrowWarps, WFormat::kAffine4, true, kSmallTileStages>(
        p, dim3(unsigned(row_tiles), unsigned(narrow)), stream);
  } else if (row_tiles * wide >= 2L * sm_count()) {
    dispatch<kWideWarps>(p, fmt, dim3(unsigned(row_tiles), unsigned(wide)), stream);
  } else {
    dispatch<kNarrowWarps>(p, fmt, dim3(unsigned(row_tiles), unsigned(narrow)), stream);
  }
}

// `out` is the row count of one matrix (W.out / n_experts for stacked experts).
// `x_rows`: rows of X the product may read.
Params make_params(const DevLinear& W, int out, const __nv_bfloat16* X, int64_t ldx, int n_rows, long x_rows,
                   const GemmOutput& Y, const char* what) {
  TANSY_CHECK(W.fmt == WFormat::kAffine4 || W.fmt == WFormat::kAffine8 || W.fmt == WFormat::kBF16,
              "{}: weight format {} is not supported", what, wformat_name(W.fmt));
  TANSY_CHECK(out >= 1 && W.in >= kGemmInAlign && W.in % kGemmInAlign == 0,
              "{}: weight shape [{}, {}] unsupported (in must be a positive multiple of {})", what, out, W.in,
              kGemmInAlign);
  if (W.fmt == WFormat::kBF16) {
    TANSY_CHECK(W.w && aligned(W.w, 16), "{}: bf16 weight pointer missing or not 16-byte aligned", what);
  } else {
    TANSY_CHECK(W.q && W.scales && W.biases && aligned(W.q, 16),
                "{}: affine weight arrays missing or codes not 16-byte aligned", what);
  }
  TANSY_CHECK(n_rows >= 1, "{}: need at least one row, got {}", what, n_rows);
  TANSY_CHECK(X && aligned(X, 16) && ldx >= W.in && ldx % 8 == 0,
              "{}: X must be 16-byte aligned with ldx ({}) >= in ({}) and a multiple of 8", what, ldx, W.in);
  // The kernel addresses X and one weight matrix with 32-bit offsets.
  TANSY_CHECK(double(x_rows) * double(ldx) < 4294967296.0, "{}: X of {} rows x {} elements is too large",
              what, x_rows, ldx);
  TANSY_CHECK(double(out) * W.in *
                      (W.fmt == WFormat::kBF16      ? 16
                       : W.fmt == WFormat::kAffine8 ? 8
                                                    : 4) /
                      8 <
                  4294967296.0,
              "{}: weight matrix [{}, {}] is too large", what, out, W.in);
  TANSY_CHECK(Y.ptr, "{}: null output", what);
  const int cols = Y.epilogue == GemmEpilogue::kSwiGlu ? out / 2 : out;
  if (Y.epilogue == GemmEpilogue::kSwiGlu)
    TANSY_CHECK(out % 2 == 0, "{}: SwiGLU epilogue needs an even row count, got {}", what, out);
  TANSY_CHECK(Y.ld >= cols && Y.ld % 2 == 0, "{}: output ld {} must be even and >= {}", what, Y.ld, cols);
  TANSY_CHECK(aligned(Y.ptr, Y.type == GemmOutType::kF32 ? 8 : 4),
              "{}: output pointer misaligned for paired stores", what);
  Params p{};
  p.q = W.q;
  p.scales = W.scales;
  p.biases = W.biases;
  p.w = W.w;
  p.out = out;
  p.in = W.in;
  p.X = X;
  p.ldx = ldx;
  p.n_rows = n_rows;
  p.Y = Y.ptr;
  p.ldy = Y.ld;
  p.out_type = Y.type;
  p.epilogue = Y.epilogue;
  return p;
}

// kAuto's kernel for a grouped expert product. gate|up (the gathered one) with at least 128 rows
// per expert on average (4,096 prompt tokens and more): the persistent warpgroup kernel, faster in
// Timing.Gemm at 4,096 tokens (0.504 vs 0.605 ms with uniform routing, 0.603 vs 0.629 skewed; H200,
// 2026-12-02) and in the model (gate|up stage 24.3 vs 24.7 ms over 40 layers; prefill 45,947 vs
// 45,677 tok/s). With fewer rows per expert it lost: routed there at every size, prefill fell 12% at
// 256 tokens and 4% at 2,048 (contract run of 3dd0a35). Its cost follows the tile count (each tile
// dequantizes its expert's weights again), so it picks its tile size per launch from the real expert
// counts (gemm_grouped_wgmma.cu): on the synthetic checkpoint, whose counts spread far wider than
// uniform routing's (28-356 rows at 4,096 tokens), that is 192 rows, gate|up 24.1 -> 22.4 ms over 40
// layers (2026-12-04). down, and gate|up below 128 rows per expert: mma.sync (down 0.359 vs 0.391-0.401
// ms uniform in Timing.Gemm; stage 14.6 vs 18.4 ms in the model).
GemmKernel grouped_auto(bool gather, long rows, int n_experts) {
  return gather && rows >= 128L * n_experts ? GemmKernel::kWgmmaGrouped : GemmKernel::kMma;
}

GemmKernel& kernel_state() {
  static GemmKernel k = GemmKernel::kAuto;
  return k;
}

// The kernel a grouped product runs (gather: gate|up, reading the token rows in place).
GemmKernel grouped_kernel(bool gather, long rows, int n_experts) {
  return kernel_state() == GemmKernel::kAuto ? grouped_auto(gather, rows, n_experts) : kernel_state();
}

}  // namespace

void gemm_set_kernel(GemmKernel k) { kernel_state() = k; }
GemmKernel gemm_kernel() { return kernel_state(); }

int grouped_tile_rows(const DevLinear& gate_up, const DevLinear& down, long rows, int n_experts) {
  const auto small_tiles = [&](const DevLinear& W, bool gather) {
    return W.fmt == WFormat::kAffine4 && gemm_impl::stages_scales(W.in, W.scales, W.biases) &&
           grouped_kernel(gather, rows, n_experts) == GemmKernel::kMma;
  };
  return n_experts >= 1 && rows <= long(kGroupedSmallBM) * n_experts && small_tiles(gate_up, true) &&
                 small_tiles(down, false)
             ? kGroupedSmallBM
             : kGroupedBM;
}

void gemm(const DevLinear& W, const __nv_bfloat16* X, int64_t ldx, int n, const GemmOutput& Y,
          cudaStream_t stream) {
  const Params p = make_params(W, W.out, X, ldx, n, n, Y, "gemm");
  if (W.fmt == WFormat::kAffine4 && kernel_state() != GemmKernel::kMma)
    return gemm_impl::launch_wgmma(p, false, 0, stream);
  if (W.fmt == WFormat::kBF16 && kernel_state() != GemmKernel::kMma)
    return gemm_impl::launch_bf16_wgmma(p, stream);
  dispatch_tiles(p, W.fmt, kBM, (n + kBM - 1) / kBM, stream, "gemm");
}

void gemm_grouped(const DevLinear& W, int n_experts, const __nv_bfloat16* X, int64_t ldx, bool gather, int n,
                  int k, const MoeRouting& r, const GemmOutput& Y, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && n_experts >= 1 && n_experts <= kGroupedMaxExperts,
              "gemm_grouped: bad n={} k={} n_experts={}", n, k, n_experts);
  TANSY_CHECK(r.expert_offsets && r.tile_offsets && r.sorted_slot, "gemm_grouped: routing arrays missing");
  TANSY_CHECK(W.out % n_experts == 0, "gemm_grouped: {} stacked rows do not split into {} experts", W.out,
              n_experts);
  const long rows = long(n) * k;
  TANSY_CHECK(rows < (1L << 30), "gemm_grouped: n*k = {} too large", rows);
  Params p = make_params(W, W.out / n_experts, X, ldx, int(rows), gather ? n : rows, Y, "gemm_grouped");
  p.tile_offsets = r.tile_offsets;
  p.expert_offsets = r.expert_offsets;
  p.sorted_slot = gather ? r.sorted_slot : nullptr;
  p.gather_k = k;
  p.n_experts = n_experts;
  const int bm = r.tile_rows;
  TANSY_CHECK(bm == kGroupedBM || bm == kGroupedSmallBM,
              "gemm_grouped: {}-row tiles are not built (only {} and {})", bm, kGroupedBM, kGroupedSmallBM);
  p.tile_rows = bm;
  // Each expert's last tile may be partial: at most rows/bm full tiles plus one per non-empty expert.
  const long max_tiles = (rows + bm - 1) / bm + std::min<long>(n_experts, rows);
  const GemmKernel kernel = grouped_kernel(gather, rows, n_experts);
  if (W.fmt == WFormat::kAffine4 && kernel == GemmKernel::kWgmma)
    return gemm_impl::launch_wgmma(p, true, max_tiles, stream);
  if (W.fmt == WFormat::kAffine4 && kernel == GemmKernel::kWgmmaGrouped)
    return gemm_impl::launch_wgmma_grouped(p, stream);  // makes its own tiles from the expert offsets
  TANSY_CHECK(bm == kGroupedBM || (W.fmt == WFormat::kAffine4 && gemm_impl::stages_scales(p)),
              "gemm_grouped: {}-row tiles need 4-bit weights whose rows hold whole runs of {} quant groups "
              "(got {} weights, in = {})",
              bm, gemm_impl::kSbGroups, wformat_name(W.fmt), W.in);
  dispatch_tiles(p, W.fmt, bm, max_tiles, stream, "gemm_grouped");
}

}  // namespace tansy::cuda
