// Bulk copies global -> shared (the Hopper copy engine, PTX cp.async.bulk) completing on an
// mbarrier: one thread moves kilobytes with one instruction, where per-thread 16-byte cp.async
// copies stall at about half the card's bandwidth (measured on the decode products and lm_head).
// Use: one thread mbar_init()s, fence_init(), __syncthreads(); a producer calls expect_tx with the
// bytes of the copies that signal the barrier, then issues them; consumers mbar_wait(parity) with
// parity = the barrier's use count & 1.
#pragma once
#include <cstdint>

#include "cuda/common/tensor_core.cuh"

namespace tansy::cuda::bulk {

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(tc::smem_addr(bar)) : "memory");
}
// A barrier whose phase completes after `count` plain arrivals (mbar_arrive), e.g. consumers
// handing a buffer back to its producer.
__device__ __forceinline__ void mbar_init_count(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tc::smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tc::smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Orders this thread's (and, after a barrier, the block's) earlier generic accesses of the
// destination before the copies it issues next.
__device__ __forceinline__ void fence_before_copy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(tc::smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Returns once the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(tc::smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// bytes (a multiple of 16; both addresses 16-byte aligned) from global to shared, counted on bar.
__device__ __forceinline__ void copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          tc::smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(tc::smem_addr(bar))
      : "memory");
}

}  // namespace tansy::cuda::bulk
