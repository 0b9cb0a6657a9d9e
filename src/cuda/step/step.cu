// The persistent decode step (step.cuh): one block per multiprocessor, a producer warp streaming
// weight tiles into a ring of shared-memory slots, eight consumer warps computing the products
// from it with grid-wide counters between dependent products.
#include <algorithm>
#include <string>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/device_math.cuh"
#include "cuda/common/grid_sync.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/gdn/decode_step.cuh"
#include "cuda/matvec/chunk.cuh"
#include "cuda/matvec/fused.cuh"
#include "cuda/matvec/tc_tile.cuh"
#include "cuda/moe/moe.cuh"
#include "cuda/moe/route_device.cuh"
#include "cuda/step/step.cuh"

namespace tansy::cuda {
namespace {

using namespace gemv;

constexpr int kConsumers = kThreads;            // 8 warps: the thread count the shared device functions use
constexpr int kStepThreads = kConsumers + 128;  // + a producer warpgroup, whose first warp (8) produces
constexpr int kProducerWarp = kWarps;
// Registers per thread after the split (tc::setmaxnreg_*). The launch gives every thread
// kLaunchRegs (12 warps: three per register file of 16K); the producer warpgroup keeps 88 and the
// consumers take the rest, 2 x 128 x 208 + 128 x 88 = 64,512. 88 is the least the producer's
// routing runs in without spilling (72 spills), so it leaves the consumers the most. With one
// producer warp (9 warps) every thread was held to 168 and the consumers spilled; the split
// decodes 9% faster at 4,096 (docs/PERFORMANCE.md).
constexpr int kLaunchRegs = 16384 / (3 * 32) / 8 * 8;  // 168
constexpr int kProducerRegs = 88, kConsumerRegs = 208;
static_assert(2 * 128 * kConsumerRegs + 128 * kProducerRegs <= kStepThreads * kLaunchRegs);

// The ring: 10 slots of one tile each. A tile is at most 16 rows of a 2048-column 4-bit matrix
// with its scales and biases (18 KiB) plus, for the GDN in_proj, the rows' conv taps and window
// (352 B). 10 slots hold the in_proj's tiles of a block (<= 6 on 132 multiprocessors) together
// with the next two products', so the weights of out_proj and the router land while the
// recurrence runs; the experts' 5 + 3 tiles fit beside each other once the routing is known.
constexpr int kSlots = 10;
constexpr uint32_t kSlotBytes = 19328;  // the in_proj's tensor-core tile with its conv taps (below)
constexpr uint32_t kXsBytes = 20736;    // staged x: the experts' 9 down inputs of 512 are the largest
constexpr size_t kStepSmem = size_t(kSlots) * kSlotBytes + kXsBytes;

using ConsumerSync = NamedSync<1, kConsumers>;
using UnitSync = NamedSync<2, gdn_unit::kUnitThreads>;

// Tile geometry. The row-to-warp assignment is free for products without a residual (each row's
// sum is the same wherever it is computed); out_proj and the experts' down keep the per-op
// kernels' row blocks (8 and 16 rows) because each row block writes one partial sum of h².
constexpr int kRowsIn = 16;      // in_proj (GDN, attention): a tensor-core tile (tc16), all 8 warps
constexpr int kRowsOut = 8;      // out_proj, o_proj: 1 row per warp = one partial sum
constexpr int kRowsRouter = 8;   // router: 1 row per warp
constexpr int kPairsGu = 8;      // experts gate|up: 8 output pairs = one tensor-core tile (16 rows)
constexpr int kRowsDown = 16;    // experts down: 16 output rows x 16 lanes, all K+1 experts
constexpr int kDownPerTile = 4;  // experts per down tile (4 x 16 rows of 512 columns)

// A block's tiles of one tensor-core product at most (in_proj, gate|up), whose partial sums wait
// in shared memory for the product's epilogue: 6 for the GDN in_proj on 132 multiprocessors, 7
// on 114 (decode_step_layers checks).
constexpr int kMaxTcTiles = 8;

struct RouteSmem {
  float l[kRouteMaxExperts + 1];
  int idx[kRouteMaxTopK + 1];
  float w[kRouteMaxTopK + 1];
};

__host__ __device__ inline int n_tiles(const StepArgs& a, const StepLayer& L, int kind) {
  switch (kind) {
    case kGdnIn:
      return (L.gdn_in.out + kRowsIn - 1) / kRowsIn;
    case kAttnIn:
      return (L.attn_in.out + kRowsIn - 1) / kRowsIn;
    case kGdnOut:
    case kAttnOut:
      return a.H / kRowsOut;
    case kRouter:
      return (L.router.out + kRowsRouter - 1) / kRowsRouter;
    case kExpertsGu:
      return (a.K + 1) * (a.I / kPairsGu);
    case kExpertsDown:
      return a.H / kRowsDown;  // row blocks of down_tiles() tiles each
    default:
      return 0;
  }
}
// Experts gate|up tile i -> expert slot j and first output pair p0: the shared expert's tiles
// (slot K) first, so that a block's first tile needs no routing and is computed while the
// producer routes and the routed experts' rows are on their way; then slots 0..K-1.
__device__ __forceinline__ void gu_tile(const StepArgs& a, int i, int& j, int& p0) {
  const int per_slot = a.I / kPairsGu;
  const int r = i < per_slot ? i + a.K * per_slot : i - per_slot;
  j = r / per_slot;
  p0 = (r % per_slot) * kPairsGu;
}
__device__ __forceinline__ int down_tiles(const StepArgs& a) {
  return (a.K + 1 + kDownPerTile - 1) / kDownPerTile;
}

// ---- the ring ----

struct Ring {
  uint64_t* full;   // [kSlots] the slot's copies landed (producer arrival + bytes)
  uint64_t* empty;  // [kSlots] the eight consumer warps are done with it
  uint8_t* slots;
  unsigned n = 0;  // tiles taken so far (producer: issued; consumers: consumed)
};

// Producer (one lane): the next slot, once free, with `bytes` of copies announced on *bar.
__device__ __forceinline__ uint8_t* ring_acquire(Ring& r, unsigned bytes, uint64_t*& bar) {
  const unsigned slot = r.n % kSlots, round = r.n / kSlots;
  ++r.n;
  if (round > 0) bulk::mbar_wait(&r.empty[slot], (round - 1) & 1);
  bar = &r.full[slot];
  bulk::mbar_expect_tx(bar, bytes);
  return r.slots + size_t(slot) * kSlotBytes;
}

// Consumer warp: the next tile, once landed.
__device__ __forceinline__ const uint8_t* ring_wait(Ring& r, unsigned& slot) {
  slot = r.n % kSlots;
  const unsigned round = r.n / kSlots;
  ++r.n;
  bulk::mbar_wait(&r.full[slot], round & 1);
  return r.slots + size_t(slot) * kSlotBytes;
}
__device__ __forceinline__ void ring_release(Ring& r, unsigned slot, int lane) {
  __syncwarp();
  if (lane == 0) bulk::mbar_arrive(&r.empty[slot]);
}

// ---- the grid barrier (consumer threads) ----

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Profiling: block b's time stamp `which` of product p (StepArgs::prof).
__device__ __forceinline__ void stamp(const StepArgs& a, unsigned p, int which) {
  if (a.prof && threadIdx.x == 0)
    a.prof[(size_t(p) * kStepStamps + which) * gridDim.x + blockIdx.x] = global_ns();
}
// Release / acquire at GPU scope (common/grid_sync.cuh): the consumer barrier before the release
// and after the acquire carries the order to the block's other consumer threads.
__device__ __forceinline__ void grid_arrive(unsigned* bar) {
  ConsumerSync{}();  // the block's writes of the product are done
  if (threadIdx.x == 0) red_add_release_gpu(bar, 1u);
}
__device__ __forceinline__ void grid_wait(const unsigned* bar, unsigned target) {
  if (threadIdx.x == 0) {
    while (ld_acquire_gpu(bar) < target) {
    }
  }
  ConsumerSync{}();
}

// The shapes the step's dot products are unrolled for (the real model's; step_supported checks
// them): chunks per row of the router's 2048 8-bit columns, of out_proj's 4096 columns, of the
// experts' 512-column down rows; slots per token. (The 2048-column 4-bit products run on tensor
// cores: matvec/tc_tile.cuh.)
constexpr int kHidden = 2048, kValueDim = 4096, kMoeInter = 512, kSlotsPerToken = 9;
static_assert(kHidden == tc16::kIn && kRowsIn == tc16::kRows && 2 * kPairsGu == tc16::kRows);
constexpr int kCprRouter = kHidden / Chunk<8>::kCols;  // 128
constexpr int kCprOut = kValueDim / Chunk<4>::kCols;   // 128
constexpr int kCprDown = kMoeInter / Chunk<4>::kCols;  // 16: one chunk per lane of 16

// R rows' dot products from their tile (rows lr[r] of it): lane l takes chunks l, l+32, ... and adds
// them in that order (the per-op kernels' order). Each chunk's product is independent, so the
// unrolled loop keeps R * CPR/32 of them in flight in the warp.
template <int BITS, int CPR, int R>
__device__ __forceinline__ void dot_rows(const uint8_t* wtile, const bf16* sc, const bf16* bi,
                                         const int (&lr)[R], const float* xs, int lane, float (&acc)[R]) {
  constexpr int S = Chunk<BITS>::kStride, N = CPR / 32, RB = CPR * 16;
  constexpr int GR = CPR * Chunk<BITS>::kCols / kQuantGroup;  // quant groups per row
  static_assert(CPR % 32 == 0);
  float d[R][N];
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const int c = lane + 32 * n;
    const int g = (c * Chunk<BITS>::kCols) / kQuantGroup;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 w = *reinterpret_cast<const uint4*>(wtile + lr[r] * RB + c * 16);
      d[r][n] = chunk_dot<BITS>(w, xs + c * S, __bfloat162float(sc[lr[r] * GR + g]),
                                __bfloat162float(bi[lr[r] * GR + g]));
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int n = 0; n < N; ++n) acc[r] += d[r][n];
  }
}

