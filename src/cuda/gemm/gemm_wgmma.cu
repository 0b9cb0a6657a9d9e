// Prefill GEMM on Hopper's warpgroup tensor cores (wgmma), 4-bit affine weights.
//
// The product is computed transposed, as in gemm.cu: D[out column][token] = W · Xᵀ. A warpgroup (4
// warps) owns 64 output columns (the wgmma M = 64) and all kN rows of the block's X tile (the wgmma
// N); a block holds kWG warpgroups side by side, BN = 64·kWG columns. k-tile 64 = one quant group.
//
// A (weights) comes from registers: each lane dequantizes exactly the values of its own wgmma A
// fragment, straight from the packed codes, so every weight is dequantized once and never stored
// as bf16. The fragment is mma.m16n8k16's A per warp (warp w of the group holds rows 16w..16w+15):
// lane (g, t) holds rows g and g+8 at k {2t, 2t+1} (regs 0/1) and {2t+8, 2t+9} (regs 2/3) of each
// k16 step s. Codes 2t, 2t+1 of a packed word (8 codes, low nibble first) are byte t of the word,
// and k16 step s reads words 2s and 2s+1; so byte t of words 0..3 (steps 0, 1) and of words 4..7
// (steps 2, 3) are gathered into one word each and dequantized in k order by dequant4.
//
// B (X) is read by the tensor cores from shared memory through a matrix descriptor: X rows are 128
// bytes (64 bf16) per k-tile, K-major, in the 128-byte swizzle (16-byte chunk c of row r at chunk
// c ^ (r % 8), the tile 1024-aligned), rows 8 apart 1024 bytes apart (the descriptor's stride
// offset); k16 step s starts 32·s bytes into the rows. The cp.async copies write that layout.
//
// Pipeline (4 stages of X and of packed weights): in k-tile kt the warpgroup issues the wgmmas of
// kt and waits for those of kt-1 (at most one group in flight: the tensor cores hold kt's work while
// the block prepares kt+1), waits for stage kt+1, starts the copy of stage kt+3 (into the stage the
// wgmmas of kt-1 read: every warp waited for them before the barrier) and dequantizes kt+1 into the
// A buffer kt-1 read. The accumulators go through an f32 tile in the freed
// stage memory to the shared epilogue (gemm_impl.cuh).
//
// Split over k (gemm_impl.cuh store_split_tile): a dense product of too few tiles for the machine
// (a short prompt's out_proj: 64 tiles) runs each tile as a cluster of 2-8 blocks, each over an
// equal share of the k-tiles.
//
// (scale, bias): when a row's groups come in whole 16-byte runs (groups % 8 == 0, every product of
// the model), 8 groups of the block's rows are copied with the stage of the k-tile that starts them
// into one of two shared buffers; otherwise (narrow test shapes) they are loaded into registers one
// k-tile before their dequant. From registers, each k-tile waited on that global load, which a
// short prompt's k-tiles (64 tokens) do not cover (gemm.cu has the same pair of paths).
//
// Tiles (kN token rows x BN columns): 64 x 128 when 128-row tiles would not fill the machine; 128 x
// 128 otherwise (the profile: instruction-bound, ~40% of the issue slots the per-lane dequant, which
// a wider wgmma N shares over more products). 256 x 128 halves the dequant per product again, at 225
// registers (one block per multiprocessor) and 144 KB of stages; it is the fastest at the prefill's
// 4,096-token chunks (Timing.Gemm on the H200: GDN in_proj 0.408 vs 0.439 ms at 128 x 128, out_proj
// 0.138 vs 0.161, attention q|k|v 0.276 vs 0.295, the shared expert's gate|up 0.040 vs 0.045 with
// 128 blocks, under one wave). 64 x 256 and 128 x 256 (4 warpgroups) measured slower than 128 x 128.
#include <algorithm>

#include "core/error.h"
#include "cuda/common/cuda_util.h"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gemm/gemm_impl.cuh"
#include "cuda/gemm/wgmma.cuh"

