#include "cuda/common/cuda_util.h"
#include "cuda/common/tensor_map.cuh"

namespace tansy::cuda {

PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    const cudaError_t e =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !fn)
      fail("the CUDA driver has no cuTensorMapEncodeTiled ({})", cudaGetErrorString(e));
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

CUtensorMap byte_matrix_map(const void* ptr, int64_t rows, int64_t row_bytes, int box_bytes, int box_rows,
                            CUtensorMapSwizzle swizzle, const char* what) {
  TANSY_CHECK(ptr && reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && row_bytes % 16 == 0 && rows >= 1 &&
                  rows < (int64_t(1) << 31),
              "{}: a tensor map needs a 16-byte aligned matrix of 16-byte rows (got {} rows of {} bytes)",
              what, rows, row_bytes);
  const cuuint64_t dims[2] = {cuuint64_t(row_bytes), cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(row_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(box_bytes), cuuint32_t(box_rows)}, estrides[2] = {1, 1};
  CUtensorMap map{};
  const CUresult r =
      tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(ptr), dims, strides, box,
                           estrides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) fail("{}: cuTensorMapEncodeTiled failed ({})", what, int(r));
  return map;
}

}  // namespace tansy::cuda
