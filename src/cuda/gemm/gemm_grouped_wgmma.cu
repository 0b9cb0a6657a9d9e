// Grouped (per-expert) 4-bit GEMM on Hopper's warpgroup tensor cores, persistent, for MoE prefill.
//
// Same product and fragment scheme as gemm_wgmma.cu (D[out column][token] = W_e · Xᵀ, the codes
// dequantized by each lane straight into its wgmma A fragment, X the B operand through a
// 128-byte-swizzle descriptor, k-tile 64 = one quant group; 2 warpgroups of 64 output columns per
// block), with what the grouped shapes need (at 4,096 tokens each of 256 experts gets 128 rows on
// average: ~90-165 with uniform routing, 28-356 on the synthetic checkpoint):
//
// - Tiles sized to the experts: the token dimension is the wgmma N, so a tile of kN rows (64, 96,
//   128, 144, 192 or 256) costs kN rows of tensor work. Expert e's c_e rows form ceil(c_e / kN)
//   tiles of balanced size. The host picks a pair of sizes from the mean rows per expert
//   (choose_rows), the kernel one of the two from the launch's real counts
//   (gemm_grouped_wgmma_pair_kernel): at 4,096 tokens 144 (one tile per expert under uniform
//   routing, 11% padding) or 192 (the wider counts of real routers, 18% fewer tiles). The first
//   wgmma kernel's 64-row tiles took 2-3 tiles per expert (25% padding, the weights dequantized 2-3
//   times, N = 64 wgmmas). kN is a compile-time choice: picking the instruction per tile at run time
//   makes ptxas serialize the kernel's wgmmas (wgmma.cuh); the pair kernel holds one whole copy of
//   the body per size, chosen once per block before either starts.
// - Persistent blocks over a tile list: one block per multiprocessor walks the work items (tile,
//   128-column tile) blockIdx.x, + gridDim.x, ... The cp.async pipeline (4 stages of X and packed
//   weights) runs across item boundaries, so the next item's first stages load while the current one
//   finishes and stores: with in = 512 (down_proj) an item is only 8 k-tiles, and a non-persistent
//   block paid its pipeline fill and its epilogue unoverlapped each time.
// - Heavy experts first: every block ranks the experts by row count (descending, ties by index)
//   from expert_offsets and numbers the tiles in that order, column tile fastest (the column tiles
//   of one row tile run side by side and share its X rows in L2; the row tiles of one expert follow
//   each other and share its weights). The small tiles of rarely chosen experts come last and fill
//   the tail. Experts with no rows have no tiles.
//
// Per k-tile step: issue the wgmmas of step s; wait for step s-1's (at most one group in flight, so
// the tensor cores always hold the next k-tile's work while the block prepares the one after); wait
// for stage s+1, barrier; start the copy of step s+3 (into the stage of step s-1, whose wgmmas every
// warp has waited for); dequantize step s+1 into the A buffer step s-1 read and fetch the
// (scale, bias) of step s+2. Two cursors walk the
// item list ahead of the products (copies at s+3, scales at s+2); each decodes its item from the
// shared tile list when it reaches the item's first k-tile. At an item's last k-tile the
// accumulators go, 64 rows at a time, through an f32 tile in shared memory of its own (the stages
// keep loading) to the shared epilogue (gemm_impl.cuh store_tile): same stores, same rounding.
#include <algorithm>
#include <cmath>
#include <iterator>

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
constexpr int kWG = 2;         // warpgroups per block
constexpr int kThreads = 128 * kWG;
constexpr int BN = 64 * kWG;    // output columns per item
constexpr int kW = BN * kWRow;  // one packed weight stage
constexpr int kPass = 64;       // tile rows per epilogue pass
constexpr int kCld = BN + 4;    // f32 output tile row
constexpr int kC = kPass * kCld * 4;
constexpr int kSchedInts = 3 * kGroupedMaxExperts + 2;  // offsets [E+1], order [E], tile starts [E+1]