namespace tansy::cuda::gemm_impl {
namespace {

constexpr int BK = 64;
constexpr int kStages = 4;
constexpr int kWRow = BK / 2;  // bytes of one 4-bit weight row per k-tile

template <int kN, int kWG, bool kStagedSb>
struct WgLayout {
  static constexpr int BN = 64 * kWG;
  static constexpr int kX = kN * BK * 2;               // one X stage (a multiple of 1024: swizzle atoms)
  static constexpr int kW = BN * kWRow;                // one packed weight stage
  static constexpr int kSb = kStagedSb ? BN * 32 : 0;  // one (scale, bias) buffer (gemm_impl.cuh)
  static constexpr int kCld = BN + 4;                  // f32 output tile row
  static constexpr int kC = kN * kCld * 4;
  static constexpr int kStageBytes = kStages * (kX + kW) + 2 * kSb;
  // + 1024: the dynamic shared memory is aligned up to 1024 bytes in the kernel
  static constexpr int kTotal = (kStageBytes > kC ? kStageBytes : kC) + 1024;
};

using wg::desc_sw128;
using wg::fence_proxy_async;
using wg::fence_regs;
using wg::gather_byte;
using wg::lds128;
using wg::wgmma_arrive;
using wg::wgmma_commit;
using wg::wgmma_wait0;
using wg::wgmma_wait1;
__device__ __forceinline__ void wgmma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) {
  wg::wgmma_rs<64>(d, a, desc_b);
}
__device__ __forceinline__ void wgmma(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
  wg::wgmma_rs<128>(d, a, desc_b);
}
__device__ __forceinline__ void wgmma(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
  wg::wgmma_rs<256>(d, a, desc_b);
}

template <int kN, int kWG, bool kStagedSb, bool kSplitK>
__global__ void __launch_bounds__(128 * kWG, kWG == 2 && kN <= 128 ? 2 : 1)
    gemm_wgmma_kernel(const Params p) {
  using L = WgLayout<kN, kWG, kStagedSb>;
  constexpr int kThreads = 128 * kWG;
  constexpr int BN = L::BN;
  constexpr int kNAcc = kN / 2;                           // f32 accumulators per thread
  constexpr int kXChunks = kN * (BK / 8) / kThreads;      // 16-byte X chunks per thread per stage
  constexpr int kWChunks = BN * (kWRow / 16) / kThreads;  // ... of packed weights
  static_assert(kXChunks >= 1 && kXChunks * kThreads == kN * (BK / 8));
  static_assert(kWChunks >= 1 && kWChunks * kThreads == BN * (kWRow / 16));
  static_assert(L::kX % 1024 == 0);

  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  unsigned char* const smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t xs_addr = tc::smem_addr(smem);
  unsigned char* const Ws = smem + kStages * L::kX;
  unsigned char* const Sbs = Ws + kStages * L::kW;  // kStagedSb: two (scale, bias) buffers
  constexpr int kSbChunks = 2 * BN / kThreads;      // 16-byte (scale | bias) copies per thread per run
  static_assert(kSbChunks * kThreads == 2 * BN);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.y * BN;

  int row0, row_end;
  const uint32_t* q = p.q;
  const __nv_bfloat16 *scales = p.scales, *biases = p.biases;
  if (p.tile_offsets) {
    const int tile = blockIdx.x;
    if (tile >= p.tile_offsets[p.n_experts]) return;  // grid is an upper bound on the tile count
    const int e = gemm_impl::tile_expert(p, tile);
    row0 = p.expert_offsets[e] + (tile - p.tile_offsets[e]) * kN;
    row_end = p.expert_offsets[e + 1];
    q += size_t(e) * size_t(p.out) * (size_t(p.in) / 8);
    scales += size_t(e) * size_t(p.out) * (p.in / kQuantGroup);
    biases += size_t(e) * size_t(p.out) * (p.in / kQuantGroup);
  } else {
    row0 = blockIdx.x * kN;
    row_end = p.n_rows;
  }

  // Copies per stage, as 32-bit offsets fixed across k-tiles. Rows past the tile's end (X) or the
  // matrix's (weights) copy a valid row: they only reach outputs that are never stored.
  uint32_t x_off[kXChunks], x_dst[kXChunks];
#pragma unroll
  for (int i = 0; i < kXChunks; ++i) {
    const int idx = tid + i * kThreads, r = idx / 8, c = idx % 8;
    const int grow = row0 + r < row_end ? row0 + r : row0;
    const int xrow = p.sorted_slot ? p.sorted_slot[grow] / p.gather_k : grow;
    x_off[i] = uint32_t(xrow) * uint32_t(p.ldx) + uint32_t(c) * 8;
    x_dst[i] = uint32_t(r * 128 + ((c ^ (r & 7)) << 4));
  }
  const unsigned char* const w_base = reinterpret_cast<const unsigned char*>(q);
  uint32_t w_off[kWChunks], w_dst[kWChunks];
  const uint32_t row_bytes = uint32_t(p.in) / 2;
#pragma unroll
  for (int i = 0; i < kWChunks; ++i) {
    const int idx = tid + i * kThreads, r = idx / 2, c = idx % 2;
    w_off[i] = uint32_t(min(n0 + r, p.out - 1)) * row_bytes + uint32_t(c) * 16;
    w_dst[i] = uint32_t(r * kWRow + c * 16);
  }
  const int KT = p.in / BK;
  // Split over k (gridDim.z > 1, one cluster of gridDim.z blocks along z): this block runs k-tiles
  // [kb, ke), whose bounds the launcher makes multiples of kSbGroups (each starts a run of staged
  // (scale, bias) and keeps the stage and parity of the unsplit loop).
  const int splits = kSplitK ? int(gridDim.z) : 1, split = kSplitK ? int(blockIdx.z) : 0;
  const int kb = kSplitK ? KT * split / splits : 0, ke = kSplitK ? KT * (split + 1) / splits : KT;
  const uint32_t groups = uint32_t(p.in / kQuantGroup);
  // kStagedSb: copy i of a run is row (tid + i*kThreads) / 2 of the block, its scales (half 0) or
  // biases (half 1); rows past the matrix copy the last row's.
  [[maybe_unused]] uint32_t sb_src[kStagedSb ? kSbChunks : 1], sb_dst[kStagedSb ? kSbChunks : 1];
  if constexpr (kStagedSb) {
#pragma unroll
    for (int i = 0; i < kSbChunks; ++i) {
      const int idx = tid + i * kThreads, r = idx / 2;
      sb_src[i] = uint32_t(min(n0 + r, p.out - 1)) * groups;
      sb_dst[i] = sb_offset(r, idx % 2);
    }
  }
  auto load_stage = [&](int kt, int stage) {
    unsigned char* xs = smem + stage * L::kX;
#pragma unroll
    for (int i = 0; i < kXChunks; ++i)
      tc::cp_async16(xs + x_dst[i], p.X + x_off[i] + uint32_t(kt) * BK, true);
    unsigned char* ws = Ws + stage * L::kW;
#pragma unroll
    for (int i = 0; i < kWChunks; ++i)
      tc::cp_async16_l2_256(ws + w_dst[i], w_base + w_off[i] + uint32_t(kt) * kWRow);
    // The run of kSbGroups groups that k-tile kt starts goes with its stage, into buffer run % 2,
    // which last held run - 2. That run's last dequant (k-tile kt - kSbGroups - 1) happened before
    // the barrier of step kt - kStages + 1, after which this copy is issued.
    if constexpr (kStagedSb) {
      if (kt % kSbGroups == 0) {
        unsigned char* sbs = Sbs + ((kt / kSbGroups) & 1) * L::kSb;
#pragma unroll
        for (int i = 0; i < kSbChunks; ++i)
          tc::cp_async16(sbs + sb_dst[i],
                         ((tid + i * kThreads) % 2 ? biases : scales) + sb_src[i] + uint32_t(kt), true);
      }
    }
  };

  // The lane's two weight rows (block-local): rows g and g+8 of warp (warp % 4)'s 16 in warpgroup
  // warp / 4's 64.
  const int wr0 = (warp / 4) * 64 + (warp % 4) * 16 + g, wr1 = wr0 + 8;
  const uint32_t sb0 = uint32_t(min(n0 + wr0, p.out - 1)) * uint32_t(p.in / kQuantGroup);
  const uint32_t sb1 = uint32_t(min(n0 + wr1, p.out - 1)) * uint32_t(p.in / kQuantGroup);
  // Without kStagedSb: (scale, bias) of rows wr0, wr1 for the next k-tile to dequantize.
  [[maybe_unused]] __nv_bfloat162 sbn[2];
  auto load_sb = [&](int kt) {
    if constexpr (!kStagedSb) {
      const uint32_t k = uint32_t(min(kt, ke - 1));
      sbn[0] = __halves2bfloat162(scales[sb0 + k], biases[sb0 + k]);
      sbn[1] = __halves2bfloat162(scales[sb1 + k], biases[sb1 + k]);
    }
  };
  const uint32_t sel = uint32_t(t) | (uint32_t(t + 4) << 4);
  // A fragments [k16 step][reg] of k-tile kt (its stage kt % kStages).
  auto dequant = [&](int kt, uint32_t(&a)[4][4]) {
    const unsigned char* ws = Ws + (kt % kStages) * L::kW;
    if constexpr (kStagedSb) {
      const int k = min(kt, ke - 1);  // past the end: a landed run, unused
      const unsigned char* sbs = Sbs + ((k / kSbGroups) & 1) * L::kSb + (k % kSbGroups) * 2;
      auto bf = [&](int r, int half) {
        return *reinterpret_cast<const __nv_bfloat16*>(sbs + sb_offset(r, half));
      };
      sbn[0] = __halves2bfloat162(bf(wr0, 0), bf(wr0, 1));
      sbn[1] = __halves2bfloat162(bf(wr1, 0), bf(wr1, 1));
    }
    const uint4 r0a = lds128(ws + wr0 * kWRow), r0b = lds128(ws + wr0 * kWRow + 16);
    const uint4 r1a = lds128(ws + wr1 * kWRow), r1b = lds128(ws + wr1 * kWRow + 16);
    const __nv_bfloat162 s0 = __low2bfloat162(sbn[0]), b0 = __high2bfloat162(sbn[0]);
    const __nv_bfloat162 s1 = __low2bfloat162(sbn[1]), b1 = __high2bfloat162(sbn[1]);
    // d.x, d.y: k {2t,2t+1}, {2t+8,2t+9} of step 2h; d.z, d.w: the same of step 2h+1
    const uint4 d0[2] = {dequant4(gather_byte(r0a, sel), s0, b0), dequant4(gather_byte(r0b, sel), s0, b0)};
    const uint4 d1[2] = {dequant4(gather_byte(r1a, sel), s1, b1), dequant4(gather_byte(r1b, sel), s1, b1)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a[2 * h][0] = d0[h].x, a[2 * h][1] = d1[h].x, a[2 * h][2] = d0[h].y, a[2 * h][3] = d1[h].y;
      a[2 * h + 1][0] = d0[h].z, a[2 * h + 1][1] = d1[h].z, a[2 * h + 1][2] = d0[h].w,
                a[2 * h + 1][3] = d1[h].w;
    }
  };

  float acc[kNAcc];
#pragma unroll
  for (int i = 0; i < kNAcc; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (kb + s < ke) load_stage(kb + s, s);  // kb % kStages == 0: k-tile kb + s is stage s
    tc::cp_async_commit();
  }
  load_sb(kb);
  tc::cp_async_wait<kStages - 2>();
  fence_proxy_async();
  __syncthreads();
  uint32_t a_even[4][4], a_odd[4][4];  // A of the even / odd k-tiles: one is read by the running wgmmas
  dequant(kb, a_even);
  load_sb(kb + 1);

  // k-tile kt: issue its wgmmas from a_use, then wait for kt-1's (they read a_fill and stage
  // (kt-1) % kStages), so that kt keeps the tensor cores busy while the block refills that stage and
  // dequantizes kt+1 into a_fill.
  auto step = [&](int kt, uint32_t(&a_use)[4][4], uint32_t(&a_fill)[4][4]) {
    const uint64_t desc = desc_sw128(xs_addr + uint32_t((kt % kStages) * L::kX));
    fence_regs(acc);
    fence_regs(a_use);
    wgmma_arrive();
#pragma unroll
    for (int s = 0; s < 4; ++s) wgmma(acc, a_use[s], desc + uint64_t(2 * s));
    wgmma_commit();
    wgmma_wait1();
    fence_regs(a_fill);
    tc::cp_async_wait<kStages - 3>();  // stage kt+1 has landed (this thread's copies)
    fence_proxy_async();
    __syncthreads();  // ... everyone's; and every warp is done with the wgmmas of kt-1
    if (kt + kStages - 1 < ke) load_stage(kt + kStages - 1, (kt + kStages - 1) % kStages);
    tc::cp_async_commit();
    // (unconditional: past the block's last k-tile it reads a stage no longer used, harmlessly)
    dequant(kt + 1, a_fill);
    load_sb(kt + 2);
  };
  for (int kt = kb; kt < ke; kt += 2) {  // two k-tiles a trip: the A buffers swap roles by name
    step(kt, a_even, a_odd);
    if (kt + 1 < ke) step(kt + 1, a_odd, a_even);
  }
  wgmma_wait0();
  fence_regs(acc);
  tc::cp_async_wait<0>();
  __syncthreads();  // stages free: reuse them for the output tile

  // acc[4i + r]: output column wr0 + (r >> 1)·8, tile row (token) 8i + 2t + (r & 1).
  float* const Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < kNAcc / 4; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) Cs[(8 * i + 2 * t + (r & 1)) * L::kCld + wr0 + (r >> 1) * 8] = acc[4 * i + r];
  __syncthreads();
  if constexpr (kSplitK)
    store_split_tile<BN, kN, kThreads, L::kCld>(p, Cs, row0, row_end, n0, tid);
  else
    store_tile<BN, kN, kThreads, L::kCld>(p, Cs, row0, row_end, n0, tid);
}

