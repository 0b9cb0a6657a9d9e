// Internals shared by the prefill GEMM kernels (gemm.cu: mma.sync; gemm_wgmma.cu and
// gemm_bf16_wgmma.cu: wgmma): the launch parameters, the 4-bit dequant, the epilogue that writes an
// f32 tile from shared memory and the split over k that adds the partial tiles of a cluster first.
#pragma once
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/cuda_util.h"
#include "cuda/common/device_math.cuh"
#include "cuda/gemm/gemm.cuh"

namespace tansy::cuda::gemm_impl {

struct Params {
  const uint32_t* q;
  const __nv_bfloat16* scales;
  const __nv_bfloat16* biases;
  const __nv_bfloat16* w;
  int out, in;
  const __nv_bfloat16* X;
  int64_t ldx;
  int n_rows;  // dense: n; grouped: n*k
  void* Y;
  int64_t ldy;
  GemmOutType out_type;
  GemmEpilogue epilogue;
  // grouped only (tile_offsets == nullptr for dense)
  const int* tile_offsets;
  const int* expert_offsets;
  const int* sorted_slot;  // non-null: gather X rows sorted_slot[r] / gather_k
  int gather_k;
  int n_experts;
  int tile_rows;  // grouped: rows a tile of the schedule (MoeRouting::tile_rows)
};

// ---- (scale, bias) staged in shared memory (both kernels) ----
// When a row's quant groups come in whole 16-byte runs of scales (every product of the model), a
// block copies kSbGroups groups of its rows' scales and biases with the stage of the k-tile that
// starts the run (each kernel's load_stage), into one of two buffers of [rows][32 B]: 8 scales
// then 8 biases a row, the two halves swapped on rows with bit 2 set so that a warp's 8 rows g
// read 8 distinct banks.
constexpr int kSbGroups = 8;

inline bool stages_scales(int in, const void* scales, const void* biases) {
  const auto a16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  return (in / kQuantGroup) % kSbGroups == 0 && a16(scales) && a16(biases);
}
inline bool stages_scales(const Params& p) { return stages_scales(p.in, p.scales, p.biases); }

// Byte offset of row r's scales (half 0) or biases (half 1) in a (scale, bias) buffer.
__device__ __forceinline__ uint32_t sb_offset(int r, int half) {
  return uint32_t(r) * 32u + uint32_t((half ^ ((r >> 2) & 1)) * 16);
}

// 8 4-bit codes (one u32, low nibble first) -> 8 bf16 values s·q + b, as 4 bf16 pairs in k order.
// Codes become exact bf16 integers through the 128+c bit trick (exponent of 128, mantissa c),
// then one subtraction and one fused multiply-add per pair (exact product, one rounding to bf16).
__device__ __forceinline__ uint4 dequant4(uint32_t w, __nv_bfloat162 s2, __nv_bfloat162 b2) {
  const uint32_t even = w & 0x0f0f0f0fu;               // c0 c2 c4 c6 in bytes 0..3
  const uint32_t odd = (w >> 4) & 0x0f0f0f0fu;         // c1 c3 c5 c7
  const uint32_t lo = __byte_perm(even, odd, 0x5140);  // bytes c0 c1 c2 c3
  const uint32_t hi = __byte_perm(even, odd, 0x7362);  // bytes c4 c5 c6 c7
  const __nv_bfloat162 k128 = __floats2bfloat162_rn(128.f, 128.f);
  uint32_t r[4] = {__byte_perm(lo, 0x43u, 0x4140), __byte_perm(lo, 0x43u, 0x4342),
                   __byte_perm(hi, 0x43u, 0x4140), __byte_perm(hi, 0x43u, 0x4342)};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&r[i]);
    v = __hfma2(__hsub2(v, k128), s2, b2);
    r[i] = *reinterpret_cast<uint32_t*>(&v);
  }
  return make_uint4(r[0], r[1], r[2], r[3]);
}