// The tile row counts it is built for (wgmma N; gemm_impl.cuh kGroupedWgmmaRows).
template <int kN>
struct Shape {
  static constexpr int kX = kN * BK * 2;                                      // one X stage
  static constexpr int kAcc = kN / 2;                                         // f32 accumulators per thread
  static constexpr int kXChunks = (kN * (BK / 8) + kThreads - 1) / kThreads;  // 16-byte X copies per thread
  static constexpr int kSmem = kStages * (kX + kW) + kC + kSchedInts * 4 + 1024;  // + 1024: aligned up
  // 64-row tiles fit two blocks per multiprocessor (128 registers, 95 KB): one's epilogue overlaps
  // the other's products. Larger tiles need more registers than that.
  static constexpr int kBlocksPerSm = kN <= 64 ? 2 : 1;
  static_assert(kN % 16 == 0 && kN <= 256 && kX % 1024 == 0 && kSmem <= 227 * 1024);
  static_assert(kN > 64 || 2 * kSmem <= 228 * 1024);
};
static_assert(kW % 1024 == 0 && kC % 16 == 0 && BN * (kWRow / 16) == kThreads);

// A 16-byte copy to shared memory (address) that is always taken: no source-size operand.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// One work item: a tile of rows [row0, row_end) of expert e times output columns n0 .. n0+BN.
struct Item {
  int e, row0, row_end, n0;
};