template <int kN, int kWG, bool kStagedSb, bool kSplitK = false>
void launch_kernel(const Params& p, long row_tiles, cudaStream_t stream, int splits = 1) {
  using L = WgLayout<kN, kWG, kStagedSb>;
  constexpr auto kern = gemm_wgmma_kernel<kN, kWG, kStagedSb, kSplitK>;
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L::kTotal) == cudaSuccess;
  }();
  if (!attr_set) fail("gemm (wgmma): cannot reserve {} bytes of shared memory per block", L::kTotal);
  const long col_tiles = (p.out + L::BN - 1) / L::BN;
  TANSY_CHECK(col_tiles <= 65535 && row_tiles <= 0x7fffffffL,
              "gemm (wgmma): out {} or {} row tiles exceed the grid limit", p.out, row_tiles);
  if constexpr (!kSplitK) {
    kern<<<dim3(unsigned(row_tiles), unsigned(col_tiles)), 128 * kWG, L::kTotal, stream>>>(p);
    launch_check("gemm (wgmma)");
  } else {
    TANSY_CHECK(splits >= 2 && splits <= 8 && (p.in / BK) % (splits * kSbGroups) == 0,
                "gemm (wgmma): {} k splits of {} k-tiles (2-8, each whole runs of {})", splits, p.in / BK,
                kSbGroups);
    launch_split(kern, dim3(unsigned(row_tiles), unsigned(col_tiles)), 128 * kWG, L::kTotal, splits, p,
                 stream, "gemm (wgmma, split over k)");
  }
}