// Row-tile layout in a slot for the CUDA-core products (out_proj, router): codes [cap rows],
// scales [cap rows], biases [cap rows]. (The tensor-core tiles: tc16's layout, copy_tile_tc.)
struct TileLayout {
  uint32_t sc, bi;
};
__device__ __forceinline__ TileLayout tile_layout(int cap, int row_bytes, int groups) {
  TileLayout t;
  t.sc = uint32_t(cap * row_bytes);
  t.bi = t.sc + uint32_t(cap * groups * 2);
  return t;
}

// The tensor-core tiles (in_proj of both mixers, experts gate|up) in a slot: tc16's tile, then for
// the GDN's conv rows the taps [16][4] f32 and the window [3][16] bf16.
constexpr uint32_t kTcCw = tc16::kTileBytes;
constexpr uint32_t kTcWin = kTcCw + kRowsIn * 4 * 4;
static_assert(kTcWin + 3 * kRowsIn * 2 <= kSlotBytes && kSlotBytes % 128 == 0);
static_assert(size_t(kHidden / Chunk<4>::kCols) * Chunk<4>::kStride * 4 + tc16::kPackBytes <= kXsBytes);

// ---- the producer ----

template <int BITS>
__device__ __forceinline__ void copy_rows(uint8_t* dst, const TileLayout& t, const DevLinear& W, int64_t r0,
                                          int rows, uint64_t* bar) {
  const int64_t rb = int64_t(W.in) * BITS / 8, groups = W.in / kQuantGroup;
  bulk::copy(dst, reinterpret_cast<const uint8_t*>(W.q) + r0 * rb, unsigned(rows * rb), bar);
  bulk::copy(dst + t.sc, W.scales + r0 * groups, unsigned(rows * groups * 2), bar);
  bulk::copy(dst + t.bi, W.biases + r0 * groups, unsigned(rows * groups * 2), bar);
}
template <int BITS>
__device__ __forceinline__ unsigned rows_bytes(const DevLinear& W, int rows) {
  return unsigned(rows * (W.in * BITS / 8 + (W.in / kQuantGroup) * 4));
}