template <int kN>
__device__ __forceinline__ void grouped_body(const Params& p) {
  using S = Shape<kN>;
  constexpr int kX = S::kX, kAcc = S::kAcc, kXChunks = S::kXChunks;
  extern __shared__ unsigned char smem_raw[];
  __shared__ int warp_sum[kThreads / 32];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  unsigned char* const smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t xs_addr = tc::smem_addr(smem);
  unsigned char* const Ws = smem + kStages * kX;
  const uint32_t ws_addr = xs_addr + uint32_t(kStages * kX);
  float* const Cs = reinterpret_cast<float*>(Ws + kStages * kW);
  int* const s_off = reinterpret_cast<int*>(Ws + kStages * kW + kC);  // expert_offsets
  int* const s_order = s_off + kGroupedMaxExperts + 1;                // expert of each rank
  int* const s_tstart = s_order + kGroupedMaxExperts;                 // first tile of each rank

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, t = lane % 4;
  const int E = p.n_experts;

  // ---- the tile list: experts ranked by row count, descending; tiles numbered in rank order ----
  for (int i = tid; i <= E; i += kThreads) s_off[i] = p.expert_offsets[i];
  __syncthreads();
  for (int e = tid; e < E; e += kThreads) {
    const int c = s_off[e + 1] - s_off[e];
    int rank = 0;
    for (int o = 0; o < E; ++o) {
      const int co = s_off[o + 1] - s_off[o];
      rank += co > c || (co == c && o < e);
    }
    s_order[rank] = e;
  }
  __syncthreads();
  auto tiles_of = [&](int e) { return (s_off[e + 1] - s_off[e] + kN - 1) / kN; };
  {
    // Exclusive scan of the tile counts over ranks, kPer consecutive ranks per thread.
    constexpr int kPer = (kGroupedMaxExperts + kThreads - 1) / kThreads;
    const int r0 = kPer * tid;
    int tl[kPer];
    int v = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) v += tl[i] = r0 + i < E ? tiles_of(s_order[r0 + i]) : 0;
    const int mine = v;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, v, o);
      if (lane >= o) v += x;
    }
    if (lane == 31) warp_sum[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int w = lane < kThreads / 32 ? warp_sum[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int x = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += x;
      }
      if (lane < kThreads / 32) warp_sum[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    int before = v - mine + (warp > 0 ? warp_sum[warp - 1] : 0);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (r0 + i < E) s_tstart[r0 + i] = before;
      before += tl[i];
    }
    if (tid == 0) s_tstart[E] = warp_sum[kThreads / 32 - 1];
    __syncthreads();
  }
  const int n_col = (p.out + BN - 1) / BN;
  const long n_items = long(s_tstart[E]) * n_col;
  if (long(blockIdx.x) >= n_items) return;
  const int my_items = int((n_items - 1 - blockIdx.x) / gridDim.x) + 1;
  const int KT = p.in / BK;
  const int total_steps = my_items * KT;

  // Item j of this block (the j-th of blockIdx.x, + gridDim.x, ...). Ranks with no tiles are the
  // last ones (sorted by count) and start at the total, so the last rank starting at or before the
  // tile index owns it.
  auto decode = [&](int j) {
    const long item = long(blockIdx.x) + long(j) * gridDim.x;
    const int ti = int(item / n_col), col = int(item - long(ti) * n_col);
    int lo = 0, hi = E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (s_tstart[mid] <= ti)
        lo = mid;
      else
        hi = mid - 1;
    }
    Item it;
    it.e = s_order[lo];
    const int base = s_off[it.e], c = s_off[it.e + 1] - base, nt = (c + kN - 1) / kN;
    const long jt = ti - s_tstart[lo];
    it.row0 = base + int(jt * c / nt);
    it.row_end = base + int((jt + 1) * c / nt);
    it.n0 = col * BN;
    return it;
  };

  // ---- copy cursor: step (ld_j, ld_kt) of the items, into stage ld_stage ----
  // X chunk i of this thread: tile row tid/8 + 32i, 16-byte chunk tid%8; weight chunk: row tid/2,
  // half tid%2. Rows past the tile's end copy its first row and rows past the matrix its last (they
  // reach only outputs never stored); rows past the tile's N are not copied (wgmma does not read them).
  // (The launcher checks that every expert's codes and (scale, bias) arrays take 32-bit offsets.)
  // The per-step work is instruction-bound (Nsight Compute: ~265 instructions per warp in each
  // k-tile step, ~330 with the per-item work; 1.5 issued per cycle per multiprocessor with 8
  // warps), so everything that does not change from
  // one k-tile to the next is computed once per item: the global pointers (advanced by one k-tile
  // per step), the shared-memory offsets (chunk i is 32 rows = 4,096 bytes after chunk 0: the
  // swizzle term c ^ (r % 8) is the same for all of a thread's chunks) and the row predicates.
  const uint32_t row_bytes = uint32_t(p.in) / 2;
  int ld_j = 0, ld_kt = 0;
  const __nv_bfloat16* x_src[kXChunks];
  bool x_on[kXChunks];
  const unsigned char* w_src = nullptr;
  const uint32_t x_dst = uint32_t((tid / 8) * 128 + (((tid % 8) ^ ((tid / 8) & 7)) << 4));
  const uint32_t w_dst = uint32_t((tid / 2) * kWRow + (tid % 2) * 16);
  auto load_next = [&](int ld_stage) {
    if (ld_kt == 0) {
      const Item it = decode(ld_j);
      const int rows8 = (it.row_end - it.row0 + 7) / 8 * 8;
#pragma unroll
      for (int i = 0; i < kXChunks; ++i) {
        const int r = tid / 8 + i * (kThreads / 8);
        const int grow = it.row0 + r < it.row_end ? it.row0 + r : it.row0;
        const int xrow = p.sorted_slot ? p.sorted_slot[grow] / p.gather_k : grow;
        x_src[i] = p.X + (uint32_t(xrow) * uint32_t(p.ldx) + uint32_t(tid % 8) * 8);
        x_on[i] = r < rows8;  // (rows8 <= kN also bounds the last, partial round of copies)
      }
      w_src = reinterpret_cast<const unsigned char*>(p.q) +
              ((uint32_t(it.e) * uint32_t(p.out) + uint32_t(min(it.n0 + tid / 2, p.out - 1))) * row_bytes +
               uint32_t(tid % 2) * 16);
    }
    const uint32_t xs = xs_addr + uint32_t(ld_stage * kX) + x_dst;
#pragma unroll
    for (int i = 0; i < kXChunks; ++i) {
      if (x_on[i]) cp_async16(xs + uint32_t(i * (kThreads / 8) * 128), x_src[i]);
      x_src[i] += BK;
    }
    cp_async16(ws_addr + uint32_t(ld_stage * kW) + w_dst, w_src);
    w_src += kWRow;
    if (++ld_kt == KT) {
      ld_kt = 0;
      ++ld_j;
    }
  };

  // ---- (scale, bias) cursor: the lane's two weight rows, rows g and g+8 of warp (warp % 4)'s 16
  // in warpgroup warp / 4's 64 ----
  const int wr0 = (warp / 4) * 64 + (warp % 4) * 16 + g, wr1 = wr0 + 8;
  const int groups = p.in / kQuantGroup;
  int sb_j = 0, sb_kt = 0;
  // scale and bias of rows wr0, wr1 at the next group to fetch
  const __nv_bfloat16 *sc0 = nullptr, *sc1 = nullptr, *bi0 = nullptr, *bi1 = nullptr;
  __nv_bfloat162 sbn[2] = {};  // (scale, bias) of rows wr0, wr1 for the next step to dequantize
  auto load_sb_next = [&] {
    if (sb_j >= my_items) return;
    if (sb_kt == 0) {
      const Item it = decode(sb_j);
      const uint32_t e_row = uint32_t(it.e) * uint32_t(p.out);
      const uint32_t i0 = (e_row + uint32_t(min(it.n0 + wr0, p.out - 1))) * uint32_t(groups);
      const uint32_t i1 = (e_row + uint32_t(min(it.n0 + wr1, p.out - 1))) * uint32_t(groups);
      sc0 = p.scales + i0, bi0 = p.biases + i0, sc1 = p.scales + i1, bi1 = p.biases + i1;
    }
    sbn[0] = __halves2bfloat162(*sc0++, *bi0++);
    sbn[1] = __halves2bfloat162(*sc1++, *bi1++);
    if (++sb_kt == KT) {
      sb_kt = 0;
      ++sb_j;
    }
  };

  const uint32_t sel = uint32_t(t) | (uint32_t(t + 4) << 4);
  // A fragments [k16 step][reg] of one k-tile from stage `stage`, with sbn (gemm_wgmma.cu's scheme).
  auto dequant = [&](int stage, uint32_t(&a)[4][4]) {
    const unsigned char* ws = Ws + stage * kW;
    const uint4 r0a = wg::lds128(ws + wr0 * kWRow), r0b = wg::lds128(ws + wr0 * kWRow + 16);
    const uint4 r1a = wg::lds128(ws + wr1 * kWRow), r1b = wg::lds128(ws + wr1 * kWRow + 16);
    const __nv_bfloat162 s0 = __low2bfloat162(sbn[0]), b0 = __high2bfloat162(sbn[0]);
    const __nv_bfloat162 s1 = __low2bfloat162(sbn[1]), b1 = __high2bfloat162(sbn[1]);
    const uint4 d0[2] = {dequant4(wg::gather_byte(r0a, sel), s0, b0),
                         dequant4(wg::gather_byte(r0b, sel), s0, b0)};
    const uint4 d1[2] = {dequant4(wg::gather_byte(r1a, sel), s1, b1),
                         dequant4(wg::gather_byte(r1b, sel), s1, b1)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      a[2 * h][0] = d0[h].x, a[2 * h][1] = d1[h].x, a[2 * h][2] = d0[h].y, a[2 * h][3] = d1[h].y;
      a[2 * h + 1][0] = d0[h].z, a[2 * h + 1][1] = d1[h].z, a[2 * h + 1][2] = d0[h].w,
                a[2 * h + 1][3] = d1[h].w;
    }
  };

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < total_steps) load_next(s);
    tc::cp_async_commit();
  }
  load_sb_next();
  tc::cp_async_wait<kStages - 2>();
  wg::fence_proxy_async();
  __syncthreads();
  uint32_t a_even[4][4], a_odd[4][4];  // A of the even / odd steps: one is read by the running wgmmas
  dequant(0, a_even);
  load_sb_next();

  // Step s of item cj (its k-tile ckt), in stage s % kStages: issue its wgmmas from a_use, then wait
  // for step s-1's (they read a_fill and stage (s-1) % kStages), so that step s keeps the tensor
  // cores busy while the block refills that stage and dequantizes step s+1 into a_fill.
  int cj = 0, ckt = 0;
  auto step = [&](int s, uint32_t(&a_use)[4][4], uint32_t(&a_fill)[4][4]) {
    uint64_t desc[4];  // k16 steps: 32 bytes apart (+2 in the address field, which cannot carry)
#pragma unroll
    for (int k = 0; k < 4; ++k) desc[k] = wg::desc_sw128_at(xs_addr + uint32_t((s % kStages) * kX), k);
    wg::fence_regs(acc);
    wg::fence_regs(a_use);
    wg::wgmma_arrive();
#pragma unroll
    for (int k = 0; k < 4; ++k) wg::wgmma_rs<kN>(acc, a_use[k], desc[k]);
    wg::wgmma_commit();
    wg::wgmma_wait1();
    wg::fence_regs(a_fill);
    tc::cp_async_wait<kStages - 3>();  // step s+1 has landed (this thread's copies)
    wg::fence_proxy_async();
    __syncthreads();  // ... everyone's; and every warp is done with the wgmmas of step s-1
    if (s + kStages - 1 < total_steps) load_next((s + kStages - 1) % kStages);
    tc::cp_async_commit();
    // (unconditional: past the last step it reads a stage that is never used, harmlessly)
    dequant((s + 1) % kStages, a_fill);
    load_sb_next();
    if (++ckt < KT) return;

    // Item cj is complete: acc[4i + r] is output column wr0 + (r >> 1)·8, tile row 8i + 2t + (r & 1).
    wg::wgmma_wait0();
    wg::fence_regs(acc);
    ckt = 0;
    const Item it = decode(cj++);
#pragma unroll
    for (int h = 0; h < (kN + kPass - 1) / kPass; ++h) {  // every pass, even past the rows: reading
      // acc behind a branch ptxas takes for divergent serializes the wgmmas (C7520)
#pragma unroll
      for (int i = 0; i < kPass / 8 && h * kPass / 8 + i < kN / 8; ++i)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          Cs[(8 * i + 2 * t + (r & 1)) * kCld + wr0 + (r >> 1) * 8] = acc[4 * (h * kPass / 8 + i) + r];
      __syncthreads();
      store_tile<BN, kPass, kThreads, kCld>(p, Cs, it.row0 + h * kPass, it.row_end, it.n0, tid);
      __syncthreads();  // Cs is free again
    }
#pragma unroll
    for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  };
  for (int s = 0; s < total_steps; s += 2) {  // two steps a trip: the A buffers swap roles by name
    step(s, a_even, a_odd);
    if (s + 1 < total_steps) step(s + 1, a_odd, a_even);
  }
  wg::wgmma_wait0();
  tc::cp_async_wait<0>();
}