// Rows of whole 16-byte runs of (scale, bias) stage them (every product of the model). splits > 1
// (k_splits): 64 x 128 tiles with staged scales only.
template <int kN, int kWG>
void launch(const Params& p, long row_tiles, cudaStream_t stream, int splits = 1) {
  if constexpr (kN == 64 && kWG == 2) {
    if (splits > 1) {
      TANSY_CHECK(stages_scales(p), "gemm (wgmma): a split over k needs staged scales");
      return launch_kernel<kN, kWG, true, true>(p, row_tiles, stream, splits);
    }
  }
  TANSY_CHECK(splits == 1, "gemm (wgmma): no split over k for {} x {} tiles", kN, 64 * kWG);
  if (stages_scales(p)) return launch_kernel<kN, kWG, true>(p, row_tiles, stream);
  launch_kernel<kN, kWG, false>(p, row_tiles, stream);
}

// k splits of a dense product in `tiles` 64-row tiles (two blocks a multiprocessor): doubled while
// the blocks stay within one wave and each split keeps whole runs of staged scales. With fewer
// tiles than multiprocessors a block's k loop is the product's whole time, mostly waiting on its
// copies: the 256-token prefill's GDN out_proj (4 x 16 tiles, 64 k-tiles) took 34 µs for 4.5 MB.
// Split 4 ways there (and the shared expert's gate|up), the 256-token prefill gained 0.5% (H100,
// 2026-12-07). The split changes how an output's sum is associated, so a product's bits now
// depend on n and on the card's multiprocessor count (as a prompt's do on its pieces already).
int k_splits(int in, bool staged_scales, long tiles, long sms) {
  if (!staged_scales) return 1;
  const int kt = in / BK;
  int s = 1;
  while (s < 8 && tiles * 2 * s <= 2 * sms && kt % (2 * s * kSbGroups) == 0) s *= 2;
  return s;
}