// The producer warp's routing of layer L once the router's logits are complete (counter >= target):
// the per-op route epilogue's arithmetic, into shared memory (and, from block 0, the global copies).
__device__ void route(const StepArgs& a, const StepLayer& L, unsigned target, RouteSmem& rs, int lane) {
  while (ld_acquire_gpu(a.barrier) < target) {
  }
  for (int e = lane; e <= a.E; e += 32) rs.l[e] = __ldcg(a.logits + e);
  __syncwarp();
  route_warp<8>(rs.l, a.E, a.K, rs.idx, rs.w);
  __syncwarp();
  if (lane == 0) {
    rs.idx[a.K] = a.E;
    rs.w[a.K] = sigmoid(rs.l[a.E]);
  }
  __syncwarp();
  if (blockIdx.x == 0 && lane <= a.K) {
    a.topk_idx[lane] = rs.idx[lane];
    a.topk_w[lane] = rs.w[lane];
    if (a.route_log) a.route_log[L.index * (a.K + 1) + lane] = rs.idx[lane];
  }
}

// One 16-row tile of a 2048-column 4-bit matrix (rows r0..r0+15) into the next slot in the
// tensor-core layout, with the GDN's conv taps and window when `conv`, by the whole producer
// warp: lane 0 takes the slot and announces the bytes, then lanes 0-15 copy a row each and lanes
// 16-21 the scales, biases, taps and window rows (one bulk copy per row: the tile's row pitch is
// not the matrix's).
__device__ void copy_tile_tc(Ring& ring, const DevLinear& W, int64_t r0, bool conv, const StepArgs& a,
                             const StepLayer& L, int lane) {
  constexpr unsigned kGroupBytes = kRowsIn * tc16::kGroups * 2;
  const unsigned bytes =
      kRowsIn * tc16::kRowBytes + 2 * kGroupBytes + (conv ? kRowsIn * 4 * 4 + 3 * kRowsIn * 2 : 0);
  uint64_t* bar = nullptr;
  uint32_t off = 0;
  if (lane == 0) off = uint32_t(ring_acquire(ring, bytes, bar) - ring.slots);
  off = __shfl_sync(0xffffffffu, off, 0);
  bar = ring.full + off / kSlotBytes;
  uint8_t* dst = ring.slots + off;
  __syncwarp();  // the announcement precedes the copies
  const int64_t groups = W.in / kQuantGroup;
  if (lane < kRowsIn)
    bulk::copy(dst + lane * tc16::kPitch,
               reinterpret_cast<const uint8_t*>(W.q) + (r0 + lane) * tc16::kRowBytes, tc16::kRowBytes, bar);
  else if (lane == 16)
    bulk::copy(dst + tc16::kSc, W.scales + r0 * groups, kGroupBytes, bar);
  else if (lane == 17)
    bulk::copy(dst + tc16::kBi, W.biases + r0 * groups, kGroupBytes, bar);
  else if (conv && lane == 18)
    bulk::copy(dst + kTcCw, L.conv_w + r0 * 4, kRowsIn * 4 * 4, bar);
  else if (conv && lane >= 19 && lane < 22)
    bulk::copy(dst + kTcWin + (lane - 19) * kRowsIn * 2, L.window + int64_t(lane - 19) * a.conv_dim + r0,
               kRowsIn * 2, bar);
}