// One tile size: the sizes forced by tests and Timing.Gemm (set_grouped_wgmma_rows), and the
// automatic choice where no larger size is built.
template <int kN>
__global__ void __launch_bounds__(kThreads, Shape<kN>::kBlocksPerSm)
    gemm_grouped_wgmma_kernel(const Params p) {
  grouped_body<kN>(p);
}

// Two tile sizes, chosen per launch from the routed counts (which only the device knows): every
// block sums the tiles each size would make, Σ_e ceil(c_e / N), and runs the cheaper one; the host
// picks the pair from the mean count (choose_rows). Same products whichever size runs: an output
// row's sums do not depend on its tile (Gemm.GroupedWgmma checks the bits), so the choice never
// changes a result. The routed counts spread far wider than the Poisson spread of uniform routing:
// at 4,096 tokens the synthetic checkpoint's experts get 28-356 rows (sd ~50 against ~11), where
// 192-row tiles make 18% fewer tiles than 144-row ones.
template <int kNa, int kNb>
__global__ void __launch_bounds__(kThreads, 1) gemm_grouped_wgmma_pair_kernel(const Params p) {
  __shared__ long part[2][kThreads / 32];
  long ta = 0, tb = 0;
  for (int e = threadIdx.x; e < p.n_experts; e += kThreads) {
    const int c = p.expert_offsets[e + 1] - p.expert_offsets[e];
    ta += (c + kNa - 1) / kNa;
    tb += (c + kNb - 1) / kNb;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    ta += __shfl_xor_sync(0xffffffffu, ta, o);
    tb += __shfl_xor_sync(0xffffffffu, tb, o);
  }
  if (threadIdx.x % 32 == 0) part[0][threadIdx.x / 32] = ta, part[1][threadIdx.x / 32] = tb;
  __syncthreads();
  ta = tb = 0;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) ta += part[0][w], tb += part[1][w];
  if (ta * (kNa + kGroupedTileOverheadRows) <= tb * (kNb + kGroupedTileOverheadRows))
    grouped_body<kNa>(p);
  else
    grouped_body<kNb>(p);
}

