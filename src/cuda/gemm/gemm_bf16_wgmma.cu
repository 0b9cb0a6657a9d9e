// Prefill GEMM with bf16 weights on Hopper's warpgroup tensor cores: Y[n, out] = X[n, in] · Wᵀ,
// both operands from shared memory (wgmma SS), for the MoE router (its 8-bit weights dequantized once
// at load into a bf16 copy: the values the 8-bit kernels' dequant feeds their products) and any
// bf16 matrix.
//
// Why a kernel of its own: the router is [258 x 2048] at 4,096 tokens, 4.3 GFLOP, and the mma.sync
// kernel took 62 µs for it (69 TF/s; 2.5 ms a 4,096-token prefill over 40 layers): 192 blocks of 64
// tokens x 128 columns, each a 32-k-tile chain of per-lane dequant and mma.sync. Here a block is one
// warpgroup: 64 output columns (the wgmma M, weights as A) x kN tokens (the wgmma N, X as B), both
// copied with cp.async in the 128-byte swizzle the descriptors read (rows of 128 bytes per k-tile:
// W's rows and X's rows alike), no dequant and no register fragments. At 4,096 tokens that is 5 x
// 32 blocks, two per multiprocessor.
//
// Pipeline (kStages stages of W and X): k-tile kt issues its 4 wgmmas, waits for kt-1's, waits for
// stage kt+1's copies, meets the block barrier (every warp is then past kt-1's wgmmas) and starts the
// copies of kt+kStages-1 into kt-1's stage. The accumulators go through an f32 tile in the stage
// memory to the shared epilogue (gemm_impl.cuh store_tile).
//
// Split over k: where the k-tiles divide by kSplits (every bf16 product whose in is a multiple of
// 256; in the 4-bit checkpoint only the router's copy), each tile runs as a cluster of kSplits blocks,
// each over a quarter of the k-tiles (store_split_tile), at every n. A short prompt's router has too
// few tiles for the machine (4 x 5 at 256 tokens): split, the 256-token prefill gained 2.1%, while
// the router's stage at 4,096 tokens went from 1.45 to 1.55 ms over 40 layers (H100, 2026-12-07).
// The split depends on the shape only: each output is the same kSplits chains of k16 products in k
// order, added in the same order, whatever n is and whichever tile holds its row (a token's experts
// do not depend on what else is in the piece).
// CPU reference: cpu::matmul. GPU tests: tests/gpu/test_gemm.cu (the bf16 cases, the router's shape).
#include <algorithm>

#include "core/error.h"
#include "cuda/common/cuda_util.h"
#include "cuda/common/tensor_core.cuh"
#include "cuda/gemm/gemm_impl.cuh"
#include "cuda/gemm/wgmma.cuh"