__device__ void produce(const StepArgs& a, const StepLayer& L, int kind, unsigned phase_target, Ring& ring,
                        RouteSmem& rs, int lane) {
  const int G = gridDim.x, b = blockIdx.x;
  const int nt = n_tiles(a, L, kind);
  uint64_t* bar = nullptr;
  switch (kind) {
    case kGdnIn:
    case kAttnIn:
    case kExpertsGu: {
      // The tensor-core tiles, at one issue site (the step's code is kept small). The experts'
      // gate|up: the shared expert's tiles before the routing, then the routed ones; every block
      // routes (the experts' down needs it).
      const bool gu = kind == kExpertsGu;
      const DevLinear& W = gu ? L.gu : kind == kGdnIn ? L.gdn_in : L.attn_in;
      const int shared_tiles = a.I / kPairsGu;
      bool routed = !gu;
      for (int i = b;; i += G) {
        if (!routed && (i >= shared_tiles || i >= nt)) {
          route(a, L, phase_target, rs, lane);
          routed = true;
        }
        if (i >= nt) break;
        int64_t r0 = int64_t(i) * kRowsIn;  // out % 16 == 0 (step_supported)
        if (gu) {
          int j, p0;
          gu_tile(a, i, j, p0);
          r0 = int64_t(i >= shared_tiles ? rs.idx[j] : a.E) * 2 * a.I + 2 * p0;
        }
        // conv_dim % 16 == 0: a tile is all conv rows or none
        copy_tile_tc(ring, W, r0, kind == kGdnIn && r0 < a.conv_dim, a, L, lane);
      }
      break;
    }
    case kGdnOut:
    case kAttnOut:
    case kRouter: {
      const DevLinear& W = kind == kGdnOut ? L.gdn_out : kind == kAttnOut ? L.attn_o : L.router;
      const int cap = kind == kRouter ? kRowsRouter : kRowsOut;
      for (int i = b; i < nt && lane == 0; i += G) {
        const int r0 = i * cap, rows = min(cap, W.out - r0);
        if (kind != kRouter) {
          const TileLayout t = tile_layout(cap, W.in / 2, W.in / kQuantGroup);
          uint8_t* dst = ring_acquire(ring, rows_bytes<4>(W, rows), bar);
          copy_rows<4>(dst, t, W, r0, rows, bar);
        } else {
          const TileLayout t = tile_layout(cap, W.in, W.in / kQuantGroup);
          uint8_t* dst = ring_acquire(ring, rows_bytes<8>(W, rows), bar);
          copy_rows<8>(dst, t, W, r0, rows, bar);
        }
      }
      break;
    }
    case kExpertsDown: {
      const DevLinear& W = L.down;
      const int rb = W.in / 2, groups = W.in / kQuantGroup;
      const int dt = down_tiles(a);
      for (int v = b; v < nt && lane == 0; v += G) {
        for (int tt = 0; tt < dt; ++tt) {
          const int j0 = tt * kDownPerTile, j1 = min(j0 + kDownPerTile, a.K + 1);
          uint8_t* dst = ring_acquire(ring, unsigned(j1 - j0) * rows_bytes<4>(W, kRowsDown), bar);
          const uint32_t sc = kDownPerTile * kRowsDown * rb, bi = sc + kDownPerTile * kRowsDown * groups * 2;
          for (int j = j0; j < j1; ++j) {
            const int jl = j - j0;
            const int64_t r0 = int64_t(rs.idx[j]) * a.H + int64_t(v) * kRowsDown;
            bulk::copy(dst + jl * kRowsDown * rb, reinterpret_cast<const uint8_t*>(W.q) + r0 * rb,
                       unsigned(kRowsDown * rb), bar);
            bulk::copy(dst + sc + jl * kRowsDown * groups * 2, W.scales + r0 * groups,
                       unsigned(kRowsDown * groups * 2), bar);
            bulk::copy(dst + bi + jl * kRowsDown * groups * 2, W.biases + r0 * groups,
                       unsigned(kRowsDown * groups * 2), bar);
          }
        }
      }
      break;
    }
    default:
      break;
  }
  __syncwarp();
}

// ---- the consumers, one function per product ----

struct Consumer {
  const StepArgs& a;
  Ring& ring;
  float* xs;
  float* red;
  RouteSmem& rs;
  int warp, lane;
  float (*part)[kWarps][tc16::kRows];  // [kMaxTcTiles][8 warps][16 rows]: the tensor-core tiles' partial sums
  float (*taps)[kRowsIn][7];           // [kMaxTcTiles][16 rows]: a GDN conv tile's 4 taps and 3 window inputs
  unsigned p = 0;                      // the product's index in the launch (profiling stamps)

  // x of a tensor-core product (xs, f32 chunks as stage_norm / stage_rows leave them) packed after
  // the chunks, and this warp's fragments.
  __device__ void tc_stage(tc16::XFrag& X) const {
    tc16::stage_x(xs, reinterpret_cast<uint8_t*>(xs + (kHidden / Chunk<4>::kCols) * Chunk<4>::kStride), X,
                  ConsumerSync{});
  }

  __device__ void staged() const { stamp(a, p, 2); }
  __device__ void landed(bool first, bool last) const {
    if (first) stamp(a, p, 3);
    if (last) stamp(a, p, 4);
  }
  __device__ float* ss(int point) const { return a.ss + size_t(point) * kNormParts; }
  __device__ const uint8_t* next_tile(unsigned& slot, bool first, bool last) {
    const uint8_t* base = ring_wait(ring, slot);
    landed(first, last);
    return base;
  }

