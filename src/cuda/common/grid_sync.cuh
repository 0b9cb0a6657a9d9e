// Signals between the blocks of a grid at GPU scope, as release / acquire operations instead of
// __threadfence(): that is a sequentially consistent fence (MEMBAR.SC.GPU, then CCTL.IVALL, which
// drops the whole L1), where a block telling others "my writes are done" needs only release order
// (MEMBAR.ALL.GPU before the atomic) and the one waiting only an acquiring load.
//
// The pattern (CUTLASS's GenericBarrier is the same): the block's threads meet at a CTA barrier,
// which puts their writes in the causal past of the thread that then releases; after an acquire,
// a CTA barrier passes what it saw on to the block's other threads.
#pragma once

namespace tansy::cuda {

__device__ __forceinline__ unsigned ld_acquire_gpu(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// *p += v with release order, no value back.
__device__ __forceinline__ void red_add_release_gpu(unsigned* p, unsigned v) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// *p += v with acquire and release order; the old value.
__device__ __forceinline__ unsigned atom_add_acq_rel_gpu(unsigned* p, unsigned v) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

// The last of `blocks` blocks to call this (every thread of each, after its writes) gets true, and
// then sees every other block's writes (through L2: read them with ld.cg, as L1 may hold stale
// lines). Uses `last` (shared) and two __syncthreads.
__device__ __forceinline__ bool last_block_arrive(unsigned* counter, unsigned blocks, int& last) {
  __syncthreads();
  if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(counter, 1u) == blocks - 1;
  __syncthreads();
  return last;
}

}  // namespace tansy::cuda
