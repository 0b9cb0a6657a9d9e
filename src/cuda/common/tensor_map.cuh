// Tensor maps (the descriptors of Hopper's tensor memory accelerator, TMA) and the 2-D tensor copy
// that reads one: a box of rows x bytes from global to shared memory in one instruction, completing
// on an mbarrier (bulk_copy.cuh). The kernels that stream weights this way (lm_head.cu, gemm.cu's
// short tiles) and the attention prefill's 3-D maps (prefill_wgmma.cu) encode theirs here.
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "cuda/common/tensor_core.cuh"

namespace tansy::cuda {

// The driver's cuTensorMapEncodeTiled, found once through the runtime (tansy does not link libcuda);
// fails loudly when the driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder();

// A 2-D map of a row-major byte matrix [rows][row_bytes] (row_bytes a multiple of 16, ptr 16-byte
// aligned), read in boxes of box_bytes x box_rows with the given swizzle and 256-byte L2 promotion;
// a box past the last row reads zeros. `what` names the caller in the error.
CUtensorMap byte_matrix_map(const void* ptr, int64_t rows, int64_t row_bytes, int box_bytes, int box_rows,
                            CUtensorMapSwizzle swizzle, const char* what);

namespace bulk {

// Box (c0 bytes, c1 rows) of `map` into dst (16-byte aligned; 1024 with a swizzle), counted on bar.
__device__ __forceinline__ void tensor_copy_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                               uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(tc::smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(tc::smem_addr(bar))
      : "memory");
}

}  // namespace bulk
}  // namespace tansy::cuda