  // GDN in_proj with the input norm, then each row's conv / gate epilogue (GDN), or the attention's
  // in_proj with its input norm, the rows stored for the attention core; on tensor cores (tc16),
  // a thread finishing each row after the block's last tile.
  __device__ void in_proj(const StepLayer& L, bool gdn) {
    const int nt = n_tiles(a, L, gdn ? kGdnIn : kAttnIn);
    if (int(blockIdx.x) >= nt) return;
    NormIn nz;
    nz.h = a.h;
    nz.ss = ss(2 * L.index);
    nz.w = L.in_norm;
    nz.eps = a.eps;
    stage_norm<4>(nz, kHidden, xs, red, false, ConsumerSync{});
    ConsumerSync{}();
    GdnInEpilogue G;
    G.conv_dim = a.conv_dim;
    G.value_dim = a.value_dim;
    G.n_v_heads = a.n_v_heads;
    G.kernel = a.conv_kernel;
    G.conv_w = L.conv_w;
    G.window = L.window;
    G.A_log = L.A_log;
    G.dt_bias = L.dt_bias;
    G.conv_out = a.conv_out;
    G.beta = a.beta;
    G.g = a.g;
    tc16::XFrag X;
    tc_stage(X);
    staged();
    // The warps take the block's tiles without waiting on each other: tile k's partial sums stay
    // in part[k] (its conv taps and window in taps[k]), and every row is finished after the last
    // tile, a thread each, instead of by 16 lanes behind a consumer barrier after every tile.
    int k = 0;
    for (int i = blockIdx.x; i < nt; i += gridDim.x, ++k) {
      unsigned slot;
      const uint8_t* base = next_tile(slot, i == int(blockIdx.x), i + int(gridDim.x) >= nt);
      if (gdn && i * kRowsIn < a.conv_dim && warp == 0 && lane < kRowsIn) {  // before the slot goes back
        const float* cw = reinterpret_cast<const float*>(base + kTcCw);
        const bf16* win = reinterpret_cast<const bf16*>(base + kTcWin);
        float* t = taps[k][lane];
#pragma unroll
        for (int q = 0; q < 4; ++q) t[q] = cw[lane * 4 + q];
#pragma unroll
        for (int q = 0; q < 3; ++q) t[4 + q] = __bfloat162float(win[q * kRowsIn + lane]);
      }
      tc16::tile_partials(base, X, part[k]);
      ring_release(ring, slot, lane);
    }
    ConsumerSync{}();  // every warp's partial sums of every tile are in part
    if (int(threadIdx.x) < k * kRowsIn) {
      const int kk = threadIdx.x / kRowsIn, rl = threadIdx.x % kRowsIn;
      const int row = (blockIdx.x + kk * gridDim.x) * kRowsIn + rl;
      const float y = tc16::row_sum(part[kk], rl);
      a.proj[row] = __float2bfloat16(y);
      if (gdn) {
        float w[4] = {0.f, 0.f, 0.f, 0.f}, in[3] = {0.f, 0.f, 0.f};
        if (row < a.conv_dim) {
#pragma unroll
          for (int q = 0; q < 4; ++q) w[q] = taps[kk][rl][q];
#pragma unroll
          for (int q = 0; q < 3; ++q) in[q] = taps[kk][rl][4 + q];
        }
        gdn_in_epilogue_k4(G, row, y, w, in);
      }
    }
  }

  // The recurrence: unit u = (head u/4, columns (u%4)*32) on threads 0..127; the state is read
  // before waiting on the in_proj (only this unit touches it).
  __device__ void gdn_rec(const StepLayer& L, unsigned pp, gdn_unit::Smem& gsm) {
    GdnDecodeArgs ga;
    ga.conv = a.conv_out;
    ga.beta = a.beta;
    ga.g = a.g;
    ga.n_k_heads = a.n_k_heads;
    ga.n_v_heads = a.n_v_heads;
    ga.state = L.state;
    ga.z = a.proj + a.conv_dim;
    ga.norm_w = L.gnorm;
    ga.eps = a.eps;
    ga.o = a.o;
    ga.counters = a.gdn_counters;
    ga.y = a.mix;
    constexpr int kUnitsPerHead = kGdnDim / gdn_unit::kColsPerUnit;
    const int units = a.n_v_heads * kUnitsPerHead;
    const bool mine = threadIdx.x < gdn_unit::kUnitThreads;
    float s[32];
    float* S = nullptr;
    int u = blockIdx.x;
    if (mine && u < units) {
      S = gdn_unit::state_column(ga, u / kUnitsPerHead, (u % kUnitsPerHead) * gdn_unit::kColsPerUnit);
      gdn_unit::load_state(S, s);
    }
    grid_wait(a.barrier, pp * gridDim.x);
    stamp(a, pp, 0);
    for (; u < units; u += gridDim.x) {
      if (!mine) continue;
      if (u != int(blockIdx.x)) {
        S = gdn_unit::state_column(ga, u / kUnitsPerHead, (u % kUnitsPerHead) * gdn_unit::kColsPerUnit);
        gdn_unit::load_state(S, s);
      }
      gdn_unit::decode_unit(ga, u / kUnitsPerHead, u % kUnitsPerHead, kUnitsPerHead, s, S, gsm, UnitSync{});
    }
  }

  // GDN out_proj or attention o_proj + residual: tile i = rows 8i..8i+7 = partial sum i of the next
  // norm point.
  __device__ void out_proj(const StepLayer& L, int kind) {
    const int nt = n_tiles(a, L, kind);
    if (int(blockIdx.x) >= nt) return;
    // h of this warp's row in the block's tile j, held by lane j (loaded before staging x)
    float hv = 0.f;
    {
      const int i = blockIdx.x + lane * gridDim.x;
      if (i < nt) hv = __ldcg(a.h + i * kRowsOut + warp);
    }
    stage_rows<4>(a.mix, kValueDim, 1, 1, kValueDim, xs, kConsumers);
    ConsumerSync{}();
    staged();
    const TileLayout t = tile_layout(kRowsOut, kValueDim / 2, kValueDim / kQuantGroup);
    float* part = ss(2 * L.index + 1);
    const int lr[1] = {warp};
    int j = 0;
    for (int i = blockIdx.x; i < nt; i += gridDim.x, ++j) {
      unsigned slot;
      const uint8_t* base = next_tile(slot, i == int(blockIdx.x), i + int(gridDim.x) >= nt);
      float y[1];
      dot_rows<4, kCprOut, 1>(base, reinterpret_cast<const bf16*>(base + t.sc),
                              reinterpret_cast<const bf16*>(base + t.bi), lr, xs, lane, y);
      ring_release(ring, slot, lane);
      y[0] = group_sum<32>(y[0]);
      const int row = i * kRowsOut + warp;
      const float hr = j < 32 ? __shfl_sync(0xffffffffu, hv, j) : __ldcg(a.h + row);
      float sq = 0.f;
      if (lane == 0) {
        const float v = hr + y[0];
        a.h[row] = v;
        sq = fmaf(v, v, sq);
      }
      residual_part(sq, part + i, red, ConsumerSync{});
    }
  }

