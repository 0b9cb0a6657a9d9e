// MoE prefill routing: the top-k choices of n tokens sorted into expert-grouped rows and the
// grouped GEMM's tile schedule (MoeRouting, gemm/gemm.cuh): one block sorts, then a grid writes the
// inverse permutation.
// CPU reference: none needed, the grouped GEMM's result is checked against cpu::matmul per expert.
#include "cuda/moe/moe.cuh"

namespace tansy::cuda {
namespace {

// ---- MoE routing sort: one block; counting sort with shared-memory counters ----
constexpr int kSortThreads = 1024;

__global__ void __launch_bounds__(kSortThreads)
    route_sort_kernel(const int* ids, int total, int n_experts, MoeRouting r) {
  __shared__ int count[kRouteMaxExperts];
  __shared__ int cursor[kRouteMaxExperts];
  __shared__ int warp_sum[2][kSortThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int e = tid; e < n_experts; e += kSortThreads) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < total; i += kSortThreads) {
    const int e = ids[i];
    if (e < 0 || e >= n_experts) __trap();  // the router produced an impossible id: stop loudly
    atomicAdd(&count[e], 1);
  }
  __syncthreads();
  // Exclusive scans of the counts and of the per-expert tile counts (n_experts <= 1024 = threads).
  const int c = tid < n_experts ? count[tid] : 0;
  int rows = c, tiles = (c + kGroupedBM - 1) / kGroupedBM;
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
  const int rows_before = rows - c + (warp > 0 ? warp_sum[0][warp - 1] : 0);
  const int tiles_before = tiles - (c + kGroupedBM - 1) / kGroupedBM + (warp > 0 ? warp_sum[1][warp - 1] : 0);
  if (tid < n_experts) {
    r.expert_offsets[tid] = rows_before;
    r.tile_offsets[tid] = tiles_before;
    cursor[tid] = rows_before;
  }
  if (tid == n_experts - 1) {
    r.expert_offsets[n_experts] = rows_before + c;
    r.tile_offsets[n_experts] = tiles_before + (c + kGroupedBM - 1) / kGroupedBM;
  }
  __syncthreads();
  // slot_row is written in slot order (coalesced); its scattered inverse is spread over the
  // machine by scatter_kernel: one block's scattered 4-byte stores were most of this kernel's time.
  for (int i = tid; i < total; i += kSortThreads) r.slot_row[i] = atomicAdd(&cursor[ids[i]], 1);
}

__global__ void scatter_kernel(int total, MoeRouting r) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < total) r.sorted_slot[r.slot_row[i]] = i;
}

}  // namespace

void moe_route_sort(const int* topk_ids, int n, int k, int n_experts, const MoeRouting& r,
                    cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && k >= 1 && k <= n_experts, "moe_route_sort: bad n={} k={} n_experts={}", n, k,
              n_experts);
  TANSY_CHECK(n_experts <= kRouteMaxExperts, "moe_route_sort: {} experts exceed the limit {}", n_experts,
              kRouteMaxExperts);
  TANSY_CHECK(long(n) * k <= (1L << 30), "moe_route_sort: n*k = {} too large", long(n) * k);
  TANSY_CHECK(topk_ids && r.expert_offsets && r.tile_offsets && r.sorted_slot && r.slot_row,
              "moe_route_sort: null pointer");
  route_sort_kernel<<<1, kSortThreads, 0, stream>>>(topk_ids, n * k, n_experts, r);
  launch_check("moe_route_sort");
  scatter_kernel<<<(n * k + 255) / 256, 256, 0, stream>>>(n * k, r);
  launch_check("moe_route_sort scatter");
}

}  // namespace tansy::cuda