template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    fail("gemm_grouped (wgmma): cannot reserve {} bytes of shared memory per block", bytes);
}

// Tiles: at most one per kN rows plus one partial per non-empty expert, times the column tiles.
long max_items(const Params& p, int kN) {
  const long rows = p.n_rows;
  return ((rows + kN - 1) / kN + std::min<long>(p.n_experts, rows)) * ((p.out + BN - 1) / BN);
}

template <int kN>
void launch(const Params& p, cudaStream_t stream) {
  constexpr int kSmem = Shape<kN>::kSmem;
  static const bool attr_set = (set_smem(gemm_grouped_wgmma_kernel<kN>, kSmem), true);
  (void)attr_set;
  const int grid = int(std::min<long>(max_items(p, kN), long(Shape<kN>::kBlocksPerSm) * sm_count()));
  gemm_grouped_wgmma_kernel<kN><<<grid, kThreads, kSmem, stream>>>(p);
  launch_check("gemm_grouped (wgmma)");
}

template <int kNa, int kNb>
void launch_pair(const Params& p, cudaStream_t stream) {
  static_assert(kNa > 64 && kNa < kNb);  // one block per multiprocessor for both
  constexpr int kSmem = std::max(Shape<kNa>::kSmem, Shape<kNb>::kSmem);
  static const bool attr_set = (set_smem(gemm_grouped_wgmma_pair_kernel<kNa, kNb>, kSmem), true);
  (void)attr_set;
  const int grid = int(std::min<long>(max_items(p, kNb), sm_count()));
  gemm_grouped_wgmma_pair_kernel<kNa, kNb><<<grid, kThreads, kSmem, stream>>>(p);
  launch_check("gemm_grouped (wgmma)");
}