  // Router logits (8-bit) of the MoE input norm; tile 0's block writes the normed input for the experts.
  __device__ void router(const StepLayer& L) {
    const DevLinear& W = L.router;
    const int nt = n_tiles(a, L, kRouter);
    if (int(blockIdx.x) >= nt) return;
    NormIn nz;
    nz.h = a.h;
    nz.ss = ss(2 * L.index + 1);
    nz.w = L.post_norm;
    nz.eps = a.eps;
    nz.xn_out = a.xn;
    stage_norm<8>(nz, kHidden, xs, red, blockIdx.x == 0, ConsumerSync{});
    ConsumerSync{}();
    staged();
    const TileLayout t = tile_layout(kRowsRouter, kHidden, kHidden / kQuantGroup);
    const int lr[1] = {warp};
    for (int i = blockIdx.x; i < nt; i += gridDim.x) {
      unsigned slot;
      const uint8_t* base = next_tile(slot, i == int(blockIdx.x), i + int(gridDim.x) >= nt);
      const int row = i * kRowsRouter + warp;
      if (row < W.out) {  // uniform across the warp
        float y[1];
        dot_rows<8, kCprRouter, 1>(base, reinterpret_cast<const bf16*>(base + t.sc),
                                   reinterpret_cast<const bf16*>(base + t.bi), lr, xs, lane, y);
        y[0] = group_sum<32>(y[0]);
        if (lane == 0) a.logits[row] = y[0];
      }
      ring_release(ring, slot, lane);
    }
  }

  // Experts gate|up with SwiGLU: tile i = (slot j, pairs p0..p0+7) by gu_tile, pair p0 + p from
  // the tile's rows 2p (gate) and 2p+1 (up), on tensor cores (tc16).
  __device__ void experts_gu(const StepLayer& L) {
    const int nt = n_tiles(a, L, kExpertsGu);
    if (int(blockIdx.x) >= nt) return;
    stage_rows<4>(a.xn, kHidden, 1, 1, kHidden, xs, kConsumers);
    ConsumerSync{}();
    tc16::XFrag X;
    tc_stage(X);
    staged();
    int k = 0;  // as in_proj: the pairs finished after the block's last tile
    for (int i = blockIdx.x; i < nt; i += gridDim.x, ++k) {
      unsigned slot;
      const uint8_t* base = next_tile(slot, i == int(blockIdx.x), i + int(gridDim.x) >= nt);
      tc16::tile_partials(base, X, part[k]);
      ring_release(ring, slot, lane);
    }
    ConsumerSync{}();  // every warp's partial sums of every tile are in part
    if (int(threadIdx.x) < k * kPairsGu) {
      const int kk = threadIdx.x / kPairsGu, pl = threadIdx.x % kPairsGu;
      int j, p0;
      gu_tile(a, blockIdx.x + kk * gridDim.x, j, p0);
      const float g = tc16::row_sum(part[kk], 2 * pl), u = tc16::row_sum(part[kk], 2 * pl + 1);
      a.act[int64_t(j) * kMoeInter + p0 + pl] = __float2bfloat16(swiglu_bf16(g, u));
    }
  }

  // Experts down + weighted combine + residual: row block v = rows 16v..16v+15, thread = (row, lane
  // of 16), lane c takes chunk c of every expert in slot order (the per-op kernel's order).
  __device__ void experts_down(const StepLayer& L) {
    const int nt = n_tiles(a, L, kExpertsDown);
    if (int(blockIdx.x) >= nt) return;
    constexpr int Gl = kCprDown;  // lanes per row: one chunk each
    static_assert(Gl == 16 && kConsumers / Gl == kRowsDown);
    const int rl = threadIdx.x / Gl, sub = threadIdx.x % Gl;
    float hv = 0.f;
    {
      const int v = blockIdx.x + sub * gridDim.x;
      if (v < nt) hv = __ldcg(a.h + v * kRowsDown + rl);
    }
    stage_rows<4>(a.act, kMoeInter, kSlotsPerToken, kSlotsPerToken, kMoeInter, xs, kConsumers);
    ConsumerSync{}();
    staged();
    constexpr int S = Chunk<4>::kStride, rb = kMoeInter / 2, groups = kMoeInter / kQuantGroup;
    constexpr uint32_t sc_off = kDownPerTile * kRowsDown * rb,
                       bi_off = sc_off + kDownPerTile * kRowsDown * groups * 2;
    constexpr int dt = (kSlotsPerToken + kDownPerTile - 1) / kDownPerTile;
    const int g = (sub * Chunk<4>::kCols) / kQuantGroup;
    float* part = ss(2 * L.index + 2);
    int jv = 0;
    for (int v = blockIdx.x; v < nt; v += gridDim.x, ++jv) {
      // one expert a pass, in slot order, a tile of kDownPerTile experts at a time; the loop is
      // rolled so that its code stays small (the step's code is fetched again every layer)
      float acc = 0.f;
      unsigned slot = 0;
      const uint8_t* base = nullptr;
#pragma unroll 1
      for (int j = 0; j < kSlotsPerToken; ++j) {
        const int jl = j % kDownPerTile;
        if (jl == 0) {
          if (j > 0) ring_release(ring, slot, lane);
          const int tt = j / kDownPerTile;
          base = next_tile(slot, v == int(blockIdx.x) && tt == 0, v + int(gridDim.x) >= nt && tt == dt - 1);
        }
        const int lr = jl * kRowsDown + rl;
        const uint4 wv = *reinterpret_cast<const uint4*>(base + lr * rb + sub * 16);
        const float s = __bfloat162float(reinterpret_cast<const bf16*>(base + sc_off)[lr * groups + g]);
        const float bb = __bfloat162float(reinterpret_cast<const bf16*>(base + bi_off)[lr * groups + g]);
        acc = fmaf(rs.w[j], chunk_dot<4>(wv, xs + (j * kCprDown + sub) * S, s, bb), acc);
      }
      ring_release(ring, slot, lane);
      acc = group_sum<Gl>(acc);
      const int r = v * kRowsDown + rl;
      const float hr = jv < Gl ? __shfl_sync(0xffffffffu, hv, (lane & ~(Gl - 1)) + jv) : __ldcg(a.h + r);
      float sq = 0.f;
      if (sub == 0) {
        const float nv = hr + acc;
        a.h[r] = nv;
        sq = nv * nv;
      }
      residual_part(sq, part + v, red, ConsumerSync{});
    }
  }
};