namespace tansy::cuda::gemm_impl {
namespace {

constexpr int BK = 64;  // k-tile: 128 bytes of bf16 per row
constexpr int kStages = 4;
constexpr int kM = 64;  // output columns per block (one warpgroup's wgmma M)
constexpr int kThreads = 128;
constexpr int kA = kM * BK * 2;  // one W stage (64 rows x 128 bytes)
constexpr int kCld = kM + 4;     // f32 output tile row
constexpr int kSplits = 4;       // k splits where the k-tiles divide (in % (kSplits * BK) == 0)

template <int kN>
struct Layout {
  static constexpr int kB = kN * BK * 2;  // one X stage
  static constexpr int kStage = kA + kB;
  static constexpr int kC = kN * kCld * 4;  // the f32 output tile, over the stages after the loop
  static constexpr int kSmem = std::max(kStages * kStage, kC) + 1024;  // + 1024: aligned up
  static_assert(kA % 1024 == 0 && kB % 1024 == 0);
};

template <int kN, bool kSplitK>
__global__ void __launch_bounds__(kThreads, 2) gemm_bf16_wgmma_kernel(const Params p) {
  using L = Layout<kN>;
  constexpr int kAcc = kN / 2;
  constexpr int kAChunks = kM * 8 / kThreads;  // 16-byte chunks per thread per stage
  constexpr int kBChunks = kN * 8 / kThreads;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_addr = tc::smem_addr(smem_raw);
  unsigned char* const smem = smem_raw + ((1024 - (raw_addr & 1023)) & 1023);
  const uint32_t s_addr = tc::smem_addr(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.y * kM, row0 = blockIdx.x * kN;
  const int row_end = min(row0 + kN, p.n_rows);

  // Chunk i of this thread: row tid/8 + 16i, 16-byte chunk tid%8, at chunk (tid%8) ^ (row % 8) of
  // its 128-byte row (row % 8 is the same for every i). Rows past the matrix (W) or past n (X) copy
  // a valid row: they only reach outputs that are never stored. Element offsets fit 32 bits (the
  // launcher's checks).
  const int r16 = tid / 8, c8 = tid % 8;
  const uint32_t dst = uint32_t(r16 * 128 + ((c8 ^ (r16 % 8)) << 4));
  uint32_t a_off[kAChunks], b_off[kBChunks];
#pragma unroll
  for (int i = 0; i < kAChunks; ++i)
    a_off[i] = uint32_t(min(n0 + r16 + 16 * i, p.out - 1)) * uint32_t(p.in) + uint32_t(c8) * 8;
#pragma unroll
  for (int i = 0; i < kBChunks; ++i)
    b_off[i] = uint32_t(min(row0 + r16 + 16 * i, p.n_rows - 1)) * uint32_t(p.ldx) + uint32_t(c8) * 8;
  // kSplitK: this block's k-tiles [kb, ke) (gridDim.z blocks along z, one cluster).
  const int KT = p.in / BK;
  const int kb = kSplitK ? KT * int(blockIdx.z) / int(gridDim.z) : 0;
  const int ke = kSplitK ? KT * int(blockIdx.z + 1) / int(gridDim.z) : KT;
  auto load_stage = [&](int kt, int stage) {
    const uint32_t a = s_addr + uint32_t(stage * L::kStage) + dst, b = a + uint32_t(kA);
#pragma unroll
    for (int i = 0; i < kAChunks; ++i)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(a + uint32_t(i * 16 * 128)),
                   "l"(p.w + a_off[i] + uint32_t(kt) * BK));
#pragma unroll
    for (int i = 0; i < kBChunks; ++i)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(b + uint32_t(i * 16 * 128)),
                   "l"(p.X + b_off[i] + uint32_t(kt) * BK));
  };

  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (kb + s < ke) load_stage(kb + s, s);
    tc::cp_async_commit();
  }
  tc::cp_async_wait<kStages - 2>();
  wg::fence_proxy_async();
  __syncthreads();
  for (int kt = kb; kt < ke; ++kt) {
    const uint32_t a = s_addr + uint32_t(((kt - kb) % kStages) * L::kStage), b = a + uint32_t(kA);
    wg::fence_regs(acc);
    wg::wgmma_arrive();
#pragma unroll
    for (int k = 0; k < 4; ++k) wg::wgmma_ss<kN>(acc, wg::desc_sw128_at(a, k), wg::desc_sw128_at(b, k), 1);
    wg::wgmma_commit();
    wg::wgmma_wait1();
    tc::cp_async_wait<kStages - 3>();  // stage kt+1 has landed (this thread's copies)
    wg::fence_proxy_async();
    __syncthreads();  // ... everyone's; and every warp is past kt-1's wgmmas
    if (kt + kStages - 1 < ke) load_stage(kt + kStages - 1, (kt - kb + kStages - 1) % kStages);
    tc::cp_async_commit();
  }
  wg::wgmma_wait0();
  wg::fence_regs(acc);
  tc::cp_async_wait<0>();
  __syncthreads();  // the stages are free: the output tile goes over them

  // acc[4i + r] is output column 16·warp + g + 8·(r >> 1) of the block's 64, token 8i + 2t + (r & 1).
  float* const Cs = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int i = 0; i < kN / 8; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r)
      Cs[(8 * i + 2 * t + (r & 1)) * kCld + 16 * warp + g + (r >> 1) * 8] = acc[4 * i + r];
  __syncthreads();
  if constexpr (kSplitK)
    store_split_tile<kM, kN, kThreads, kCld>(p, Cs, row0, row_end, n0, tid);
  else
    store_tile<kM, kN, kThreads, kCld>(p, Cs, row0, row_end, n0, tid);
}

template <int kN, bool kSplitK>
void launch(const Params& p, cudaStream_t stream) {
  constexpr int kSmem = Layout<kN>::kSmem;
  constexpr auto kern = gemm_bf16_wgmma_kernel<kN, kSplitK>;
  static const bool attr_set = [] {
    return cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) == cudaSuccess;
  }();
  if (!attr_set) fail("gemm (bf16 wgmma): cannot reserve {} bytes of shared memory per block", kSmem);
  const dim3 grid(unsigned((p.n_rows + kN - 1) / kN), unsigned((p.out + kM - 1) / kM));
  if constexpr (kSplitK) {
    launch_split(kern, grid, kThreads, kSmem, kSplits, p, stream, "gemm (bf16 wgmma, split over k)");
  } else {
    kern<<<grid, kThreads, kSmem, stream>>>(p);
    launch_check("gemm (bf16 wgmma)");
  }
}

template <int kN>
void launch(const Params& p, cudaStream_t stream) {
  if (p.in % (kSplits * BK) == 0) return launch<kN, true>(p, stream);
  launch<kN, false>(p, stream);
}

}  // namespace

void launch_bf16_wgmma(const Params& p, cudaStream_t stream) {
  TANSY_CHECK(p.w && !p.tile_offsets && p.in % BK == 0, "gemm (bf16 wgmma): dense bf16 weights only");
  TANSY_CHECK((p.out + kM - 1) / kM <= 65535, "gemm (bf16 wgmma): {} output columns exceed the grid", p.out);
  // 128-token tiles where they make at least one block per multiprocessor, else 64 (small pieces).
  const long tiles128 = long((p.n_rows + 127) / 128) * ((p.out + kM - 1) / kM);
  if (tiles128 >= sm_count()) return launch<128>(p, stream);
  launch<64>(p, stream);
}

}  // namespace tansy::cuda::gemm_impl
