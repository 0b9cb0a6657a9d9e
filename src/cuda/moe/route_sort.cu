// MoE routing sorts. Prefill: the top-k choices of n tokens sorted into expert-grouped rows and the
// grouped GEMM's tile schedule (MoeRouting, gemm/gemm.cuh), in two grid-wide launches:
//   count    every block counts its ids in shared memory and adds the counts to the work
//            counters; the last block to finish scans them into the offsets and cursors
//   scatter  every block counts its ids again, takes a range of rows per expert from the
//            cursors (one global atomic per block and expert) and writes both permutations
// The whole sort used to run in one block (a counting sort over 32,768 ids, then a scatter grid):
// 18.5 µs a layer at 4,096 tokens, on the critical path between the router and the experts.
// CPU reference: none needed; tests/gpu/test_moe.cu checks the permutation, the offsets and the
// tiles against the ids, and the grouped GEMM's result is checked against cpu::matmul per expert.
#include "cuda/common/grid_sync.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/moe/moe.cuh"

namespace tansy::cuda {
namespace {

constexpr int kSortThreads = 1024;  // >= kRouteMaxExperts: one expert a thread in the scan
constexpr int kIdsPerThread = 4;    // ids a thread holds in the scatter
constexpr int kIdsPerBlock = kSortThreads * kIdsPerThread;  // [4,096] ids a block
static_assert(kRouteMaxExperts <= kSortThreads);

// MoeRouting::work: [count: n_experts][cursor: n_experts][blocks done: 1]
__device__ __forceinline__ int* work_count(const MoeRouting& r) { return r.work; }
__device__ __forceinline__ int* work_cursor(const MoeRouting& r, int E) { return r.work + E; }
__device__ __forceinline__ int* work_done(const MoeRouting& r, int E) { return r.work + 2 * E; }

// Exclusive scans of the counts and of the per-expert tile counts (BM rows a tile) over the
// block's threads (thread e holds expert e's count c); returns {rows before e, tiles before e}.
template <int BM>
__device__ int2 scan_counts(int c, int (*warp_sum)[kSortThreads / 32]) {
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  int rows = c, tiles = (c + BM - 1) / BM;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int a = __shfl_up_sync(0xffffffffu, rows, o), b = __shfl_up_sync(0xffffffffu, tiles, o);
    if (lane >= o) {
      rows += a;
      tiles += b;
    }
  }
  if (lane == 31) {
    warp_sum[0][warp] = rows;
    warp_sum[1][warp] = tiles;
  }
  __syncthreads();
  if (warp == 0) {
    int a = warp_sum[0][lane], b = warp_sum[1][lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int x = __shfl_up_sync(0xffffffffu, a, o), y = __shfl_up_sync(0xffffffffu, b, o);
      if (lane >= o) {
        a += x;
        b += y;
      }
    }
    warp_sum[0][lane] = a;
    warp_sum[1][lane] = b;  // inclusive over warps
  }
  __syncthreads();
  return {rows - c + (warp > 0 ? warp_sum[0][warp - 1] : 0),
          tiles - (c + BM - 1) / BM + (warp > 0 ? warp_sum[1][warp - 1] : 0)};
}

// BM: the schedule's rows a tile (MoeRouting::tile_rows).
template <int BM>
__global__ void __launch_bounds__(kSortThreads)
    route_count_kernel(const int* ids, int total, int E, MoeRouting r) {
  __shared__ int count[kRouteMaxExperts];
  __shared__ int warp_sum[2][kSortThreads / 32];
  __shared__ int last;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kSortThreads) count[e] = 0;
  __syncthreads();
  const int i0 = blockIdx.x * kIdsPerBlock, i1 = min(total, i0 + kIdsPerBlock);
  for (int i = i0 + tid; i < i1; i += kSortThreads) {
    const int e = ids[i];
    if (e < 0 || e >= E) __trap();  // the router produced an impossible id: stop loudly
    atomicAdd(&count[e], 1);
  }
  __syncthreads();
  int* g_count = work_count(r);
  if (tid < E && count[tid]) atomicAdd(&g_count[tid], count[tid]);
  // this block's counts are in before it says it is done
  if (!last_block_arrive(reinterpret_cast<unsigned*>(work_done(r, E)), gridDim.x, last)) return;
  const int c = tid < E ? __ldcg(&g_count[tid]) : 0;  // L2: the other blocks' atomics
  const int2 before = scan_counts<BM>(c, warp_sum);
  if (tid < E) {
    r.expert_offsets[tid] = before.x;
    r.tile_offsets[tid] = before.y;
    work_cursor(r, E)[tid] = before.x;
    g_count[tid] = 0;  // left zero for the next sort
  }
  if (tid == E - 1) {
    r.expert_offsets[E] = before.x + c;
    r.tile_offsets[E] = before.y + (c + BM - 1) / BM;
  }
  if (tid == 0) *work_done(r, E) = 0;
}

__global__ void __launch_bounds__(kSortThreads)
    route_scatter_kernel(const int* ids, int total, int E, MoeRouting r) {
  __shared__ int count[kRouteMaxExperts];
  __shared__ int base[kRouteMaxExperts];
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kSortThreads) count[e] = 0;
  __syncthreads();
  const int i0 = blockIdx.x * kIdsPerBlock;
  int e_of[kIdsPerThread], rank[kIdsPerThread];