// Consumer thread tid's share of the small f32 weights product `kind` of layer N reads after its
// barrier (the norm weights, the gates' A_log and dt_bias, the gated norm's weights), asked into L2
// one product ahead: between two uses they are evicted by the weight stream, and from DRAM they
// would lengthen the x staging (one L2 round trip for h and the partial sums otherwise).
__device__ __forceinline__ void prefetch_small(const StepArgs& a, const StepLayer& N, int kind, int tid) {
  constexpr int kLineFloats = 32;
  auto lines = [&](const float* w, int n, int first) {
    const int l = tid - first;
    if (w && l >= 0 && l * kLineFloats < n) prefetch_l2(w + l * kLineFloats);
    return first + (n + kLineFloats - 1) / kLineFloats;
  };
  switch (kind) {
    case kGdnIn: {
      const int t = lines(N.in_norm, a.H, 0);
      lines(N.dt_bias, a.n_v_heads, lines(N.A_log, a.n_v_heads, t));
      break;
    }
    case kAttnIn:
      lines(N.in_norm, a.H, 0);
      break;
    case kRouter:
      lines(N.post_norm, a.H, 0);
      break;
    case kGdnRec:
      lines(N.gnorm, kGdnDim, 0);
      break;
    default:
      break;
  }
}

// 12 warps: three share one of the four register files (16K each), so 168 registers per thread at
// launch, then split between the warpgroups (kConsumerRegs).
__global__ void __launch_bounds__(kStepThreads, 1) step_kernel(const __grid_constant__ StepArgs a) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ alignas(8) uint64_t full[kSlots], empty[kSlots];
  __shared__ float red[kWarps];
  __shared__ float part[kMaxTcTiles][kWarps][tc16::kRows];
  __shared__ float taps[kMaxTcTiles][kRowsIn][7];
  __shared__ RouteSmem rs;
  __shared__ gdn_unit::Smem gsm;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      bulk::mbar_init(&full[s]);
      bulk::mbar_init_count(&empty[s], kWarps);
    }
    bulk::fence_init();
  }
  __syncthreads();
  Ring ring{full, empty, smem, 0};
  const unsigned G = gridDim.x;
  if (warp >= kProducerWarp) {
    tc::setmaxnreg_dec<kProducerRegs>();
    if (warp != kProducerWarp) return;  // the warpgroup's other warps only give their registers
    // Weights only (and the sequence's conv window, which nothing in this step wrote yet): no
    // wait on the previous kernel.
    unsigned p = 0;
    for (int li = 0; li < a.n_layers; ++li)
      for (int j = 0; j < step_n_products(a.layer[li]); ++j, ++p)
        produce(a, a.layer[li], step_product(a.layer[li], j), p * G, ring, rs, lane);
    return;
  }
  tc::setmaxnreg_inc<kConsumerRegs>();
  prefetch_small(a, a.layer[0], step_product(a.layer[0], 0), threadIdx.x);
  pdl_wait();
  Consumer c{a,    ring, reinterpret_cast<float*>(smem + size_t(kSlots) * kSlotBytes), red, rs, warp, lane,
             part, taps};
  unsigned p = 0;
  unsigned total = 0;
  for (int li = 0; li < a.n_layers; ++li) total += step_n_products(a.layer[li]);
  for (int li = 0; li < a.n_layers; ++li) {
    const StepLayer& L = a.layer[li];
    for (int j = 0; j < step_n_products(L); ++j, ++p) {
      const int kind = step_product(L, j);
      if (p > 0) {
        grid_arrive(a.barrier);
        stamp(a, p - 1, 1);
        if (kind != kGdnRec) grid_wait(a.barrier, p * G);
      }
      if (kind != kGdnRec) stamp(a, p, 0);
      c.p = p;
      if (j + 1 < step_n_products(L))
        prefetch_small(a, L, step_product(L, j + 1), threadIdx.x);
      else if (li + 1 < a.n_layers)
        prefetch_small(a, a.layer[li + 1], step_product(a.layer[li + 1], 0), threadIdx.x);
      if (p + 1 == total) pdl_launch_dependents();
      switch (kind) {
        case kGdnIn:
        case kAttnIn:
          c.in_proj(L, kind == kGdnIn);
          break;
        case kGdnRec:
          c.gdn_rec(L, p, gsm);
          break;
        case kGdnOut:
        case kAttnOut:
          c.out_proj(L, kind);
          break;
        case kRouter:
          c.router(L);
          break;
        case kExpertsGu:
          c.experts_gu(L);
          break;
        default:
          c.experts_down(L);
          break;
      }
    }
  }
  if (a.prof) {
    ConsumerSync{}();
    stamp(a, total - 1, 1);
  }
}

