// Tensor-core primitives shared by the prefill kernels (gemm, attention prefill) and the decode
// attention's copies: mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async, the swizzled tile layout.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common/device_math.cuh"

// Fragment layouts follow the PTX ISA
// ("Matrix fragments for mma.m16n8k16"): lane = 4*g + c; A rows g/g+8, cols 2c/2c+1 (+8);
// B (k x n) col n = g, rows 2c/2c+1 (+8); C rows g/g+8, cols 2c/2c+1.
namespace tansy::cuda::tc {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; when !valid the destination is zero-filled and `src` is not read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
// A 16-byte async copy that asks L2 to fetch the whole aligned 256-byte block around `src`. The
// prefill GEMMs read a weight row 32 bytes a k-tile, rows a kilobyte or more apart: with the hint
// the row's next 7 k-tiles are L2 hits and the DRAM serves whole blocks, not 32-byte sectors.
__device__ __forceinline__ void cp_async16_l2_256(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
// 4-byte async copy (through L1: cp.async.cg takes only 16), zero-filled when !valid.
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// Two transposed 8x8 matrices: lanes 0-15 give the row addresses (the rest are ignored).
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}

// d += a·b
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One 32-bit word of 4-bit codes (8 columns) for rows g (wa) and g+8 (wb) of an m16 tile: two
// k-steps of 16. Nibbles k and k+4 of the word become the bf16 pair 128+q (exact), so the k order
// inside a word is (0,4), (1,5), (2,6), (3,7), and b holds x packed in that order: (b.x, b.y) the
// first k-step's two B registers, (b.z, b.w) the second's. Used by the fused head and the decode
// products' tensor-core tiles (matvec/tc_tile.cuh).
__device__ __forceinline__ void mma_word(float (&c)[4], uint32_t wa, uint32_t wb, uint4 b) {
  uint32_t p[4], q[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    p[k] = nibbles_bf16x2(wa >> (4 * k));
    q[k] = nibbles_bf16x2(wb >> (4 * k));
  }
  const uint32_t a0[4] = {p[0], q[0], p[1], q[1]}, a1[4] = {p[2], q[2], p[3], q[3]};
  mma_bf16(c, a0, b.x, b.y);
  mma_bf16(c, a1, b.z, b.w);
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element offset of (row, col) in a shared tile whose rows hold `kChunks` 16-byte chunks (8 bf16
// each). The chunk index is XORed with row%8 so the 8 row addresses of one ldmatrix matrix fall
// in 8 different bank groups.
template <int kChunks>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kChunks >= 8 && kChunks % 8 == 0);
  return row * kChunks * 8 + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Warpgroup register split (Hopper): the four warps of a warpgroup all execute one of these, a
// producer warpgroup handing registers back to the block's pool and consumer warpgroups taking
// them. The counts are multiples of 8 in 24..256, and what the consumers take must fit in what
// the launch allocated (threads x the kernel's register count) less what the producers kept.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace tansy::cuda::tc
