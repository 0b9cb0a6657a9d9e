#include "cuda/common/launch.cuh"
#include "cuda/head/head.cuh"

namespace tansy::cuda {
namespace {

__global__ void embed_kernel(DevLinear E, const int* __restrict__ ids, float* __restrict__ h, float* ss,
                             int64_t ss_ld) {
  __shared__ float red[32];
  pdl_wait();
  pdl_launch_dependents();
  const int t = blockIdx.x, id = ids[t];
  float* out = h + int64_t(t) * E.in;
  const bool ok = id >= 0 && id < E.out;
  float sq = 0.f;
  for (int c = threadIdx.x; c < E.in; c += blockDim.x) {
    float v = 0.f;
    if (ok) {
      if (E.fmt == WFormat::kBF16) {
        v = __bfloat162float(E.w[int64_t(id) * E.in + c]);
      } else {
        const int bits = E.fmt == WFormat::kAffine4 ? 4 : 8, per = 32 / bits;
        const uint32_t word = E.q[int64_t(id) * (E.in / per) + c / per];
        const uint32_t code = (word >> (bits * (c % per))) & ((1u << bits) - 1);
        const int64_t g = int64_t(id) * (E.in / kQuantGroup) + c / kQuantGroup;
        v = __bfloat162float(E.scales[g]) * float(code) + __bfloat162float(E.biases[g]);
      }
    }
    out[c] = v;
    sq = fmaf(v, v, sq);
  }
  if (!ss) return;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sq;
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.f;
    for (int w = 0; w < int(blockDim.x / 32); ++w) t += red[w];
    ss[blockIdx.x * ss_ld] = t;
  }
}

__device__ unsigned long long block_max(unsigned long long k) {
  __shared__ unsigned long long red[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, k, o);
    k = other > k ? other : k;
  }
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = k;
  __syncthreads();
  unsigned long long r = 0;
  for (int w = 0; w < int(blockDim.x / 32); ++w) r = red[w] > r ? red[w] : r;
  return r;
}

__global__ void argmax_partial(const float* __restrict__ logits, int n, unsigned long long* scratch) {
  pdl_wait();
  pdl_launch_dependents();
  unsigned long long best = 0;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const unsigned long long k = argmax_key(logits[i], i);
    best = k > best ? k : best;
  }
  best = block_max(best);
  if (threadIdx.x == 0) scratch[blockIdx.x] = best;
}

__global__ void argmax_final(const unsigned long long* scratch, int* dst, int* ring, int* counter) {
  pdl_wait();
  pdl_launch_dependents();
  unsigned long long best = threadIdx.x < kArgmaxBlocks ? scratch[threadIdx.x] : 0;
  for (int i = threadIdx.x + blockDim.x; i < kArgmaxBlocks; i += blockDim.x)
    best = scratch[i] > best ? scratch[i] : best;
  best = block_max(best);
  if (threadIdx.x == 0) {
    const int id = argmax_index(best);
    *dst = id;
    if (ring) ring[(*counter)++] = id;
  }
}

__global__ void advance_kernel(int* pos, int n) {
  pdl_wait();
  pdl_launch_dependents();
  *pos += n;
}

}  // namespace

void embed(const DevLinear& E, const int* ids, int n, float* h, cudaStream_t stream, float* ss,
           int64_t ss_ld) {
  TANSY_CHECK(!ss || n == 1 || ss_ld >= kNormParts,
              "embed: the Σh² outputs of several tokens need rows apart");
  TANSY_CHECK(E.fmt == WFormat::kBF16 || E.fmt == WFormat::kAffine4 || E.fmt == WFormat::kAffine8,
              "embed: format {} unsupported", wformat_name(E.fmt));
  TANSY_CHECK(E.in % kQuantGroup == 0 && n >= 1 && ids && h, "embed: bad arguments (in {}, n {})", E.in, n);
  pdl_launch(embed_kernel, dim3(n), dim3(256), 0, stream, E, ids, h, ss, ss_ld);
}

void argmax(const float* logits, int n, unsigned long long* scratch, int* dst, int* ring, int* counter,
            cudaStream_t stream) {
  TANSY_CHECK(n >= 1 && logits && scratch && dst && (!ring || counter), "argmax: bad arguments");
  pdl_launch(argmax_partial, dim3(kArgmaxBlocks), dim3(256), 0, stream, logits, n, scratch);
  pdl_launch(argmax_final, dim3(1), dim3(256), 0, stream, scratch, dst, ring, counter);
}

void advance_pos(int* pos, int n, cudaStream_t stream) {
  pdl_launch(advance_kernel, dim3(1), dim3(1), 0, stream, pos, n);
}

}  // namespace tansy::cuda