bool fail_why(std::string* why, std::string msg) {
  if (why) *why = std::move(msg);
  return false;
}

}  // namespace

bool step_supported(const StepLayer& L, const StepArgs& a, std::string* why) {
  auto q4 = [](const DevLinear& W) { return W.fmt == WFormat::kAffine4; };
  const bool gdn = L.mixer == kStepGdn;
  if (a.H != kHidden || a.I != kMoeInter || a.K + 1 != kSlotsPerToken || (gdn && a.value_dim != kValueDim))
    return fail_why(
        why, "dimensions other than the real model's (hidden 2048, GDN values 4096, top-8 + shared of 512)");
  if (L.mixer == kStepAttnIn) {
    if (!q4(L.attn_in) || L.attn_in.in != a.H || L.attn_in.out % kRowsIn != 0)
      return fail_why(why, "the attention in_proj is not a 4-bit [16n, hidden] matrix");
    return true;  // no MoE in this entry
  }
  if (L.mixer == kStepAttnOut && (!q4(L.attn_o) || L.attn_o.in != kValueDim || L.attn_o.out != a.H))
    return fail_why(why, "the attention o_proj is not a 4-bit [hidden, 4096] matrix");
  if (gdn) {
    if (!q4(L.gdn_in) || !q4(L.gdn_out)) return fail_why(why, "GDN projections are not 4-bit");
    if (L.gdn_in.in != a.H || a.H > kFusedNormMaxDim || a.H % 64 != 0)
      return fail_why(why, "hidden size outside the step's 64..2048");
    if (a.conv_dim % kRowsIn != 0 || a.conv_kernel != 4)
      return fail_why(why, "conv channels or taps outside the step's tiles");
    if (L.gdn_in.out < a.conv_dim + a.value_dim + 2 * a.n_v_heads)
      return fail_why(why, "GDN in_proj too small");
    if (L.gdn_out.in != a.value_dim || L.gdn_out.out != a.H) return fail_why(why, "GDN out_proj shape");
    if (uint32_t(kRowsOut * (a.value_dim / 2 + a.value_dim / 16)) > kSlotBytes ||
        size_t(a.value_dim / 32) * 36 * 4 > kXsBytes)
      return fail_why(why, "GDN value dim too large for the step's tiles");
    if (L.gdn_in.out % kRowsIn != 0) return fail_why(why, "GDN in_proj rows not a multiple of 16");
    if (a.n_v_heads % a.n_k_heads != 0) return fail_why(why, "GDN heads");
  }
  if (L.router.fmt != WFormat::kAffine8 || L.router.in != a.H || L.router.out < a.E + 1)
    return fail_why(why, "the router is not an 8-bit [E+1, H] matrix");
  if (!q4(L.gu) || !q4(L.down)) return fail_why(why, "expert matrices are not 4-bit");
  if (L.gu.in != a.H || L.down.in != a.I)
    return fail_why(why, "expert matrices' columns are not hidden / moe_intermediate");
  if (a.E > 8 * 32 || a.K + 1 > kRouteMaxTopK + 1 || a.K > kRouteMaxTopK)
    return fail_why(why, "routing outside top-k <= 8 of <= 256 experts");
  if (a.I != 512) return fail_why(why, "moe_intermediate is not 512");
  if (L.gu.out != (a.E + 1) * 2 * a.I || L.down.out != (a.E + 1) * a.H)
    return fail_why(why, "the shared expert is not folded into the expert matrices");
  if (a.H % kRowsDown != 0) return fail_why(why, "hidden size not a multiple of 16");
  if (size_t(a.K + 1) * (a.I / 32) * 36 * 4 > kXsBytes)
    return fail_why(why, "experts' inputs exceed the staging");
  return true;
}

void decode_step_layers(const StepArgs& a, cudaStream_t stream) {
  TANSY_CHECK(a.n_layers >= 1 && a.n_layers <= kStepMaxLayers,
              "decode step: {} layers per launch outside 1..{}", a.n_layers, kStepMaxLayers);
  for (int i = 0; i < a.n_layers; ++i) {
    std::string why;
    TANSY_CHECK(step_supported(a.layer[i], a, &why), "decode step: layer {}: {}", a.layer[i].index, why);
  }
  TANSY_CHECK(a.h && a.ss && a.proj && a.conv_out && a.beta && a.g && a.o && a.gdn_counters && a.mix &&
                  a.logits && a.topk_idx && a.topk_w && a.xn && a.act && a.barrier,
              "decode step: missing buffers");
  const int sms = sm_count();
  TANSY_CHECK(sms >= 1, "decode step: no multiprocessors");
  for (int i = 0; i < a.n_layers; ++i) {
    const StepLayer& L = a.layer[i];
    const int tc_tiles = L.mixer == kStepAttnIn ? n_tiles(a, L, kAttnIn)
                                                : std::max(L.mixer == kStepGdn ? n_tiles(a, L, kGdnIn) : 0,
                                                           n_tiles(a, L, kExpertsGu));
    TANSY_CHECK((tc_tiles + sms - 1) / sms <= kMaxTcTiles,
                "decode step: layer {}: {} tensor-core tiles on {} multiprocessors, more than {} a block",
                L.index, tc_tiles, sms, kMaxTcTiles);
  }
  allow_smem<step_kernel>(kStepSmem, "decode step");
  pdl_launch(step_kernel, dim3(sms), dim3(kStepThreads), kStepSmem, stream, a);
}

}  // namespace tansy::cuda