// The automatic choice for a dense product: rows a tile (64, 128 or 256) and k splits (64 only).
struct DenseTiles {
  int rows;
  long row_tiles;
  int splits;
};
DenseTiles dense_tiles(int out, int in, int n_rows, bool staged_scales) {
  const long sms = sm_count();
  const long cols128 = (out + 127) / 128;
  const long tiles256 = (long(n_rows) + 255) / 256;
  if (tiles256 * cols128 * 8 >= sms * 7 && long(n_rows) * 8 >= tiles256 * 256 * 7) return {256, tiles256, 1};
  const long tiles128 = (long(n_rows) + 127) / 128;
  if (tiles128 * cols128 >= 2 * sms) return {128, tiles128, 1};
  const long tiles64 = (long(n_rows) + 63) / 64;
  return {64, tiles64, k_splits(in, staged_scales, tiles64 * cols128, sms)};
}

int g_force_rows = 0, g_force_wg = 0;  // set_wgmma_tiles

template <int kN>
void launch_n(const Params& p, int wg, long row_tiles, cudaStream_t stream) {
  if (wg == 4) return launch<kN, 4>(p, row_tiles, stream);
  return launch<kN, 2>(p, row_tiles, stream);
}

}  // namespace

void set_wgmma_tiles(int rows, int warpgroups) {
  TANSY_CHECK((rows == 0 && warpgroups == 0) ||
                  ((rows == 64 || rows == 128) && (warpgroups == 2 || warpgroups == 4)) ||
                  (rows == 256 && warpgroups == 2),
              "gemm (wgmma): tile {} rows x {} warpgroups is not built", rows, warpgroups);
  g_force_rows = rows;
  g_force_wg = warpgroups;
}

