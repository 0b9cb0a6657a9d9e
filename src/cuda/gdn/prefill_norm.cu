// The gated RMSNorm of the GDN prefill (MODEL.md §5.7; CPU: cpu::rmsnorm_gated), at the memory
// rate: one warp per (token, value head), each lane 4 of the head's 128 values, so every access is
// a 16-byte (o) or 8-byte (z, y) vector and the sum of squares is one warp reduction, with no
// block barrier. (norm/norm.cu's gated_rmsnorm spends a 128-thread block and a barrier on each
// head of each token.)
#include "cuda/common/device_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/gdn/gdn.cuh"

namespace tansy::cuda {
namespace {

constexpr int kNormWarps = 8;
static_assert(kGdnDim == 32 * 4, "a lane holds 4 values of a head");

__global__ void __launch_bounds__(32 * kNormWarps) gdn_gated_norm_kernel(const GdnGatedNormArgs A) {
  pdl_wait();
  pdl_launch_dependents();
  const int lane = threadIdx.x % 32;
  const int64_t item = int64_t(blockIdx.x) * kNormWarps + threadIdx.x / 32;  // token * heads + head
  if (item >= int64_t(A.n) * A.n_heads) return;
  const int64_t t = item / A.n_heads;
  const int j = int(item % A.n_heads), d = 4 * lane;
  const float4 v = *reinterpret_cast<const float4*>(A.o + t * A.ldo + int64_t(j) * kGdnDim + d);
  const uint2 zr = *reinterpret_cast<const uint2*>(A.z + t * A.ldz + int64_t(j) * kGdnDim + d);
  const float4 w = *reinterpret_cast<const float4*>(A.w + d);
  float s = v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  const float scale = rsqrtf(s / float(kGdnDim) + A.eps);
  const float2 z01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zr.x));
  const float2 z23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&zr.y));
  const __nv_bfloat162 y01 =
      __floats2bfloat162_rn(w.x * v.x * scale * silu_fast(z01.x), w.y * v.y * scale * silu_fast(z01.y));
  const __nv_bfloat162 y23 =
      __floats2bfloat162_rn(w.z * v.z * scale * silu_fast(z23.x), w.w * v.w * scale * silu_fast(z23.y));
  uint2 out;
  out.x = *reinterpret_cast<const uint32_t*>(&y01);
  out.y = *reinterpret_cast<const uint32_t*>(&y23);
  *reinterpret_cast<uint2*>(A.y + t * A.ldy + int64_t(j) * kGdnDim + d) = out;
}

bool aligned(const void* ptr, size_t n) { return reinterpret_cast<uintptr_t>(ptr) % n == 0; }

}  // namespace

void gdn_gated_norm(const GdnGatedNormArgs& a, cudaStream_t stream) {
  TANSY_CHECK(a.n >= 1 && a.n_heads >= 1, "gdn_gated_norm: n {} heads {} outside limits", a.n, a.n_heads);
  TANSY_CHECK(a.o && a.z && a.w && a.y, "gdn_gated_norm: missing buffers");
  TANSY_CHECK(aligned(a.o, 16) && a.ldo % 4 == 0 && aligned(a.z, 8) && a.ldz % 4 == 0 && aligned(a.y, 8) &&
                  a.ldy % 4 == 0 && aligned(a.w, 16),
              "gdn_gated_norm: rows must be aligned for 4-wide accesses (strides {}, {}, {})", a.ldo, a.ldz,
              a.ldy);
  const int64_t items = int64_t(a.n) * a.n_heads;
  const int64_t blocks = (items + kNormWarps - 1) / kNormWarps;
  TANSY_CHECK(blocks <= 0x7fffffff, "gdn_gated_norm: {} tokens x {} heads exceed the grid", a.n, a.n_heads);
  pdl_launch(gdn_gated_norm_kernel, dim3(unsigned(blocks)), dim3(32 * kNormWarps), 0, stream, a);
}

}  // namespace tansy::cuda