// Grouped GEMM: the expert that owns tile `tile` (the last whose first tile is <= tile), given
// tile < p.tile_offsets[p.n_experts].
__device__ __forceinline__ int tile_expert(const Params& p, int tile) {
  int lo = 0, hi = p.n_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p.tile_offsets[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Writes rows row0.. (< row_end) of a kRows x BN f32 tile Cs (rows kCld floats apart, columns n0..) to
// Y with p's epilogue; every thread of the block takes column pairs of whole rows.
template <int BN, int kRows, int kThreads, int kCld>
__device__ __forceinline__ void store_tile(const Params& p, const float* Cs, int row0, int row_end, int n0,
                                           int tid) {
  constexpr int kPairs = BN / 2;  // column pairs per row
  constexpr int kRowsPerPass = kThreads / kPairs;
  const int pc = n0 + 2 * (tid % kPairs);  // this thread's first column
  if (pc >= p.out) return;
  const bool pair = pc + 1 < p.out;
#pragma unroll 4
  for (int lr = tid / kPairs; lr < kRows; lr += kRowsPerPass) {
    const int row = row0 + lr;
    if (row >= row_end) break;
    const float2 v = *reinterpret_cast<const float2*>(Cs + lr * kCld + (pc - n0));
    float v0 = v.x, v1 = v.y;
    if (p.epilogue == GemmEpilogue::kSwiGlu) {
      const size_t i = size_t(row) * p.ldy + pc / 2;  // (gate, up) = (pc, pc+1); out is even
      const float y = silu_fast(v0) * v1;
      if (p.out_type == GemmOutType::kF32)
        static_cast<float*>(p.Y)[i] = y;
      else
        static_cast<__nv_bfloat16*>(p.Y)[i] = __float2bfloat16(y);
      continue;
    }
    const size_t i = size_t(row) * p.ldy + pc;
    if (p.out_type == GemmOutType::kF32) {
      float* y = static_cast<float*>(p.Y) + i;
      if (pair) {
        if (p.epilogue == GemmEpilogue::kAccumulate) {
          const float2 o = *reinterpret_cast<float2*>(y);
          v0 += o.x;
          v1 += o.y;
        }
        *reinterpret_cast<float2*>(y) = make_float2(v0, v1);
      } else {
        if (p.epilogue == GemmEpilogue::kAccumulate) v0 += *y;
        *y = v0;
      }
    } else {
      __nv_bfloat16* y = static_cast<__nv_bfloat16*>(p.Y) + i;
      if (pair) {
        if (p.epilogue == GemmEpilogue::kAccumulate) {
          const float2 o = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(y));
          v0 += o.x;
          v1 += o.y;
        }
        *reinterpret_cast<__nv_bfloat162*>(y) = __floats2bfloat162_rn(v0, v1);
      } else {
        if (p.epilogue == GemmEpilogue::kAccumulate) v0 += __bfloat162float(*y);
        *y = __float2bfloat16(v0);
      }
    }
  }
}

// ---- split over k (both wgmma kernels) ----
// A product of too few tiles for the machine runs each tile as a cluster of `splits` blocks, the
// whole of grid z (so a block's rank in the cluster is its blockIdx.z and its k order), block z
// over its share of the k-tiles. Each block leaves its partial f32 tile in Cs (shared
// memory); block z then adds rows [r0, r1) of every block's tile, in block order, into its own
// (through distributed shared memory), stores them with p's epilogue, and waits for the cluster
// before leaving so that its tile stays readable until all have added. No workspace, and each
// output is the same sum in the same order at every launch.
template <int BN, int kRows, int kThreads, int kCld>
__device__ __forceinline__ void store_split_tile(const Params& p, float* Cs, int row0, int row_end, int n0,
                                                 int tid) {
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  const int splits = int(cluster.num_blocks()), split = int(cluster.block_rank());
  cluster.sync();  // every block's partial tile is written
  const int r0 = kRows * split / splits, r1 = kRows * (split + 1) / splits;
  constexpr int kVecs = BN / 4;  // float4 a tile row (kCld % 4 == 0)
  static_assert(BN % 4 == 0 && kCld % 4 == 0);
  for (int i = tid; i < (r1 - r0) * kVecs; i += kThreads) {
    float4* const mine = reinterpret_cast<float4*>(Cs + (r0 + i / kVecs) * kCld) + i % kVecs;
    float4 sum = *cluster.map_shared_rank(mine, 0);
    for (int z = 1; z < splits; ++z) {
      const float4 v = *cluster.map_shared_rank(mine, z);
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    *mine = sum;
  }
  __syncthreads();
  store_tile<BN, kRows, kThreads, kCld>(p, Cs + r0 * kCld, row0 + r0, min(row_end, row0 + r1), n0, tid);
  cluster.sync();  // no block leaves while another may still read its tile
}

// Launches kern(p) on grid.x x grid.y tiles split `splits` ways over k (grid.z, one cluster a tile).
inline void launch_split(void (*kern)(Params), dim3 grid, int threads, int smem, int splits, const Params& p,
                         cudaStream_t stream, const char* what) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid.x, grid.y, unsigned(splits));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = unsigned(splits);
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, p));
  launch_check(what);
}

// The wgmma kernel's launcher (gemm_wgmma.cu): 4-bit weights only. `grouped`: p holds a tile schedule
// and row tiles are kGroupedBM rows.
void launch_wgmma(const Params& p, bool grouped, long row_tiles, cudaStream_t stream);
// The k splits its automatic choice gives a dense product of n_rows rows (1: none), for the tests.
int wgmma_k_splits(int out, int in, int n_rows, bool staged_scales);
// The bf16-weight wgmma kernel (gemm_bf16_wgmma.cu): dense products with p.w set.
void launch_bf16_wgmma(const Params& p, cudaStream_t stream);
// The persistent grouped wgmma kernel (gemm_grouped_wgmma.cu): 4-bit weights, p holds the expert
// offsets (it makes its own tiles, of up to grouped_wgmma_rows rows per expert; tile_offsets is not read).
void launch_wgmma_grouped(const Params& p, cudaStream_t stream);
// The tile row counts (wgmma N) it is built for; the smaller of the two it chooses between for `rows`
// routed rows over `experts` experts (the kernel takes it or the next larger size, from the real
// counts); and, for tests and Timing.Gemm, a forced choice (0 restores the automatic one).
inline constexpr int kGroupedWgmmaRows[] = {64, 96, 128, 144, 192, 256};
// The cost of one of its tiles of N rows, in rows of tensor work: N + this (the tile's expert weights
// dequantized again, its barriers and its epilogue). Fitted on the H200 (2026-12-04): with it,
// Σ_e ceil(c_e / N) · (N + 230) puts 144-row tiles 5% above 192-row ones on the synthetic
// checkpoint's expert counts at 4,096 tokens (measured: gate|up 24.1 vs 22.9 ms over 40 layers) and
// below them on Timing.Gemm's uniform counts (measured 0.504 vs 0.529 ms).
inline constexpr int kGroupedTileOverheadRows = 230;
int grouped_wgmma_rows(long rows, int experts);
void set_grouped_wgmma_rows(int rows);
// For tests and Timing.Gemm: every wgmma launch uses `rows` (64 or 128, or 256 with 2 warpgroups;
// grouped always 64) x 64·`warpgroups` (2 or 4) tiles instead of the automatic choice; (0, 0)
// restores it. The 256-row tile is only reachable from here until Timing.Gemm has measured it.
void set_wgmma_tiles(int rows, int warpgroups);

}  // namespace tansy::cuda::gemm_impl