// Dense: 256-row tiles of 128 columns when they make at least 7/8 of a wave (one block per
// multiprocessor) and their rows are at least 7/8 used; else 128-row tiles when two blocks per
// multiprocessor fill the machine; else 64-row tiles, split over k when they leave the machine
// short (k_splits). Grouped (64-row tiles, moe_route_sort's
// schedule): 256 columns when there are tiles enough, else 128.
void launch_wgmma(const Params& p, bool grouped, long row_tiles, cudaStream_t stream) {
  static_assert(kGroupedBM == 64);
  TANSY_CHECK(!grouped || p.tile_rows == kGroupedBM,
              "gemm_grouped (wgmma): the schedule's {}-row tiles are not built here (only {})", p.tile_rows,
              kGroupedBM);
  const long sms = sm_count();
  if (g_force_rows) {
    const int rows = grouped ? 64 : g_force_rows;
    if (!grouped) row_tiles = (long(p.n_rows) + rows - 1) / rows;
    if (rows == 256) return launch<256, 2>(p, row_tiles, stream);
    if (rows == 128) return launch_n<128>(p, g_force_wg, row_tiles, stream);
    return launch_n<64>(p, g_force_wg, row_tiles, stream);
  }
  if (grouped) {
    if (row_tiles * ((p.out + 255) / 256) >= 2 * sms) return launch<64, 4>(p, row_tiles, stream);
    return launch<64, 2>(p, row_tiles, stream);
  }
  const DenseTiles d = dense_tiles(p.out, p.in, p.n_rows, stages_scales(p));
  if (d.rows == 256) return launch<256, 2>(p, d.row_tiles, stream);
  if (d.rows == 128) return launch<128, 2>(p, d.row_tiles, stream);
  return launch<64, 2>(p, d.row_tiles, stream, d.splits);
}

int wgmma_k_splits(int out, int in, int n_rows, bool staged_scales) {
  return dense_tiles(out, in, n_rows, staged_scales).splits;
}

}  // namespace tansy::cuda::gemm_impl