int g_force_rows = 0;  // set_grouped_wgmma_rows

// The smaller tile rows for `rows` routed rows over `experts` experts: the built size with the least
// expected work when each expert's count is Poisson with the mean rows / experts (uniform routing),
// at kGroupedTileOverheadRows per tile. At 4,096 tokens (mean 128) that is 144: one tile per expert, 11%
// padding, where 128-row tiles would split half the experts in two. The kernel then takes it or
// the next larger size, whichever the launch's real counts make cheaper.
int choose_rows(long rows, int experts) {
  thread_local long memo_rows = -1;
  thread_local int memo_experts = -1, memo_n = 0;
  if (rows == memo_rows && experts == memo_experts) return memo_n;
  const double mean = double(rows) / experts;
  int best = kGroupedWgmmaRows[0];
  double best_cost = 0;
  for (const int n : kGroupedWgmmaRows) {
    double cost = 0;
    const double sd = std::sqrt(mean);
    const int c0 = std::max(1, int(mean - 8 * sd)), c1 = int(mean + 8 * sd) + 8;
    for (int c = c0; c <= c1; ++c) {
      const double pmf = std::exp(c * std::log(mean) - mean - std::lgamma(c + 1.0));
      cost += pmf * double((c + n - 1) / n) * (n + kGroupedTileOverheadRows);
    }
    if (n == kGroupedWgmmaRows[0] || cost < best_cost) best = n, best_cost = cost;
  }
  memo_rows = rows, memo_experts = experts, memo_n = best;
  return best;
}

}  // namespace

void set_grouped_wgmma_rows(int rows) {
  TANSY_CHECK(rows == 0 || std::find(std::begin(kGroupedWgmmaRows), std::end(kGroupedWgmmaRows), rows) !=
                               std::end(kGroupedWgmmaRows),
              "gemm_grouped (wgmma): {}-row tiles are not built", rows);
  g_force_rows = rows;
}

int grouped_wgmma_rows(long rows, int experts) {
  return g_force_rows ? g_force_rows : choose_rows(rows, experts);
}

void launch_wgmma_grouped(const Params& p, cudaStream_t stream) {
  TANSY_CHECK(p.expert_offsets && p.n_experts >= 1 && p.n_experts <= kGroupedMaxExperts,
              "gemm_grouped (wgmma): bad expert schedule ({} experts)", p.n_experts);
  TANSY_CHECK(double(p.n_experts) * p.out * p.in / 2 < 4294967296.0,
              "gemm_grouped (wgmma): {} stacked experts of [{}, {}] exceed 32-bit offsets", p.n_experts,
              p.out, p.in);
  static_assert(sizeof(kGroupedWgmmaRows) / sizeof(int) == 6);
  if (!g_force_rows) switch (choose_rows(p.n_rows, p.n_experts)) {
      case 128:
        return launch_pair<128, 144>(p, stream);
      case 144:
        return launch_pair<144, 192>(p, stream);
      case 192:
        return launch_pair<192, 256>(p, stream);
      default:
        break;  // (below 128: one size; the product routes those counts to the mma.sync kernel)
    }
  switch (grouped_wgmma_rows(p.n_rows, p.n_experts)) {
    case 64:
      return launch<64>(p, stream);
    case 96:
      return launch<96>(p, stream);
    case 128:
      return launch<128>(p, stream);
    case 144:
      return launch<144>(p, stream);
    case 192:
      return launch<192>(p, stream);
    default:
      return launch<256>(p, stream);
  }
}

}  // namespace tansy::cuda::gemm_impl