#pragma unroll
  for (int j = 0; j < kIdsPerThread; ++j) {
    const int i = i0 + tid + j * kSortThreads;
    e_of[j] = i < total ? ids[i] : -1;
    rank[j] = e_of[j] >= 0 ? atomicAdd(&count[e_of[j]], 1) : 0;
  }
  __syncthreads();
  if (tid < E && count[tid]) base[tid] = atomicAdd(&work_cursor(r, E)[tid], count[tid]);
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kIdsPerThread; ++j) {
    if (e_of[j] < 0) continue;
    const int i = i0 + tid + j * kSortThreads, row = base[e_of[j]] + rank[j];
    r.slot_row[i] = row;
    r.sorted_slot[row] = i;
  }
}

// Several decode tokens' slots by expert (ExpertGroups), in one block: the ids into shared
// memory and counted, the counts scanned into each expert's first sorted index and first item,
// then warp 0 scatters the slots in order, 32 at a time (lanes with the same expert rank among
// themselves by lane), which keeps each expert's slots in slot order.
constexpr int kGroupMaxSlots = kMaxBatch * kRouteMaxTopK;

__global__ void __launch_bounds__(kSortThreads)
    expert_groups_kernel(const int* __restrict__ idx, int total, int E, ExpertGroups g) {
  __shared__ int ids[kGroupMaxSlots];
  __shared__ int count[kRouteMaxExperts];
  __shared__ int cursor[kRouteMaxExperts];
  __shared__ int warp_sum[2][kSortThreads / 32];
  const int tid = threadIdx.x;
  pdl_wait();  // idx: the router's choices
  pdl_launch_dependents();
  for (int e = tid; e < E; e += kSortThreads) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < total; i += kSortThreads) {
    const int e = idx[i];
    if (e < 0 || e >= E) __trap();  // the router produced an impossible id: stop loudly
    ids[i] = e;
    atomicAdd(&count[e], 1);
  }
  __syncthreads();
  const int c = tid < E ? count[tid] : 0;
  const int2 before = scan_counts<kGroupCols>(c, warp_sum);
  if (tid < E) {
    cursor[tid] = before.x;
    for (int j = 0; j * kGroupCols < c; ++j)
      g.items[before.y + j] =
          make_int4(tid, before.x + j * kGroupCols, min(kGroupCols, c - j * kGroupCols), 0);
    if (tid == E - 1) *g.n_items = before.y + (c + kGroupCols - 1) / kGroupCols;
  }
  __syncthreads();
  if (tid < 32) {
    for (int i0 = 0; i0 < total; i0 += 32) {
      const int i = i0 + tid, e = i < total ? ids[i] : -1;
      const unsigned same = __match_any_sync(0xffffffffu, e);
      const int rank = __popc(same & ((1u << tid) - 1u));
      if (e >= 0) g.sorted[cursor[e] + rank] = i;
      __syncwarp();
      if (e >= 0 && rank == 0) cursor[e] += __popc(same);
      __syncwarp();
    }
  }
}

}  // namespace

void expert_groups(const int* idx, int n, int k, int n_experts, const ExpertGroups& g, cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && long(n) * k <= kGroupMaxSlots, "expert_groups: n*k = {}*{} outside 1..{}",
              n, k, kGroupMaxSlots);
  TANSY_CHECK(n_experts >= 1 && n_experts <= kRouteMaxExperts, "expert_groups: {} experts outside 1..{}",
              n_experts, kRouteMaxExperts);
  TANSY_CHECK(idx && g.sorted && g.items && g.n_items, "expert_groups: null pointer");
  pdl_launch(expert_groups_kernel, dim3(1), dim3(kSortThreads), 0, stream, idx, n * k, n_experts, g);
}

void moe_route_sort(const int* topk_ids, int n, int k, int n_experts, const MoeRouting& r,
                    cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && k <= n_experts, "moe_route_sort: bad n={} k={} n_experts={}", n, k,
              n_experts);
  TANSY_CHECK(n_experts <= kRouteMaxExperts, "moe_route_sort: {} experts exceed the limit {}", n_experts,
              kRouteMaxExperts);
  TANSY_CHECK(long(n) * k <= (1L << 30), "moe_route_sort: n*k = {} too large", long(n) * k);
  TANSY_CHECK(topk_ids && r.expert_offsets && r.tile_offsets && r.sorted_slot && r.slot_row && r.work,
              "moe_route_sort: null pointer");
  TANSY_CHECK(r.tile_rows == kGroupedBM || r.tile_rows == kGroupedSmallBM,
              "moe_route_sort: {}-row tiles are not built (only {} and {})", r.tile_rows, kGroupedBM,
              kGroupedSmallBM);
  const int total = n * k, blocks = (total + kIdsPerBlock - 1) / kIdsPerBlock;
  if (r.tile_rows == kGroupedSmallBM)
    route_count_kernel<kGroupedSmallBM><<<blocks, kSortThreads, 0, stream>>>(topk_ids, total, n_experts, r);
  else
    route_count_kernel<kGroupedBM><<<blocks, kSortThreads, 0, stream>>>(topk_ids, total, n_experts, r);
  launch_check("moe_route_sort count");
  route_scatter_kernel<<<blocks, kSortThreads, 0, stream>>>(topk_ids, total, n_experts, r);
  launch_check("moe_route_sort scatter");
}

}  // namespace tansy::cuda
